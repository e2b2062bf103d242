"""RL algorithms as pure tensor functions: advantages, policy/value losses, loss aggregation, KL.

Conventions shared by every function here:

- Token tensors are ``[B, L]`` over the response part of each sample; ``response_mask`` ``[B, L]`` is 1
  for response tokens up to and including EOS and 0 for padding.
- Outcome rewards arrive as ``token_level_rewards`` ``[B, L]`` with the sequence's score on its last
  valid token (as in EasyR1/verl); outcome estimators sum them over the mask to get the score ``[B]``.
- ``index`` holds the prompt uid of every response (list or numpy object array, length ``B``).
  Groups are formed by uid, never by position, so responses may arrive in any order.
- Policy/value losses return a per-token loss ``[B, L]`` plus per-token diagnostics; reducing them to
  a scalar is a separate step, :func:`aggregate_loss`, chosen by name.

A config string selects an algorithm through the registries ``ADV_ESTIMATORS``, ``POLICY_LOSSES``,
``LOSS_AGG_MODES`` and ``KL_ESTIMATORS`` and their ``get_*`` functions. Nothing here reads a config
object or calls ``torch.distributed``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

# exp() of a log-ratio above ~88 overflows float32 to inf, and inf * 0 advantages gives NaN gradients
# (pytorch/pytorch#10729). Ratios beyond e^20 are clipped by every loss anyway, so clamping is lossless.
LOG_RATIO_CLAMP = 20.0


# --------------------------------------------------------------------------------------------------
# Masked helpers
# --------------------------------------------------------------------------------------------------


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask)`` over ``dim`` (all elements when ``dim`` is None)."""
    masked = values * mask.to(values.dtype)
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(values * mask) / sum(mask)`` over ``dim``; 0 where the mask is empty (mask is 0/1)."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the valid elements (scalar). Unbiased (divides by n - 1) like ``torch.var`` and verl.

    With n <= 1 valid elements the variance is defined as 0.
    """
    mean = masked_mean(values, mask)
    sum_sq = masked_sum((values - mean) ** 2, mask)
    count = mask.to(values.dtype).sum()
    denominator = count - 1 if unbiased else count
    if denominator <= 0:
        return torch.zeros_like(sum_sq)
    return sum_sq / denominator


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(values - mean) / sqrt(var + eps)`` with mean and unbiased var over the valid elements only.

    Padding positions are whitened too (they are not zeroed here); callers multiply by the mask. With
    ``shift_mean=False`` the mean is added back, i.e. only the scale is normalised.
    """
    mean = masked_mean(values, mask)
    whitened = (values - mean) * torch.rsqrt(masked_var(values, mask) + eps)
    return whitened if shift_mean else whitened + mean


# --------------------------------------------------------------------------------------------------
# Registries
# --------------------------------------------------------------------------------------------------

ADV_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}
POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {}
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}
LOSS_AGG_MODES: tuple[str, ...] = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)


def _register(registry: dict[str, Callable], *names: str) -> Callable[[Callable], Callable]:
    def decorator(fn: Callable) -> Callable:
        for name in names:
            registry[name] = fn
        return fn

    return decorator


def _lookup(registry: dict[str, Callable], name: str, kind: str) -> Callable:
    if name not in registry:
        raise ValueError(
            f"Unknown {kind} {name!r}. Valid names: {', '.join(sorted(registry))}. "
            f"Pick one of these in the config, or add a function to the registry in {__name__}."
        )
    return registry[name]


def get_adv_estimator(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The advantage estimator registered as ``name``; ValueError listing the valid names otherwise."""
    return _lookup(ADV_ESTIMATORS, name, "advantage estimator")


def get_policy_loss(name: str) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The policy loss registered as ``name``; ValueError listing the valid names otherwise."""
    return _lookup(POLICY_LOSSES, name, "policy loss")


def get_kl_estimator(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The per-token KL estimator registered as ``name``; ValueError listing the valid names otherwise."""
    return _lookup(KL_ESTIMATORS, name, "KL estimator")


# --------------------------------------------------------------------------------------------------
# Advantage estimators
#
# All share one keyword signature so the trainer can call any of them the same way; each ignores the
# arguments it does not use and raises if one it needs is missing. All return (advantages, returns),
# both [B, L] float32, zero on padding, computed without autograd.
# --------------------------------------------------------------------------------------------------


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


@_register(ADV_ESTIMATORS, "grpo")
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


@_register(ADV_ESTIMATORS, "rloo")
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


@_register(ADV_ESTIMATORS, "reinforce_plus_plus")
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


@_register(ADV_ESTIMATORS, "remax")
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


@_register(ADV_ESTIMATORS, "gae")
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


# --------------------------------------------------------------------------------------------------
# Policy losses
#
# Common signature: (old_log_probs, log_probs, advantages, response_mask, *, <the loss's own knobs>).
# The knobs are keyword-only and named as in worker.actor (clip_ratio_low, clip_ratio_high,
# clip_ratio_dual, tau_positive, tau_negative); :func:`policy_loss_kwargs` picks the ones a loss takes.
# Clip ratios left None take the loss's default from POLICY_LOSS_CLIP_DEFAULTS. Each loss returns
# (loss [B, L], diagnostics) where diagnostics are detached per-token float tensors [B, L]
# (``pg_clipfrac``, ``pg_clipfrac_dual``, ``ppo_kl``); reduce them with masked_mean. The loss is NOT
# reduced: pass it to aggregate_loss.
# --------------------------------------------------------------------------------------------------

# loss -> (clip_ratio_low, clip_ratio_high) used when the config leaves them null; None: no clip range.
# The ratio (or importance weight) is clipped to [1 - low, 1 + high].
POLICY_LOSS_CLIP_DEFAULTS: dict[str, tuple[float, float] | None] = {
    "ppo": (0.2, 0.3),  # PPO's 0.2 below, DAPO's clip-higher 0.28-0.3 above (EasyR1's defaults)
    # GSPO paper, sec. 5.1: a sequence ratio is a geometric mean of token ratios and sits within ~1e-3
    # of 1, so the token-level 0.2 would never clip; the paper clips at 3e-4 / 4e-4
    "gspo": (3e-4, 4e-4),
    "gspo_token": (3e-4, 4e-4),
    # MiniMax-M1: no lower bound on the IS weight (1 - 1.0 = 0, below every ratio), upper 1 + 4 = 5 as
    # EasyR1's CISPO recipe. clip_ratio_low=0 gives EasyR1's weight >= 1 instead.
    "cispo": (1.0, 4.0),
    "sapo": None,  # a soft gate instead of a clip
}


def policy_clip_range(
    loss_type: str, clip_ratio_low: float | None = None, clip_ratio_high: float | None = None
) -> tuple[float, float] | None:
    """``(clip_ratio_low, clip_ratio_high)`` in effect for ``loss_type``: the given values, the loss's
    default (:data:`POLICY_LOSS_CLIP_DEFAULTS`) for each one left None; None for a loss without clip
    (a ValueError if a clip ratio is given to it)."""
    get_policy_loss(loss_type)  # an unknown name fails listing the valid ones
    defaults = POLICY_LOSS_CLIP_DEFAULTS[loss_type]
    if defaults is None:
        if clip_ratio_low is not None or clip_ratio_high is not None:
            raise ValueError(
                f"policy loss {loss_type!r} has no clip range; leave clip_ratio_low/clip_ratio_high None"
            )
        return None
    low = defaults[0] if clip_ratio_low is None else clip_ratio_low
    high = defaults[1] if clip_ratio_high is None else clip_ratio_high
    return low, high


def policy_loss_kwargs(loss_type: str, **knobs: float | None) -> dict[str, float | None]:
    """The keyword arguments of the loss ``loss_type`` out of ``knobs`` (every knob of every loss, as in
    the config): only those its signature takes, with the clip ratios resolved by
    :func:`policy_clip_range`. The caller keeps one call for all losses; each loss sees its own knobs."""
    accepted = inspect.signature(get_policy_loss(loss_type)).parameters
    clip_range = policy_clip_range(
        loss_type, knobs.pop("clip_ratio_low", None), knobs.pop("clip_ratio_high", None)
    )
    if clip_range is not None:
        knobs["clip_ratio_low"], knobs["clip_ratio_high"] = clip_range
    return {name: value for name, value in knobs.items() if name in accepted}


def _clamped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))`` and where the clipped term won."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def _diagnostics(
    token_log_ratio: torch.Tensor, clipped: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The diagnostics every loss returns; ``clipped`` [B, L] 0/1 (None: nothing clips)."""
    clipped = torch.zeros_like(token_log_ratio) if clipped is None else clipped
    return {
        "pg_clipfrac": clipped.detach().float(),
        "pg_clipfrac_dual": torch.zeros_like(token_log_ratio).detach(),
        "ppo_kl": -token_log_ratio.detach(),
    }


@_register(POLICY_LOSSES, "ppo")
def compute_ppo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_dual: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token (Schulman et al. 2017), asymmetric clip (DAPO), dual clip.

    ``ratio_t = exp(logp_t - old_logp_t)`` (log-ratio clamped to ±20 before exp, see LOG_RATIO_CLAMP),
    ``loss_t = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_ratio_low, 1 + clip_ratio_high))``
    (None: 0.2 / 0.3, :data:`POLICY_LOSS_CLIP_DEFAULTS`).
    Dual clip (Ye et al. 2020), when ``clip_ratio_dual = c`` (> 1) is given: for ``A_t < 0`` the loss is
    further capped at ``-A_t * c``, so a huge ratio on a bad token cannot blow up the update.

    Shapes: every input ``[B, L]``. Returns the per-token loss ``[B, L]`` and diagnostics:
    ``pg_clipfrac`` (trust-region clip active), ``pg_clipfrac_dual`` (dual clip active),
    ``ppo_kl`` (``old_logp - logp``, k1 estimate of KL(old || new)).
    """
    if clip_ratio_dual is not None and clip_ratio_dual <= 1.0:
        raise ValueError(f"clip_ratio_dual must be > 1 (e.g. 3.0) or None to disable; got {clip_ratio_dual}.")
    low, high = policy_clip_range("ppo", clip_ratio_low, clip_ratio_high)
    log_ratio = log_probs - old_log_probs
    ratio = _clamped_exp(log_ratio)
    loss, clipped = _clipped_surrogate(ratio, advantages, low, high)
    diagnostics = _diagnostics(log_ratio, clipped)
    if clip_ratio_dual is not None:
        dual_cap = -advantages * clip_ratio_dual
        apply_dual = (advantages < 0) & (loss > dual_cap)
        loss = torch.where(apply_dual, dual_cap, loss)
        diagnostics["pg_clipfrac_dual"] = apply_dual.float()
    return loss, diagnostics


@_register(POLICY_LOSSES, "gspo")
def compute_gspo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): clip a sequence-level importance ratio instead of token ratios.

    ``s_i = exp(mean_t (logp_it - old_logp_it))`` over the response's valid tokens (differentiable, so
    ``grad s_i = s_i * mean_t grad logp_it``), on every token of the row:
    ``loss_it = max(-A_it * s_i, -A_it * clip(s_i, 1 - low, 1 + high))`` (None: 3e-4 / 4e-4, the
    paper's: a sequence ratio stays near 1). A whole sequence is clipped or not. Meant for
    sequence-level advantages (GRPO): with token-level ones, token ``t``'s gradient is driven by the
    row's *mean* advantage (use ``gspo_token`` to keep each token's own). With
    ``seq_mean_token_mean`` aggregation this is exactly the GSPO objective.

    Shapes and diagnostics as :func:`compute_ppo_policy_loss` (``pg_clipfrac`` is per sequence,
    broadcast to its tokens; ``pg_clipfrac_dual`` 0).
    """
    low, high = policy_clip_range("gspo", clip_ratio_low, clip_ratio_high)
    token_log_ratio = log_probs - old_log_probs
    seq_log_ratio = masked_mean(token_log_ratio, response_mask, dim=-1).unsqueeze(-1)  # [B, 1]
    ratio = _clamped_exp(seq_log_ratio).expand_as(log_probs)  # [B, L]
    loss, clipped = _clipped_surrogate(ratio, advantages, low, high)
    return loss, _diagnostics(token_log_ratio, clipped)


@_register(POLICY_LOSSES, "gspo_token")
def compute_gspo_token_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (Zheng et al. 2025, eq. 13): the sequence ratio with each token's own advantage.

    ``s_it = sg[s_i] * pi_it / sg[pi_it]`` with ``s_i`` as in :func:`compute_gspo_policy_loss`: its
    value is ``s_i`` on every token and its gradient ``s_i * grad logp_it``.
    ``loss_it = max(-A_it * s_it, -A_it * clip(s_it, 1 - low, 1 + high))`` (None: 3e-4 / 4e-4).
    With one advantage per sequence (``A_it = A_i``) value and gradient equal ``gspo``'s; with
    token-level advantages token ``t`` is weighted by its own ``A_it``, not the row's mean.

    Shapes and diagnostics as :func:`compute_gspo_policy_loss`.
    """
    low, high = policy_clip_range("gspo_token", clip_ratio_low, clip_ratio_high)
    token_log_ratio = log_probs - old_log_probs
    seq_log_ratio = masked_mean(token_log_ratio, response_mask, dim=-1).unsqueeze(-1)  # [B, 1]
    combined_log_ratio = seq_log_ratio.detach() + log_probs - log_probs.detach()  # [B, L]
    ratio = _clamped_exp(combined_log_ratio)
    loss, clipped = _clipped_surrogate(ratio, advantages, low, high)
    return loss, _diagnostics(token_log_ratio, clipped)


@_register(POLICY_LOSSES, "cispo")
def compute_cispo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient importance weight.

    ``loss_t = -sg(clip(ratio_t, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A_t * logp_t``, so
    ``d loss_t / d logp_t = -clip(ratio_t) * A_t``: unlike PPO, clipped tokens still get a gradient,
    only its weight is bounded. None: 1.0 / 4.0, the paper's choice of no lower bound (``1 - 1 = 0``)
    with EasyR1's upper bound 5; ``clip_ratio_low=0`` keeps every weight >= 1 (EasyR1's recipe).

    Shapes and diagnostics as :func:`compute_ppo_policy_loss`; ``pg_clipfrac`` marks tokens whose
    weight was clipped.
    """
    low, high = policy_clip_range("cispo", clip_ratio_low, clip_ratio_high)
    log_ratio = log_probs - old_log_probs
    ratio = _clamped_exp(log_ratio).detach()
    weight = ratio.clamp(1.0 - low, 1.0 + high)
    loss = -weight * advantages * log_probs
    return loss, _diagnostics(log_ratio, (weight != ratio).float())


@_register(POLICY_LOSSES, "sapo")
def compute_sapo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    tau_positive: float = 1.0,
    tau_negative: float = 1.05,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Soft Adaptive Policy Optimization, arXiv 2511.20347): a soft gate instead of a hard clip.

    ``f_tau(r) = (4 / tau) * sigmoid(tau * (r - 1))``, ``loss_t = -A_t * f_tau(r_t)`` with
    ``tau = tau_positive`` where ``A_t >= 0`` and ``tau_negative`` where ``A_t < 0``. Since
    ``f'(r) = 4 * sigmoid * (1 - sigmoid)``: at ``r = 1`` the gradient wrt ``logp_t`` is ``-A_t``
    exactly (on-policy it is the plain policy gradient), and it decays smoothly (not to zero at a
    boundary) as ``r`` leaves 1, faster for larger ``tau``; negative tokens get the slightly larger
    temperature because their updates destabilise more.

    Shapes: every input ``[B, L]``. Diagnostics as :func:`compute_ppo_policy_loss`
    (``pg_clipfrac`` and ``pg_clipfrac_dual`` 0: nothing is clipped).
    """
    if tau_positive <= 0 or tau_negative <= 0:
        raise ValueError(
            f"SAPO temperatures must be > 0; got tau_positive={tau_positive}, tau_negative={tau_negative}"
        )
    log_ratio = log_probs - old_log_probs
    ratio = _clamped_exp(log_ratio)
    tau = torch.where(advantages >= 0, tau_positive, tau_negative).to(ratio.dtype)  # [B, L]
    gate = 4.0 / tau * torch.sigmoid(tau * (ratio - 1.0))
    return -advantages * gate, _diagnostics(log_ratio)


# --------------------------------------------------------------------------------------------------
# Reward shaping
# --------------------------------------------------------------------------------------------------


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_length: int, buffer_length: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO's soft overlong punishment [B] of responses of ``response_lengths`` [B] tokens.

    With ``L`` the length, ``L_max = max_response_length``, ``B = buffer_length`` (> 0) and
    ``F = penalty_factor``: 0 for ``L <= L_max - B``, ``((L_max - B) - L) / B * F`` inside the buffer
    (falling linearly to ``-F`` at ``L_max``), ``-F`` beyond. Added to the reward.
    """
    if buffer_length <= 0 or buffer_length >= max_response_length:
        raise ValueError(
            f"overlong buffer_length={buffer_length} must be in (0, max_response_length={max_response_length})"
        )
    excess = (response_lengths.float() - (max_response_length - buffer_length)) / buffer_length
    return -excess.clamp(0.0, 1.0) * penalty_factor


# --------------------------------------------------------------------------------------------------
# Loss aggregation
# --------------------------------------------------------------------------------------------------


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_num_tokens: int | float | torch.Tensor | None = None,
    global_num_seqs: int | float | torch.Tensor | None = None,
    max_response_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, L]`` to a scalar. ``mask`` ``[B, L]`` is 0/1.

    With ``N`` valid tokens, ``S`` sequences (rows with at least one valid token), ``n_i`` valid tokens
    in row ``i`` and ``l_it`` the loss:

    - ``token_mean``:              ``sum_it l_it / N``                (DAPO; every token weighs the same)
    - ``seq_mean_token_mean``:     ``sum_i (sum_t l_it / n_i) / S``   (original GRPO)
    - ``seq_mean_token_sum``:      ``sum_i sum_t l_it / S``
    - ``seq_mean_token_sum_norm``: ``sum_i sum_t l_it / (S * max_response_length)`` (Dr. GRPO: a constant
      horizon instead of the length, so long answers are not down-weighted. verl omits the ``1 / S``.)

    **Splitting over micro-batches and data-parallel ranks.** A mean of micro-batch means is not the
    mean of the batch when pieces hold different numbers of tokens or sequences. So, as in OpenRLHF,
    the caller counts ``N`` and ``S`` once over the whole global (mini-)batch, all ranks included, and
    passes them as ``global_num_tokens`` / ``global_num_seqs`` (``S`` as
    ``(mask.sum(-1) > 0).sum()`` summed over pieces). Then this returns the piece's *share*
    ``sum_piece / global_count``, and the shares summed over all micro-batches and ranks equal the
    global value exactly, whatever the split and padding. Only the normaliser a mode needs is read;
    without it the piece's own count is used (correct for an unsplit batch). Gradient accumulation must
    therefore *sum* micro-batch losses, and since DDP/FSDP *average* gradients over ranks, the caller
    multiplies the loss by the data-parallel world size (or reduces with a sum).
    ``max_response_length`` must be given for ``seq_mean_token_sum_norm``: a padded width would vary
    between micro-batches.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"Unknown loss aggregation mode {mode!r}. Valid modes: {', '.join(LOSS_AGG_MODES)}.")
    mask = mask.to(loss_mat.dtype)
    token_sums = (loss_mat * mask).sum(dim=-1)  # [B]
    tokens_per_seq = mask.sum(dim=-1)  # [B]

    if mode == "token_mean":
        num_tokens = tokens_per_seq.sum() if global_num_tokens is None else global_num_tokens
        return token_sums.sum() / _at_least_one(num_tokens, loss_mat)

    num_seqs = (tokens_per_seq > 0).sum() if global_num_seqs is None else global_num_seqs
    if mode == "seq_mean_token_mean":
        seq_losses = token_sums / tokens_per_seq.clamp(min=1.0)  # [B]; empty rows contribute 0
    elif mode == "seq_mean_token_sum":
        seq_losses = token_sums
    else:  # seq_mean_token_sum_norm
        if max_response_length is None or max_response_length <= 0:
            raise ValueError(
                "Loss aggregation 'seq_mean_token_sum_norm' needs max_response_length (the rollout's "
                f"maximum response length in tokens, > 0); got {max_response_length}."
            )
        seq_losses = token_sums / max_response_length
    return seq_losses.sum() / _at_least_one(num_seqs, loss_mat)


def _at_least_one(count: int | float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A normaliser as a tensor on ``like``'s device, clamped to >= 1 so empty pieces give 0, not NaN."""
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1.0)


# --------------------------------------------------------------------------------------------------
# Value loss
# --------------------------------------------------------------------------------------------------


def compute_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values_old: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss per token (PPO2 style).

    ``v_clip = clip(v, v_old - c, v_old + c)``,
    ``loss_t = 0.5 * max((v - R)^2, (v_clip - R)^2)``.
    All inputs ``[B, L]``; returns the per-token loss ``[B, L]`` (reduce with :func:`aggregate_loss`)
    and ``vf_clipfrac``, per token 1 where the clipped term was the larger one. ``response_mask`` is
    accepted for a uniform call; masking happens in the aggregation.
    """
    vpreds_clipped = torch.clamp(vpreds, values_old - cliprange_value, values_old + cliprange_value)
    unclipped = (vpreds - returns) ** 2
    clipped = (vpreds_clipped - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped)
    return loss, {"vf_clipfrac": (clipped > unclipped).float().detach()}


# --------------------------------------------------------------------------------------------------
# KL
# --------------------------------------------------------------------------------------------------


@_register(KL_ESTIMATORS, "k1", "kl")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``logp - ref_logp``: unbiased per-sample estimate of KL(pi || ref), can be negative."""
    return log_prob.float() - ref_log_prob.float()


@_register(KL_ESTIMATORS, "abs")
def kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``|logp - ref_logp|``."""
    return (log_prob.float() - ref_log_prob.float()).abs()


@_register(KL_ESTIMATORS, "k2", "mse")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``0.5 * (logp - ref_logp)^2``: low variance, biased (Schulman, "Approximating KL", 2020)."""
    return 0.5 * (log_prob.float() - ref_log_prob.float()) ** 2


@_register(KL_ESTIMATORS, "k3", "low_var_kl")
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``exp(ref - logp) - (ref - logp) - 1``: unbiased, always >= 0 (Schulman 2020; GRPO's KL term).

    Like verl, ``ref - logp`` is clamped to ±20 before exp and the result to [-10, 10]: one token the
    policy has left far behind must not dominate the loss or overflow.
    """
    log_ratio = (ref_log_prob.float() - log_prob.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (log_ratio.exp() - log_ratio - 1).clamp(-10.0, 10.0)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate ``[B, L]`` between the policy and the reference, by estimator name.

    Names: ``k1``/``kl``, ``k2``/``mse``, ``k3``/``low_var_kl``, ``abs`` (see ``KL_ESTIMATORS``).
    Computed in float32 whatever the input dtype.
    """
    return get_kl_estimator(kind)(log_prob, ref_log_prob)


@torch.no_grad()
def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, torch.Tensor]:
    """KL as a reward penalty (Ziegler et al. 2019): ``rewards_t = scores_t - kl_coef * kl_t * mask_t``.

    All tensors ``[B, L]``. Returns ``(token_level_rewards [B, L], mean_kl)`` where ``mean_kl`` (0-dim)
    is the per-sequence masked mean of ``kl_t`` averaged over sequences: the value an
    :class:`AdaptiveKLController` is updated with.
    """
    kl = kl_penalty(log_prob, ref_log_prob, kind) * response_mask.float()  # [B, L]
    token_level_rewards = token_level_scores.float() - kl_coef * kl
    mean_kl = masked_mean(kl, response_mask, dim=-1).mean()
    return token_level_rewards, mean_kl


class FixedKLController:
    """A constant KL coefficient; ``update`` does nothing."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """Kept for the same interface as :class:`AdaptiveKLController`."""


class AdaptiveKLController:
    """KL coefficient steered towards a target KL (Ziegler et al. 2019, arXiv:1909.08593).

    ``e = clip(current_kl / target_kl - 1, -0.2, 0.2)``, ``value *= 1 + e * n_steps / horizon``.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(
                f"AdaptiveKLController needs target_kl > 0 and horizon > 0; got target_kl={target_kl}, "
                f"horizon={horizon}."
            )
        self.value = init_kl_coef
        self.target_kl = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Scale ``value`` after ``n_steps`` samples were trained with mean KL ``current_kl``."""
        proportional_error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


KL_CONTROLLER_TYPES = ("fixed", "adaptive")


def build_kl_controller(
    kl_type: str, kl_coef: float, kl_target: float, kl_horizon: float
) -> FixedKLController | AdaptiveKLController:
    """The KL coefficient controller named ``kl_type``: ``fixed`` keeps ``kl_coef``; ``adaptive`` starts
    there and steers the KL towards ``kl_target`` over ``kl_horizon`` samples."""
    if kl_type == "fixed":
        return FixedKLController(kl_coef)
    if kl_type == "adaptive":
        return AdaptiveKLController(kl_coef, kl_target, kl_horizon)
    raise ValueError(f"Unknown KL controller {kl_type!r}. Valid names: {', '.join(KL_CONTROLLER_TYPES)}.")


# --------------------------------------------------------------------------------------------------
# Logit helpers
# --------------------------------------------------------------------------------------------------


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim: ``[..., V] -> [...]``.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``: no log of a probability is taken, so tokens with
    probability 0 (underflow) cannot produce ``0 * -inf = NaN``. Computed in the input's dtype.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """``log_softmax(logits)[..., labels]``: ``logits [..., V]``, ``labels [...]`` in ``[0, V)`` -> ``[...]``.

    For float32/64 this is ``logit[label] - logsumexp(logits)``, which never materialises a
    ``[..., V]`` log-softmax copy. bf16/fp16 logsumexp is too coarse, so those rows are upcast to float32
    ``chunk_rows`` at a time rather than all at once (peak memory of one chunk in no-grad passes), and
    the result is float32 (float32/64 inputs keep their dtype).
    """
    labels = labels.long()
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    vocab_size = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab_size)  # [N, V]
    flat_labels = labels.reshape(-1)  # [N]
    pieces = []
    for start in range(0, flat_logits.shape[0], chunk_rows):
        chunk = flat_logits[start : start + chunk_rows].float()
        picked = torch.gather(chunk, -1, flat_labels[start : start + chunk_rows].unsqueeze(-1)).squeeze(-1)
        pieces.append(picked - torch.logsumexp(chunk, dim=-1))
    if not pieces:
        return logits.new_zeros(labels.shape, dtype=torch.float32)
    return torch.cat(pieces).reshape(labels.shape)
