"""Rollout correction: the rollout engine's probabilities are not the trainer's.

The responses were sampled from pi_rollout (vLLM's kernels, bf16), while the loss treats them as
samples of pi_old (the trainer's forward of the same weights). Per token the ratio
rho_t = pi_old(y_t) / pi_rollout(y_t) measures the gap; :func:`rollout_correction_weights` turns it into
a weight on each token's policy loss (Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"; Liu, Li et al. 2025, "When speed kills stability"), as TRL, verl and OpenRLHF
do. The knobs are the section :class:`~mmrl.config.RolloutCorrectionConfig`.
"""

from __future__ import annotations

import torch

from mmrl.config import RolloutCorrectionConfig
from mmrl.core_algos.masked import masked_mean, masked_sum
from mmrl.core_algos.policy_losses import LOG_RATIO_CLAMP

ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_LEVELS = ("token", "sequence", "geometric")


def _level_log_ratio(token_log_ratio: torch.Tensor, response_mask: torch.Tensor, level: str) -> torch.Tensor:
    """``log rho`` at ``level`` on every token [B, L]: token ``log rho_t``; sequence ``sum_t log rho_t``
    (the product of the ratios); geometric ``mean_t log rho_t`` (their geometric mean). Clamped to
    ±LOG_RATIO_CLAMP, so exp() stays finite however long the response."""
    if level == "token":
        level_log_ratio = token_log_ratio
    elif level == "sequence":
        level_log_ratio = masked_sum(token_log_ratio, response_mask, dim=-1).unsqueeze(-1)
    elif level == "geometric":
        level_log_ratio = masked_mean(token_log_ratio, response_mask, dim=-1).unsqueeze(-1)
    else:
        raise ValueError(f"Unknown rollout correction level {level!r}; expected one of {ROLLOUT_RS_LEVELS}.")
    return level_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).expand_as(token_log_ratio)


@torch.no_grad()
def rollout_correction_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    options: RolloutCorrectionConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights ``[B, L]`` on the policy loss that correct for sampling from pi_rollout.

    With ``log rho_t = old_log_probs_t - rollout_log_probs_t`` (0 on padding) and ``log rho`` at a level
    as :func:`_level_log_ratio` (token, sequence = product, geometric = geometric mean):

    - truncated importance sampling (``rollout_is``): ``w = min(exp(log rho), rollout_is_threshold)``,
      1 when None. Token level bounds each token's weight (biased, low variance); sequence level is the
      unbiased sequence weight, truncated (high variance on long responses).
    - rejection (``rollout_rs``): ``a = 1`` where ``lower <= exp(log rho) <= rollout_rs_threshold``, 0
      outside, with ``lower = rollout_rs_threshold_lower`` (None: ``1 / rollout_rs_threshold``); 1 when
      None. Sequence and geometric levels reject whole responses.

    Returns ``w * a * response_mask`` (no gradient: the ratio's parts are fixed behaviour quantities)
    and per-token diagnostics [B, L]: ``rollout_is_weight`` (``w``), ``rollout_is_truncated`` (1 where
    the threshold cut ``w``), ``rollout_rs_masked`` (``1 - a``), ``rollout_kl_k1``
    (``log pi_rollout - log pi_old``) and ``rollout_kl_k3`` (``rho - 1 - log rho``), the k1 and k3
    estimates of KL(pi_rollout || pi_old) from the rollout's samples.
    """
    rollout_is, rollout_is_threshold = options.rollout_is, options.rollout_is_threshold
    rollout_rs, rollout_rs_threshold = options.rollout_rs, options.rollout_rs_threshold
    rollout_rs_threshold_lower = options.rollout_rs_threshold_lower
    mask = response_mask.to(torch.float32)
    token_log_ratio = (old_log_probs.float() - rollout_log_probs.float()) * mask  # [B, L]
    weight = torch.ones_like(token_log_ratio)
    truncated = torch.zeros_like(token_log_ratio)
    if rollout_is is not None:
        if rollout_is not in ROLLOUT_IS_LEVELS:
            raise ValueError(f"Unknown rollout_is level {rollout_is!r}; expected one of {ROLLOUT_IS_LEVELS}.")
        if rollout_is_threshold <= 0:
            raise ValueError(f"rollout_is_threshold must be > 0; got {rollout_is_threshold}.")
        ratio = _level_log_ratio(token_log_ratio, mask, rollout_is).exp()
        weight = ratio.clamp(max=rollout_is_threshold)
        truncated = (ratio > rollout_is_threshold).float()
    accepted = torch.ones_like(token_log_ratio)
    if rollout_rs is not None:
        lower = (
            1.0 / rollout_rs_threshold if rollout_rs_threshold_lower is None else rollout_rs_threshold_lower
        )
        if not 0 <= lower < rollout_rs_threshold:
            raise ValueError(
                f"rejection bounds must satisfy 0 <= lower < upper; got [{lower}, {rollout_rs_threshold}]."
            )
        ratio = _level_log_ratio(token_log_ratio, mask, rollout_rs).exp()
        accepted = ((ratio >= lower) & (ratio <= rollout_rs_threshold)).float()
    clamped = token_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    diagnostics = {
        "rollout_is_weight": weight * mask,
        "rollout_is_truncated": truncated * mask,
        "rollout_rs_masked": (1.0 - accepted) * mask,
        "rollout_kl_k1": -token_log_ratio,
        "rollout_kl_k3": (clamped.exp() - 1.0 - clamped) * mask,
    }
    return weight * accepted * mask, diagnostics
