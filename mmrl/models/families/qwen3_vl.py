"""Qwen3-VL (``Qwen3VLForConditionalGeneration``).

- Vision tower at ``model.visual``, with "deepstack" mergers: the features of some vision blocks are
  added to the hidden states of the first decoder layers at the visual tokens. The decoder receives
  them as ``visual_pos_masks`` [B, T] and ``deepstack_visual_embeds`` (one [V, D] per layer, V = the
  visual tokens in row order); a packed row carries them like any other row, a sequence-parallel rank
  keeps those of its own tokens (:func:`shard_deepstack_inputs`).
- Interleaved M-RoPE ids from ``model.model.get_rope_index`` (taking ``mm_token_type_ids``). A video is
  a run of frames, each ``<t seconds><|vision_start|><|video_pad|>...<|vision_end|>``: the processor
  writes the timestamps as text, so positions need no seconds per patch. Text after a vision block
  resumes at the block's largest id + 1, as in vLLM (no fix needed, transformers 5.19).
- vLLM's weight names equal transformers' on-disk ones.
"""

from __future__ import annotations

from typing import Any

import torch

from mmrl.models.families import ModelFamily, token_type_position_ids


def shard_deepstack_inputs(decoder_kwargs: dict[str, Any], local_index: torch.Tensor) -> None:
    """Keep the deepstack inputs of this sequence-parallel rank's tokens (``local_index`` [T_local] of
    the packed row): ``visual_pos_masks`` [1, T] -> [1, T_local], and of each layer's features [V, D]
    the rows of the visual tokens this rank holds, in its order."""
    visual_mask = decoder_kwargs.get("visual_pos_masks")
    if visual_mask is None:
        return
    visual_ordinal = visual_mask.long().cumsum(-1) - 1  # [1, T]: each visual token's row in the features
    local_mask = visual_mask.index_select(1, local_index)
    local_rows = visual_ordinal.index_select(1, local_index)[local_mask]  # [V_local]
    decoder_kwargs["visual_pos_masks"] = local_mask
    decoder_kwargs["deepstack_visual_embeds"] = [
        features.index_select(0, local_rows) for features in decoder_kwargs["deepstack_visual_embeds"]
    ]


FAMILY = ModelFamily(
    name="qwen3_vl",
    model_types=("qwen3_vl",),
    auto_class="AutoModelForImageTextToText",
    position_ids=token_type_position_ids,  # the model's own get_rope_index
    towers=("model.visual",),
    placeholder_tokens=("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"),
    position_keys=("image_grid_thw", "video_grid_thw"),
    shard_decoder_inputs=shard_deepstack_inputs,
)
