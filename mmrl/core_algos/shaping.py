"""Reward shaping added to the reward workers' scores."""

from __future__ import annotations

import torch


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
