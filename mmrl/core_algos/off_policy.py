"""Off-policy objectives' maths (``algorithm.off_policy``; specs in :mod:`mmrl.algorithms`): weights on
the per-token policy loss for tokens that an older policy sampled.

:func:`decoupled_weights`: decoupled PPO (Fu et al. 2025, AReaL), ``w = pi_prox / pi_behav`` per token,
bounded by ``algorithm.decoupled`` (mmrl/algorithms/decoupled.py states the objective).
"""

from __future__ import annotations

import torch

from mmrl.config import AlgorithmConfig

# log-ratios are clamped before exp (as the policy losses do): a token the behaviour policy found near
# impossible must not overflow the weight to inf (it is over any cap anyway)
LOG_WEIGHT_CLAMP = 20.0


def decoupled_weights(
    proximal_log_probs: torch.Tensor,
    behaviour_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    algorithm: AlgorithmConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights ``w`` [B, R] on the policy loss (0 on padding and on masked tokens), and the
    per-token diagnostics [B, R] logged as token means: ``behaviour_weight`` (``w`` before the cap),
    ``behaviour_over_cap`` (1 where ``w`` exceeded the cap: masked or truncated) and ``behaviour_kl``
    (``log pi_behav - log pi_prox``, the k1 estimate of KL(pi_behav || pi_prox) from the samples)."""
    options = algorithm.decoupled
    mask = response_mask.to(torch.float32)
    log_weight = (proximal_log_probs.float() - behaviour_log_probs.float()).detach() * mask  # [B, R]
    weight = log_weight.clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP).exp()
    cap = options.behaviour_weight_cap
    over_cap = (weight > cap).float() if cap is not None else torch.zeros_like(weight)
    if options.over_cap == "truncate":
        applied = torch.where(over_cap.bool(), torch.full_like(weight, float(cap or 0.0)), weight)
    else:
        applied = weight * (1.0 - over_cap)
    diagnostics = {
        "behaviour_weight": weight * mask,
        "behaviour_over_cap": over_cap * mask,
        "behaviour_kl": -log_weight,
    }
    return applied * mask, diagnostics
