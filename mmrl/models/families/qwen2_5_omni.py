"""Qwen2.5-Omni: only the thinker (text + vision + audio towers) is trained.

A Qwen2.5-Omni folder (``model_type: qwen2_5_omni``, a thinker plus an optional talker) loads its
thinker from ``thinker_config`` with ``AutoModelForImageTextToText`` (which maps
``qwen2_5_omni_thinker`` to ``Qwen2_5OmniThinkerForConditionalGeneration``; its ``base_model_prefix =
"thinker"`` strips the ``thinker.`` prefix of the stored weights). vLLM serves the full folder and reads
the thinker's weights under ``thinker.*``.

M-RoPE ids come from the thinker's own ``get_rope_index``, which tells media tokens apart by their ids
(no ``mm_token_type_ids``) and takes the audio lengths, whether each video's sound track is interleaved
with it, and each video's seconds per temporal patch.
"""

from __future__ import annotations

from typing import Any

from mmrl.models.families import ModelFamily

FULL_MODEL_TYPE = "qwen2_5_omni"


def thinker_config(config: Any) -> Any:
    """The thinker's config from a full Omni folder's config (a thinker's own config as it is)."""
    return config.thinker_config if config.model_type == FULL_MODEL_TYPE else config


def vllm_weight_prefix(folder_config: Any) -> str:
    """A full Omni folder holds the thinker under ``thinker.*``, which vLLM's loader expects, while the
    trained thinker's own names carry no prefix."""
    return "thinker." if folder_config.model_type == FULL_MODEL_TYPE else ""


def position_ids(model, input_ids, attention_mask, media, mm_token_type_ids=None):
    """M-RoPE ids [3, B, L] from the thinker's ``get_rope_index``."""
    feature_mask = media.get("feature_attention_mask")
    positions, _ = model.get_rope_index(
        input_ids,
        image_grid_thw=media.get("image_grid_thw"),
        video_grid_thw=media.get("video_grid_thw"),
        attention_mask=attention_mask,
        use_audio_in_video=bool(media.get("use_audio_in_video", False)),
        audio_seqlens=None if feature_mask is None else feature_mask.sum(-1),
        second_per_grids=media.get("video_second_per_grid"),
    )
    return positions


FAMILY = ModelFamily(
    name="qwen2_5_omni",
    model_types=(FULL_MODEL_TYPE, "qwen2_5_omni_thinker"),
    auto_class="AutoModelForImageTextToText",
    position_ids=position_ids,
    towers=("visual", "audio_tower"),
    placeholder_tokens=(
        "<|IMAGE|>",
        "<|VIDEO|>",
        "<|AUDIO|>",
        "<|vision_bos|>",
        "<|vision_eos|>",
        "<|audio_bos|>",
        "<|audio_eos|>",
    ),
    position_keys=(
        "image_grid_thw",
        "video_grid_thw",
        "feature_attention_mask",
        "video_second_per_grid",
        "use_audio_in_video",
    ),
    position_only_keys=("video_second_per_grid", "use_audio_in_video"),
    trained_config=thinker_config,
    vllm_weight_prefix=vllm_weight_prefix,
)
