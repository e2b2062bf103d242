"""Qwen3-Omni (``Qwen3OmniMoeForConditionalGeneration``: Qwen3-Omni-30B-A3B): only the thinker (text +
vision + audio towers, a MoE decoder) is trained.

As Qwen2.5-Omni (:mod:`mmrl.models.families.qwen2_5_omni`): a folder (``model_type: qwen3_omni_moe``,
a thinker plus an optional talker and code-to-wave decoder) loads its thinker from ``thinker_config``
with ``AutoModelForImageTextToText`` (``qwen3_omni_moe_thinker`` ->
``Qwen3OmniMoeThinkerForConditionalGeneration``, whose ``base_model_prefix = "thinker"`` strips the
stored weights' prefix); vLLM reads the thinker's weights under ``thinker.*``. M-RoPE ids come from
the thinker's own ``get_rope_index``, which takes what Qwen2.5-Omni's takes.

What differs:
- the decoder is Qwen3-VL MoE's: every MLP a sparse block whose router is ``mlp.gate`` (softmax top-k,
  renormalised when the text config says ``norm_topk_prob``, dropless), and Qwen3-VL's deepstack
  inputs (``visual_pos_masks``, ``deepstack_visual_embeds``), which a sequence-parallel rank keeps for
  its own tokens as Qwen3-VL's (:func:`mmrl.models.families.qwen3_vl.shard_deepstack_inputs`);
- ``get_rope_index`` returns float ids: a video's temporal ids are its temporal patches times seconds
  per patch times ``position_id_per_seconds``, fractional for some frame rates. vLLM 0.32 truncates
  them to integers; so does :func:`position_ids` (mmrl's ``position_ids`` column is int64), so both
  engines see the same ids (equal to transformers' own whenever they are whole, e.g. 2 fps, 2 frames
  per patch, 13 ids a second);
- vLLM 0.32 reads keys that transformers 5.19's config classes no longer have: the vision tower's
  ``image_size`` and ``apply_vit_abs_pos_embed`` (transformers derives the learned position grid from
  ``num_position_embeddings``) and the text config's ``tie_word_embeddings`` (the thinker's says it):
  :func:`vllm_config_keys` sets them where they are missing.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from mmrl.models.families import qwen2_5_omni as omni
from mmrl.models.families.qwen3_vl import shard_deepstack_inputs

FULL_MODEL_TYPE = "qwen3_omni_moe"


def thinker_config(config: Any) -> Any:
    """The thinker's config from a full Qwen3-Omni folder's config (a thinker's own config as it is)."""
    return config.thinker_config if config.model_type == FULL_MODEL_TYPE else config


def vllm_weight_prefix(folder_config: Any) -> str:
    """A full folder holds the thinker under ``thinker.*``; the trained thinker's names have no prefix."""
    return "thinker." if folder_config.model_type == FULL_MODEL_TYPE else ""


def position_ids(model, input_ids, attention_mask, media, mm_token_type_ids=None):
    """M-RoPE ids [3, B, L] from the thinker's ``get_rope_index``, truncated to integers (see the
    module doc)."""
    return omni.position_ids(model, input_ids, attention_mask, media, mm_token_type_ids).long()


def vllm_config_keys(config: Any) -> None:
    """Set the keys vLLM reads (see the module doc) where they are missing: ``image_size`` = patch size
    x the learned grid's side (sqrt of ``num_position_embeddings``), the grid an absolute position
    embedding (as transformers builds it), and the thinker's word-embedding tying on its text config."""
    thinker = thinker_config(config)
    text = thinker.text_config
    if getattr(text, "tie_word_embeddings", None) is None:
        text.tie_word_embeddings = thinker.tie_word_embeddings
    vision = thinker.vision_config
    if getattr(vision, "image_size", None) is None:
        vision.image_size = vision.patch_size * math.isqrt(vision.num_position_embeddings)
    if getattr(vision, "apply_vit_abs_pos_embed", None) is None:
        vision.apply_vit_abs_pos_embed = True


FAMILY = replace(
    omni.FAMILY,
    name="qwen3_omni_moe",
    model_types=(FULL_MODEL_TYPE, "qwen3_omni_moe_thinker"),
    position_ids=position_ids,
    placeholder_tokens=(
        "<|image_pad|>",
        "<|video_pad|>",
        "<|audio_pad|>",
        "<|vision_start|>",
        "<|vision_end|>",
        "<|audio_start|>",
        "<|audio_end|>",
    ),
    trained_config=thinker_config,
    vllm_weight_prefix=vllm_weight_prefix,
    shard_decoder_inputs=shard_deepstack_inputs,
    moe_router="mlp.gate",
    fix_vllm_config=vllm_config_keys,
)
