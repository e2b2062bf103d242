"""A GLM-4.1V run of the trainer on both rollout backends, as one 2-step run in two invocations sharing
a checkpoint folder: step 1 on the transformers rollout (saved), then the run resumed from that
checkpoint for step 2 on the vLLM rollout (saved). Every test here reads that run: rollout/trainer
log-prob parity from its metrics, the resume, and the merge of its last checkpoint."""

from __future__ import annotations

import pytest
from _trainer_run import merged_and_base, run_main, small_run_overrides

pytestmark = [pytest.mark.slow(seconds=200), pytest.mark.distributed, pytest.mark.shares("vllm")]


@pytest.fixture(scope="module")
def glm4v_run(tiny_glm4v_path, shapes_data_dir, tmp_path_factory) -> dict:
    save_dir = tmp_path_factory.mktemp("glm4v") / "run"
    overrides = small_run_overrides(tiny_glm4v_path, shapes_data_dir, save_dir) + [
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "trainer.save_freq=1",
    ]
    first = run_main([*overrides, "worker.rollout.name=hf", "trainer.max_steps=1"], save_dir)
    both = run_main([*overrides, "worker.rollout.name=vllm"], save_dir)  # resumes: find_last_checkpoint
    steps = [row for row in both if "actor/grad_norm" in row]
    return {"save_dir": save_dir, "first": first, "steps": steps}


@pytest.mark.timeout(600)
def test_each_backend_trains_a_step_with_rollout_log_probs_equal_to_the_trainers(glm4v_run):
    # step 1 by the transformers rollout, step 2, after the resume, by vLLM; each scores its tokens as the
    # trainer does (fp32: the order of sums)
    assert [row["step"] for row in glm4v_run["steps"]] == [1, 2]  # the resumed invocation trained step 2 only
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
        glm4v_run["save_dir"] / "global_step_2" / "actor", merged_dir, tiny_glm4v_path
    )
    assert merged.keys() == base.keys()
    for name in (
        "model.language_model.layers.0.mlp.gate_up_proj.weight",
        "model.language_model.layers.1.self_attn.q_proj.bias",
        "model.visual.blocks.0.attn.qkv.weight",
        "lm_head.weight",
    ):
        # An Adam update moves an entry by at most about lr (0.0200 after step 1, measured), so a step 2
        # that started from the base would leave every entry within ~lr of it; resumed from step 1's
        # weights and Adam state, entries whose gradient kept its sign moved two updates (0.0400 seen)
        assert (merged[name] - base[name]).abs().max() > 1.5 * LR, name
