"""A GLM-4.1V run of the trainer on both rollout backends, as one 4-step run of two stages in one command:
steps 1-2 on the transformers rollout (saved), then fresh workers resumed from that checkpoint for steps
3-4 on the vLLM rollout (saved). Every test here reads that run: rollout/trainer
log-prob parity from its metrics, the resume, and the merge of its last checkpoint."""

from __future__ import annotations

import pytest
from _trainer_run import merged_and_base, small_run_overrides, train_on_both_backends

pytestmark = [pytest.mark.slow(seconds=200), pytest.mark.distributed, pytest.mark.shares("vllm")]


@pytest.fixture(scope="module")
def glm4v_run(tiny_glm4v_path, shapes_data_dir, tmp_path_factory) -> dict:
    save_dir = tmp_path_factory.mktemp("glm4v") / "run"
    overrides = small_run_overrides(tiny_glm4v_path, shapes_data_dir, save_dir) + [
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
    ]
    # steps 1-2 on the transformers rollout, saved; steps 3-4 resumed on vLLM (the second stage)
    return {"save_dir": save_dir, "steps": train_on_both_backends(overrides, save_dir)}


@pytest.mark.timeout(600)
def test_each_backend_trains_two_steps_with_rollout_log_probs_equal_to_the_trainers(glm4v_run):
    # steps 1-2 by the transformers rollout, 3-4, after the resume, by vLLM; each scores its tokens as the
    # trainer does (fp32: the order of sums)
    assert [row["step"] for row in glm4v_run["steps"]] == [1, 2, 3, 4]  # the resumed stage: 3-4 only
    for row in glm4v_run["steps"]:
        assert row["rollout/log_prob_gap_max"] < 1e-4, row["step"]
        assert row["actor/grad_norm"] > 0


LR = 0.02  # small_run_overrides' worker.actor.optim.lr; one Adam update per step (one mini-batch)


@pytest.mark.timeout(600)
def test_the_resumed_step_starts_from_the_saved_one_and_merges_into_weights_that_load_back(
    glm4v_run, tiny_glm4v_path, tmp_path
):

    merged_dir = tmp_path / "merged"
    merged, base = merged_and_base(
        glm4v_run["save_dir"] / "global_step_4" / "actor", merged_dir, tiny_glm4v_path
    )
    assert merged.keys() == base.keys()
    for name in (
        "model.language_model.layers.0.mlp.gate_up_proj.weight",
        "model.language_model.layers.1.self_attn.q_proj.bias",
        "model.visual.blocks.0.attn.qkv.weight",
        "lm_head.weight",
    ):
        # An Adam update moves an entry by at most about lr, so steps 3-4 started from the base would
        # leave every entry within ~2 lr of it; resumed from step 2's weights and Adam state, entries whose
        # gradient kept its sign moved four updates
        assert (merged[name] - base[name]).abs().max() > 2.5 * LR, name
