"""Qwen3-VL MoE (``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL-30B-A3B, -235B-A22B).

Qwen3-VL (:mod:`mmrl.models.families.qwen3_vl`: vision tower, deepstack inputs, interleaved M-RoPE,
token types) with every decoder MLP a sparse block: a softmax router (``mlp.gate``, a [E, D] weight,
top-k of the probabilities renormalised to sum to 1) and E experts stored as two 3-D parameters
(``mlp.experts.gate_up_proj`` [E, 2I, D], ``mlp.experts.down_proj`` [E, D, I]), dropless: every token
reaches its k experts, none is dropped for capacity. FSDP2 shards the expert tensors with the rest of
each decoder layer. What mmrl does with the routers (load-balancing loss, router metrics, routing
replay) is :mod:`mmrl.models.moe`.
- vLLM's weight names equal transformers' on-disk ones (vLLM splits the fused expert tensors itself).
"""

from __future__ import annotations

from dataclasses import replace

from mmrl.models.families.qwen3_vl import FAMILY as QWEN3_VL

FAMILY = replace(QWEN3_VL, name="qwen3_vl_moe", model_types=("qwen3_vl_moe",), moe_router="mlp.gate")
