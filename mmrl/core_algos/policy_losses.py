"""Policy losses: ``(old_log_probs, log_probs, advantages, response_mask, options) -> (loss, diagnostics)``.

``options`` is the actor's loss section (:class:`~mmrl.config.PolicyLossConfig`, which
``worker.actor`` derives from): each loss reads the knobs it needs from it, so a new knob is a field
there and a line here. Each loss is registered by name with its clip defaults and the checks of its
clip ratios in :mod:`mmrl.algorithms.losses`; clip ratios left None take the loss's default.
Each loss returns (loss [B, L], diagnostics) where diagnostics are detached per-token float tensors
[B, L] (``pg_clipfrac``, ``pg_clipfrac_dual``, ``ppo_kl``); reduce them with masked_mean. The loss is
NOT reduced: pass it to :func:`~mmrl.core_algos.aggregation.aggregate_loss`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from mmrl.algorithms import POLICY_LOSSES as LOSS_SPECS
from mmrl.algorithms import policy_clip_range
from mmrl.config import PolicyLossConfig
from mmrl.core_algos.masked import masked_mean
from mmrl.core_algos.registry import get_policy_loss

# exp() of a log-ratio above ~88 overflows float32 to inf, and inf * 0 advantages gives NaN gradients
# (pytorch/pytorch#10729). Ratios beyond e^20 are clipped by every loss anyway, so clamping is lossless.
LOG_RATIO_CLAMP = 20.0
DEFAULT_OPTIONS = PolicyLossConfig()


class _ClipDefaults(Mapping[str, "tuple[float, float] | None"]):
    """loss -> its spec's ``clip_defaults`` (always current)."""

    def __getitem__(self, name: str) -> tuple[float, float] | None:
        return LOSS_SPECS[name].clip_defaults

    def __iter__(self) -> Iterator[str]:
        return iter(LOSS_SPECS)

    def __len__(self) -> int:
        return len(LOSS_SPECS)


# loss -> (clip_ratio_low, clip_ratio_high) used when the config leaves them null (None: no clip range),
# as registered in mmrl.algorithms.losses; the ratio (or importance weight) is clipped to [1 - low, 1 + high]
POLICY_LOSS_CLIP_DEFAULTS = _ClipDefaults()


def compute_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    options: PolicyLossConfig = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss named ``options.loss_type`` (:mod:`mmrl.algorithms`), called with ``options``."""
    loss = get_policy_loss(options.loss_type)
    return loss(old_log_probs, log_probs, advantages, response_mask, options)


def _clip_range(loss_type: str, options: PolicyLossConfig) -> tuple[float, float]:
    return policy_clip_range(loss_type, options.clip_ratio_low, options.clip_ratio_high)


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


def compute_ppo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    options: PolicyLossConfig = DEFAULT_OPTIONS,
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
    clip_ratio_dual = options.clip_ratio_dual
    if clip_ratio_dual is not None and clip_ratio_dual <= 1.0:
        raise ValueError(f"clip_ratio_dual must be > 1 (e.g. 3.0) or None to disable; got {clip_ratio_dual}.")
    low, high = _clip_range("ppo", options)
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


def compute_gspo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    options: PolicyLossConfig = DEFAULT_OPTIONS,
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
    low, high = _clip_range("gspo", options)
    token_log_ratio = log_probs - old_log_probs
    seq_log_ratio = masked_mean(token_log_ratio, response_mask, dim=-1).unsqueeze(-1)  # [B, 1]
    ratio = _clamped_exp(seq_log_ratio).expand_as(log_probs)  # [B, L]
    loss, clipped = _clipped_surrogate(ratio, advantages, low, high)
    return loss, _diagnostics(token_log_ratio, clipped)


def compute_gspo_token_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    options: PolicyLossConfig = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token (Zheng et al. 2025, eq. 13): the sequence ratio with each token's own advantage.

    ``s_it = sg[s_i] * pi_it / sg[pi_it]`` with ``s_i`` as in :func:`compute_gspo_policy_loss`: its
    value is ``s_i`` on every token and its gradient ``s_i * grad logp_it``.
    ``loss_it = max(-A_it * s_it, -A_it * clip(s_it, 1 - low, 1 + high))`` (None: 3e-4 / 4e-4).
    With one advantage per sequence (``A_it = A_i``) value and gradient equal ``gspo``'s; with
    token-level advantages token ``t`` is weighted by its own ``A_it``, not the row's mean.

    Shapes and diagnostics as :func:`compute_gspo_policy_loss`.
    """
    low, high = _clip_range("gspo_token", options)
    token_log_ratio = log_probs - old_log_probs
    seq_log_ratio = masked_mean(token_log_ratio, response_mask, dim=-1).unsqueeze(-1)  # [B, 1]
    combined_log_ratio = seq_log_ratio.detach() + log_probs - log_probs.detach()  # [B, L]
    ratio = _clamped_exp(combined_log_ratio)
    loss, clipped = _clipped_surrogate(ratio, advantages, low, high)
    return loss, _diagnostics(token_log_ratio, clipped)


def compute_cispo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    options: PolicyLossConfig = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, 2025): REINFORCE with a clipped, stop-gradient importance weight.

    ``loss_t = -sg(clip(ratio_t, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A_t * logp_t``, so
    ``d loss_t / d logp_t = -clip(ratio_t) * A_t``: unlike PPO, clipped tokens still get a gradient,
    only its weight is bounded. None: 1.0 / 4.0, the paper's choice of no lower bound (``1 - 1 = 0``)
    with EasyR1's upper bound 5; ``clip_ratio_low=0`` keeps every weight >= 1 (EasyR1's recipe).

    Shapes and diagnostics as :func:`compute_ppo_policy_loss`; ``pg_clipfrac`` marks tokens whose
    weight was clipped.
    """
    low, high = _clip_range("cispo", options)
    log_ratio = log_probs - old_log_probs
    ratio = _clamped_exp(log_ratio).detach()
    weight = ratio.clamp(1.0 - low, 1.0 + high)
    loss = -weight * advantages * log_probs
    return loss, _diagnostics(log_ratio, (weight != ratio).float())


def compute_sapo_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    options: PolicyLossConfig = DEFAULT_OPTIONS,
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
    tau_positive, tau_negative = options.tau_positive, options.tau_negative
    if tau_positive <= 0 or tau_negative <= 0:
        raise ValueError(
            f"SAPO temperatures must be > 0; got tau_positive={tau_positive}, tau_negative={tau_negative}"
        )
    log_ratio = log_probs - old_log_probs
    ratio = _clamped_exp(log_ratio)
    tau = torch.where(advantages >= 0, tau_positive, tau_negative).to(ratio.dtype)  # [B, L]
    gate = 4.0 / tau * torch.sigmoid(tau * (ratio - 1.0))
    return -advantages * gate, _diagnostics(log_ratio)


def _token_covariance(
    log_probs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """``(A_t - mean A) * (logp_t - mean logp)`` per token ``[B, L]``, means over the valid tokens given;
    detached (it selects tokens, it is not differentiated)."""
    log_probs = log_probs.detach()
    centered_advantages = advantages - masked_mean(advantages, response_mask)
    return centered_advantages * (log_probs - masked_mean(log_probs, response_mask))


def _covariance_count(ratio: float, response_mask: torch.Tensor) -> int:
    """``max(1, floor(ratio * N))`` tokens of the ``N`` valid ones."""
    return max(1, int(ratio * float(response_mask.sum())))


def compute_clip_cov_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    options: PolicyLossConfig = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al. 2025, "The Entropy Mechanism of RL for Reasoning Language Models"; verl's
    ``clip_cov``): PPO's clipped loss, with the gradient cut on a few tokens of high covariance.

    The entropy falls when the policy raises tokens that are both likely and advantageous: the change of
    the entropy is minus the covariance ``cov_t = (A_t - mean A)(logp_t - mean logp)`` (means over the
    valid tokens given). Tokens that PPO's clip has not already cut and whose ``cov_t`` lies in
    ``(clip_cov_lb, clip_cov_ub)`` are candidates; ``n = max(1, floor(clip_cov_ratio * N))`` of them
    (``N`` valid tokens; all when fewer) drawn at random get ``loss_t = 0``. Elsewhere the loss is
    :func:`compute_ppo_policy_loss`'s without dual clip (clip range: ppo's defaults).

    As in verl the means and ``N`` are over the tokens this call sees (a micro-batch), so the selection
    depends on how a batch is split. Diagnostics as PPO's, plus ``pg_covfrac``: the cut tokens.
    """
    low, high = _clip_range("clip_cov", options)
    log_ratio = log_probs - old_log_probs
    loss, clipped = _clipped_surrogate(_clamped_exp(log_ratio), advantages, low, high)
    covariance = _token_covariance(log_probs, advantages, response_mask)
    candidates = (
        response_mask.bool()
        & (clipped == 0)
        & (covariance > options.clip_cov_lb)
        & (covariance < options.clip_cov_ub)
    )
    positions = torch.nonzero(candidates.reshape(-1)).squeeze(-1)  # [n_candidates]
    count = min(_covariance_count(options.clip_cov_ratio, response_mask), positions.numel())
    picked = positions[torch.randperm(positions.numel(), device=positions.device)[:count]]
    cut = torch.zeros(candidates.numel(), dtype=loss.dtype, device=loss.device)
    cut[picked] = 1.0
    cut = cut.reshape(candidates.shape)  # [B, L]
    diagnostics = _diagnostics(log_ratio, clipped)
    diagnostics["pg_covfrac"] = cut.detach()
    return loss * (1.0 - cut), diagnostics


def compute_kl_cov_policy_loss(
    old_log_probs: torch.Tensor,
    log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    options: PolicyLossConfig = DEFAULT_OPTIONS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al. 2025; verl's ``kl_cov``): no ratio clip; the tokens of highest covariance get a
    KL penalty towards the old policy instead.

    ``loss_t = -A_t * ratio_t``, plus ``kl_cov_coef * |logp_t - old_logp_t|`` on the
    ``n = max(1, floor(kl_cov_ratio * N))`` valid tokens of largest ``cov_t`` (as in
    :func:`compute_clip_cov_policy_loss`). Those are the tokens whose update
    would lower the entropy most; the penalty holds them near the old policy while the rest move freely.

    Means, ``N`` and the ranking are over the tokens this call sees (a micro-batch), as in verl.
    Diagnostics as PPO's (``pg_clipfrac`` 0: nothing is clipped), plus ``pg_covfrac``: the penalised tokens.
    """
    log_ratio = log_probs - old_log_probs
    loss = -advantages * _clamped_exp(log_ratio)
    covariance = _token_covariance(log_probs, advantages, response_mask)
    valid = response_mask.bool().reshape(-1)
    ranked = covariance.reshape(-1).masked_fill(~valid, float("-inf"))
    count = min(_covariance_count(options.kl_cov_ratio, response_mask), int(valid.sum()))
    picked = torch.topk(ranked, count).indices if count else ranked.new_zeros(0, dtype=torch.long)
    penalised = torch.zeros_like(ranked)
    penalised[picked] = 1.0
    penalised = penalised.reshape(loss.shape)  # [B, L]
    loss = loss + penalised * options.kl_cov_coef * log_ratio.abs()
    diagnostics = _diagnostics(log_ratio)
    diagnostics["pg_covfrac"] = penalised.detach()
    return loss, diagnostics
