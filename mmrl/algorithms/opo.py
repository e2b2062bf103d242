"""OPO: the on-policy optimal reward baseline (Hao et al. 2025, "On-Policy RL with Optimal Reward
Baseline", arXiv 2505.23585; verl's ``opo``).

In a prompt group ``g`` each response's baseline is the group's scores averaged with weights its
responses' lengths: ``b_g = sum_j L_j r_j / sum_j L_j`` and ``A_i = r_i - b_g`` on every token of
response ``i`` (``L_j``: its valid tokens). When the gradient norm of a sequence grows with its length
this is the baseline of least variance among constant ones (the paper, sec. 3); with equal lengths it is
Dr. GRPO's group mean. A group of one response has ``b = r`` and advantage 0, as the other group
estimators give it. No std division: a group whose responses score alike gets 0, not noise.

Selected by ``algorithm.adv_estimator=opo``; needs ``worker.rollout.n >= 2``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mmrl.algorithms.spec import AdvantageSpec, register


def compute_opo_advantages(
    token_level_rewards: Any,
    response_mask: Any,
    *,
    index: Sequence[Any] | None = None,
    values: Any = None,
    reward_baselines: Any = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Any, Any]:
    """``(advantages, returns)``, both ``[B, L]`` float32 and equal, zero on padding; ``index`` holds
    the prompt uid of each of the ``B`` responses (groups by uid, in any order)."""
    import torch  # when the estimator runs: the config reads this module's spec without torch

    if index is None:
        raise ValueError("Advantage estimator 'opo' groups responses by prompt: pass index=<uids>.")
    mask = response_mask.float()  # [B, L]
    scores = (token_level_rewards.float() * mask).sum(-1)  # [B]
    lengths = mask.sum(-1)  # [B]
    uids = index.tolist() if isinstance(index, torch.Tensor) else list(index)
    if len(uids) != scores.shape[0]:
        raise ValueError(
            f"Advantage estimator 'opo': index has {len(uids)} uids but the batch has {scores.shape[0]} "
            "responses; pass one prompt uid per response."
        )
    groups: dict[Any, int] = {}
    group_ids = torch.tensor([groups.setdefault(uid, len(groups)) for uid in uids], device=scores.device)
    weighted = scores.new_zeros(len(groups)).index_add(0, group_ids, lengths * scores)  # [G]
    total_length = scores.new_zeros(len(groups)).index_add(0, group_ids, lengths)  # [G]
    # a group of empty responses has no weight: baseline 0, and no token to carry an advantage anyway
    baseline = weighted / total_length.clamp(min=1.0)  # [G]; lengths are whole token counts
    advantages = (scores - baseline[group_ids]).unsqueeze(-1) * mask  # [B, L]
    return advantages, advantages


register(AdvantageSpec("opo", compute_opo_advantages, needs_groups=True))
