"""Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``).

Their facts are the same but for the model type: the vision tower at ``model.visual``, M-RoPE ids from
``model.model.get_rope_index`` (taking ``mm_token_type_ids``; Qwen2.5-VL also the seconds per temporal
patch of each video, ``second_per_grid_ts``), vLLM's weight names equal to transformers' on-disk ones.

Their fix: where text resumes after a video, as the models were trained. Qwen2-VL and Qwen2.5-VL
number the tokens after a vision block from the largest position id inside that block plus one. For
a video that is usually its last temporal id: ``(grid_t - 1) * interval``
(Qwen2.5-VL: ``interval = tokens_per_second * second_per_grid_ts``) past the block's start. The
original Qwen code and vLLM (``get_mrope_input_positions``) do this. Transformers' v5 rewrite of
``get_rope_index`` resumes at ``start + max(grid_h, grid_w) // merge`` instead, ignoring the video's
time span (transformers 5.3 to at least 5.19; huggingface/transformers#45381 fixed the ids inside the
video, not the text after it). Images are unaffected (one temporal patch), videos are not: on the tiny
Qwen2.5-VL, vLLM's log-probs of a response after an 8-frame video differed from transformers' by up
to 5.6 nats.

:func:`resume_text_after_vision_max` wraps the model's own ``get_rope_index`` so that every consumer
(the trainer's position ids, ``generate`` in the transformers rollout, the warm-up) numbers the text
after a vision block from the block's maximum + 1. It checks the behaviour rather than a version: a
transformers release that already does so is left alone.
"""

from __future__ import annotations

import functools
import inspect
import itertools

import torch
from torch import nn

from mmrl.models.families import ModelFamily, token_type_position_ids


def renumber_text_after_vision(
    position_ids: torch.Tensor, token_types: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """Position ids ``[3, L]`` of one sequence with each text run renumbered from the maximum id seen
    so far + 1; vision runs (``token_types != 0``) keep their shape relative to their own start.

    ``valid`` [L] marks the sequence's tokens (padding keeps its ids). The ids of a vision run are
    shifted by the same amount as the text before them, so the relative 3-D layout never changes.
    """
    out = position_ids.clone()
    index = valid.nonzero().squeeze(-1)
    kinds = token_types[index].tolist()
    next_position, position = 0, 0
    for kind, run in itertools.groupby(kinds):  # vision blocks sit between vision start/end tokens
        length = len(list(run))
        columns = index[position : position + length]
        if kind != 0:  # vision: keep its layout, starting where the text before it ended
            block = position_ids[:, columns]
            start = block[1:].min()  # height/width ids start at the block's start position
            out[:, columns] = block - start + next_position
            next_position = int(out[:, columns].max()) + 1
        else:
            out[:, columns] = torch.arange(next_position, next_position + length, device=out.device).expand(
                3, -1
            )
            next_position += length
        position += length
    return out


def _needs_patch(owner: nn.Module) -> bool:
    """True when ``owner.get_rope_index`` resumes text after a 3-patch video before the video's last
    temporal id (a probe on a 1-text + video + 1-text sequence, not a version check)."""
    config = owner.config
    merge = config.vision_config.spatial_merge_size
    video_token = getattr(config, "video_token_id", None)
    if video_token is None:
        return False
    input_ids = torch.tensor([[0] + [video_token] * 3 + [0]])  # grid (3, merge, merge) -> 3 tokens
    token_types = torch.tensor([[0, 2, 2, 2, 0]])
    # Qwen2-VL's get_rope_index takes no second_per_grid_ts (its **kwargs swallow it)
    kwargs = {"video_grid_thw": torch.tensor([[3, merge, merge]]), "second_per_grid_ts": torch.tensor([1.0])}
    position_ids, _ = owner.get_rope_index(input_ids, mm_token_type_ids=token_types, **kwargs)
    video_max = int(position_ids[:, 0, 1:4].max())
    return int(position_ids[0, 0, 4]) != video_max + 1


def resume_text_after_vision_max(model: nn.Module) -> bool:
    """Wrap ``get_rope_index`` of a Qwen2-VL / Qwen2.5-VL ``model`` (see module doc) on this instance;
    returns whether it was wrapped. Fixed transformers releases, and a wrapped model, are untouched."""
    owner = model.model
    if getattr(owner.get_rope_index, "mmrl_resumes_after_vision_max", False) or not _needs_patch(owner):
        return False
    original = owner.get_rope_index
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_rope_index(*args, **kwargs):
        position_ids, _ = original(*args, **kwargs)  # [3, B, L]
        bound = signature.bind(*args, **kwargs).arguments
        input_ids, token_types = bound["input_ids"], bound["mm_token_type_ids"]
        attention_mask = bound.get("attention_mask")
        valid = (
            torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        )
        fixed = torch.stack(
            [
                renumber_text_after_vision(position_ids[:, row], token_types[row], valid[row])
                for row in range(input_ids.shape[0])
            ],
            dim=1,
        )
        # decoding continues from each row's largest id: delta = max + 1 - number of tokens
        deltas = (fixed.amax(dim=(0, 2)) + 1 - valid.sum(-1)).unsqueeze(1)
        return fixed, deltas.to(position_ids.device)

    get_rope_index.mmrl_resumes_after_vision_max = True
    owner.get_rope_index = get_rope_index
    return True


def position_ids(model, input_ids, attention_mask, media, mm_token_type_ids=None):
    """M-RoPE ids [3, B, L] from the model's own (wrapped) ``get_rope_index``; Qwen2.5-VL also takes the
    seconds per temporal patch of each video (Qwen2-VL none)."""
    second_per_grid_ts = media.get("second_per_grid_ts")
    return token_type_position_ids(
        model, input_ids, attention_mask, media, mm_token_type_ids, second_per_grid_ts=second_per_grid_ts
    )


FAMILY = ModelFamily(
    name="qwen2_vl",
    model_types=("qwen2_vl", "qwen2_5_vl"),
    auto_class="AutoModelForImageTextToText",
    position_ids=position_ids,
    towers=("model.visual",),
    placeholder_tokens=("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"),
    position_keys=("image_grid_thw", "video_grid_thw", "second_per_grid_ts"),
    position_only_keys=("second_per_grid_ts",),
    fix_model=resume_text_after_vision_max,
)
