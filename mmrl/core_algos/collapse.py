"""Signs of a collapsed policy, and the gate of the collapse-recovery term (``worker.actor.collapse_recovery``).

A policy that has settled on one answer for every prompt samples groups whose responses all score the
same: group-relative advantages are then 0, and the policy gradient, the sample-based KL and the
entropy bonus have logit gradients that vanish at p ~ 1 (``1 - p`` and ``p log p``). The gate watches
the share of each step's groups whose scores are all equal and switches on a term whose gradient does
not vanish there (``core_algos.spread_from_logits``) for as long as the collapse lasts.

A group whose responses all scored at least ``solved_score`` is *solved*, not collapsed: a policy that
has learnt the task also samples all-equal groups (every response right), and spreading its probability
would unlearn it. The gate therefore judges the share of all-equal groups among the groups not solved:
a policy settled on one answer of a two-answer task is right on half the prompts (solved groups) and
wrong on the other half (all-equal, not solved), a collapse; a policy right on every prompt is none.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def all_equal_groups(
    uids: Sequence[Any], scores: Sequence[float] | np.ndarray, solved_score: float | None = None
) -> tuple[int, int, int]:
    """``(groups whose responses all scored the same, groups, solved groups)`` for responses grouped by
    ``uids``; a solved group is an all-equal one whose score is at least ``solved_score`` (none when
    ``solved_score`` is None).

    A group of one response counts as all-equal: it carries no group-relative signal either."""
    uids, scores = np.asarray(uids), np.asarray(scores, dtype=np.float64)
    if len(uids) != len(scores):
        raise ValueError(f"all_equal_groups: {len(uids)} uids for {len(scores)} scores")
    _, group = np.unique(uids, return_inverse=True)
    groups = int(group.max()) + 1 if len(group) else 0
    low = np.full(groups, np.inf)
    high = np.full(groups, -np.inf)
    np.minimum.at(low, group, scores)
    np.maximum.at(high, group, scores)
    equal = low == high
    solved = int((equal & (low >= solved_score)).sum()) if solved_score is not None else 0
    return int(equal.sum()), groups, solved


class CollapseGate:
    """The weight of the collapse-recovery term for each update, and the collapse metrics.

    After :meth:`observe` with a step's ``(all-equal groups, groups, solved groups)``: the step is
    *collapsed* when ``(all_equal - solved) / (groups - solved) >= all_equal_share`` (a step whose groups
    were all solved is not); :attr:`coefficient` is ``coeff`` when the last
    ``patience`` steps (this one included) were all collapsed, else 0 (and always 0 when not
    ``enabled``). The step whose groups were observed is the one whose update gets the coefficient,
    so the term starts on the ``patience``-th collapsed step and stops on the first step with enough
    mixed groups.
    """

    def __init__(
        self,
        *,
        enabled: bool = False,
        coeff: float = 0.05,
        all_equal_share: float = 0.95,
        patience: int = 2,
        solved_score: float | None = 1.0,
    ):
        if enabled and (coeff <= 0 or not 0 < all_equal_share <= 1 or patience < 1):
            raise ValueError(
                f"collapse recovery needs coeff > 0, 0 < all_equal_share <= 1 and patience >= 1; got "
                f"coeff={coeff}, all_equal_share={all_equal_share}, patience={patience}"
            )
        self.enabled, self.coeff = enabled, coeff
        self.all_equal_share, self.patience = all_equal_share, patience
        self.solved_score = solved_score  # all-equal groups scoring at least this are solved
        self.collapsed_steps = 0  # consecutive collapsed steps up to the last observed
        self.steps_since_mixed = 0  # steps since the last one that generated a group with mixed scores
        self.share = 0.0  # the last observed step's share of all-equal groups
        self.solved_share = 0.0  # ... of solved groups
        self.stuck_share = 0.0  # ... of all-equal groups among those not solved (what the gate judges)

    @property
    def coefficient(self) -> float:
        """The recovery term's weight for the update of the last observed step."""
        return self.coeff if self.enabled and self.collapsed_steps >= self.patience else 0.0

    def observe(self, all_equal: int, groups: int, solved: int = 0) -> None:
        """Record a step's generated groups (all rounds of a dynamically sampled step)."""
        self.share = all_equal / groups if groups else 1.0
        self.solved_share = solved / groups if groups else 0.0
        self.stuck_share = (all_equal - solved) / (groups - solved) if groups > solved else 0.0
        self.steps_since_mixed = self.steps_since_mixed + 1 if all_equal == groups else 0
        self.collapsed_steps = self.collapsed_steps + 1 if self.stuck_share >= self.all_equal_share else 0

    def metrics(self) -> dict[str, float]:
        """``rollout/all_equal_group_frac``, ``rollout/solved_group_frac``, ``rollout/stuck_group_frac``
        (all-equal among the groups not solved: what the gate judges), ``rollout/steps_since_mixed_group``
        and the applied ``actor/collapse_coeff``."""
        return {
            "rollout/all_equal_group_frac": self.share,
            "rollout/solved_group_frac": self.solved_share,
            "rollout/stuck_group_frac": self.stuck_share,
            "rollout/steps_since_mixed_group": float(self.steps_since_mixed),
            "actor/collapse_coeff": self.coefficient,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"collapsed_steps": self.collapsed_steps, "steps_since_mixed": self.steps_since_mixed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.collapsed_steps = int(state["collapsed_steps"])
        self.steps_since_mixed = int(state["steps_since_mixed"])
