"""Qwen3-VL MoE (``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL-30B-A3B, -235B-A22B).

Qwen3-VL (:mod:`mmrl.models.families.qwen3_vl`: vision tower, deepstack inputs, interleaved M-RoPE,
token types) with every decoder MLP a sparse block: a softmax router (``mlp.gate``, a [E, D] weight,
top-k of the probabilities renormalised to sum to 1) and E experts stored as two 3-D parameters
(``mlp.experts.gate_up_proj`` [E, 2I, D], ``mlp.experts.down_proj`` [E, D, I]), dropless: every token
reaches its k experts, none is dropped for capacity. FSDP2 shards the expert tensors with the rest of
each decoder layer. What mmrl does with the routers (load-balancing loss, router metrics, routing
replay) is :mod:`mmrl.models.moe`.

For vLLM (0.32), which builds the model from the folder's config and reads the original checkpoints'
layout: the router renormalises its top-k only when the text config says ``norm_topk_prob``, a key
transformers 5.19's config no longer has (its router always renormalises), so it is set; and the
fused experts are pushed as the released checkpoints store them, ``gate_up_proj`` [E, D, 2I] and
``down_proj`` [E, I, D] (transformers 5.19 holds, and saves, them transposed). Names are transformers'
on-disk ones (vLLM splits the fused expert tensors itself).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mmrl.models.families.qwen3_vl import FAMILY as QWEN3_VL

FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def vllm_renormalises_top_k(config) -> None:
    """Make vLLM's router renormalise the top-k probabilities, as transformers' always does."""
    config.get_text_config().norm_topk_prob = True


def experts_as_released(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A fused expert tensor in the released checkpoints' layout (the last two axes swapped); any other
    tensor as it is."""
    return tensor.transpose(1, 2).contiguous() if name.endswith(FUSED_EXPERTS) else tensor


FAMILY = replace(
    QWEN3_VL,
    name="qwen3_vl_moe",
    model_types=("qwen3_vl_moe",),
    moe_router="mlp.gate",
    fix_vllm_config=vllm_renormalises_top_k,
    to_vllm_layout=experts_as_released,
)
