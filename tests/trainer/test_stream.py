"""Streaming (``trainer.async_mode=stream``) on the trainer: one training rank, one rollout worker of
its own generating all the time in chunks of one token, so that weight pushes may land in generations
in flight; each step trains groups at most ``trainer.max_staleness`` updates old. The run is two stages
(2 steps, then 1) in one command: the second resumes from the first's checkpoint, written with a
prompt batch in flight, and generates it again. Online filtering is on, judging the groups as they
arrive (mmrl/trainer/asynchrony.py, StreamSchedule;
mmrl/trainer/separate_rollout.py, StreamedRollouts; docs/async.md). Partial rollouts themselves, token
for token, are tested in-process in tests/workers/rollout/test_partial_rollout.py."""

from __future__ import annotations

import json

import pytest
from _trainer_run import REPO_ROOT, run_main, small_run_overrides

COARSE_REWARD = REPO_ROOT / "tests/trainer/assets/coarse_reward.py"

STEPS = 3
GROUPS = 4  # data.rollout_batch_size: prompts (groups of 4 responses) a step


@pytest.fixture(scope="module")
def streamed(tiny_vl_path, shapes_data_dir, tmp_path_factory) -> dict:
    """The streamed run (stages of 2 and 1 steps): its training lines by step, and ``save_dir``."""
    save_dir = tmp_path_factory.mktemp("stream") / "run"
    overrides = [
        key
        for key in small_run_overrides(tiny_vl_path, shapes_data_dir, save_dir)
        if "val_files" not in key and "reward_function" not in key
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
    assert streamed[2]["rollout/stream_outstanding_groups"] == GROUPS  # batch 2, in flight at the save


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
