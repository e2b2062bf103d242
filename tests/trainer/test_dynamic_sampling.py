"""The pure decisions of DAPO dynamic sampling, on hand-worked groups (mmrl.trainer.dynamic_sampling)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmrl.core_algos import get_adv_estimator
from mmrl.protocol import DataProto
from mmrl.trainer.dynamic_sampling import (
    DynamicSamplingError,
    FilterOptions,
    failed_groups,
    filter_scores,
    first_groups,
    kept_groups,
    loss_rows,
    zero_advantage_group_fraction,
)


def keep(groups: dict[str, list[float]], low: float = 0.01, high: float = 0.99) -> dict[str, bool]:
    """Decision per group for groups given as consecutive rows; checks every row of a group agrees."""
    uids = [uid for uid, scores in groups.items() for _ in scores]
    scores = np.array([score for group in groups.values() for score in group])
    mask = kept_groups(uids, scores, low, high)
    decisions = {}
    for uid, row_kept in zip(uids, mask.tolist()):
        assert decisions.setdefault(uid, row_kept) == row_kept, f"group {uid} split by the filter"
    return decisions


def test_groups_with_equal_scores_are_dropped_whatever_their_mean():
    groups = {"wrong": [0, 0, 0, 0], "right": [1, 1, 1, 1], "half": [0.5, 0.5], "mixed": [0, 1, 0, 0]}
    # all-equal at 0.5 lies inside [0.01, 0.99] but carries no group-relative advantage
    assert keep(groups) == {"wrong": False, "right": False, "half": False, "mixed": True}


def test_mean_bounds_are_inclusive():
    # means: 0.25, 0.5, 0.75 (each group varied)
    groups = {"a": [0, 0, 0, 1], "b": [0, 1], "c": [1, 1, 1, 0]}
    assert keep(groups, low=0.3, high=0.7) == {"a": False, "b": True, "c": False}  # below low, above high
    assert keep(groups, low=0.25, high=0.75) == {"a": True, "b": True, "c": True}  # on both boundaries
    assert keep(groups, low=0.5, high=0.5) == {"a": False, "b": True, "c": False}
    # DAPO's accuracy filter (0 < mean < 1) is the same as "not all equal" for 0/1 rewards
    assert keep(groups, low=0.0, high=1.0) == {"a": True, "b": True, "c": True}


def test_a_group_of_one_response_is_dropped():
    assert keep({"alone": [0.4], "pair": [0.4, 0.6]}, low=0.0, high=1.0) == {"alone": False, "pair": True}


def test_groups_are_found_by_uid_not_position():
    uids = ["a", "b", "a", "b"]
    mask = kept_groups(uids, np.array([0.0, 1.0, 1.0, 1.0]), 0.0, 1.0)
    assert mask.tolist() == [True, False, True, False]


def test_the_filter_reads_the_configured_score_key():
    reward_scores = [
        {"overall": 1.0, "format": 1.0},
        {"overall": 0.0, "format": 1.0},
        {"overall": 0.5, "format": 0.0},
        {"overall": 0.5, "format": 1.0},
    ]
    uids = ["a", "a", "b", "b"]
    on_overall = kept_groups(uids, filter_scores(reward_scores, "overall"), 0.0, 1.0)
    on_format = kept_groups(uids, filter_scores(reward_scores, "format"), 0.0, 1.0)
    assert on_overall.tolist() == [True, True, False, False]
    assert on_format.tolist() == [False, False, True, True]
    with pytest.raises(DynamicSamplingError, match=r"filter_key='accuracy'.*\['format', 'overall'\]"):
        filter_scores(reward_scores, "accuracy")


def test_failed_groups_are_those_below_the_lower_bound_by_uid():
    # means: a 0, b 1, c 0.25, d 0.5 (all alike in between), e 0.005 (below 0.01)
    uids = ["a", "b", "c", "a", "b", "c", "d", "d", "e", "e"]
    scores = np.array([0, 1, 0, 0, 1, 0.5, 0.5, 0.5, 0.0, 0.01])
    assert failed_groups(uids, scores, 0.01).tolist() == [1, 0, 0, 1, 0, 0, 0, 0, 1, 1]
    assert failed_groups(uids, scores, 0.3).tolist() == [1, 0, 1, 1, 0, 1, 0, 0, 1, 1]
    assert not failed_groups(uids, scores, 0.0).any()  # strictly below: a mean of 0 is not below 0


def test_left_out_rows_leave_the_actors_loss_and_keep_the_metrics_mask():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    batch = DataProto.from_dict(tensors={"response_mask": mask, "left_out": torch.tensor([0, 1, 0])})
    actor_batch = loss_rows(batch)
    assert actor_batch.batch["response_mask"].tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1]]
    assert batch.batch["response_mask"].tolist() == mask.tolist()  # the step's own batch is untouched
    nothing_left_out = DataProto.from_dict(tensors={"response_mask": mask, "left_out": torch.zeros(3).long()})
    assert loss_rows(nothing_left_out) is nothing_left_out


def test_first_groups_trims_to_whole_groups_in_generation_order():
    uids = ["c", "c", "a", "a", "b", "b"]
    assert first_groups(uids, 2).tolist() == [0, 1, 2, 3]
    assert first_groups(["a", "b", "a", "c"], 2).tolist() == [0, 1, 2]


def test_zero_advantage_group_fraction_of_grpo_advantages():
    # GRPO gives a group of equal rewards advantage 0 exactly: 2 of the 3 groups here
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    mask = torch.tensor([[1, 1, 0]] * 6, dtype=torch.float32)
    token_rewards = torch.zeros(6, 3)
    token_rewards[:, 1] = scores
    uids = np.array(["a", "a", "b", "b", "c", "c"], dtype=object)
    advantages, _ = get_adv_estimator("grpo")(token_rewards, mask, index=uids)
    assert zero_advantage_group_fraction(advantages, mask, uids) == pytest.approx(2 / 3)
    # a non-zero advantage on a padding token is not a signal
    padded = advantages.clone()
    padded[0, 2] = 5.0
    assert zero_advantage_group_fraction(padded, mask, uids) == pytest.approx(2 / 3)


def test_round_limit_and_its_message_name_the_knobs():
    options = FilterOptions("overall", 0.01, 0.99, groups_per_step=4, max_rounds=2)
    assert options.may_start(1) and not options.may_start(2)
    assert FilterOptions("overall", 0.01, 0.99, 4, max_rounds=-1).may_start(10**6)
    message = options.give_up_message(rounds=2, kept=1, generated=8)
    for knob in (
        "trainer.max_try_make_batch=2",
        "data.rollout_batch_size=4",
        "data.mini_rollout_batch_size",
        "algorithm.filter_low=0.01",
        "algorithm.online_filtering=false",
    ):
        assert knob in message
