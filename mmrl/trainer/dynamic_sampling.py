"""DAPO dynamic sampling (online filtering): which prompt groups a step keeps, and how many were useless.

A group-relative estimator (GRPO, RLOO) gives a prompt whose n responses all score the same an
advantage of exactly 0: the group costs a rollout and contributes no gradient. When a small policy
settles on one answer before it uses the image, nearly every group is such a group and learning
stops. With ``algorithm.online_filtering`` the trainer generates ``data.mini_rollout_batch_size``
prompts a round, drops those groups, and goes on until ``data.rollout_batch_size`` groups are kept
(DAPO, Yu et al. 2025, section 3.2). The decisions are pure functions here; the loop that generates
is ``RayPPOTrainer._filtered_rollout``, and in stream mode (``trainer.async_mode=stream``) the
stream's book, ``mmrl.trainer.asynchrony.StreamSchedule``, which judges groups as they arrive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmrl.protocol import DataProto


class DynamicSamplingError(RuntimeError):
    """The step could not be filled (too many rounds) or the filter cannot read its score."""


@dataclass(frozen=True)
class FilterOptions:
    """The filter of one run, from ``algorithm.*`` and ``data.*`` / ``trainer.max_try_make_batch``."""

    key: str  # score the filter reads (``overall`` = the reward)
    low: float  # keep a group only when low <= its mean score <= high ...
    high: float
    groups_per_step: int  # data.rollout_batch_size
    max_rounds: int  # generation rounds a step may take; -1 = no limit
    train_unfilled: bool = False  # past max_rounds: top the step up with dropped groups instead of stopping
    groups_per_round: int = 0  # prompts a round draws (data.mini_rollout_batch_size); 0 = groups_per_step

    def may_start(self, round_index: int) -> bool:
        return self.max_rounds == -1 or round_index < self.max_rounds

    @property
    def max_groups(self) -> int:
        """Groups a step may judge (stream mode): as many as ``max_rounds`` rounds generate; -1 = no limit."""
        per_round = self.groups_per_round or self.groups_per_step
        return -1 if self.max_rounds == -1 else self.max_rounds * per_round

    def top_up_message(self, rounds: int, kept: int) -> str:
        return (
            f"dynamic sampling kept {kept} of data.rollout_batch_size={self.groups_per_step} prompt groups in "
            f"{rounds} rounds (trainer.max_try_make_batch); algorithm.unfilled_step=train: the step trains "
            f"with {self.groups_per_step - kept} groups it dropped"
        )

    def give_up_message(self, rounds: int, kept: int, generated: int) -> str:
        return (
            f"dynamic sampling kept {kept} of the {generated} prompt groups generated in {rounds} rounds "
            f"(trainer.max_try_make_batch={self.max_rounds}) and needs data.rollout_batch_size="
            f"{self.groups_per_step}: nearly every group scores the same on algorithm.filter_key="
            f"'{self.key}' or has a mean outside [algorithm.filter_low={self.low}, "
            f"algorithm.filter_high={self.high}]. Raise trainer.max_try_make_batch (-1 = no limit) or "
            "data.mini_rollout_batch_size, widen the filter bounds, set algorithm.unfilled_step=train (train "
            "on what was kept, topped up with dropped groups), or set algorithm.online_filtering=false"
        )


def filter_scores(reward_scores: Sequence[dict[str, Any]], key: str) -> np.ndarray:
    """The ``key`` score of every response ``[B]`` (float64); names the available keys when absent."""
    try:
        return np.array([float(score[key]) for score in reward_scores], dtype=np.float64)
    except KeyError:
        found = sorted(reward_scores[0]) if len(reward_scores) else []
        raise DynamicSamplingError(
            f"algorithm.filter_key='{key}' is not a score of the reward function (it returns {found}); "
            "set algorithm.filter_key to one of them"
        ) from None


def kept_groups(uids: Sequence[Any], scores: np.ndarray, low: float, high: float) -> np.ndarray:
    """Row mask ``[B]`` (bool): the rows of the prompt groups (rows sharing a uid) worth training on.

    A group is kept iff its scores are not all equal and ``low <= mean(scores) <= high`` (both bounds
    inclusive). A group of one response is always "all equal", so it is dropped: alone it has no
    group-relative advantage either.
    """
    uids = np.asarray(list(uids), dtype=object)
    keep = np.zeros(len(uids), dtype=bool)
    for uid in dict.fromkeys(uids.tolist()):
        rows = uids == uid
        group = scores[rows]
        varied = group.max() > group.min()
        keep[rows] = varied and low <= group.mean() <= high
    return keep


def failed_groups(uids: Sequence[Any], scores: np.ndarray, low: float) -> np.ndarray:
    """Row mask ``[B]`` (bool): the rows of the prompt groups whose mean score is below ``low`` (the
    filter's lower bound): the groups the policy got wrong (every response, with 0/1 rewards)."""
    uids = np.asarray(list(uids), dtype=object)
    failed = np.zeros(len(uids), dtype=bool)
    for uid in dict.fromkeys(uids.tolist()):
        rows = uids == uid
        failed[rows] = scores[rows].mean() < low
    return failed


def loss_rows(batch: DataProto) -> DataProto:
    """The actor's batch: ``response_mask`` zeroed on the rows marked ``left_out`` (top-up groups of an
    unfilled step that did not fail), so they add nothing to any loss term (policy, entropy, KL) nor
    to the counts that normalise them; the rows stay, so the mini-batches and the ranks' shares keep
    their sizes. ``batch`` itself keeps its mask (the step's metrics see every row)."""
    if "left_out" not in batch.batch.keys() or not bool(batch.batch["left_out"].any()):
        return batch
    actor_batch = batch.select()
    left_out = batch.batch["left_out"].bool().unsqueeze(-1)  # [B, 1]
    actor_batch.batch["response_mask"] = batch.batch["response_mask"].masked_fill(left_out, 0)
    return actor_batch


def group_verdicts(uids: Sequence[Any], scores: np.ndarray, low: float, high: float) -> dict[Any, str]:
    """Each prompt group's fate under the filter: ``kept`` (:func:`kept_groups`), ``failed`` (dropped, mean
    below ``low``: first to top an unfilled step up) or ``other`` (dropped: all alike, or mean above
    ``high``; an unfilled step's top-up leaves it out of the loss)."""
    keep = kept_groups(uids, scores, low, high)
    failed = failed_groups(uids, scores, low)
    verdicts: dict[Any, str] = {}
    for row, uid in enumerate(uids):
        verdicts.setdefault(uid, "kept" if keep[row] else "failed" if failed[row] else "other")
    return verdicts


def first_groups(uids: Sequence[Any], count: int) -> np.ndarray:
    """Row indices of the first ``count`` distinct uids (in order of first appearance), in row order."""
    chosen = set(list(dict.fromkeys(list(uids)))[:count])
    return np.array([row for row, uid in enumerate(uids) if uid in chosen], dtype=np.int64)


def zero_advantage_group_fraction(
    advantages: torch.Tensor, response_mask: torch.Tensor, uids: Sequence[Any]
) -> float:
    """Fraction of prompt groups whose responses all have advantage 0 on every response token: the
    groups an update spends compute on without any policy-gradient signal.

    ``advantages``/``response_mask``: ``[B, L]``; ``uids``: ``B`` prompt uids.
    """
    nonzero_rows = ((advantages != 0) & response_mask.bool()).any(dim=-1).tolist()  # [B]
    useful: dict[Any, bool] = {}
    for uid, nonzero in zip(uids, nonzero_rows):
        useful[uid] = useful.get(uid, False) or nonzero
    return float(sum(not flag for flag in useful.values()) / max(len(useful), 1))
