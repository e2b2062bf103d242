"""Registries: a config string selects a function by name (``get_*`` fail listing the valid names).

Advantage estimators and policy losses are registered as specs in :mod:`mmrl.algorithms`; the mappings
here are views of those registries that give the functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from mmrl.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    AlgorithmSpec,
    advantage_estimator,
    policy_loss,
)

KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {}


class _Functions(Mapping[str, Callable]):
    """name -> function of a registry of specs (always current: a spec registered later is in it)."""

    def __init__(self, specs: Mapping[str, AlgorithmSpec]):
        self._specs = specs

    def __getitem__(self, name: str) -> Callable:
        return self._specs[name].load()

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)


ADV_ESTIMATORS: Mapping[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = _Functions(
    ADVANTAGE_ESTIMATORS
)
POLICY_LOSSES: Mapping[str, Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]] = _Functions(
    POLICY_LOSSES
)


def register(registry: dict[str, Callable], *names: str) -> Callable[[Callable], Callable]:
    def decorator(fn: Callable) -> Callable:
        for name in names:
            registry[name] = fn
        return fn

    return decorator


def get_adv_estimator(name: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The advantage estimator registered as ``name``; ValueError listing the valid names otherwise."""
    return advantage_estimator(name).load()


def get_policy_loss(name: str) -> Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The policy loss registered as ``name``; ValueError listing the valid names otherwise."""
    return policy_loss(name).load()


def get_kl_estimator(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The per-token KL estimator registered as ``name``; ValueError listing the valid names otherwise."""
    if name not in KL_ESTIMATORS:
        raise ValueError(
            f"Unknown KL estimator {name!r}. Valid names: {', '.join(sorted(KL_ESTIMATORS))}. "
            f"Pick one of these in the config, or add a function to the registry in mmrl.core_algos."
        )
    return KL_ESTIMATORS[name]
