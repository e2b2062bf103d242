"""What mmrl knows about an advantage estimator or a policy loss, apart from its maths: one spec each.

A spec names its function as ``"module:function"`` (or holds it), imported on first use, so the config
reads every spec (its choices, its checks, the flags the step plan reads) without importing torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# a check takes the section it checks and returns one message per problem, each naming the key and the fix
Check = Callable[[Any], list[str]]


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str  # the config's value for it
    function: str | Callable[..., Any]  # "module:function", imported when first used, or the function
    check: Check | None = None  # problems of the options it reads, given its config section

    def load(self) -> Callable[..., Any]:
        """The function itself."""
        if callable(self.function):
            return self.function
        module, _, name = self.function.partition(":")
        return getattr(importlib.import_module(module), name)

    def problems(self, section: Any) -> list[str]:
        return self.check(section) if self.check is not None else []


@dataclass(frozen=True)
class AdvantageSpec(AlgorithmSpec):
    """An advantage estimator: ``(token_level_rewards, response_mask, *, index, values, reward_baselines,
    gamma, lam, norm_adv_by_std, eps) -> (advantages, returns)``; ``check`` gets ``algorithm``."""

    needs_groups: bool = False  # compares the responses of a prompt: worker.rollout.n >= 2
    greedy_baseline: bool = False  # needs each prompt's greedy response scored as its baseline (ReMax)
    needs_critic: bool = False  # needs a critic's values (and trains one)


@dataclass(frozen=True)
class PolicyLossSpec(AlgorithmSpec):
    """A policy loss: ``(old_log_probs, log_probs, advantages, response_mask, options) -> (loss,
    diagnostics)``; ``check`` and ``describe`` get the actor's loss section (``PolicyLossConfig``)."""

    # (clip_ratio_low, clip_ratio_high) taken for null keys; None: the loss has no ratio clip
    clip_defaults: tuple[float, float] | None = None
    # the line printed with the config about how the ratio is bounded; None: the clip range in effect
    describe: Callable[[Any], str] | None = None

    def summary(self, options: Any) -> str:
        """How the ratio is bounded with ``options`` (the actor's loss section), for the printed config."""
        if self.describe is not None:
            return self.describe(options)
        clip = policy_clip_range(self.name, options.clip_ratio_low, options.clip_ratio_high)
        return "no ratio clip" if clip is None else f"ratio clipped to [1 - {clip[0]:g}, 1 + {clip[1]:g}]"


@dataclass(frozen=True)
class OffPolicySpec(AlgorithmSpec):
    """A correction of the policy loss for samples that an older policy (or another engine) drew:
    ``(proximal_log_probs, behaviour_log_probs, response_mask, algorithm) -> (weights, diagnostics)``,
    the per-token weights [B, R] on the policy loss (whose ratio is taken against the proximal policy,
    the old-log-prob pass's) and per-token diagnostics [B, R], logged as token means ``actor/<name>``;
    ``check`` gets ``algorithm``. Selected by ``algorithm.off_policy`` (``none``: no correction)."""


ADVANTAGE_ESTIMATORS: dict[str, AdvantageSpec] = {}
POLICY_LOSSES: dict[str, PolicyLossSpec] = {}
OFF_POLICY_OBJECTIVES: dict[str, OffPolicySpec] = {}


def register(spec: AdvantageSpec | PolicyLossSpec | OffPolicySpec) -> AlgorithmSpec:
    """Add ``spec`` to its registry (a module of :mod:`mmrl.algorithms` calls this at import)."""
    registry: dict[str, Any] = (
        ADVANTAGE_ESTIMATORS
        if isinstance(spec, AdvantageSpec)
        else OFF_POLICY_OBJECTIVES
        if isinstance(spec, OffPolicySpec)
        else POLICY_LOSSES
    )
    if spec.name in registry:
        raise ValueError(f"{type(spec).__name__} {spec.name!r} is registered twice")
    registry[spec.name] = spec
    return spec


def _lookup(registry: dict[str, Any], name: str, kind: str) -> Any:
    if name not in registry:
        raise ValueError(
            f"Unknown {kind} {name!r}. Valid names: {', '.join(sorted(registry))}. "
            f"Pick one of these in the config, or add a module to mmrl/algorithms that registers it."
        )
    return registry[name]


def advantage_estimator(name: str) -> AdvantageSpec:
    """The spec registered as ``name``; ValueError listing the valid names otherwise."""
    return _lookup(ADVANTAGE_ESTIMATORS, name, "advantage estimator")


def policy_loss(name: str) -> PolicyLossSpec:
    """The spec registered as ``name``; ValueError listing the valid names otherwise."""
    return _lookup(POLICY_LOSSES, name, "policy loss")


def off_policy_objective(name: str) -> OffPolicySpec | None:
    """The spec registered as ``name``; None for ``none`` (no correction); ValueError otherwise."""
    return None if name == "none" else _lookup(OFF_POLICY_OBJECTIVES, name, "off-policy objective")


def policy_clip_range(
    loss_type: str, clip_ratio_low: float | None = None, clip_ratio_high: float | None = None
) -> tuple[float, float] | None:
    """``(clip_ratio_low, clip_ratio_high)`` in effect for ``loss_type``: the given values, the loss's
    default (``clip_defaults``) for each one left None; None for a loss without clip (a ValueError if a
    clip ratio is given to it)."""
    defaults = policy_loss(loss_type).clip_defaults  # an unknown name fails listing the valid ones
    if defaults is None:
        if clip_ratio_low is not None or clip_ratio_high is not None:
            raise ValueError(
                f"policy loss {loss_type!r} has no clip range; leave clip_ratio_low/clip_ratio_high None"
            )
        return None
    low = defaults[0] if clip_ratio_low is None else clip_ratio_low
    high = defaults[1] if clip_ratio_high is None else clip_ratio_high
    return low, high
