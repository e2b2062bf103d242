"""A Qwen3-VL MoE run of the trainer in two stages of one command: steps 1-2 on two FSDP2 workers (the expert
tensors sharded with the rest of each decoder layer), the transformers rollout recording its routing and
the actor replaying it, saved; steps 3-4 resumed from that checkpoint on one worker with the vLLM rollout
(the weights pushed into vLLM's fused-MoE layers). The routers' load-balancing loss is in every update and
the router metrics logged; the last checkpoint merges into a Hugging Face folder that loads back."""

from __future__ import annotations

import math

import pytest
import torch
from _trainer_run import merged_and_base, small_run_overrides, train_on_both_backends

LR = 0.02  # small_run_overrides' worker.actor.optim.lr; one Adam update per step (one mini-batch)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_moe_trains_a_step_on_each_backend_with_router_loss_resumes_and_merges(
    tiny_qwen3_vl_moe_path, shapes_data_dir, tmp_path
):

    save_dir = tmp_path / "run"
    overrides = small_run_overrides(tiny_qwen3_vl_moe_path, shapes_data_dir, save_dir) + [
        "worker.actor.moe.aux_loss_coef=0.01",
        "worker.actor.share_prompts=false",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
    ]
    # steps 1-2: the rollout's experts cross to the actor and are replayed; steps 3-4 on vLLM, which
    # records no experts: the actor routes freely
    replayed = ("worker.actor.moe.routing_replay=true",)
    rows = train_on_both_backends(
        overrides, save_dir, transformers=replayed, vllm=("trainer.n_gpus_per_node=1",)
    )
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # the resumed stage trained steps 3-4 only
    for row in rows:
        assert row["rollout/log_prob_gap_max"] < 1e-4, row["step"]  # both backends score as the trainer
        assert 1.0 <= row["actor/moe_aux_loss"] <= 2.0  # 1 balanced, E / k = 2 all on two experts
        assert 0.25 <= row["actor/moe_max_expert_share"] <= 0.5  # 1 / E to 1 / k
        assert 0 < row["actor/moe_router_entropy"] < math.log(4)
        assert row["actor/grad_norm"] > 0

    merged_dir = tmp_path / "merged"
    merged, base = merged_and_base(save_dir / "global_step_4" / "actor", merged_dir, tiny_qwen3_vl_moe_path)
    assert merged.keys() == base.keys()
    for key in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"):  # trained, whole
        name = f"model.language_model.layers.0.{key}"
        assert merged[name].shape == base[name].shape and not torch.equal(merged[name], base[name]), name
        # an Adam update moves an entry by at most about lr: steps 3-4 started from step 2's weights
        assert (merged[name] - base[name]).abs().max() > 2.5 * LR, name
