"""Masked reductions over ``[B, L]`` token tensors (``mask`` is 0/1, 1 on valid tokens)."""

from __future__ import annotations

import torch


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
