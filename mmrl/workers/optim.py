"""Optimizers beyond ``torch.optim`` (registered by name in :data:`mmrl.workers.fsdp_engine.OPTIMIZERS`).

:class:`AdamWBf16` is AdamW whose two moment buffers are stored in bfloat16: 4 bytes of optimizer state
per parameter instead of 8 (a 3B model: 11 GiB less), with the parameters (fp32 masters) and the
arithmetic in float32.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

# elements updated at a time: the float32 temporaries of a chunk (moments, noise, denominator) stay
# ~100 MB instead of several GB for a 151,936 x 2,048 embedding
CHUNK_ELEMENTS = 1 << 22
ROUNDING_SEED = 0x5EED  # with the step, the seed of the rounding noise (rounding_noise)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of an FSDP2 DTensor (a view: in-place changes reach the DTensor), else ``tensor``."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def round_to_bf16_stochastically_(values: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """``values`` (float32), in place, rounded to a bfloat16 value up or down at random, with the
    probability of rounding up equal to the fraction of the gap covered, so the result is unbiased:
    ``E[round(x)] = x``. ``noise``: int32 uniform in [0, 2^16), the shape of ``values``. Returns
    ``values``, now exactly representable in bfloat16 (``.to(torch.bfloat16)`` is exact).

    Why: with round-to-nearest, ``v <- beta2 * v + (1 - beta2) * g^2`` (``beta2 = 0.999``) changes ``v`` by
    0.1 %, less than half a bfloat16 step (0.2-0.8 %), so after ~700 steps ``v`` stops moving at all.
    bfloat16 is the top 16 bits of a float32: adding uniform noise to the low 16 bits of the magnitude and
    truncating them rounds up with exactly that probability (the sign bit is not touched).
    """
    bits = values.view(torch.int32)
    bits.add_(noise).bitwise_and_(-65536)  # -65536 = 0xFFFF0000
    return values


def rounding_noise(size: int, device: torch.device, step: int) -> torch.Tensor:
    """Two int32 rows of ``size`` uniform draws in [0, 2^16) (one for each moment), from a generator
    seeded by ``step``: the same step of a resumed run rounds the same way as the uninterrupted run,
    without any saved RNG state. One draw per step is reused by every chunk of every tensor (drawing
    per element is the slowest part of the step on a CPU); each element still gets fresh noise at
    every step, which is what keeps its rounding unbiased over time."""
    generator = torch.Generator(device)
    generator.manual_seed(ROUNDING_SEED * 1_000_003 + step)
    return torch.randint(0, 1 << 16, (2, size), dtype=torch.int32, device=device, generator=generator)


class AdamWBf16(torch.optim.Optimizer):
    """AdamW (Loshchilov & Hutter) with ``exp_avg`` and ``exp_avg_sq`` kept in bfloat16.

    The update is torch.optim.AdamW's, computed in float32 chunk by chunk:
    ``p <- p * (1 - lr * wd)``, ``m <- b1 m + (1 - b1) g``, ``v <- b2 v + (1 - b2) g^2``,
    ``p <- p - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)``; the new ``m`` and ``v`` are stored
    rounded stochastically (:func:`round_to_bf16_stochastically`). Parameters may be FSDP2 DTensors:
    the states are DTensors of the same placement (so distributed checkpoints shard them like
    torch's AdamW states) and each rank updates its local shard.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= beta < 1 for beta in betas):
            raise ValueError(
                f"AdamWBf16: invalid lr={lr}, betas={betas}, eps={eps} or weight_decay={weight_decay}"
            )
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def _state(self, param: nn.Parameter) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)  # a float32 CPU tensor, as torch.optim.AdamW keeps it
            state["exp_avg"] = torch.zeros_like(
                param, dtype=torch.bfloat16, memory_format=torch.preserve_format
            )
            state["exp_avg_sq"] = torch.zeros_like(
                param, dtype=torch.bfloat16, memory_format=torch.preserve_format
            )
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every floating state to its parameter's dtype (float32 masters): cast the
        moments back, or a resumed run would hold (and keep) 8 bytes of state per parameter."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped = [
            param for group in self.param_groups for param in group["params"] if param.grad is not None
        ]
        largest = max((_local(param).numel() for param in stepped), default=0)
        noise: dict[torch.device, torch.Tensor] = {}
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("AdamWBf16 does not support sparse gradients")
                state = self._state(param)
                state["step"] += 1
                step = int(state["step"].item())
                local = _local(param)
                if local.device not in noise:
                    noise[local.device] = rounding_noise(min(largest, CHUNK_ELEMENTS), local.device, step)
                moments = (_local(state["exp_avg"]), _local(state["exp_avg_sq"]))
                self._update(local, _local(param.grad), *moments, step, group, noise[local.device])
        return loss

    @staticmethod
    def _update(
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        step: int,
        group: dict,
        noise: torch.Tensor,
    ) -> None:
        """One AdamW step of a (local) tensor, in float32 chunks of :data:`CHUNK_ELEMENTS`."""
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        # m / (sqrt(v) / c2 + eps) = c2 * m / (sqrt(v) + eps * c2) with c2 = sqrt(1 - beta2^t): one pass less
        bias_correction2_sqrt = math.sqrt(1 - beta2**step)
        step_size = lr / (1 - beta1**step) * bias_correction2_sqrt
        tensors = (param, grad, exp_avg, exp_avg_sq)
        if all(tensor.is_contiguous() for tensor in tensors):
            tensors = tuple(tensor.view(-1) for tensor in tensors)
            chunks = [
                slice(start, start + CHUNK_ELEMENTS) for start in range(0, param.numel(), CHUNK_ELEMENTS)
            ]
        else:  # not seen with FSDP2 shards: one chunk of the tensor's own shape, noise drawn for it
            noise = torch.randint(0, 1 << 16, (2, *param.shape), dtype=torch.int32, device=param.device)
            chunks = [...]
        param, grad, exp_avg, exp_avg_sq = tensors
        for chunk in chunks:
            g = grad[chunk].float()
            m = exp_avg[chunk].float().mul_(beta1).add_(g, alpha=1 - beta1)
            v = exp_avg_sq[chunk].float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
            target = param[chunk]
            if weight_decay:
                target.mul_(1 - lr * weight_decay)
            denominator = v.sqrt().add_(eps * bias_correction2_sqrt)
            target.addcdiv_(m, denominator, value=-step_size)
            size = m.numel()
            exp_avg[chunk].copy_(round_to_bf16_stochastically_(m, noise[0].view(-1)[:size].view_as(m)))
            exp_avg_sq[chunk].copy_(round_to_bf16_stochastically_(v, noise[1].view(-1)[:size].view_as(v)))
