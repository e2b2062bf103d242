"""KL between the policy and the reference: per-token estimators (as a loss term or a reward penalty)
and the coefficient's controllers."""

from __future__ import annotations

import torch

from mmrl.core_algos.masked import masked_mean
from mmrl.core_algos.policy_losses import LOG_RATIO_CLAMP
from mmrl.core_algos.registry import KL_ESTIMATORS, get_kl_estimator, register


@register(KL_ESTIMATORS, "k1", "kl")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``logp - ref_logp``: unbiased per-sample estimate of KL(pi || ref), can be negative."""
    return log_prob.float() - ref_log_prob.float()


@register(KL_ESTIMATORS, "abs")
def kl_abs(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``|logp - ref_logp|``."""
    return (log_prob.float() - ref_log_prob.float()).abs()


@register(KL_ESTIMATORS, "k2", "mse")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """``0.5 * (logp - ref_logp)^2``: low variance, biased (Schulman, "Approximating KL", 2020)."""
    return 0.5 * (log_prob.float() - ref_log_prob.float()) ** 2


@register(KL_ESTIMATORS, "k3", "low_var_kl")
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
