"""Registries: a config string selects an algorithm by name (``get_*`` fail listing the valid names)."""

from __future__ import annotations

from collections.abc import Callable

import torch

ADV_ESTIMATORS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {}
POLICY_LOSSES: dict[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = {}
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}


def register(registry: dict[str, Callable], *names: str) -> Callable[[Callable], Callable]:
    def decorator(fn: Callable) -> Callable:
        for name in names:
            registry[name] = fn
        return fn

    return decorator


def _lookup(registry: dict[str, Callable], name: str, kind: str) -> Callable:
    if name not in registry:
        raise ValueError(
            f"Unknown {kind} {name!r}. Valid names: {', '.join(sorted(registry))}. "
            f"Pick one of these in the config, or add a function to the registry in mmrl.core_algos."
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
