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
# Common signature: (old_log_probs, log_probs, advantages, response_mask, *, clip_ratio_low,
# clip_ratio_high, clip_ratio_dual). Each returns (loss [B, L], diagnostics) where diagnostics are
# detached per-token float tensors [B, L]; reduce them with masked_mean. The loss is NOT reduced:
# pass it to aggregate_loss.
# --------------------------------------------------------------------------------------------------


def _clamped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _clipped_surrogate(
    ratio: torch.Tensor, advantages: torch.Tensor, clip_ratio_low: float, clip_ratio_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``max(-A * ratio, -A * clip(ratio, 1 - low, 1 + high))`` and where the clipped term won."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


@_register(POLICY_LOSSES, "ppo")
def compute_ppo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.3,
    clip_ratio_dual: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token (Schulman et al. 2017), asymmetric clip (DAPO), dual clip.

    ``ratio_t = exp(logp_t - old_logp_t)`` (log-ratio clamped to ±20 before exp, see LOG_RATIO_CLAMP),
    ``loss_t = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_ratio_low, 1 + clip_ratio_high))``.
    Dual clip (Ye et al. 2020), when ``clip_ratio_dual = c`` (> 1) is given: for ``A_t < 0`` the loss is
    further capped at ``-A_t * c``, so a huge ratio on a bad token cannot blow up the update.

    Shapes: every input ``[B, L]``. Returns the per-token loss ``[B, L]`` and diagnostics:
    ``pg_clipfrac`` (trust-region clip active), ``pg_clipfrac_dual`` (dual clip active),
    ``ppo_kl`` (``old_logp - logp``, k1 estimate of KL(old || new)).
    """
    if clip_ratio_dual is not None and clip_ratio_dual <= 1.0:
        raise ValueError(f"clip_ratio_dual must be > 1 (e.g. 3.0) or None to disable; got {clip_ratio_dual}.")
    log_ratio = log_probs - old_log_probs
    ratio = _clamped_exp(log_ratio)
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    dual_clipped = torch.zeros_like(clipped)
    if clip_ratio_dual is not None:
        dual_cap = -advantages * clip_ratio_dual
        apply_dual = (advantages < 0) & (loss > dual_cap)
        loss = torch.where(apply_dual, dual_cap, loss)
        dual_clipped = apply_dual.float()
    diagnostics = {
        "pg_clipfrac": clipped.detach(),
        "pg_clipfrac_dual": dual_clipped.detach(),
        "ppo_kl": -log_ratio.detach(),
    }
    return loss, diagnostics


@_register(POLICY_LOSSES, "gspo")
def compute_gspo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_dual: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): clip a sequence-level importance ratio instead of token ratios.

    ``s_i = exp(mean_t (logp_it - old_logp_it))`` over the response's valid tokens, spread to tokens as
    ``s_it = sg[s_i] * pi_it / sg[pi_it]`` (GSPO-token form): its value is ``s_i`` on every token and its
    gradient is ``s_i * grad logp_it``. ``loss_it = max(-A_it * s_it, -A_it * clip(s_it, 1 - low, 1 + high))``
    so a whole sequence is clipped or not. With ``seq_mean_token_mean`` aggregation and per-sequence
    advantages this is exactly the GSPO objective and gradient. ``clip_ratio_dual`` is ignored.

    Shapes and diagnostics as :func:`compute_ppo_policy_loss` (``pg_clipfrac`` is per sequence,
    broadcast to its tokens).
    """
    token_log_ratio = log_probs - old_log_probs
    seq_log_ratio = masked_mean(token_log_ratio, response_mask, dim=-1).unsqueeze(-1)  # [B, 1]
    combined_log_ratio = seq_log_ratio.detach() + log_probs - log_probs.detach()  # [B, L]
    ratio = _clamped_exp(combined_log_ratio)
    loss, clipped = _clipped_surrogate(ratio, advantages, clip_ratio_low, clip_ratio_high)
    diagnostics = {
        "pg_clipfrac": clipped.detach(),
        "pg_clipfrac_dual": torch.zeros_like(clipped),
        "ppo_kl": -token_log_ratio.detach(),
    }
    return loss, diagnostics


@_register(POLICY_LOSSES, "cispo")
def compute_cispo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.3,
    clip_ratio_dual: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient importance weight.

    ``loss_t = -sg(clip(ratio_t, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A_t * logp_t``, so
    ``d loss_t / d logp_t = -clip(ratio_t) * A_t``: unlike PPO, clipped tokens still get a gradient,
    only its weight is bounded. (The paper clips only the upper side; set ``clip_ratio_low`` large,
    e.g. 1.0, for that.) ``clip_ratio_dual`` is ignored.

    Shapes and diagnostics as :func:`compute_ppo_policy_loss`; ``pg_clipfrac`` marks tokens whose
    weight was clipped.
    """
    log_ratio = log_probs - old_log_probs
    ratio = _clamped_exp(log_ratio).detach()
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = -weight * advantages * log_probs
    diagnostics = {
        "pg_clipfrac": (weight != ratio).float(),
        "pg_clipfrac_dual": torch.zeros_like(ratio),
        "ppo_kl": -log_ratio.detach(),
    }
    return loss, diagnostics


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
