"""The Qwen3.5 runs of the trainer: the dense model's (last test), and the Qwen3.5 MoE tiny model's (it
holds everything the dense Qwen3.5 has — gated-delta-net linear attention run per packed sequence,
prompts not shared — plus routed experts). The MoE's: one 2-step run, one
training rank, the transformers rollout recording its routing and the actor replaying it, the routers'
load-balancing loss in the update, the last step saved, read by the first two tests. (Resuming this
family's experts and linear attention: tests/checkpoint/test_checkpoint.py, in-process.)"""

from __future__ import annotations

import math

import pytest
import torch
from _trainer_run import merged_and_base, run_main, small_run_overrides

pytestmark = [pytest.mark.slow(seconds=120), pytest.mark.distributed]

LR = 0.02  # small_run_overrides' worker.actor.optim.lr; one Adam update per step (one mini-batch)


@pytest.fixture(scope="module")
def qwen3_5_moe_run(tiny_qwen3_5_moe_path, shapes_data_dir, tmp_path_factory) -> dict:
    save_dir = tmp_path_factory.mktemp("qwen3_5_moe") / "run"
    overrides = small_run_overrides(tiny_qwen3_5_moe_path, shapes_data_dir, save_dir) + [
        "trainer.n_gpus_per_node=1",
        "worker.rollout.name=hf",
        "worker.actor.moe.aux_loss_coef=0.01",
        "worker.actor.moe.routing_replay=true",  # the rollout's experts cross to the actor and are replayed
        "worker.actor.share_prompts=false",  # routing replay's config check asks for it
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "trainer.save_freq=2",
    ]
    rows = run_main(overrides, save_dir)
    return {"save_dir": save_dir, "steps": [row for row in rows if "actor/grad_norm" in row]}


@pytest.mark.timeout(400)
def test_each_step_has_parity_and_router_metrics(qwen3_5_moe_run):
    steps = qwen3_5_moe_run["steps"]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        # the rollout (cached recurrence, step by step) and the trainer (chunked) agree; fp32 sums
        assert row["rollout/log_prob_gap_max"] < 1e-4, row["step"]
        assert 1.0 <= row["actor/moe_aux_loss"] <= 2.0  # 1 balanced, E / k = 2 all on two experts
        assert 0.25 <= row["actor/moe_max_expert_share"] <= 0.5  # 1 / E to 1 / k
        assert 0 < row["actor/moe_router_entropy"] < math.log(4)
        assert row["actor/grad_norm"] > 0


@pytest.mark.timeout(400)
def test_both_steps_reach_the_merged_weights_that_load_back(qwen3_5_moe_run, tiny_qwen3_5_moe_path, tmp_path):
    merged, base = merged_and_base(
        qwen3_5_moe_run["save_dir"] / "global_step_2" / "actor", tmp_path / "merged", tiny_qwen3_5_moe_path
    )
    assert merged.keys() == base.keys()
    a_log = "model.language_model.layers.0.linear_attn.A_log"  # 2 entries, each moved 0.017: trained
    assert not torch.equal(merged[a_log], base[a_log])
    for key in (
        "layers.0.linear_attn.in_proj_qkv.weight",
        "layers.0.linear_attn.conv1d.weight",
        "layers.1.self_attn.q_proj.weight",
        "layers.0.mlp.experts.gate_up_proj",  # the fused experts, whole (their files split them)
        "layers.0.mlp.experts.down_proj",
        "layers.0.mlp.gate.weight",
        "layers.0.mlp.shared_expert.up_proj.weight",
    ):
        name = f"model.language_model.{key}"
        assert merged[name].shape == base[name].shape
        # An Adam update moves an entry by at most about lr: entries whose gradient kept its sign moved
        # two updates (0.040 seen for each tensor here, the fused experts whole after the merge)
        assert (merged[name] - base[name]).abs().max() > 1.5 * LR, name


@pytest.mark.timeout(400)
def test_dense_qwen3_5_trains_two_steps_with_parity_and_merges(tiny_qwen3_5_path, shapes_data_dir, tmp_path):
    """The dense family's own run: 2 steps on one training rank, the transformers rollout, the default
    shared prompts turned off for it (its linear attention sees each sequence whole); merged, every
    kind of layer trained."""
    save_dir = tmp_path / "run"
    overrides = small_run_overrides(tiny_qwen3_5_path, shapes_data_dir, save_dir) + [
        "trainer.n_gpus_per_node=1",
        "worker.rollout.name=hf",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "trainer.save_freq=2",
    ]
    steps = [row for row in run_main(overrides, save_dir) if "actor/grad_norm" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert row["rollout/log_prob_gap_max"] < 1e-4, row["step"]  # cached recurrence vs chunked
        assert row["actor/grad_norm"] > 0
    merged, base = merged_and_base(
        save_dir / "global_step_2" / "actor", tmp_path / "merged", tiny_qwen3_5_path
    )
    assert merged.keys() == base.keys()
    for key in (
        "layers.0.linear_attn.in_proj_qkv.weight",
        "layers.0.linear_attn.A_log",
        "layers.1.self_attn.q_proj.weight",
    ):
        name = f"model.language_model.{key}"
        assert not torch.equal(merged[name], base[name]), name
