"""Mixture-of-experts routers: what each forward routed, the load-balancing loss, router metrics.

A MoE family names its routers (:attr:`~mmrl.models.families.ModelFamily.moe_router`): modules that
map a layer's hidden states [T, D] to ``(logits [T, E], weights [T, k], experts [T, k])``.
:class:`RouterRecorder` hooks them for the length of a block and keeps each call's logits (with their
graph, so the load-balancing loss can be trained) and chosen experts, and which of the T tokens are real
(a padded forward routes its padding too; a packed one has none). It also replays routing: the
transformers rollout records each token's experts per layer (the ``routed_experts`` column, [B, L,
layers, k]), and with ``worker.actor.moe.routing_replay`` the actor's old-log-prob and update passes
route every token by them (:func:`forward_routing` lays them out as a forward's routers see the tokens).

Losses and metrics are plain functions of those calls:

- :func:`load_balancing_loss`: Switch Transformer's ``E * sum_i f_i * P_i`` per layer, ``f_i`` the share
  of the (token, slot) pairs routed to expert i (sums to 1) and ``P_i`` the mean router probability of
  expert i over the tokens; mean over layers. 1 when perfectly balanced, up to E / k when every token
  goes to the same k experts. (transformers' ``load_balancing_loss_func`` counts slots per token, so its
  value is k times this, pooled over layers.) Only ``P`` carries a gradient.
- :func:`router_metrics`: the busiest expert's share of the routed pairs (1 / E balanced, 1 / k at
  worst) and the router's entropy (nats, mean over tokens; ln E is uniform), both means over layers.
  Qwen3-VL MoE routes dropless (every token reaches its k experts), so no token is ever dropped and no
  dropped-token count is reported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from mmrl.models.families import family_of


@dataclass
class RouterCall:
    """One router forward: its ``logits`` [T, E] (graph kept), chosen ``experts`` [T, k], and ``valid``
    [T] (False on padding tokens) or None when every token is real."""

    logits: torch.Tensor
    experts: torch.Tensor
    valid: torch.Tensor | None = None

    def real(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, experts)`` of the real tokens only."""
        if self.valid is None:
            return self.logits, self.experts
        return self.logits[self.valid], self.experts[self.valid]


def router_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, router)`` of each MoE router of ``model`` in layer order; [] for a dense model."""
    return family_of(model).router_modules(model)


ROUTED_EXPERTS = "routed_experts"  # the batch column of the experts the rollout chose (mmrl.columns)
FREE = -1  # a token without recorded experts (padding, a response's last token): its router chooses


class RouterRecorder:
    """Hooks on ``model``'s routers for the length of a pass (``with recorder.hooked():``, backward
    included, so that a layer recomputed by gradient checkpointing routes as in its forward). Each
    forward's router calls go to :attr:`calls` (layer by layer; :meth:`begin` clears them).

    Routing replay: after ``begin(replay)`` with ``replay`` [T, layers, k] (the experts of the T tokens
    the next forward's routers see, in their order; :data:`FREE` rows route freely) every router takes
    the given experts instead of its top-k, weighted as the router weighs its own choice: the softmax
    probabilities at those experts, renormalised to sum to 1 (so replaying a router's own choice changes
    nothing, bit for bit). The logits, and the load-balancing loss's gradient, are the router's own."""

    def __init__(self, model: nn.Module):
        self.model = model
        routers = router_modules(model)
        if not routers:
            raise ValueError(f"{type(model).__name__} has no MoE routers to record")
        self.routers = [router for _, router in routers]
        self.layer_of = {id(router): layer for layer, router in enumerate(self.routers)}
        self.calls: list[RouterCall] = []
        self.replay: torch.Tensor | None = None
        self._valid: torch.Tensor | None = None  # [B * L] of the forward under way (padded), else None

    def begin(self, replay: torch.Tensor | None = None) -> None:
        """Start a new forward: no calls recorded, ``replay`` [T, layers, k] (or None: free routing)."""
        self.calls, self.replay = [], replay

    @contextlib.contextmanager
    def hooked(self) -> Iterator[RouterRecorder]:
        handles = [self.model.register_forward_pre_hook(self._on_model_call, with_kwargs=True)]
        handles += [router.register_forward_hook(self._on_router_call) for router in self.routers]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            self.replay = self._valid = None

    @contextlib.contextmanager
    def recording(self, replay: torch.Tensor | None = None) -> Iterator[RouterRecorder]:
        """One block of forwards (no backward after it): hooked, and begun with ``replay``."""
        with self.hooked():
            self.begin(replay)
            yield self

    def layer_experts(self) -> torch.Tensor:
        """The experts of the last forward's tokens, [T, layers, k] (its last ``layers`` calls)."""
        return torch.stack([call.experts for call in self.calls[-len(self.routers) :]], dim=1)

    def _on_model_call(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        # a padded forward gets its [B, L] mask; a packed one none (all its tokens are real)
        mask = kwargs.get("attention_mask")
        self._valid = mask.reshape(-1).bool() if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None

    def _on_router_call(self, module: nn.Module, args: tuple, output: tuple) -> tuple | None:
        logits, weights, experts = output
        if self.replay is not None:
            chosen = self.replay[:, self.layer_of[id(module)]].to(experts.device, experts.dtype)  # [T, k]
            if chosen.shape != experts.shape:
                raise ValueError(
                    f"routing replay: the router sees {len(experts)} tokens, the replayed experts are "
                    f"for {len(chosen)}; the recorded routing does not belong to this forward's rows"
                )
            experts = torch.where(chosen == FREE, experts, chosen)
            chosen_probs = logits.float().softmax(-1).gather(-1, experts)
            weights = (chosen_probs / chosen_probs.sum(-1, keepdim=True)).to(weights.dtype)
        valid = self._valid if self._valid is not None and len(self._valid) == len(logits) else None
        self.calls.append(RouterCall(logits, experts.detach(), valid))
        return (logits, weights, experts) if self.replay is not None else None


def forward_routing(
    routed_experts: torch.Tensor, attention_mask: torch.Tensor, padding_free: bool
) -> torch.Tensor:
    """The recorded experts [B, L, layers, k] of a micro-batch's rows in the order its forward's
    routers see the tokens, [T, layers, k]: all B * L of a padded forward, the valid ones in row order
    of a packed one (one packed sequence per row; shared prompts would reorder them)."""
    if not padding_free:
        return routed_experts.reshape(-1, *routed_experts.shape[2:])
    return routed_experts[attention_mask.bool()]


def load_balancing_loss(call: RouterCall, num_experts: int) -> torch.Tensor:
    """``E * sum_i f_i * P_i`` of one router call over its real tokens (see the module docstring)."""
    logits, experts = call.real()
    if len(logits) == 0:
        return logits.new_zeros((), dtype=torch.float32)
    probs = logits.float().softmax(-1)  # [T, E]
    routed = torch.bincount(experts.reshape(-1), minlength=num_experts).float()
    routed_share = routed / routed.sum()  # f [E]
    return num_experts * (routed_share * probs.mean(0)).sum()


def mean_load_balancing_loss(calls: list[RouterCall], num_experts: int) -> torch.Tensor:
    """:func:`load_balancing_loss` averaged over ``calls`` (the layers of a forward)."""
    return torch.stack([load_balancing_loss(call, num_experts) for call in calls]).mean()


def router_metrics(calls: list[RouterCall], num_experts: int) -> dict[str, torch.Tensor]:
    """``moe_max_expert_share`` and ``moe_router_entropy`` of ``calls``, means over the calls."""
    shares, entropies = [], []
    with torch.no_grad():
        for call in calls:
            logits, experts = call.real()
            if len(logits) == 0:
                continue
            routed = torch.bincount(experts.reshape(-1), minlength=num_experts).float()
            shares.append(routed.max() / routed.sum())
            log_probs = logits.float().log_softmax(-1)
            entropies.append(-(log_probs.exp() * log_probs).sum(-1).mean())
    if not shares:
        return {}
    return {
        "moe_max_expert_share": torch.stack(shares).mean(),
        "moe_router_entropy": torch.stack(entropies).mean(),
    }


def num_experts_of(model: nn.Module) -> int:
    """E of ``model``'s routers (all layers alike in the shipped MoE families); 0 for a dense model or
    one without a Hugging Face config."""
    if getattr(model, "config", None) is None:
        return 0
    counts = {router.num_experts for _, router in router_modules(model)}
    if len(counts) > 1:
        raise ValueError(f"expected one expert count over the routers, found {sorted(counts)}")
    return counts.pop() if counts else 0
