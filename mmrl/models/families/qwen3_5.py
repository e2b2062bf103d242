"""Qwen3.5 (``Qwen3_5ForConditionalGeneration``): Qwen3-VL's vision tower (without deepstack) and
M-RoPE ids, with a hybrid decoder: most layers are gated delta nets (linear attention: a causal
depthwise convolution, then a gated delta-rule recurrence), every few a gated full-attention layer.

The fix: the linear-attention layers carry state along the sequence (the convolution's window, the
recurrence's state), and transformers' torch implementation (5.19; its FLA / causal-conv1d kernels are
not installed on CPU) ignores the boundaries of a packed row, so each sequence would start from the
state its predecessor left: on the tiny model, log-probs of the 2nd to 4th sequences of a packed row
were off by up to 2.6 nats. :func:`linear_attention_per_sequence` runs those layers on each sequence of
a packed row separately (exact; a Python loop over the row's sequences per layer).

vLLM (0.32) builds Qwen3.5's language model from the text config alone and ties its output head to
the embedding only when the *text* config says ``tie_word_embeddings``; transformers ties by the
top-level config's. A tied checkpoint whose text config does not say so (the tiny model's: transformers
writes the text config's default, false) stores no ``lm_head.weight``, and vLLM's head stayed unloaded
(NaN logits, measured): :func:`vllm_ties_as_transformers` hands vLLM the top-level setting.

Not supported: sequence parallelism and shared-prompt packing (a sequence split over ranks, or
responses continuing a shared prompt, would need the recurrence state handed over). ``sequence_state``
has the config check refuse them at load, naming the keys; the layer refuses them too, should a
caller reach it another way.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from mmrl.models.attention import PackedSequences
from mmrl.models.families import ModelFamily, token_type_position_ids

LINEAR_ATTENTION = "Qwen3_5GatedDeltaNet"  # the layer class (Qwen3.5 MoE: its own copy of it)


def _per_sequence(original, hidden_states, *args, packed_sequences=None, **kwargs):
    if packed_sequences is None:
        return original(hidden_states, *args, **kwargs)
    if type(packed_sequences) is not PackedSequences:
        raise NotImplementedError(
            f"Qwen3.5's linear-attention layers run on plain packed rows only, not on "
            f"{type(packed_sequences).__name__}: set worker.actor.share_prompts=false and no sequence "
            "parallelism (ulysses_size = ring_size = 1) for this model"
        )
    pieces = hidden_states.split(list(packed_sequences.lengths), dim=1)  # [1, T, D] -> [1, L_i, D]
    kwargs = {**kwargs, "attention_mask": None, "cache_params": None}
    return torch.cat([original(piece, **kwargs) for piece in pieces], dim=1)


def linear_attention_per_sequence(model: nn.Module, layer_class: str = LINEAR_ATTENTION) -> bool:
    """Make every gated delta net (a ``layer_class`` module) of ``model`` run each sequence of a packed
    row on its own (see the module doc); returns whether any layer changed. Idempotent."""
    changed = False
    for module in model.modules():
        if type(module).__name__ == layer_class and not hasattr(module.forward, "mmrl_per_sequence"):
            forward = functools.partial(_per_sequence, module.forward)
            forward.mmrl_per_sequence = True
            module.forward = forward
            changed = True
    return changed


def vllm_ties_as_transformers(config) -> None:
    """Make vLLM tie the output head as transformers does (see the module doc)."""
    config.get_text_config().tie_word_embeddings = config.tie_word_embeddings


FAMILY = ModelFamily(
    name="qwen3_5",
    model_types=("qwen3_5",),
    auto_class="AutoModelForImageTextToText",
    position_ids=token_type_position_ids,  # the model's own get_rope_index
    towers=("model.visual",),
    placeholder_tokens=("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"),
    position_keys=("image_grid_thw", "video_grid_thw"),
    fix_model=linear_attention_per_sequence,
    fix_vllm_config=vllm_ties_as_transformers,
    sequence_state="linear-attention (gated delta net) layers",
)
