"""Streaming (``trainer.async_mode=stream``) on the trainer: one training rank, one rollout worker of
its own generating all the time in chunks of one token, so that weight pushes may land in generations
in flight; each step trains groups at most ``trainer.max_staleness`` updates old. The run is two stages
(2 steps, then 1) in one command: the second resumes from the first's checkpoint, written with a
prompt batch in flight, and generates it again (mmrl/trainer/asynchrony.py, StreamSchedule;
mmrl/trainer/separate_rollout.py, StreamedRollouts; docs/async.md). The rollouts are multi-turn
trajectories: a tiny model taught to call the demo's tool (``examples/tools/zoom_center.py``), which
returns an image, on the rollout worker. Partial rollouts themselves, token for token, are tested
in-process in tests/workers/rollout/test_partial_rollout.py (single turns) and
tests/workers/rollout/test_agent_rollout_worker.py (trajectories)."""

from __future__ import annotations

import json

import pytest
from _trainer_run import ZOOM_CENTER_TOOL, run_main, small_run_overrides

STEPS = 3
GROUPS = 4  # data.rollout_batch_size: prompts (groups of 4 responses) a step


@pytest.fixture(scope="module")
def streamed(tool_calling_vl_path, shapes_data_dir, tmp_path_factory) -> dict:
    """The streamed run (stages of 2 and 1 steps): its training lines by step, and ``save_dir``."""
    save_dir = tmp_path_factory.mktemp("stream") / "run"
    overrides = [
        key
        for key in small_run_overrides(tool_calling_vl_path, shapes_data_dir, save_dir)
        if "val_files" not in key
    ]
    overrides += [
        "trainer.async_mode=stream",
        "trainer.max_staleness=1",
        "algorithm.off_policy=decoupled",
        "trainer.max_steps=null",
        "trainer.stages=[{name: first, steps: 2}, {name: second, steps: 1}]",
        "trainer.val_before_train=false",
        "worker.rollout.name=hf",
        "worker.rollout.placement=separate",
        "worker.rollout.stream_chunk_tokens=1",
        "trainer.n_gpus_per_node=1",
        # multi-turn trajectories: the model calls the tool, which returns an image (on the rollout worker)
        "data.max_prompt_length=320",  # the tool's schema in the system prompt
        "data.max_response_length=96",  # a call (34 tokens), the tool turn with its image, the next turn
        "worker.rollout.multi_turn.enable=true",
        f"worker.rollout.multi_turn.tools=[{ZOOM_CENTER_TOOL}]",
        "worker.rollout.multi_turn.max_turns=2",
        "worker.actor.optim.lr=0.002",  # the taught call survives the 3 updates
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
        # the trajectories called the tool, saw its image (observation tokens) in a later turn, and trained
        assert row.get("agent/tool_calls/zoom", 0) > 0 and row["agent/observation_tokens/mean"] > 0, row
        assert row["agent/turns/max"] == 2 and row["agent/errors/raised"] == 0
    assert streamed[2]["rollout/stream_outstanding_groups"] == GROUPS  # batch 2, in flight at the save


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_the_prompts_in_flight_at_a_checkpoint_are_generated_again_after_the_resume(streamed):
    # stage 1's last step (2) had submitted loader batch 2 (4 prompts) ahead, not trained: its
    # checkpoint resumes the loader there, nothing after it trained. Stage 2 (new workers, the saved
    # weights, version 2) generates that batch again and trains it at step 3: fresh (staleness 0), and
    # its own checkpoint has the loader after batch 2 with nothing pending: no prompt lost or trained twice
    first = json.loads((streamed["save_dir"] / "global_step_2" / "trainer_state.json").read_text())
    assert first["stream"]["submissions"] == 3
    assert first["loader"] == {"epoch": 0, "batch_index": 2} and first["stream"]["trained"] == []
    assert streamed[3]["rollout/staleness_max"] == 0
    second = json.loads((streamed["save_dir"] / "global_step_3" / "trainer_state.json").read_text())
    assert second["loader"] == {"epoch": 0, "batch_index": 3} and second["stream"]["trained"] == []
