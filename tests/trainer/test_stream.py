"""Streaming (``trainer.async_mode=stream``) on the trainer: one training rank, two rollout workers of
their own (the submissions in turn) generating all the time in chunks of one token, so that weight pushes may land in generations
in flight; each step trains groups at most ``trainer.max_staleness`` updates old. The run is two stages
(1 step, then 2) in one command, SIGKILLed in step 2 (after its update, a prompt batch in flight) and
resumed with the same command: the second stage starts, live and again at the resume, from the first's
checkpoint, written with a prompt batch in flight, and generates that batch again; online filtering judges the groups as they arrive; across the kill no
prompt is trained twice or lost and nothing is left running (mmrl/trainer/asynchrony.py,
StreamSchedule; mmrl/trainer/separate_rollout.py, StreamedRollouts; docs/async.md). Partial rollouts
themselves, token for token, are tested in-process in tests/workers/rollout/test_partial_rollout.py
(single turns) and tests/workers/rollout/test_agent_rollout_worker.py (trajectories). The rollouts are
multi-turn trajectories: a tiny model taught to call the demo's tool (``examples/tools/zoom_center.py``),
which returns an image, on the rollout worker."""

from __future__ import annotations

import json

import pytest
from _trainer_run import (
    REPO_ROOT,
    ZOOM_CENTER_TOOL,
    assert_left_nothing,
    loader_rows,
    metrics_rows,
    run_killed,
    run_main,
    small_run_overrides,
    trained_rows,
    with_longer_prompts,
)

COARSE_REWARD = REPO_ROOT / "tests/trainer/assets/coarse_reward.py"  # with the rows record

STEPS = 3
GROUPS = 4  # data.rollout_batch_size: prompts (groups of 4 responses) a step
RESPONSES = 4  # worker.rollout.n
PROMPTS = 32  # rows of the training file (shapes_data_dir)
RUN_TIMEOUT_S = 600  # a loaded 2-core machine starts Ray and the workers in minutes
ORPHANS_EXIT_S = 120  # Ray's workers exit in seconds; its dashboard and runtime-env agents took 62 s


@pytest.fixture(scope="module")
def streamed(tool_calling_vl_path, shapes_data_dir, tmp_path_factory) -> dict:
    """The streamed run (stages of 1 and 2 steps), killed in step 2 and resumed: the training lines of
    both by step, ``save_dir``, the killed run's output, what it had trained and saved at its death."""
    save_dir = tmp_path_factory.mktemp("stream") / "run"
    # every third prompt from row 2 on longer (the tool call was taught on rows 0 and 2 as here): groups
    # of submissions padded to different widths meet in a step
    data_dir = with_longer_prompts(shapes_data_dir, save_dir.parent / "data", slice(2, None, 3))
    overrides = [
        key
        for key in small_run_overrides(tool_calling_vl_path, data_dir, save_dir)
        if "val_files" not in key and "reward_function=" not in key
    ]
    overrides += [
        "trainer.async_mode=stream",
        "trainer.max_staleness=1",
        "algorithm.off_policy=decoupled",
        "trainer.max_steps=null",
        "trainer.stages=[{name: first, steps: 1}, {name: second, steps: 2}]",
        "trainer.val_before_train=false",
        "worker.rollout.name=hf",
        "worker.rollout.placement=separate",
        "worker.rollout.stream_chunk_tokens=1",
        "worker.rollout.num_workers=2",  # submissions go to them in turn
        "trainer.n_gpus_per_node=1",
        # online filtering, scored as the groups arrive: no group passes (crc_mod_4 lies in 0..3, the
        # bounds start at 4), and one round (4 groups judged) per step; each step is then topped up with
        # the 4 it dropped (all failed), so it trains the groups it would without the filter. The coarse
        # reward (overall 0 or 1) makes some groups score all alike, for the collapse gate's count
        f"worker.reward.reward_function={COARSE_REWARD}:compute_score",
        "algorithm.online_filtering=true",
        "algorithm.filter_key=crc_mod_4",
        "algorithm.filter_low=4.0",
        "algorithm.filter_high=5.0",
        "algorithm.unfilled_step=train",
        "trainer.max_try_make_batch=1",
        "algorithm.disable_kl=true",  # the rewards alone make the advantages (and the run shorter)
        # multi-turn trajectories: the model calls the tool, which returns an image (on the rollout worker)
        "data.max_prompt_length=336",  # the tool's schema in the system prompt (and the longer prompts)
        "data.max_response_length=96",  # a call (34 tokens), the tool turn with its image, the next turn
        "worker.rollout.multi_turn.enable=true",
        f"worker.rollout.multi_turn.tools=[{ZOOM_CENTER_TOOL}]",
        "worker.rollout.multi_turn.max_turns=2",
        "worker.actor.optim.lr=0.0005",  # the taught call survives the 3 updates (as in test_async)
    ]
    log_path = save_dir.parent / "killed.log"
    killed = run_killed(overrides, "sync:2", log_path, RUN_TIMEOUT_S, orphans_exit_s=ORPHANS_EXIT_S)
    before = [row["step"] for row in metrics_rows(save_dir) if "actor/pg_loss" in row]
    committed = sorted(path.name for path in save_dir.glob("global_step_*"))
    rows = run_main(overrides, save_dir, timeout_s=RUN_TIMEOUT_S)
    assert_left_nothing(killed.pid)  # the resume removed the killed run's Ray session and temp folders
    lines = [row for row in rows if "actor/pg_loss" in row]
    return {
        **{row["step"]: row for row in lines},
        "save_dir": save_dir,
        "killed": killed.output,
        "trained_before_resume": before,
        "committed_at_kill": committed,
        "trained_steps": [row["step"] for row in lines],
    }


def steps(streamed: dict) -> list[int]:
    return sorted(step for step in streamed if isinstance(step, int))


@pytest.mark.slow(seconds=150)
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_each_step_trains_a_batch_of_groups_at_most_max_staleness_old(streamed):
    assert steps(streamed) == list(range(1, STEPS + 1))
    assert streamed[1]["rollout/staleness_max"] == 0  # the first groups: the initial weights'
    for step in range(1, STEPS + 1):
        row = streamed[step]
        assert row["rollout/generated_responses"] == GROUPS * RESPONSES
        assert 0 <= row["rollout/staleness_mean"] <= row["rollout/staleness_max"] <= 1
        assert 0 <= row["rollout/partial_response_frac"] <= 1
        assert row["rollout/stream_dropped_groups"] >= 0
        # submitted, neither trained nor dropped: at most (max_staleness + 1) steps' groups and less than
        # a loader batch more (whole batches go in while there is room; a group the filter drops frees
        # its room as it is judged, before the step's top-up trains it)
        assert row["rollout/stream_outstanding_groups"] <= 2 * GROUPS + GROUPS - 1
        assert row["transfer/weight_push_bytes"] > 0
        assert row["agent/errors/raised"] == 0
    assert streamed[2]["rollout/stream_outstanding_groups"] >= GROUPS  # step 3's groups, at least
    # the trajectories called the tool, saw its image (observation tokens) in a later turn, and trained.
    # Over the run, not each step: a streamed step trains the groups that end first, and a trajectory that
    # calls the tool ends last (3 to 9 zoom calls in a step's 16 trajectories measured, from 89 % sampled)
    calls = {step: streamed[step].get("agent/tool_calls/zoom", 0) for step in range(1, STEPS + 1)}
    assert sum(calls.values()) >= STEPS, calls
    for row in (streamed[step] for step, count in calls.items() if count):
        assert row["agent/turns/max"] == 2 and row["agent/observation_tokens/mean"] > 0, row


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_online_filtering_judges_the_streamed_groups_and_tops_an_unfilled_step_up(streamed):
    for step in range(1, STEPS + 1):
        row = streamed[step]
        # one round's 4 groups judged, all dropped (failed), then trained as the step's top-up
        assert row["rollout/kept_groups"] == 0 and row["rollout/dropped_groups"] == GROUPS
        assert row["rollout/unfilled_groups"] == GROUPS and row["rollout/left_out_groups"] == 0
        assert row["rollout/rounds"] == 1.0
        # the collapse gate counts the groups the step's filter saw (here the ones it trains): with no KL
        # in the rewards, a group whose rewards are all equal is one whose advantages are all 0
        assert row["rollout/all_equal_group_frac"] == row["rollout/zero_adv_group_frac"]
        assert row["rollout/all_equal_group_frac"] * GROUPS in (0, 1, 2, 3, 4)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_the_prompts_in_flight_at_a_checkpoint_are_generated_again_after_the_resume(streamed):
    # stage 1's only step (1) had submitted loader batches 0 and 1 (one to each rollout worker; maybe 2
    # as well) and trained the first groups to arrive (a group leaves as soon as its trajectories have ended, so they
    # may come from both): its checkpoint resumes the loader at the first batch with a prompt not
    # trained, and lists what was trained from there on. Stage 2 (new workers, the saved weights, version 1)
    # generates the batch in flight again and trains it fresh (staleness 0); the last checkpoint
    # agrees with what the three steps trained
    trained = [trained_rows(streamed[step], RESPONSES) for step in range(1, STEPS + 1)]
    batches = loader_rows(PROMPTS, GROUPS, STEPS + 1)
    first = json.loads((streamed["save_dir"] / "global_step_1" / "trainer_state.json").read_text())
    # two batches fill the admission bound; a group the filter drops (all do here) frees its room as it
    # is judged, so a third may have gone in before the step's top-up
    assert first["stream"]["submissions"] in (2, 3)
    assert len(trained[0]) == GROUPS and set(trained[0]) <= set(batches[0]) | set(batches[1])
    assert (first["loader"], first["stream"]["trained"]) == resume_state(trained[:1], batches)
    assert streamed[2]["rollout/staleness_max"] == 0
    last = json.loads((streamed["save_dir"] / f"global_step_{STEPS}" / "trainer_state.json").read_text())
    assert (last["loader"], last["stream"]["trained"]) == resume_state(trained, batches)


def resume_state(trained: list[list[int]], batches: list[list[int]]) -> tuple[dict, list]:
    """What a streamed run's checkpoint holds after training the dataset rows ``trained`` (step by
    step) out of the loader's ``batches``: the loader at the first batch with a row not trained, and the
    rows trained from that batch on, as (epoch, batch, position in the batch)."""
    done = {row for rows in trained for row in rows}
    start = next(index for index, rows in enumerate(batches) if not set(rows) <= done)
    rows = enumerate(batches[start:], start)
    consumed = [
        [0, index, position] for index, batch in rows for position, row in enumerate(batch) if row in done
    ]
    return {"epoch": 0, "batch_index": start}, consumed


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_a_kill_with_groups_in_flight_resumes_with_no_prompt_trained_twice_or_lost(streamed):
    # the killed run crossed into stage 2 live (generating step 1's batch in flight again from its
    # checkpoint) and was SIGKILLed after step 2's update, with a batch submitted for step 3: in flight or
    # finished on the rollout worker, none trained. Its step 2 was never logged nor saved; the resume
    # (the same command) starts again from step 1's checkpoint and trains steps 2 and 3
    assert "stage 2/2 second" in streamed["killed"], streamed["killed"][-4000:]
    assert f"resuming from {streamed['save_dir'] / 'global_step_1'}" in streamed["killed"]  # stage 2
    assert streamed["committed_at_kill"] == ["global_step_1"]
    assert streamed["trained_before_resume"] == [1]
    assert streamed["trained_steps"] == [1, 2, 3]  # the killed run's line, then the resumed run's
    # each step trained GROUPS prompts, none twice: the two rollout workers' groups arrive in any order,
    # each as soon as its trajectories have ended, and a step trains what arrived first
    trained = [trained_rows(streamed[step], RESPONSES) for step in range(1, STEPS + 1)]
    assert all(len(rows) == GROUPS for rows in trained), trained
    assert len({row for rows in trained for row in rows}) == STEPS * GROUPS  # none trained twice
    batches = loader_rows(PROMPTS, GROUPS, STEPS + 1)
    assert {row for rows in trained for row in rows} <= {row for batch in batches for row in batch}
    # none lost: every batch before the last checkpoint's loader position trained whole
    last = json.loads((streamed["save_dir"] / f"global_step_{STEPS}" / "trainer_state.json").read_text())
    before = batches[: last["loader"]["batch_index"]]
    assert last["loader"]["batch_index"] >= STEPS - 1
    assert {row for batch in before for row in batch} <= {row for rows in trained for row in rows}
