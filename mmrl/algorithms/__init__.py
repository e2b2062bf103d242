"""Every advantage estimator, policy loss and off-policy objective, one spec each (:mod:`mmrl.algorithms.spec`): its function,
its defaults, the checks of its options and the flags the step plan reads.

The config's choices (``algorithm.adv_estimator``, ``worker.actor.loss_type``), the loader's checks and
the step plan read these registries; nothing else names an algorithm. Every module of this package is
imported here and registers its specs, so adding an algorithm is adding one module (docs/algorithms.md).
Nothing here imports torch at import time: a module's function imports it when it runs.
"""

import importlib
import pkgutil

from mmrl.algorithms.spec import (
    ADVANTAGE_ESTIMATORS,
    OFF_POLICY_OBJECTIVES,
    POLICY_LOSSES,
    AdvantageSpec,
    AlgorithmSpec,
    OffPolicySpec,
    PolicyLossSpec,
    advantage_estimator,
    off_policy_objective,
    policy_clip_range,
    policy_loss,
    register,
)


def _discover() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_discover()

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "OFF_POLICY_OBJECTIVES",
    "POLICY_LOSSES",
    "AdvantageSpec",
    "AlgorithmSpec",
    "OffPolicySpec",
    "PolicyLossSpec",
    "advantage_estimator",
    "off_policy_objective",
    "policy_clip_range",
    "policy_loss",
    "register",
]
