"""The Qwen3.5 runs of the trainer, dense (last test) and MoE (the Qwen3.5 MoE tiny model: everything
the dense Qwen3.5 has — gated-delta-net linear attention run per packed sequence, prompts not shared —
plus routed experts), each one training rank in two stages of one command: steps 1-2 on the transformers rollout,
saved (the MoE's recording its routing and the actor replaying it, the routers' load-balancing loss in
the update), steps 3-4 resumed on vLLM. The MoE run is read by the first two tests. (Resuming these
families' experts and linear attention in full: tests/checkpoint/test_checkpoint.py, in-process.)"""

from __future__ import annotations

import math

import pytest
import torch
from _trainer_run import merged_and_base, small_run_overrides, train_on_both_backends

pytestmark = [pytest.mark.slow(seconds=120), pytest.mark.distributed]

LR = 0.02  # small_run_overrides' worker.actor.optim.lr; one Adam update per step (one mini-batch)


# vLLM's CPU kernel for the linear attention takes bf16 only: the engine in bf16 (with chunked prefill for
# its hybrid cache) against the fp32 trainer
ON_VLLM = ("worker.rollout.dtype=bf16", "worker.rollout.enable_chunked_prefill=true")


def assert_bf16_engine_parity(row: dict) -> None:
    """bf16 rounding of every layer (3.6e-3 to 5.8e-3 max, ~1e-3 mean seen on the tiny models); a
    misplaced token or a stale weight is off by tenths of a nat. Above 1e-5: the engine did run in bf16."""
    assert 1e-5 < row["rollout/log_prob_gap_max"] < 0.05, row["step"]
    assert row["rollout/log_prob_gap_mean"] < 5e-3, row["step"]


@pytest.fixture(scope="module")
def qwen3_5_moe_run(tiny_qwen3_5_moe_path, shapes_data_dir, tmp_path_factory) -> dict:
    """Steps 1-2 on the transformers rollout with routing replay, saved; steps 3-4 resumed on vLLM (which
    records no experts: the actor routes freely)."""
    save_dir = tmp_path_factory.mktemp("qwen3_5_moe") / "run"
    overrides = small_run_overrides(tiny_qwen3_5_moe_path, shapes_data_dir, save_dir) + [
        "trainer.n_gpus_per_node=1",
        "worker.actor.moe.aux_loss_coef=0.01",
        "worker.actor.share_prompts=false",  # routing replay's config check asks for it
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
    ]
    replayed = ("worker.actor.moe.routing_replay=true",)
    return {"save_dir": save_dir, "steps": train_on_both_backends(overrides, save_dir, replayed, ON_VLLM)}


@pytest.mark.timeout(700)
def test_each_step_has_parity_and_router_metrics(qwen3_5_moe_run):
    steps = qwen3_5_moe_run["steps"]
    assert [row["step"] for row in steps] == [1, 2, 3, 4]
    # the transformers rollout (cached recurrence, step by step) and the trainer (chunked) agree to fp32
    assert all(row["rollout/log_prob_gap_max"] < 1e-4 for row in steps[:2])
    for row in steps[2:]:
        assert_bf16_engine_parity(row)
    for row in steps:
        assert 1.0 <= row["actor/moe_aux_loss"] <= 2.0  # 1 balanced, E / k = 2 all on two experts
        assert 0.25 <= row["actor/moe_max_expert_share"] <= 0.5  # 1 / E to 1 / k
        assert 0 < row["actor/moe_router_entropy"] < math.log(4)
        assert row["actor/grad_norm"] > 0


@pytest.mark.timeout(400)
def test_every_step_reaches_the_merged_weights_that_load_back(
    qwen3_5_moe_run, tiny_qwen3_5_moe_path, tmp_path
):
    merged, base = merged_and_base(
        qwen3_5_moe_run["save_dir"] / "global_step_4" / "actor", tmp_path / "merged", tiny_qwen3_5_moe_path
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
        # An Adam update moves an entry by at most about lr: steps 3-4 from the base would leave every entry
        # within ~2 lr; resumed from step 2, entries whose gradient kept its sign moved four updates
        assert (merged[name] - base[name]).abs().max() > 2.5 * LR, name


@pytest.mark.timeout(600)
def test_dense_qwen3_5_trains_two_steps_on_each_backend_resumes_and_merges(
    tiny_qwen3_5_path, shapes_data_dir, tmp_path
):
    """The dense family's own run, one training rank, in two stages of one command: steps 1-2 on the transformers
    rollout, saved; steps 3-4 resumed from it on vLLM, whose CPU kernel for the linear attention takes
    bf16 only (the engine in bf16, with chunked prefill for its hybrid cache); merged, every kind of layer
    trained, steps 3-4 from step 2's weights."""
    save_dir = tmp_path / "run"
    overrides = small_run_overrides(tiny_qwen3_5_path, shapes_data_dir, save_dir) + [
        "trainer.n_gpus_per_node=1",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
    ]
    steps = train_on_both_backends(overrides, save_dir, vllm=ON_VLLM)
    assert [row["step"] for row in steps] == [1, 2, 3, 4]
    assert all(row["rollout/log_prob_gap_max"] < 1e-4 for row in steps[:2])  # cached recurrence vs chunked
    for row in steps[2:]:
        assert_bf16_engine_parity(row)
    assert all(row["actor/grad_norm"] > 0 for row in steps)
    merged, base = merged_and_base(
        save_dir / "global_step_4" / "actor", tmp_path / "merged", tiny_qwen3_5_path
    )
    assert merged.keys() == base.keys()
    for key in ("layers.0.linear_attn.A_log", "layers.1.self_attn.q_proj.weight"):
        name = f"model.language_model.{key}"
        assert not torch.equal(merged[name], base[name]), name
    name = "model.language_model.layers.0.linear_attn.in_proj_qkv.weight"  # an Adam update moves <= ~lr
    assert (merged[name] - base[name]).abs().max() > 2.5 * LR  # steps 3-4 started from step 2's weights
