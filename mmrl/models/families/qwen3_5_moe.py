"""Qwen3.5 MoE (``Qwen3_5MoeForConditionalGeneration``: Qwen3.5-35B-A3B, -122B-A10B, -397B-A17B).

Qwen3.5 (:mod:`mmrl.models.families.qwen3_5`: vision tower, M-RoPE ids, gated-delta-net linear
attention run per packed sequence, no sequence parallelism, no shared prompts) with every decoder MLP a
sparse block: a softmax router (``mlp.gate``, top-k of the probabilities renormalised to sum to 1, the
same router as Qwen3-VL MoE's), E routed experts stored as two 3-D parameters (``mlp.experts.gate_up_proj``
[E, 2I, D], ``mlp.experts.down_proj`` [E, D, I]) and one shared expert every token passes through,
scaled by a sigmoid gate (``mlp.shared_expert_gate``, [1, D]: not a router). Dropless, as Qwen3-VL
MoE: every token reaches its k experts. What mmrl does with the routers (load-balancing loss, router
metrics, routing replay) is :mod:`mmrl.models.moe`; it sees the routers only, so the shared expert
is trained like any dense MLP.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from mmrl.models.families.qwen3_5 import FAMILY as QWEN3_5
from mmrl.models.families.qwen3_5 import linear_attention_per_sequence

FAMILY = replace(
    QWEN3_5,
    name="qwen3_5_moe",
    model_types=("qwen3_5_moe",),
    fix_model=functools.partial(linear_attention_per_sequence, layer_class="Qwen3_5MoeGatedDeltaNet"),
    moe_router="mlp.gate",
)
