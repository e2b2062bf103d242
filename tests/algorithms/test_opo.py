"""OPO (mmrl/algorithms/opo.py): values worked out by hand, and that the config selects it."""

from __future__ import annotations

import pytest
import torch

from mmrl import core_algos
from mmrl.algorithms.opo import compute_opo_advantages
from mmrl.config.loading import ConfigError, load_config
from mmrl.trainer.step_plan import StepPlan


def outcome(lengths: list[int], scores: list[float], width: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rewards with each score on its response's last valid token, and the response mask."""
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])
    rewards = torch.zeros_like(mask)
    for row, (n, score) in enumerate(zip(lengths, scores)):
        rewards[row, n - 1] = score
    return rewards, mask


def test_the_baseline_is_the_length_weighted_group_mean():
    # group a: lengths 1 and 3, scores 1 and 0: b = (1*1 + 3*0) / 4 = 0.25 -> 0.75, -0.25
    # group b: lengths 2, 2, 4, scores 1, 0, 0.5: b = (2 + 0 + 2) / 8 = 0.5 -> 0.5, -0.5, 0
    # group c: one response: b = its score -> 0
    rewards, mask = outcome([1, 2, 3, 2, 4, 3], [1.0, 1.0, 0.0, 0.0, 0.5, 0.7])
    advantages, returns = compute_opo_advantages(rewards, mask, index=["a", "b", "a", "b", "b", "c"])
    expected = torch.tensor([0.75, 0.5, -0.25, -0.5, 0.0, 0.0]).unsqueeze(-1) * mask
    torch.testing.assert_close(advantages, expected)
    assert torch.equal(returns, advantages) and advantages.dtype == torch.float32


def test_with_equal_lengths_it_is_the_group_mean_baseline_of_dr_grpo():
    rewards, mask = outcome([3, 3, 3, 3], [1.0, 0.0, 0.0, 0.25])
    uids = ["p", "q", "p", "q"]
    opo, _ = compute_opo_advantages(rewards, mask, index=uids)
    dr_grpo, _ = core_algos.compute_grpo_advantages(rewards, mask, index=uids, norm_adv_by_std=False)
    torch.testing.assert_close(opo, dr_grpo)


def test_it_needs_one_uid_per_response():
    rewards, mask = outcome([1, 2], [1.0, 0.0])
    with pytest.raises(ValueError, match="'opo' groups responses by prompt"):
        compute_opo_advantages(rewards, mask)
    with pytest.raises(ValueError, match="index has 1 uids but the batch has 2"):
        compute_opo_advantages(rewards, mask, index=["a"])


def test_the_config_selects_it_as_a_group_estimator():
    config = load_config(
        ["algorithm.adv_estimator=opo", "algorithm.online_filtering=true"], check_paths=False
    )
    assert core_algos.get_adv_estimator(config.algorithm.adv_estimator) is compute_opo_advantages
    plan = StepPlan.for_step(config, 0)
    assert not plan.use_critic and not plan.greedy_baseline
    with pytest.raises(ConfigError) as raised:
        load_config(["algorithm.adv_estimator=opo", "worker.rollout.n=1"], check_paths=False)
    assert any("adv_estimator=opo compares the responses of a prompt" in e for e in raised.value.errors)
