"""Qwen2 / Qwen2.5 / Qwen3 text models: ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``; 1-D RoPE, no towers."""

from __future__ import annotations

from mmrl.models.families import ModelFamily, text_position_ids


def position_ids(model, input_ids, attention_mask, media, mm_token_type_ids=None):
    """1-D ids [B, L] over the valid tokens of each row (a model numbering them itself would count the
    left padding)."""
    return text_position_ids(attention_mask)


FAMILY = ModelFamily(
    name="qwen2",
    model_types=("qwen2", "qwen3"),
    auto_class="AutoModelForCausalLM",
    position_ids=position_ids,
)
