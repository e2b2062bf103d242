"""Decoupled PPO (Fu et al. 2025, "AReaL: a large-scale asynchronous reinforcement learning system for
language reasoning", sec. 5): PPO on samples that an older policy drew.

Three policies meet in an asynchronous step: the behaviour policy ``pi_behav`` that sampled each token
(the rollout engine's log-probs, ``rollout_log_probs``: weights one or more updates old, and another
engine's kernels), the proximal policy ``pi_prox`` (the weights at the start of the update: the
old-log-prob pass's ``old_log_probs``, or with the on-policy shortcut the update's own first forward)
and the policy ``pi_theta`` being trained. The loss of a token is

    w_t * max(-A_t r_t, -A_t clip(r_t, 1 - eps_low, 1 + eps_high)),  r_t = pi_theta / pi_prox,
    w_t = pi_prox(y_t) / pi_behav(y_t)   (a constant: no gradient flows through it)

i.e. the policy loss ``worker.actor.loss_type`` clipped around the proximal policy, each token weighted
by its importance weight between behaviour and proximal policy. ``w`` above
``algorithm.decoupled.behaviour_weight_cap`` drops the token from the loss (``over_cap=mask``, AReaL's
rule: it still counts in the normalisers) or is cut to the cap (``over_cap=truncate``). When
behaviour and proximal policy agree, ``w = 1`` and the loss is plain PPO's.

Selected by ``algorithm.off_policy=decoupled``; knobs in ``algorithm.decoupled``. The maths is
:func:`mmrl.core_algos.off_policy.decoupled_weights`; nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

from mmrl.algorithms.spec import OffPolicySpec, register


def _check(algorithm: Any) -> list[str]:
    errors = algorithm.decoupled.check()
    if algorithm.rollout_correction.enabled:
        errors.append(
            "algorithm.off_policy=decoupled already weights each token by pi_old / pi_rollout (its "
            "behaviour weight); algorithm.rollout_correction would weight it twice: set "
            "algorithm.rollout_correction.rollout_is and rollout_rs to null, or algorithm.off_policy=none"
        )
    return errors


register(OffPolicySpec("decoupled", "mmrl.core_algos.off_policy:decoupled_weights", _check))
