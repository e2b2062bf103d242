"""Advantage estimators: ``(token_level_rewards, response_mask, *, index, values, reward_baselines,
gamma, lam, norm_adv_by_std, eps) -> (advantages, returns)``.

Each is registered by name with its flags in :mod:`mmrl.algorithms.estimators`. All share one keyword
signature so the trainer can call any of them the same way; each ignores the
arguments it does not use and raises if one it needs is missing. All return (advantages, returns),
both [B, L] float32, zero on padding, computed without autograd.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mmrl.core_algos.masked import masked_sum, masked_whiten


def _sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome score of each response: its token rewards summed over the mask. [B, L] -> [B]."""
    return masked_sum(token_level_rewards.float(), response_mask, dim=-1)


def _group_ids(index: Sequence[Any] | np.ndarray | None, batch_size: int, estimator: str) -> torch.Tensor:
    """Map prompt uids to dense group ids ``[B]`` (int64) in order of first appearance."""
    if index is None:
        raise ValueError(f"Advantage estimator {estimator!r} groups responses by prompt: pass index=<uids>.")
    if isinstance(index, torch.Tensor):
        index = index.tolist()  # tensor elements hash by identity, not value
    uids = list(index)
    if len(uids) != batch_size:
        raise ValueError(
            f"Advantage estimator {estimator!r}: index has {len(uids)} uids but the batch has "
            f"{batch_size} responses; pass one prompt uid per response."
        )
    uid_to_group: dict[Any, int] = {}
    return torch.tensor([uid_to_group.setdefault(uid, len(uid_to_group)) for uid in uids], dtype=torch.long)


def _group_mean_std(
    scores: torch.Tensor, group_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-response group mean, unbiased group std and group size, each ``[B]``.

    The std of a size-1 group is 0 (there is no spread to measure).
    """
    group_ids = group_ids.to(scores.device)
    num_groups = int(group_ids.max()) + 1 if group_ids.numel() else 0
    zeros = scores.new_zeros(num_groups)
    group_size = zeros.index_add(0, group_ids, torch.ones_like(scores))
    group_mean = zeros.index_add(0, group_ids, scores) / group_size
    centered = scores - group_mean[group_ids]  # [B]
    group_sum_sq = zeros.index_add(0, group_ids, centered**2)
    group_std = (group_sum_sq / (group_size - 1).clamp(min=1)).sqrt()
    return group_mean[group_ids], group_std[group_ids], group_size[group_ids]


def _broadcast_over_tokens(per_sequence: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B] -> [B, L]``: the same value on every response token, 0 on padding."""
    return per_sequence.unsqueeze(-1) * response_mask.float()


@torch.no_grad()
def compute_grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Sequence[Any] | np.ndarray | None = None,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024), one value per response broadcast over its tokens.

    ``A_i = (r_i - mean_g) / (std_g + eps)`` where ``r_i`` is the response's score and ``g`` the
    responses sharing its prompt uid; ``std_g`` is the unbiased std (``torch.std`` default, as in
    EasyR1/verl). ``norm_adv_by_std=False`` gives Dr. GRPO (Liu et al. 2025): ``A_i = r_i - mean_g``.

    A group of size 1 gets advantage 0: without peers there is no baseline to compare against, so the
    sample carries no relative signal (verl instead passes the raw score through; EasyR1 refuses).

    Shapes: ``token_level_rewards``/``response_mask`` ``[B, L]``, ``index`` ``B`` uids.
    Returns ``(advantages, returns)``, both ``[B, L]`` and equal, zero on padding.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)  # [B]
    group_ids = _group_ids(index, scores.shape[0], "grpo")
    group_mean, group_std, _ = _group_mean_std(scores, group_ids)
    centered = scores - group_mean  # exactly 0 for size-1 groups
    advantages = centered / (group_std + eps) if norm_adv_by_std else centered
    advantages = _broadcast_over_tokens(advantages, response_mask)
    return advantages, advantages


@torch.no_grad()
def compute_grpo_passk_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Sequence[Any] | np.ndarray | None = None,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantage (Chen et al. 2025, arXiv 2503.19595; EasyR1's and verl's ``grpo_passk``): only
    the best response of each group is pushed up, by how much it beats the runner-up.

    In a group ``g``: ``A_best = (r_max - r_second) / (std_g + eps)`` for one response with the highest
    score (the first one in batch order on a tie, which then gets 0), ``A_i = 0`` for every other one;
    ``std_g`` is the unbiased std as in :func:`compute_grpo_advantages`, ``norm_adv_by_std=False`` leaves
    out the division. A policy optimised this way is rewarded for having *one* good answer among its
    samples rather than for the mean, which keeps it exploring; its gradient is never negative. A group
    of size 1 gets 0. (EasyR1 leaves the other responses' raw scores as their advantages; verl and the
    paper's "only the best response gets an advantage" give them 0, as here.)

    Shapes as :func:`compute_grpo_advantages`; returns ``(advantages, returns)`` equal, ``[B, L]``.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)  # [B]
    group_ids = _group_ids(index, scores.shape[0], "grpo_passk")
    _, group_std, _ = _group_mean_std(scores, group_ids)
    advantages = torch.zeros_like(scores)
    for group in range(int(group_ids.max()) + 1 if group_ids.numel() else 0):
        rows = torch.nonzero(group_ids == group).squeeze(-1)  # [n_g], in batch order
        if rows.numel() < 2:
            continue
        group_scores = scores[rows]
        best = int(torch.argmax(group_scores))  # the first of the highest scores
        margin = group_scores[best] - torch.cat([group_scores[:best], group_scores[best + 1 :]]).max()
        advantages[rows[best]] = margin / (group_std[rows[best]] + eps) if norm_adv_by_std else margin
    advantages = _broadcast_over_tokens(advantages, response_mask)
    return advantages, advantages


@torch.no_grad()
def compute_rloo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Sequence[Any] | np.ndarray | None = None,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO advantage (Ahmadian et al. 2024): leave-one-out baseline within each prompt group.

    ``A_i = r_i - mean_{j != i} r_j = n / (n - 1) * (r_i - mean_g)`` for a group of ``n`` responses.
    A group of size 1 has no other sample to form a baseline and gets advantage 0.

    Shapes as :func:`compute_grpo_advantages`; returns ``(advantages, returns)`` equal, ``[B, L]``.
    """
    scores = _sequence_scores(token_level_rewards, response_mask)  # [B]
    group_ids = _group_ids(index, scores.shape[0], "rloo")
    group_mean, _, group_size = _group_mean_std(scores, group_ids)
    scale = torch.where(group_size > 1, group_size / (group_size - 1).clamp(min=1), 0.0)
    advantages = _broadcast_over_tokens(scale * (scores - group_mean), response_mask)
    return advantages, advantages


def _discounted_returns(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Returns-to-go ``G_t = r_t + gamma * G_{t+1}`` over valid tokens; 0 on padding. [B, L]."""
    rewards = token_level_rewards.float() * response_mask.float()
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])  # [B]
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns * response_mask.float()


@torch.no_grad()
def compute_reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Sequence[Any] | np.ndarray | None = None,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted returns-to-go, whitened over the whole batch.

    ``G_t = sum_{k >= t} gamma^(k - t) r_k`` over the response's valid tokens, then
    ``A = masked_whiten(G, response_mask)``: mean and unbiased std over every valid token of the batch
    (global, not per group). Returns ``(A, G)``, both ``[B, L]``, zero on padding.
    """
    returns = _discounted_returns(token_level_rewards, response_mask, gamma)
    advantages = masked_whiten(returns, response_mask) * response_mask.float()
    return advantages, returns


@torch.no_grad()
def compute_remax_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Sequence[Any] | np.ndarray | None = None,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023): the greedy response's reward as baseline.

    ``A_i = r_i - b_i`` broadcast over the response's tokens, with ``b_i = reward_baselines[i]`` the
    score of the greedy decode of the same prompt, ``[B]``. Returns are the undiscounted
    returns-to-go of the token rewards (equal to ``r_i`` on every token for outcome rewards).
    """
    if reward_baselines is None:
        raise ValueError("Advantage estimator 'remax' needs reward_baselines=<greedy scores, shape [B]>.")
    scores = _sequence_scores(token_level_rewards, response_mask)  # [B]
    baselines = reward_baselines.to(scores.device, torch.float32).reshape(-1)
    if baselines.shape != scores.shape:
        raise ValueError(
            f"Advantage estimator 'remax': reward_baselines has {baselines.numel()} values but the batch "
            f"has {scores.numel()} responses; pass one greedy score per response."
        )
    advantages = _broadcast_over_tokens(scores - baselines, response_mask)
    returns = _discounted_returns(token_level_rewards, response_mask, gamma=1.0)
    return advantages, returns


@torch.no_grad()
def compute_gae_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    index: Sequence[Any] | np.ndarray | None = None,
    values: torch.Tensor | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_adv_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (Schulman et al. 2016) with critic values ``[B, L]``.

    Backwards over valid tokens: ``delta_t = r_t + gamma * V_next - V_t``,
    ``A_t = delta_t + gamma * lam * A_next``, where ``V_next``/``A_next`` come from the next *valid*
    token (masked positions are skipped, so padding or tool-output tokens never leak values), and are
    0 after the last one. ``returns = A + V`` (before whitening) are the critic's targets; the
    advantages are then whitened over all valid tokens of the batch. Both zero on padding.
    """
    if values is None:
        raise ValueError("Advantage estimator 'gae' needs values=<critic values, shape [B, L]>.")
    rewards, values = token_level_rewards.float(), values.float()
    valid = response_mask.bool()
    next_value = rewards.new_zeros(rewards.shape[0])  # [B]
    next_advantage = rewards.new_zeros(rewards.shape[0])  # [B]
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        next_advantage = torch.where(valid[:, t], advantage, next_advantage)
        advantages[:, t] = advantage
    mask = response_mask.float()
    returns = (advantages + values) * mask
    advantages = masked_whiten(advantages, response_mask) * mask
    return advantages, returns
