"""Streaming (``trainer.async_mode=stream``) on the trainer: one training rank, one rollout worker of
its own generating all the time in chunks of one token, so that weight pushes land in generations in
flight; each step trains groups at most ``trainer.max_staleness`` updates old, and a checkpoint records
where the prompts not yet trained start (mmrl/trainer/asynchrony.py, StreamSchedule;
mmrl/trainer/separate_rollout.py, StreamedRollouts; docs/async.md). Partial rollouts themselves, token
for token, are tested in-process in tests/workers/rollout/test_partial_rollout.py."""

from __future__ import annotations

import json

import pytest
from _trainer_run import run_main, small_run_overrides

STEPS = 3
GROUPS = 4  # data.rollout_batch_size: prompts (groups of 4 responses) a step


@pytest.fixture(scope="module")
def streamed(tiny_vl_path, shapes_data_dir, tmp_path_factory) -> dict:
    """The 3-step streamed run: its training lines by step, and ``save_dir``."""
    save_dir = tmp_path_factory.mktemp("stream") / "run"
    overrides = [
        key for key in small_run_overrides(tiny_vl_path, shapes_data_dir, save_dir) if "val_files" not in key
    ]
    overrides += [
        "trainer.async_mode=stream",
        "trainer.max_staleness=1",
        "algorithm.off_policy=decoupled",
        f"trainer.max_steps={STEPS}",
        "trainer.save_freq=2",
        "trainer.val_before_train=false",
        "worker.rollout.name=hf",
        "worker.rollout.placement=separate",
        "worker.rollout.stream_chunk_tokens=1",
        "trainer.n_gpus_per_node=1",
    ]
    rows = run_main(overrides, save_dir, timeout_s=600)
    return {**{row["step"]: row for row in rows if "actor/pg_loss" in row}, "save_dir": save_dir}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_each_step_trains_a_batch_of_groups_at_most_max_staleness_old(streamed):
    assert sorted(step for step in streamed if step != "save_dir") == list(range(1, STEPS + 1))
    assert streamed[1]["rollout/staleness_max"] == 0  # the first groups: the initial weights'
    for step in range(1, STEPS + 1):
        row = streamed[step]
        assert row["rollout/generated_responses"] == GROUPS * 4
        assert 0 <= row["rollout/staleness_mean"] <= row["rollout/staleness_max"] <= 1
        assert 0 <= row["rollout/partial_response_frac"] <= 1
        assert row["rollout/stream_dropped_groups"] >= 0
        # never more than (max_staleness + 1) steps' groups submitted and not trained
        assert row["rollout/stream_outstanding_groups"] <= 2 * GROUPS - GROUPS
        assert row["transfer/weight_push_bytes"] > 0


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_a_checkpoint_resumes_where_the_prompts_not_trained_start(streamed):
    # after 2 steps 8 prompts trained: every row of the loader batches before the saved position (4
    # each), plus the rows after it listed as trained, none listed twice
    state = json.loads((streamed["save_dir"] / "global_step_2" / "trainer_state.json").read_text())
    loader, trained = state["loader"], state["stream"]["trained"]
    assert loader["epoch"] == 0 and all(row[0] == 0 and row[1] >= loader["batch_index"] for row in trained)
    assert len({tuple(row) for row in trained}) == len(trained)
    assert loader["batch_index"] * GROUPS + len(trained) == 2 * GROUPS
    assert state["stream"]["submissions"] >= 2
