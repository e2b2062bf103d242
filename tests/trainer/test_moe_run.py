"""A Qwen3-VL MoE run of the trainer: two FSDP2 workers (the expert tensors sharded with the rest of
each decoder layer), the transformers rollout recording its routing and the actor replaying it, the
routers' load-balancing loss in the update and the router metrics logged; the checkpoint merges into a
Hugging Face folder that loads back."""

from __future__ import annotations

import math

import pytest
import torch
from _trainer_run import merged_and_base, run_main, small_run_overrides


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_moe_run_trains_two_steps_with_router_loss_and_merges(
    tiny_qwen3_vl_moe_path, shapes_data_dir, tmp_path
):

    save_dir = tmp_path / "run"
    overrides = small_run_overrides(tiny_qwen3_vl_moe_path, shapes_data_dir, save_dir) + [
        "worker.rollout.name=hf",
        "worker.actor.moe.aux_loss_coef=0.01",
        "worker.actor.moe.routing_replay=true",  # the rollout's experts cross to the actor and are replayed
        "worker.actor.share_prompts=false",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "trainer.save_freq=2",
    ]
    rows = [row for row in run_main(overrides, save_dir) if "actor/grad_norm" in row]
    assert len(rows) == 2
    for row in rows:
        assert row["rollout/log_prob_gap_max"] < 1e-4  # rollout and trainer score the same tokens alike
        assert 1.0 <= row["actor/moe_aux_loss"] <= 2.0  # 1 balanced, E / k = 2 all on two experts
        assert 0.25 <= row["actor/moe_max_expert_share"] <= 0.5  # 1 / E to 1 / k
        assert 0 < row["actor/moe_router_entropy"] < math.log(4)
        assert row["actor/grad_norm"] > 0

    merged_dir = tmp_path / "merged"
    merged, base = merged_and_base(save_dir / "global_step_2" / "actor", merged_dir, tiny_qwen3_vl_moe_path)
    assert merged.keys() == base.keys()
    for key in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"):  # trained, whole
        name = f"model.language_model.layers.0.{key}"
        assert merged[name].shape == base[name].shape and not torch.equal(merged[name], base[name]), name
