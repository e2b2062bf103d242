"""One-step off-policy training (``trainer.async_mode=one_step_off``) with decoupled PPO
(``algorithm.off_policy=decoupled``) on the trainer, its rollout engine in a worker of its own
(``worker.rollout.placement=separate``: one training rank, two rollout workers, each generating half of
every batch; one below): each step trains the
batch the step before generated with the weights before its update, while that update ran, every
loader batch image and video prompts (on the transformers engine, and below on either engine,
multi-turn trajectories whose tool returns an image, after a streamed step of them); every
token records the version that sampled it; the weights reach the rollout worker over the push group;
and a run SIGKILLed while the rollout worker generates the next step's batch, resumed from its
checkpoint, leaves nothing running and trains the uninterrupted run's samples to its numbers
(mmrl/trainer/asynchrony.py, mmrl/trainer/separate_rollout.py, docs/async.md)."""

from __future__ import annotations

import pytest
from _trainer_run import (
    ROW_REWARD,
    VIDEO_OVERRIDES,
    ZOOM_CENTER_TOOL,
    assert_left_nothing,
    loader_rows,
    metrics_rows,
    run_killed,
    run_main,
    small_run_overrides,
    trained_rows,
    video_rows,
)

from mmrl.models.loading import load_model

STEPS = 4
GROUPS, RESPONSES, PROMPTS = 4, 4, 32  # data.rollout_batch_size, worker.rollout.n, training rows
ORPHANS_EXIT_S = 120  # Ray's workers exit in seconds; its dashboard and runtime-env agents took 62 s
RUN_TIMEOUT_S = 600  # a loaded 2-core machine starts Ray and two ranks in minutes
# timings, byte counts and memory vary between runs; a resumed run has just pushed its weights
VARYING = ("timing_s/", "throughput/", "transfer/", "memory/", "rollout/weight_pushes_before_generate")


def async_overrides(model_path, data_dir, save_dir) -> list[str]:
    """4 steps, one step off with decoupled PPO, one training rank and two rollout workers of their own,
    checkpoints after steps 2 and 4, no validation; the reward records the rows each step trained.
    ``data_dir``: image_video_data_dir (tests/conftest.py), every loader batch images and videos."""
    overrides = small_run_overrides(model_path, data_dir, save_dir)
    dropped = ("data.val_files=", "worker.reward.reward_function=")
    return [key for key in overrides if not key.startswith(dropped)] + [
        *VIDEO_OVERRIDES,
        f"worker.reward.reward_function={ROW_REWARD}:compute_score",
        "trainer.async_mode=one_step_off",
        "algorithm.off_policy=decoupled",
        f"trainer.max_steps={STEPS}",
        "trainer.save_freq=2",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "worker.rollout.name=hf",  # starts in seconds where vLLM's CPU engine takes a minute
        "worker.rollout.placement=separate",
        "worker.rollout.num_workers=2",  # each generates half of every batch
        "trainer.n_gpus_per_node=1",
    ]


def assert_images_and_videos(trained: list[list[int]], videos: set[int]) -> None:
    """Every step's trained rows (``trained_rows``) hold video prompts and image prompts."""
    for step, rows in enumerate(trained, start=1):
        assert set(rows) & videos and set(rows) - videos, (step, rows, sorted(videos))


def model_bytes(model_path) -> int:
    """The bytes of the model's parameters and persistent buffers, each in its own dtype, tied ones once:
    what a weight push sends."""
    model, seen, total = load_model(str(model_path)), set(), 0
    for tensor in model.state_dict().values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def training_lines(rows: list[dict]) -> dict[int, dict]:
    return {row["step"]: row for row in rows if "actor/pg_loss" in row}


def deterministic(row: dict) -> dict:
    return {key: value for key, value in row.items() if not key.startswith(VARYING)}


@pytest.fixture(scope="module")
def uninterrupted(tiny_vl_path, image_video_data_dir, tmp_path_factory) -> dict:
    """The 4-step run: its training lines by step, and ``save_dir``."""
    save_dir = tmp_path_factory.mktemp("one_step_off") / "run"
    rows = run_main(
        async_overrides(tiny_vl_path, image_video_data_dir, save_dir), save_dir, timeout_s=RUN_TIMEOUT_S
    )
    return {**training_lines(rows), "save_dir": save_dir}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_each_step_trains_the_batch_the_weights_one_update_older_sampled(uninterrupted, image_video_data_dir):
    # step 1: the first batch, by the initial weights; step 2: generated during step 1, before its update;
    # a checkpoint after step 2 holds nothing in flight, so step 3 generates its own; step 4 again ahead
    assert sorted(step for step in uninterrupted if step != "save_dir") == list(range(1, STEPS + 1))
    staleness = [uninterrupted[step]["rollout/staleness_max"] for step in range(1, STEPS + 1)]
    assert staleness == [0.0, 1.0, 0.0, 1.0]
    assert [uninterrupted[step]["rollout/staleness_mean"] for step in range(1, STEPS + 1)] == staleness
    for step in range(1, STEPS + 1):
        row = uninterrupted[step]
        weight = row["actor/behaviour_weight"]
        if staleness[step - 1] == 0:  # behaviour == proximal up to the engine's numerics: w = 1
            assert weight == pytest.approx(1.0, abs=1e-3) and row["actor/behaviour_over_cap"] == 0
        else:  # sampled by the weights before the last update (lr 0.02 moves them visibly)
            assert abs(row["actor/behaviour_kl"]) > 1e-3
        assert row["rollout/generated_responses"] == GROUPS * RESPONSES
    # each step trained one loader batch, in the loader's order: every prompt once, images and videos
    trained = [trained_rows(uninterrupted[step], RESPONSES) for step in range(1, STEPS + 1)]
    assert trained == [sorted(rows) for rows in loader_rows(PROMPTS, GROUPS, STEPS)]
    assert_images_and_videos(trained, video_rows(image_video_data_dir))


@pytest.mark.slow(seconds=110)
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_a_kill_with_a_batch_in_flight_resumes_to_the_uninterrupted_runs_numbers(
    uninterrupted, tiny_vl_path, image_video_data_dir, tmp_path
):
    # resumed from step 2's checkpoint (which holds no batch in flight: step 2 generated nothing ahead),
    # the run is SIGKILLed in step 3 right after it started step 4's generation on the rollout worker
    # (before step 3's log-prob pass and update): a kill between checkpoints loses that generation and
    # step 3, and the prompts of both are drawn again (docs/async.md). The driver's death alone ends the
    # rollout worker, the training rank and Ray's processes. Run again from the same checkpoint, steps 3
    # and 4 train the same samples as the uninterrupted run, none twice, none lost, and the versions
    # the resumed engines stamp match the driver's restored count: every number equals it
    source = uninterrupted["save_dir"] / "global_step_2"
    save_dir = tmp_path / "resumed"
    overrides = async_overrides(tiny_vl_path, image_video_data_dir, save_dir) + [
        f"trainer.load_checkpoint_path={source}"
    ]
    killed = run_killed(
        overrides, "generating:4", tmp_path / "killed.log", RUN_TIMEOUT_S, orphans_exit_s=ORPHANS_EXIT_S
    )
    assert f"resuming from {source}" in killed.output, killed.output[-4000:]
    assert not list(save_dir.glob("global_step_*")), "the killed run had no checkpoint to write"
    assert training_lines(metrics_rows(save_dir)) == {}  # killed inside its first step, step 3
    resumed = training_lines(run_main(overrides, save_dir, timeout_s=RUN_TIMEOUT_S))
    assert_left_nothing(killed.pid)  # the resume removed the killed run's Ray session and temp folders
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        assert deterministic(resumed[step]) == deterministic(uninterrupted[step]), step


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_the_generation_ahead_runs_while_the_step_trains(uninterrupted):
    # steps 1 and 3 started the next step's generation on the rollout worker before their log-prob pass:
    # the rollout worker's recorded window overlaps the training ranks' passes (timestamps, not speed);
    # steps 2 and 4 (a checkpoint follows) generated nothing ahead
    overlaps = [uninterrupted[step]["timing_s/gen_overlap"] for step in range(1, STEPS + 1)]
    assert overlaps[0] > 0 and overlaps[2] > 0, overlaps
    assert overlaps[1] == overlaps[3] == 0, overlaps
    # their rewards were launched as it ended, before the driver settled it after the update
    leads = [uninterrupted[step]["timing_s/reward_lead"] for step in range(1, STEPS + 1)]
    assert leads[0] > 0 and leads[2] > 0 and leads[1] == leads[3] == 0, leads


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_each_update_pushes_the_whole_model_once(uninterrupted, tiny_vl_path):
    # fp32 on CPU: every parameter and persistent buffer (tied ones once) in its own dtype, per update
    expected = model_bytes(tiny_vl_path)
    for step in range(1, STEPS + 1):
        assert uninterrupted[step]["transfer/weight_push_bytes"] == expected
        assert uninterrupted[step]["timing_s/sync"] > 0


# ---------------------------------------------------------------- multi-turn, streamed then one step off, on either engine


@pytest.fixture(scope="module", params=["vllm", "hf"])
def staged_separate(request, tool_calling_vl_path, image_video_data_dir, tmp_path_factory) -> dict:
    """Images and videos on each engine (the param) of the rollout worker of its own, multi-turn trajectories
    (the tiny model taught to call the demo's tool, which returns an image; a video row has none, so its
    call fails alone), in one command of two stages: 1 step streamed, a chunk of one token at a time,
    the turns sampled as their calls return (``turn_schedule=as_ready``), then (resumed from the first
    stage's checkpoint) 2 steps one step off. Its training lines by step."""
    save_dir = tmp_path_factory.mktemp(f"separate_{request.param}") / "run"
    stream = [
        "trainer.async_mode=stream",
        "worker.rollout.multi_turn.turn_schedule=as_ready",  # each trajectory's turns as its calls return
    ]
    overrides = async_overrides(tool_calling_vl_path, image_video_data_dir, save_dir) + [
        "worker.rollout.multi_turn.enable=true",
        f"worker.rollout.multi_turn.tools=[{ZOOM_CENTER_TOOL}]",
        "worker.rollout.multi_turn.max_turns=2",
        "data.max_prompt_length=320",  # the tool's schema in the system prompt
        "data.max_response_length=96",  # a call (34 tokens), the tool turn with its image, the next turn
        "worker.actor.optim.lr=0.0005",  # the taught call survives the updates (0.002 unlearnt it in one)
        f"worker.rollout.name={request.param}",
        # one worker: it runs its submissions in turn, so the streamed step trains the first loader
        # batch whole, however fast each group ends (two raced, and a step once trained only groups
        # that had not called the tool)
        "worker.rollout.num_workers=1",
        "worker.rollout.cpu_kv_cache_gib=0.125",
        "worker.rollout.stream_chunk_tokens=1",
        "trainer.max_steps=null",
        "trainer.save_freq=-1",
        f"trainer.stages=[{{name: stream, steps: 1, overrides: [{', '.join(stream)}]}}, {{name: off, steps: 2}}]",
    ]
    return training_lines(run_main(overrides, save_dir, timeout_s=RUN_TIMEOUT_S))


@pytest.mark.slow(seconds=120)
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_a_rollout_worker_streams_and_generates_ahead_multi_turn_with_the_pushed_weights(
    staged_separate, tool_calling_vl_path, image_video_data_dir
):
    # step 1, streamed, trains trajectories the engine decoded a token per call with the initial weights
    # (pushed into the engine's random ones at start; staleness 0), the tool's images in them; step 2,
    # the first one step off after the resume, trains the batch generated with its own weights (w = 1);
    # step 3 trains the batch the engine generated during step 2 with the weights before its update,
    # pushed over the push group (fp32: the model's bytes); steps 2 and 3 multi-turn as well
    assert sorted(staged_separate) == [1, 2, 3]
    streamed, first, second = staged_separate[1], staged_separate[2], staged_separate[3]
    staleness = [staged_separate[step]["rollout/staleness_max"] for step in (1, 2, 3)]
    assert staleness == [0.0, 0.0, 1.0]
    for row in (streamed, first):  # fresh samples: behaviour = proximal up to the engines' numerics
        assert row["actor/behaviour_weight"] == pytest.approx(1.0, abs=1e-4)
        assert row["actor/behaviour_over_cap"] == 0 and abs(row["actor/behaviour_kl"]) < 1e-5
    # sampled by the weights before the update: the KL 10x past the fresh steps' bound, the weight past
    # theirs (a mean of clipped ratios either side of 1: measured 0.9996 on transformers, 0.984 on vLLM)
    assert abs(second["actor/behaviour_kl"]) > 1e-4 and abs(second["actor/behaviour_weight"] - 1) > 1e-4
    assert first["timing_s/gen_overlap"] > 0  # step 3's batch was generated while step 2 trained
    assert streamed["rollout/stream_dropped_groups"] == 0
    # the trajectories, streamed and one step off, called the tool, whose image came back as an observation
    for row in (streamed, first, second):
        assert row.get("agent/tool_calls/zoom", 0) > 0 and row["agent/observation_tokens/mean"] > 0, row
        assert row["agent/turns/max"] == 2
    expected = model_bytes(tool_calling_vl_path)
    for row in (streamed, first, second):
        assert row["transfer/weight_push_bytes"] == expected
        assert row["rollout/generated_responses"] == 16
    # every step generated and trained video prompts (frames attached on the rollout worker, 3-D
    # positions numbered there) beside image ones, in either mode
    trained = [trained_rows(staged_separate[step], RESPONSES) for step in (1, 2, 3)]
    assert_images_and_videos(trained, video_rows(image_video_data_dir))
    # the stream's one worker ran loader batch 0 whole before batch 1 (in flight at the checkpoint, so
    # generated again after the resume); the steps trained the loader's batches in order
    assert [sorted(rows) for rows in trained] == [sorted(rows) for rows in loader_rows(PROMPTS, GROUPS, 3)]
