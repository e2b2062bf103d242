"""The algorithm registry (mmrl.algorithms) is the one place the config, the loader and the step plan
learn about an estimator or a loss."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mmrl import algorithms
from mmrl.config import CHOICES, ActorConfig, AlgorithmConfig, PPOConfig, WorkerConfig
from mmrl.config.loading import ConfigError, config_to_yaml, load_config
from mmrl.trainer.step_plan import StepPlan


def test_the_config_and_the_specs_import_without_torch():
    code = "import sys, mmrl.config.loading, mmrl.algorithms; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_spec_loads_its_function_and_the_config_offers_every_registered_name():
    for registry in (algorithms.ADVANTAGE_ESTIMATORS, algorithms.POLICY_LOSSES):
        for name, spec in registry.items():
            assert spec.name == name and callable(spec.load()), name
    assert CHOICES[AlgorithmConfig, "adv_estimator"] == tuple(algorithms.ADVANTAGE_ESTIMATORS)
    assert CHOICES[ActorConfig, "loss_type"] == tuple(algorithms.POLICY_LOSSES)


def test_the_step_plan_and_the_critic_follow_the_estimators_flags():
    def plan(estimator: str) -> StepPlan:
        return StepPlan.for_step(PPOConfig(algorithm=AlgorithmConfig(adv_estimator=estimator)), 0)

    assert plan("remax").greedy_baseline and not plan("remax").use_critic
    assert plan("gae").use_critic and not plan("gae").greedy_baseline
    assert not plan("grpo").use_critic and not plan("grpo").greedy_baseline
    flagged = {
        name: (spec.greedy_baseline, spec.needs_critic)
        for name, spec in algorithms.ADVANTAGE_ESTIMATORS.items()
    }
    assert flagged["remax"] == (True, False) and flagged["gae"] == (False, True)
    assert {n for n, s in algorithms.ADVANTAGE_ESTIMATORS.items() if s.needs_groups} >= {
        "grpo",
        "grpo_passk",
        "rloo",
    }


def test_a_group_estimator_needs_groups_and_a_loss_spec_checks_its_clip_ratios():
    with pytest.raises(ConfigError) as raised:
        load_config(["algorithm.adv_estimator=rloo", "worker.rollout.n=1"], check_paths=False)
    assert any("adv_estimator=rloo compares the responses" in e for e in raised.value.errors)
    with pytest.raises(ConfigError) as raised:
        load_config(["worker.actor.loss_type=cispo", "worker.actor.clip_ratio_low=2"], check_paths=False)
    assert any("cispo bounds its weight below" in e for e in raised.value.errors)
    spec = algorithms.policy_loss("kl_cov")
    assert spec.problems(ActorConfig(loss_type="kl_cov", clip_ratio_high=0.3)) == [
        "worker.actor.clip_ratio_low/clip_ratio_high: loss_type=kl_cov has no ratio clip (a KL penalty on the "
        "high-covariance tokens, tuned by kl_cov_ratio/kl_cov_coef); set them to null"
    ]
    assert spec.problems(ActorConfig(loss_type="kl_cov")) == []


def test_the_printed_config_describes_the_loss_from_its_spec():
    cfg = PPOConfig(worker=WorkerConfig(actor=ActorConfig(loss_type="gspo", clip_ratio_high=1e-3)))
    assert "# worker.actor: loss_type=gspo: ratio clipped to [1 - 0.0003, 1 + 0.001]" in config_to_yaml(cfg)
    assert algorithms.policy_clip_range("cispo") == (1.0, 4.0)
    with pytest.raises(ValueError, match="Unknown policy loss 'ppo2'. Valid names: cispo"):
        algorithms.policy_clip_range("ppo2")


def test_a_name_registered_twice_is_refused():
    with pytest.raises(ValueError, match="'grpo' is registered twice"):
        algorithms.register(algorithms.AdvantageSpec("grpo", "mmrl.core_algos:compute_grpo_advantages"))
