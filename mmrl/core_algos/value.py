"""The critic's loss."""

from __future__ import annotations

import torch


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
