"""End-to-end tests of the training engine: ``python -m mmrl.trainer.main`` in a subprocess.

Real Ray, two FSDP2 ranks over gloo, the transformers rollout, a reference model with the KL loss and
a reward actor, on the tiny random Qwen2.5-VL and the synthetic colour task (session fixtures). The
reward is ``assets/fingerprint_reward.py``: dense, so GRPO advantages are non-zero and the weights
really move (lr 0.02), plus a fingerprint of the response texts, so that equal metrics mean equal
generations.

One uninterrupted 4-step run (``run_a``, module scope) serves the tests of the run itself, of the exact
resume after SIGKILL, of the resume on one worker, of the merger and of the trackers (it logs to
tensorboard, wandb offline and an MLflow file store too, whose files are read back). Every trainer process starts in a
session of its own: a kill of its process group takes Ray's head processes with it, and whatever is
left can be found by session id (Ray's workers have their own process groups but keep the session).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import _warm_start as warm
import psutil
import pytest
import torch
from _trackers import (
    mlflow_run,
    mlflow_run_status,
    offline_tracker_env,
    tensorboard_run,
    wandb_offline_exit_code,
    wandb_offline_run,
)
from _trainer_run import command_of, kill_session, name_of, session_processes

from mmrl.checkpoint.tracker import find_last_checkpoint
from mmrl.config.loading import config_to_yaml, load_config

REPO_ROOT = Path(__file__).resolve().parents[2]
ASSETS = Path(__file__).resolve().parent / "assets"
FINGERPRINT_REWARD = f"{ASSETS / 'fingerprint_reward.py'}:compute_score"
RAISING_REWARD = f"{ASSETS / 'raising_reward.py'}:compute_score"
HANGING_REWARD = f"{ASSETS / 'hanging_reward.py'}:compute_score"
REWARD_TIMEOUT_S = 5.0  # scoring a step takes well under a second here

# A trainer run takes 20-45 s on a 2-core machine; the limits only keep a hang from stalling CI.
RUN_TIMEOUT_S = 240.0
EXIT_AFTER_WORKER_DEATH_S = 120.0
SESSION_EXIT_TIMEOUT_S = 60.0  # Ray's workers exit a few seconds after its head processes
TEST_TIMEOUT_S = 900  # several runs plus the module's shared run

WORLD_SIZE = 2
TOTAL_STEPS = 4
SAVE_FREQ = 2
ROLLOUT_BATCH_SIZE = 4  # prompts per step; the train set has 32, so 8 steps per epoch
RESPONSES_PER_PROMPT = 4
MAX_RESPONSE_LENGTH = 4
LEARNING_RATE = 0.02  # large enough for greedy validation answers to change within 4 steps
# metrics of the run rather than of the computation: times, the bytes through Ray (a pickled Ray
# ref holds its owner's address, whose port differs between runs) and the processes' peak memory
TIME_BASED_PREFIXES = ("timing_s/", "throughput/", "transfer/", "memory/")
# counts of what the process did before the step: a resumed run starts with weights just pushed
PROCESS_HISTORY_KEYS = ("rollout/weight_pushes_before_generate",)


def trainer_e2e(test: Callable | None = None, *, seconds: float = 25) -> Callable:
    """Marks a test that runs the trainer: slow (about ``seconds`` on a 2-core machine, a guess that
    orders the work of parallel test workers), spawns a Ray cluster, with a bounded duration."""

    def mark(test: Callable) -> Callable:
        return pytest.mark.slow(seconds=seconds)(
            pytest.mark.distributed(pytest.mark.timeout(TEST_TIMEOUT_S)(test))
        )

    return mark(test) if test is not None else mark


# ---- configs and processes ----------------------------------------------------------------------


def trainer_overrides(model_path: Path, data_dir: Path, save_dir: Path) -> list[str]:
    """A complete tiny run: 2 CPU workers, 4 prompts x 4 responses of 4 tokens, 4 steps."""
    return [
        f"data.train_files={data_dir / 'train.jsonl'}",
        f"data.val_files={data_dir / 'val.jsonl'}",
        "data.max_prompt_length=64",
        f"data.max_response_length={MAX_RESPONSE_LENGTH}",
        f"data.rollout_batch_size={ROLLOUT_BATCH_SIZE}",
        "data.min_pixels=3136",
        "data.max_pixels=50176",
        "data.seed=1",
        "algorithm.adv_estimator=grpo",
        "algorithm.disable_kl=false",
        "algorithm.use_kl_loss=true",
        "algorithm.kl_coef=0.01",
        # adaptive entropy control over the top-20 entropy, always below its target: the coefficient
        # rises 0.001 a step (0.001, 0.002, ...), so a resume that lost its state would show it
        "worker.actor.entropy_coeff=0.001",
        "worker.actor.entropy_top_k=20",
        "worker.actor.adaptive_entropy.enabled=true",
        "worker.actor.adaptive_entropy.target_entropy=100",
        "worker.actor.adaptive_entropy.delta_ent_coef=0.001",
        "worker.actor.adaptive_entropy.max_ent_coef=0.01",
        f"worker.actor.model.model_path={model_path}",
        "worker.actor.model.enable_gradient_checkpointing=false",
        f"worker.actor.global_batch_size={ROLLOUT_BATCH_SIZE}",
        "worker.actor.micro_batch_size_per_device_for_update=4",
        "worker.actor.micro_batch_size_per_device_for_experience=8",
        "worker.actor.max_grad_norm=1.0",
        f"worker.actor.optim.lr={LEARNING_RATE}",
        "worker.actor.optim.weight_decay=0.0",
        "worker.rollout.name=hf",
        f"worker.rollout.n={RESPONSES_PER_PROMPT}",
        "worker.rollout.temperature=1.0",
        "worker.rollout.val_override_config.temperature=0",
        "worker.rollout.val_override_config.n=1",
        f"worker.reward.reward_function={FINGERPRINT_REWARD}",
        f"trainer.max_steps={TOTAL_STEPS}",
        "trainer.logger=[jsonl]",
        "trainer.nnodes=1",
        f"trainer.n_gpus_per_node={WORLD_SIZE}",
        "trainer.device=cpu",
        "trainer.val_freq=2",
        "trainer.val_before_train=true",
        f"trainer.save_freq={SAVE_FREQ}",
        "trainer.save_limit=-1",
        f"trainer.save_checkpoint_path={save_dir}",
    ]


def write_config(path: Path, overrides: Sequence[str]) -> Path:
    """Validates ``overrides`` here (a ``ConfigError`` names any bad key) and writes the resolved config
    that the trainer subprocess is started with."""
    path.write_text(config_to_yaml(load_config(list(overrides))))
    return path


def trainer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    # RAY_DEDUP_LOGS=0: every rank's lines reach the driver's output with their "(model_rankN pid=...)"
    # prefix, which the dying-worker test reads.
    env = {**os.environ, "RAY_DEDUP_LOGS": "0", "OMP_NUM_THREADS": "1"}
    return {**env, **(extra or {})}


def start_trainer(
    config_file: Path, log_path: Path, extra: Sequence[str] = (), env: dict[str, str] | None = None
) -> subprocess.Popen:
    """The trainer CLI in a new session (its pid is the session id), output to ``log_path``; ``env`` is
    added to the environment."""
    with open(log_path, "wb") as log:
        return warm.start(
            [sys.executable, "-m", "mmrl.trainer.main", f"config={config_file}", *extra],
            cwd=REPO_ROOT,
            env=trainer_env(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def read_log(log_path: Path) -> str:
    return log_path.read_text(errors="replace")


def leftover_processes(session_id: int, timeout_s: float) -> list[str]:
    """Waits up to ``timeout_s`` for the session to empty; describes the processes still running."""
    deadline = time.monotonic() + timeout_s
    while (alive := session_processes(session_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    described = []
    for process in alive:
        try:
            described.append(f"{process.pid} {process.name()}")
        except psutil.Error:
            continue
    return described


def wait_for_exit(process: subprocess.Popen, log_path: Path, timeout_s: float) -> int:
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_session(process)
        pytest.fail(
            f"the trainer did not exit within {timeout_s:g} s; its output ends:\n{read_log(log_path)[-4000:]}"
        )


def wait_until(
    condition: Callable[[], bool], process: subprocess.Popen, log_path: Path, what: str, timeout_s: float
) -> None:
    """Polls ``condition`` while the trainer runs; fails if it exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if process.poll() is not None:
            pytest.fail(
                f"the trainer exited (code {process.returncode}) before {what}; its output ends:\n"
                f"{read_log(log_path)[-4000:]}"
            )
        if time.monotonic() > deadline:
            kill_session(process)
            pytest.fail(f"no {what} within {timeout_s:g} s; the output ends:\n{read_log(log_path)[-4000:]}")
        time.sleep(0.1)


@dataclass
class TrainerRun:
    returncode: int
    output: str
    save_dir: Path
    leftovers: list[str]  # processes of the run's session still running a while after it exited


def run_trainer(
    config_file: Path,
    save_dir: Path,
    log_path: Path,
    extra: Sequence[str] = (),
    timeout_s: float = RUN_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> TrainerRun:
    process = start_trainer(config_file, log_path, extra, env)
    try:
        returncode = wait_for_exit(process, log_path, timeout_s)
        leftovers = leftover_processes(process.pid, SESSION_EXIT_TIMEOUT_S)
    finally:
        kill_session(process)
    return TrainerRun(returncode, read_log(log_path), save_dir, leftovers)


# ---- run artefacts ------------------------------------------------------------------------------


def metrics_lines(save_dir: Path) -> list[dict[str, float]]:
    path = save_dir / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def logged_steps(save_dir: Path) -> int:
    """Lines in metrics.jsonl so far, counted without parsing (the trainer may be writing one)."""
    path = save_dir / "logs" / "metrics.jsonl"
    return path.read_bytes().count(b"\n") if path.is_file() else 0


def merge_checkpoint(actor_dir: Path, target_dir: Path, env: dict | None = None) -> None:
    """``scripts/model_merger.py`` on a checkpoint's actor folder; it must succeed."""
    merge = warm.run(
        [
            sys.executable,
            "scripts/model_merger.py",
            "--local_dir",
            str(actor_dir),
            "--target_dir",
            str(target_dir),
        ],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert merge.returncode == 0, merge.stderr[-4000:]


def metrics_by_step(lines: Sequence[dict[str, float]]) -> dict[int, dict[str, float]]:
    """The last line of each step (a resumed run appends to the file), without the ``step`` key."""
    by_step = {}
    for line in lines:
        by_step[line["step"]] = {key: value for key, value in line.items() if key != "step"}
    return by_step


def latest_committed_step(save_dir: Path) -> int | None:
    try:
        return json.loads((save_dir / "checkpoint_tracker.json").read_text())["latest_step"]
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def deterministic_part(metrics: dict[str, float]) -> dict[str, float]:
    return {
        key: value
        for key, value in metrics.items()
        if not key.startswith(TIME_BASED_PREFIXES) and key not in PROCESS_HISTORY_KEYS
    }


def val_part(metrics: dict[str, float]) -> dict[str, float]:
    return {key: value for key, value in metrics.items() if key.startswith("val/")}


def token_log_probs(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """log p(token_t | tokens_<t) for t >= 1: [B, L - 1]."""
    with torch.no_grad():
        logits = model(**inputs).logits  # [B, L, V]
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return log_probs.gather(-1, inputs["input_ids"][:, 1:, None]).squeeze(-1)


# ---- the shared uninterrupted run ---------------------------------------------------------------


@pytest.fixture(scope="module")
def e2e_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ray_trainer")


# every file tracker of run A; its jsonl files are what the others must hold too
RUN_A_LOGGERS = "trainer.logger=[console,jsonl,tensorboard,wandb,mlflow]"
RUN_A_GENERATIONS = 2  # validation samples logged per validation


@pytest.fixture(scope="module")
def run_a_config(e2e_dir, tiny_vl_path, shapes_data_dir) -> Path:
    overrides = trainer_overrides(tiny_vl_path, shapes_data_dir, e2e_dir / "run_a") + [
        RUN_A_LOGGERS,
        f"trainer.val_generations_to_log={RUN_A_GENERATIONS}",
    ]
    return write_config(e2e_dir / "run_a.yaml", overrides)


@pytest.fixture(scope="module")
def run_a(e2e_dir, run_a_config) -> TrainerRun:
    """4 steps on 2 workers, uninterrupted: checkpoints at steps 2 and 4, validation at 0, 2 and 4."""
    # Ray's log deduplication on, as users have it: its held-back lines must not follow mmrl's last line.
    # Since only rank 0 reads the weights, transformers' info lines (the processor's files, the same on
    # both workers) are what Ray deduplicates.
    env = {
        **offline_tracker_env(e2e_dir / "tracker_home"),
        "RAY_DEDUP_LOGS": "1",
        "TRANSFORMERS_VERBOSITY": "info",
        **PLANTED_SECRETS,
    }
    return run_trainer(run_a_config, e2e_dir / "run_a", e2e_dir / "run_a.log", env=env)


# Keys in run A's environment that no file of a run may hold: a judge's API key (the variable a
# judge.api_key_env would name), trackers' and the hub's keys, and the Ray cluster's own token (the
# variable wins over ~/.ray/auth_token: the run's cluster uses it). Random, so a match is no accident.
PLANTED_SECRETS = {
    "MMRL_JUDGE_API_KEY": f"sk-planted-{os.urandom(12).hex()}",
    "WANDB_API_KEY": os.urandom(20).hex(),  # wandb checks for 40 characters
    "MLFLOW_TRACKING_TOKEN": f"mlflow-planted-{os.urandom(12).hex()}",
    "HF_TOKEN": f"hf_planted{os.urandom(12).hex()}",
    "RAY_AUTH_TOKEN": os.urandom(32).hex(),
}


def assert_succeeded(run: TrainerRun) -> None:
    assert run.returncode == 0, (
        f"the trainer exited with {run.returncode}; output ends:\n{run.output[-4000:]}"
    )


# ---- tests --------------------------------------------------------------------------------------


@trainer_e2e
def test_no_file_a_run_writes_holds_a_key_of_its_environment(run_a, e2e_dir):
    """Logs, metrics, the saved config, checkpoints, every tracker's files and the run's output: none
    holds any of the keys planted in run A's environment (the runs resumed from run A's checkpoints
    write under ``e2e_dir`` too)."""
    assert_succeeded(run_a)
    files = [path for path in e2e_dir.rglob("*") if path.is_file()]
    assert len(files) > 20 and any(path.suffix == ".distcp" for path in files)  # the run's folders are there
    found = [
        f"{name} in {path.relative_to(e2e_dir)}"
        for path in files
        for name, value in PLANTED_SECRETS.items()
        if value.encode() in path.read_bytes()
    ]
    assert found == []


@trainer_e2e
def test_training_run_logs_validates_and_checkpoints(run_a):
    assert_succeeded(run_a)
    assert run_a.leftovers == [], f"processes still running after the trainer exited: {run_a.leftovers}"

    metrics = metrics_by_step(metrics_lines(run_a.save_dir))
    assert sorted(metrics) == [0, 1, 2, 3, 4]
    assert set(metrics[0]) == {
        "val/reward/overall",
        "val/reward/fingerprint",
        "val/shapes_color/overall",
    }  # validation before training only
    for step in range(1, TOTAL_STEPS + 1):
        step_metrics = metrics[step]
        for key in (
            "reward/overall",
            "reward/fingerprint",
            "critic/score/mean",
            "critic/advantages/mean",
            "actor/pg_loss",
            "actor/kl_loss",
            "actor/grad_norm",
            "actor/entropy",
            "actor/lr",
            "response_length/mean",
            "response_length/max",
            "prompt_length/mean",
            "timing_s/step",
            "timing_s/gen",  # no timing_s/old_log_prob: on-policy, the update computes them
            "timing_s/ref_log_prob",
            "timing_s/update_actor",
            "timing_s/sync",  # the weight push into the rollout, a phase of its own
            "throughput/tokens_per_s",
            "memory/gen_peak_gib",  # per phase, the largest over the ranks
            "memory/ref_log_prob_peak_gib",
            "memory/update_actor_peak_gib",
            "memory/sync_peak_gib",
        ):
            assert key in step_metrics, f"step {step} has no {key}: {sorted(step_metrics)}"
        assert 0.1 < step_metrics["memory/update_actor_peak_gib"] < 8  # a worker process's resident set
        assert 1 <= step_metrics["response_length/max"] <= MAX_RESPONSE_LENGTH
        assert step_metrics["actor/lr"] == pytest.approx(LEARNING_RATE)
        assert step_metrics["actor/grad_norm"] > 0  # the dense reward gives non-zero advantages
        assert step_metrics["timing_s/step"] > 0
        assert 0 < step_metrics["timing_s/sync"] < step_metrics["timing_s/step"]
        assert ("val/reward/overall" in step_metrics) == (step % 2 == 0)  # val_freq=2 and the last step
    # the entropy bonus's coefficient rose by delta_ent_coef a step (adaptive control, below the target)
    assert [metrics[step]["actor/entropy_coeff"] for step in (1, 2, 3, 4)] == pytest.approx(
        [0.001, 0.002, 0.003, 0.004]
    )
    assert all(0 < metrics[step]["actor/entropy"] <= math.log(20) for step in (1, 2, 3, 4))  # top-20
    # the policy moved: greedy validation answers differ after training
    assert metrics[4]["val/reward/fingerprint"] != metrics[0]["val/reward/fingerprint"]

    save_dir = run_a.save_dir
    assert sorted(path.name for path in save_dir.iterdir()) == [
        "checkpoint_tracker.json",
        "global_step_2",
        "global_step_4",
        "logs",
    ]  # no .tmp folder left
    tracker = json.loads((save_dir / "checkpoint_tracker.json").read_text())
    assert tracker["latest_step"] == 4
    assert tracker["metric_name"] == "val/reward/overall"
    # the best step follows val/reward/overall; a tie keeps the earlier step
    best = 4 if metrics[4]["val/reward/overall"] > metrics[2]["val/reward/overall"] else 2
    assert tracker["best_step"] == best
    step_dir = save_dir / "global_step_4"
    assert sorted(path.name for path in step_dir.iterdir()) == ["actor", "trainer_state.json"]
    trainer_state = json.loads((step_dir / "trainer_state.json").read_text())
    assert trainer_state["global_step"] == 4
    assert trainer_state["entropy_ctrl"] == {"value": pytest.approx(0.005), "active": True}
    assert trainer_state["loader"] == {"epoch": 0, "batch_index": 4}  # 4 of the epoch's 8 batches
    state_info = json.loads((step_dir / "actor" / "mmrl_state.json").read_text())
    assert state_info["world_size"] == WORLD_SIZE and state_info["has_optimizer"]
    for name in ("model/.metadata", "optimizer/.metadata", "extra_state_rank0.pt", "extra_state_rank1.pt"):
        assert (step_dir / "actor" / name).is_file(), name


def generations_by_step(save_dir: Path) -> dict[int, list[dict]]:
    """The validation samples of ``logs/generations.jsonl``, by step, without the ``step`` key."""
    by_step: dict[int, list[dict]] = {}
    for line in (save_dir / "logs" / "generations.jsonl").read_text().splitlines():
        sample = json.loads(line)
        by_step.setdefault(sample.pop("step"), []).append(sample)
    return by_step


def assert_trackers_hold(
    save_dir: Path, metrics: dict[int, dict[str, float]], generations: dict[int, list[dict]]
) -> None:
    """tensorboard, wandb and MLflow hold ``metrics`` (jsonl's, by step) and ``generations`` (the
    samples of each validation): every key at every step, and one table per validation."""
    from mmrl.logging.loggers import generations_markdown

    log_dir = save_dir / "logs"
    rows = {
        step: [[s["prompt"], s["response"], s["ground_truth"], s["score"]] for s in samples]
        for step, samples in generations.items()
    }
    columns = ["prompt", "response", "ground_truth", "score"]
    by_key: dict[str, dict[int, float]] = {}
    for step, step_metrics in metrics.items():
        for key, value in step_metrics.items():
            by_key.setdefault(key, {})[step] = value
    assert all(value is not None for steps in by_key.values() for value in steps.values())

    scalars, markdown = tensorboard_run(log_dir)
    assert set(scalars) == set(by_key)
    for key, steps in by_key.items():  # event files hold float32
        assert scalars[key] == pytest.approx(steps, rel=1e-6), key
    assert markdown == {step: generations_markdown(samples) for step, samples in generations.items()}

    history, wandb_tables = wandb_offline_run(log_dir)
    assert history == by_key
    assert wandb_tables == {step: {"columns": columns, "data": data} for step, data in rows.items()}

    _, mlflow_metrics, mlflow_tables = mlflow_run(log_dir)
    assert mlflow_metrics == by_key
    assert mlflow_tables == {step: {"columns": columns, "data": data} for step, data in rows.items()}


def ray_lines(output: str) -> list[str]:
    """Lines Ray forwarded from its worker processes in ``output``: ``(model_rank0 pid=...)`` prefixes and
    its deduplication's ``[repeated 4x across cluster]``."""
    ray_line = re.compile(r"pid=\d+\)|repeated \d+x across cluster")
    return [line for line in output.splitlines() if ray_line.search(line)]


@trainer_e2e
def test_the_last_lines_of_a_run_are_mmrls(run_a):
    """With Ray's log deduplication on, a run ends with the console's summary: Ray's held-back
    "[repeated Nx across cluster]" lines come out before it (the driver leaves Ray first)."""
    assert_succeeded(run_a)
    lines = [line for line in run_a.output.splitlines() if line.strip()]
    assert re.fullmatch(r"finished at step 4 after \S+", lines[-1]), lines[-5:]
    assert "[repeated" in run_a.output, "Ray deduplicated no line: this run tests nothing"


@trainer_e2e
def test_every_tracker_holds_the_runs_metrics_and_validation_generations(run_a, monkeypatch):
    """Run A logged to jsonl, tensorboard, wandb (offline) and MLflow (file store): read back, the last
    three hold every metric of steps 0-4 and a 2-row generations table per validation (0, 2, 4)."""
    assert_succeeded(run_a)
    for key, value in offline_tracker_env(run_a.save_dir.parent / "tracker_home").items():
        monkeypatch.setenv(key, value)
    metrics = metrics_by_step(metrics_lines(run_a.save_dir))
    generations = generations_by_step(run_a.save_dir)
    assert sorted(generations) == [0, 2, 4]
    assert all(len(samples) == RUN_A_GENERATIONS for samples in generations.values())
    assert_trackers_hold(run_a.save_dir, metrics, generations)
    assert wandb_offline_exit_code(run_a.save_dir / "logs") == 0  # finished, not failed
    assert mlflow_run_status(run_a.save_dir / "logs") == "FINISHED"
    assert sorted(path.name for path in (run_a.save_dir / "logs").iterdir()) == [
        "generations.jsonl",
        "metrics.jsonl",
        "mlruns",
        "tensorboard",
        "wandb",
    ]


@trainer_e2e
def test_val_only_validates_logs_to_every_tracker_and_exits(
    run_a, e2e_dir, tiny_vl_path, shapes_data_dir, monkeypatch
):
    """trainer.val_only (with val_before_train=false): one validation of the initial model at step 0,
    equal to run A's on one worker instead of two, 3 generations in every tracker, then the run exits:
    no training step, no checkpoint, no process left."""
    assert_succeeded(run_a)
    save_dir = e2e_dir / "val_only"
    overrides = trainer_overrides(tiny_vl_path, shapes_data_dir, save_dir) + [
        "trainer.logger=[console,jsonl,tensorboard,wandb,mlflow]",
        "trainer.val_only=true",
        "trainer.val_before_train=false",
        "trainer.val_generations_to_log=3",
        "trainer.n_gpus_per_node=1",
    ]
    config_file = write_config(e2e_dir / "val_only.yaml", overrides)
    env = offline_tracker_env(e2e_dir / "val_only_home")
    run = run_trainer(config_file, save_dir, e2e_dir / "val_only.log", env=env)
    assert_succeeded(run)
    assert run.leftovers == [], f"processes still running after the trainer exited: {run.leftovers}"

    assert sorted(path.name for path in save_dir.iterdir()) == ["logs"]  # no checkpoint
    metrics = metrics_by_step(metrics_lines(save_dir))
    run_a_metrics = metrics_by_step(metrics_lines(run_a.save_dir))
    assert metrics == {0: val_part(run_a_metrics[0])}  # only the validation: no training step
    generations = generations_by_step(save_dir)
    assert list(generations) == [0] and len(generations[0]) == 3
    assert generations[0][:RUN_A_GENERATIONS] == generations_by_step(run_a.save_dir)[0]
    assert "validation generations at step 0 (3 samples)" in run.output  # the console's
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert_trackers_hold(save_dir, metrics, generations)


# for runs whose point is not the ranks: a second training rank's process costs ~6 CPU-s a run
ONE_TRAINING_RANK = "trainer.n_gpus_per_node=1"
# Where the chaos run's driver kills itself (mmrl.trainer.ray_trainer.fault_point), in order, each
# resumed from the last checkpoint (saved every step): (phase, step, the last checkpoint at the kill).
# Each run goes a step past its resume point, so every kind of resume comes once: mid-stage (from 1),
# across the stage boundary live and from a partial checkpoint (from 2), mid-stage in the second stage
# (from 3, the last run). A kill between two commits leaves the same thing whatever the driver was
# waiting for (the last commit, nothing after it): the step's first phase and its last stand for the
# others, and the random kill samples the rest. Each kill point is one more run, whose start-up of Ray
# and both workers is most of its ~50 s on a 2-core machine.
CHAOS_FAULTS = (
    ("rollout", 2, 1),  # before anything of step 2
    ("checkpoint", 3, 2),  # resumed from 1: step 2, then step 3's workers' part written, not committed
    ("sync", 4, 3),  # resumed from 2 (over the partial step 3): step 3, then step 4's update done
)
RANDOM_KILL_WINDOW_S = (3.0, 15.0)  # seconds after the start: from start-up to past the last step


def check_against_uninterrupted(lines: Sequence[dict], expected: dict[int, dict[str, float]]) -> None:
    """Every metrics line of the chaos run (killed segments and resumes alike) equals the uninterrupted
    run's for its step, timings aside; a resume's validation-only line is compared where A validated."""
    for line in lines:
        if "trainer/stage" in line:  # run A is one stage; the chaos run is two, steps 1-2 and 3-4
            assert line["trainer/stage"] == (1 if line["step"] <= 2 else 2), line["step"]
        skipped = ("step", "trainer/stage")
        step, found = line["step"], deterministic_part({k: v for k, v in line.items() if k not in skipped})
        if set(found) == set(val_part(found)):
            if val_part(expected[step]):
                assert found == val_part(expected[step]), f"validation at step {step}"
            continue
        assert found == deterministic_part(expected[step]), f"step {step}"


@trainer_e2e(seconds=250)
def test_sigkill_at_any_moment_and_resume_reproduce_the_uninterrupted_metrics(
    run_a, e2e_dir, tiny_vl_path, shapes_data_dir
):
    """Run A's config, saving every step, SIGKILLed (the driver, then what is left of its session, as a
    crashed machine loses it) at the start of a step's rollout, in its weight sync (after the update)
    and in the middle of a checkpoint write, and once at a random moment, resumed after every kill:
    each step's metrics equal run A's exactly, timings aside. It runs as a two-stage schedule (steps
    1-2, then 3-4 with workers rebuilt from the second stage's config, which changes nothing that shows
    in the numbers): one run crosses the boundary live, one resumes at it, the last mid-stage."""
    import random

    assert_succeeded(run_a)
    save_dir = e2e_dir / "run_chaos"
    # no validation at each start (run A's at step 0 does not change its training: the resumed
    # segments, which validate at other steps than run A, reproduce it exactly)
    overrides = trainer_overrides(tiny_vl_path, shapes_data_dir, save_dir) + [
        "trainer.save_freq=1",
        "trainer.val_before_train=false",
        "trainer.stages=[{name: first, steps: 2}, {name: second, steps: 2, overrides: [worker.reward.timeout_s=300]}]",
    ]
    config_file = write_config(e2e_dir / "run_chaos.yaml", overrides)
    seconds = {}
    for index, (phase, step, last_saved) in enumerate(CHAOS_FAULTS):
        log_path = e2e_dir / f"run_chaos_{index}_{phase}.log"
        started = time.monotonic()
        process = start_trainer(config_file, log_path, env={"MMRL_FAULT_AT": f"{phase}:{step}"})
        try:
            returncode = wait_for_exit(process, log_path, RUN_TIMEOUT_S)
        finally:
            kill_session(process)
        seconds[f"{phase}:{step}"] = round(time.monotonic() - started, 1)
        assert returncode == -signal.SIGKILL, read_log(log_path)[-4000:]
        assert latest_committed_step(save_dir) == last_saved, phase
        if phase == "checkpoint":  # killed mid-save: the partial folder is there, and ignored
            assert (save_dir / f"global_step_{step}.tmp" / "actor").is_dir()
            assert not (save_dir / f"global_step_{step}").exists()
        elif index > 0:
            assert f"resuming from {save_dir / f'global_step_{CHAOS_FAULTS[index - 1][2]}'}" in read_log(
                log_path
            )

    seed = int(os.environ.get("MMRL_CHAOS_SEED", random.randrange(1 << 30)))
    delay_s = random.Random(seed).uniform(*RANDOM_KILL_WINDOW_S)
    print(f"random kill: seed {seed}, {delay_s:.1f} s after the start (MMRL_CHAOS_SEED={seed} repeats it)")
    log_path = e2e_dir / "run_chaos_random.log"
    process = start_trainer(config_file, log_path)
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=delay_s)
    finally:
        kill_session(process)  # SIGKILL of the whole session, wherever it is (or a no-op if finished)
    assert not (save_dir / "global_step_4.tmp").is_file()
    committed = latest_committed_step(save_dir)  # 3, unless the random kill came after step 4's commit
    resumed = run_trainer(config_file, save_dir, e2e_dir / "run_chaos_resumed.log")
    assert_succeeded(resumed)
    print(f"seconds per killed run: {seconds}")
    # the last run resumed from step 3, inside the second stage (the stages of its lines are checked below)
    assert committed == TOTAL_STEPS or f"resuming from {save_dir / 'global_step_3'}" in resumed.output

    assert latest_committed_step(save_dir) == TOTAL_STEPS
    assert not list(save_dir.glob("*.tmp")), "a partial checkpoint folder was left after the last save"
    expected, lines = metrics_by_step(metrics_lines(run_a.save_dir)), metrics_lines(save_dir)
    check_against_uninterrupted(lines, expected)
    trained_steps = {line["step"] for line in lines if "actor/pg_loss" in line}
    assert trained_steps == set(range(1, TOTAL_STEPS + 1))
    assert {line["trainer/stage"] for line in lines if "actor/pg_loss" in line} == {1, 2}
    # the run killed in step 4's weight sync resumed at the stage boundary with the second stage's config
    assert "mmrl: stage 2/2 second: steps 3-4 with worker.reward.timeout_s=300" in read_log(
        e2e_dir / "run_chaos_2_sync.log"
    )
    assert {line["step"] for line in lines if "val/reward/overall" in line} == {2, 4}  # val_freq=2


@trainer_e2e
def test_resume_on_one_worker_from_a_two_worker_checkpoint(run_a, e2e_dir, tiny_vl_path, shapes_data_dir):
    """Run A's last checkpoint (2 ranks) resumed on 1 rank for one more step. Greedy validation at the
    resumed step reproduces run A's step-4 validation, so the loaded weights are run A's."""
    from mmrl.checkpoint.merger import load_full_state_dict

    assert_succeeded(run_a)
    save_dir = e2e_dir / "run_one_worker"
    overrides = trainer_overrides(tiny_vl_path, shapes_data_dir, save_dir) + [
        "trainer.n_gpus_per_node=1",
        f"trainer.max_steps={TOTAL_STEPS + 1}",
        f"trainer.load_checkpoint_path={run_a.save_dir / 'global_step_4'}",
    ]
    config_file = write_config(e2e_dir / "run_one_worker.yaml", overrides)
    resumed = run_trainer(config_file, save_dir, e2e_dir / "run_one_worker.log")
    assert_succeeded(resumed)

    expected = metrics_by_step(metrics_lines(run_a.save_dir))
    found = metrics_by_step(metrics_lines(save_dir))
    assert sorted(found) == [4, 5]
    # validation must see a trained model for this to identify the weights (checked in run A too)
    assert expected[4]["val/reward/fingerprint"] != expected[0]["val/reward/fingerprint"]
    assert found[4] == val_part(expected[4])
    assert "actor/pg_loss" in found[5] and "val/reward/overall" in found[5]

    step_dir = save_dir / "global_step_5"
    assert json.loads((step_dir / "trainer_state.json").read_text())["loader"] == {
        "epoch": 0,
        "batch_index": 5,
    }
    assert json.loads((step_dir / "actor" / "mmrl_state.json").read_text())["world_size"] == 1
    saved = load_full_state_dict(run_a.save_dir / "global_step_4" / "actor" / "model")
    trained_on = load_full_state_dict(step_dir / "actor" / "model")
    assert saved.keys() == trained_on.keys()
    assert any(not torch.equal(saved[key], trained_on[key]) for key in saved)  # step 5 trained


@trainer_e2e
def test_merged_trainer_checkpoint_loads_with_from_pretrained(run_a, e2e_dir, tiny_vl_path, shapes_data_dir):
    """scripts/model_merger.py on run A's step-4 actor gives a Hugging Face folder whose model scores
    an image prompt exactly like the DCP checkpoint loaded in-process, and unlike the initial model."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmrl.checkpoint.merger import load_full_state_dict

    assert_succeeded(run_a)
    actor_dir = run_a.save_dir / "global_step_4" / "actor"
    merged_dir = e2e_dir / "merged_step_4"
    merge_checkpoint(actor_dir, merged_dir)

    processor = AutoProcessor.from_pretrained(merged_dir)  # the merged folder is complete
    messages = [
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "What colour is the shape?"}],
        }
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True) + "red<|im_end|>"
    image = Image.open(shapes_data_dir / "images" / "val_00000.png").convert("RGB")
    inputs = dict(processor(text=[text], images=[image], return_tensors="pt"))
    assert "pixel_values" in inputs

    merged = AutoModelForImageTextToText.from_pretrained(merged_dir, dtype=torch.float32).eval()
    from_checkpoint = AutoModelForImageTextToText.from_pretrained(tiny_vl_path, dtype=torch.float32).eval()
    from_checkpoint.load_state_dict(load_full_state_dict(actor_dir / "model"), strict=True)
    initial = AutoModelForImageTextToText.from_pretrained(tiny_vl_path, dtype=torch.float32).eval()

    merged_log_probs = token_log_probs(merged, inputs)
    torch.testing.assert_close(merged_log_probs, token_log_probs(from_checkpoint, inputs), rtol=0, atol=1e-6)
    assert (merged_log_probs - token_log_probs(initial, inputs)).abs().max() > 1e-3


def kill_a_process_of_an_endless_run(
    folder: Path, tiny_vl_path: Path, shapes_data_dir: Path, name: str, find_victim, extra: Sequence[str] = ()
) -> tuple[int, float, str, list]:
    """Starts a run (with the ``extra`` overrides) that would never end, waits for its first logged
    step, SIGKILLs the process that ``find_victim(trainer process, log path)`` picks and waits for the
    trainer's exit: (its exit code, seconds from the kill to the exit, its output, processes of its
    session still running)."""
    save_dir = folder / name
    overrides = trainer_overrides(tiny_vl_path, shapes_data_dir, save_dir) + [
        "trainer.max_steps=1000",  # never reached: the run must end because of the kill
        "trainer.val_before_train=false",
        "trainer.val_freq=0",
        "trainer.save_freq=0",
        *extra,
    ]
    config_file = write_config(folder / f"{name}.yaml", overrides)
    log_path = folder / f"{name}.log"
    process = start_trainer(config_file, log_path)
    try:
        wait_until(lambda: logged_steps(save_dir) >= 1, process, log_path, "logged step", RUN_TIMEOUT_S)
        find_victim(process, log_path).kill()
        killed_at = time.monotonic()
        returncode = wait_for_exit(process, log_path, EXIT_AFTER_WORKER_DEATH_S)
        seconds_to_exit = time.monotonic() - killed_at
        leftovers = leftover_processes(process.pid, SESSION_EXIT_TIMEOUT_S)
    finally:
        kill_session(process)
    return returncode, seconds_to_exit, read_log(log_path), leftovers


@trainer_e2e(seconds=70)
def test_dying_worker_stops_the_run_with_a_message_naming_its_rank(tmp_path, tiny_vl_path, shapes_data_dir):
    """SIGKILL of rank 1's process mid-run: the trainer exits 1 within a bounded time, naming the rank."""
    rank1 = re.compile(r"\(model_rank1 pid=(\d+)\)")

    def rank1_process(process: subprocess.Popen, log_path: Path) -> psutil.Process:
        wait_until(
            lambda: rank1.search(read_log(log_path)) is not None, process, log_path, "line of rank 1", 30
        )
        rank1_pid = int(rank1.search(read_log(log_path)).group(1))
        worker = psutil.Process(rank1_pid)
        assert os.getsid(rank1_pid) == process.pid and worker.name().startswith("ray::")
        return worker

    returncode, seconds_to_exit, output, leftovers = kill_a_process_of_an_endless_run(
        tmp_path, tiny_vl_path, shapes_data_dir, "run_worker_dies", rank1_process
    )
    print(f"rank 1 killed: the trainer exited {seconds_to_exit:.1f} s later")
    assert returncode == 1, output[-4000:]
    assert seconds_to_exit < EXIT_AFTER_WORKER_DEATH_S
    assert "mmrl: training stopped: model_rank1 (rank 1 of 2) lost its process" in output, output[-4000:]
    assert leftovers == [], f"processes still running after the trainer exited: {leftovers}"


@trainer_e2e
def test_raising_reward_function_stops_the_run_naming_file_function_and_sample(
    tmp_path, tiny_vl_path, shapes_data_dir
):
    """The reward raises on the answer of train row 2; unshuffled, the first batch holds rows 0-3 and
    response i belongs to prompt i // n, so the first failing sample is n x (first row with that answer)."""
    first_batch = first_batch_answers(shapes_data_dir)
    fail_on = first_batch[2]
    first_failing_sample = first_batch.index(fail_on) * RESPONSES_PER_PROMPT
    save_dir = tmp_path / "run_raising_reward"
    overrides = trainer_overrides(tiny_vl_path, shapes_data_dir, save_dir) + [
        f"worker.reward.reward_function={RAISING_REWARD}",
        f"worker.reward.reward_function_kwargs.fail_on_answer={fail_on}",
        "data.shuffle=false",
        "trainer.val_before_train=false",
        ONE_TRAINING_RANK,
        "trainer.logger=[console,jsonl,wandb]",
    ]
    config_file = write_config(tmp_path / "run_raising_reward.yaml", overrides)
    env = {**offline_tracker_env(tmp_path / "tracker_home_raising"), "RAY_DEDUP_LOGS": "1"}
    run = run_trainer(config_file, save_dir, tmp_path / "run_raising_reward.log", env=env)

    assert run.returncode == 1, run.output[-4000:]
    assert wandb_offline_exit_code(save_dir / "logs") == 1  # the W&B app shows the run as Failed
    # mmrl's message is the last thing the run prints: no Ray line after it
    stopped_at = run.output.index("mmrl: training stopped:")
    assert ray_lines(run.output[stopped_at:]) == [], run.output[stopped_at:]
    batch_responses = ROLLOUT_BATCH_SIZE * RESPONSES_PER_PROMPT
    expected = (
        f"mmrl: training stopped: Reward function `compute_score` from {ASSETS / 'raising_reward.py'} "
        f"(reward 'raising', sequential) raised ValueError on sample {first_failing_sample} of {batch_responses}: "
        f"refusing to score a sample whose answer is {fail_on!r}"
    )
    assert expected in run.output, run.output[-4000:]
    assert f'File "{ASSETS / "raising_reward.py"}", line' in run.output  # the user's failing line
    assert metrics_lines(save_dir) == []  # it failed in the first step


def first_batch_answers(shapes_data_dir: Path) -> list[str]:
    """Ground truths of the first step's prompts when unshuffled (train rows 0-3); response i belongs to
    prompt i // n."""
    lines = (shapes_data_dir / "train.jsonl").read_text().splitlines()[:ROLLOUT_BATCH_SIZE]
    return [json.loads(line)["answer"] for line in lines]


@trainer_e2e
def test_hanging_reward_function_stops_the_run_at_the_timeout_naming_the_sample(
    tmp_path, tiny_vl_path, shapes_data_dir
):
    """The reward never returns on the answer of train row 2: the run exits 1 soon after
    worker.reward.timeout_s, naming the reward file, function and the sample being scored, and the
    hung reward process is gone."""
    answers = first_batch_answers(shapes_data_dir)
    hang_on = answers[2]
    hung_sample = answers.index(hang_on) * RESPONSES_PER_PROMPT
    save_dir = tmp_path / "run_hanging_reward"
    overrides = trainer_overrides(tiny_vl_path, shapes_data_dir, save_dir) + [
        f"worker.reward.reward_function={HANGING_REWARD}",
        f"worker.reward.reward_function_kwargs.hang_on_answer={hang_on}",
        f"worker.reward.reward_function_kwargs.hang_marker={tmp_path / 'reward_hangs'}",
        f"worker.reward.timeout_s={REWARD_TIMEOUT_S}",
        "data.shuffle=false",
        "trainer.val_before_train=false",
        ONE_TRAINING_RANK,
    ]
    config_file = write_config(tmp_path / "run_hanging_reward.yaml", overrides)
    process = start_trainer(config_file, tmp_path / "run_hanging_reward.log")
    try:
        returncode = wait_for_exit(process, tmp_path / "run_hanging_reward.log", RUN_TIMEOUT_S)
        seconds_to_exit = time.time() - (tmp_path / "reward_hangs").stat().st_mtime
        leftovers = leftover_processes(process.pid, SESSION_EXIT_TIMEOUT_S)
    finally:
        kill_session(process)
    run = TrainerRun(returncode, read_log(tmp_path / "run_hanging_reward.log"), save_dir, leftovers)
    print(f"hanging reward: the trainer exited {seconds_to_exit:.1f} s after the hang began")

    assert run.returncode == 1, run.output[-4000:]
    batch_responses = ROLLOUT_BATCH_SIZE * RESPONSES_PER_PROMPT
    expected = (
        f"mmrl: training stopped: reward scoring did not finish within "
        f"worker.reward.timeout_s={REWARD_TIMEOUT_S:g} s; the reward workers were stopped."
    )
    assert expected in run.output, run.output[-4000:]
    assert (
        f"reward worker 0 of 1: `compute_score` from {ASSETS / 'hanging_reward.py'} "
        f"(reward 'hanging', sequential) was scoring sample {hung_sample} of {batch_responses}: "
    ) in run.output, run.output[-4000:]
    assert f"'ground_truth': '{hang_on}'" in run.output
    assert run.leftovers == [], f"processes still running after the trainer exited: {run.leftovers}"
    assert seconds_to_exit < REWARD_TIMEOUT_S + EXIT_AFTER_WORKER_DEATH_S


@trainer_e2e
def test_dying_reward_worker_stops_the_run_with_a_message_naming_it(tmp_path, tiny_vl_path, shapes_data_dir):
    """SIGKILL of the reward actor's process between steps: the next step's scoring fails, and the
    trainer exits 1 within seconds naming the reward worker."""

    def reward_scorer(process: subprocess.Popen, log_path: Path) -> psutil.Process:
        scorers = [p for p in session_processes(process.pid) if name_of(p).startswith("ray::RewardScorer")]
        assert len(scorers) == 1, [name_of(p) for p in session_processes(process.pid)]
        return scorers[0]

    returncode, seconds_to_exit, output, leftovers = kill_a_process_of_an_endless_run(
        tmp_path,
        tiny_vl_path,
        shapes_data_dir,
        "run_reward_worker_dies",
        reward_scorer,
        extra=[ONE_TRAINING_RANK],
    )
    print(f"reward worker killed: the trainer exited {seconds_to_exit:.1f} s later")
    assert returncode == 1, output[-4000:]
    assert seconds_to_exit < EXIT_AFTER_WORKER_DEATH_S
    assert "mmrl: training stopped: reward worker 0 of 1 (RewardScorer) died while scoring" in output, output[
        -4000:
    ]
    assert leftovers == [], f"processes still running after the trainer exited: {leftovers}"


def folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


@trainer_e2e
def test_full_disk_at_save_time_stops_the_run_with_the_last_checkpoint_intact(run_a, e2e_dir):
    """The checkpoint folder is a tmpfs with room for one checkpoint and a half (run A's step-2 folder
    measures one): step 1 saves, step 2 hits a real ENOSPC. The run exits 1 naming the folder, the OS
    error and the intact step-1 checkpoint, which find-last then picks."""
    from _faults import small_tmpfs

    assert_succeeded(run_a)
    one_checkpoint = folder_bytes(run_a.save_dir / "global_step_2")
    with small_tmpfs(e2e_dir / "small_disk", int(one_checkpoint * 1.5)) as save_dir:
        overrides = [
            f"config={e2e_dir / 'run_a.yaml'}",
            f"trainer.save_checkpoint_path={save_dir}",
            "trainer.max_steps=2",
            "trainer.save_freq=1",
            "trainer.val_before_train=false",
            "trainer.val_freq=0",
            "trainer.logger=[jsonl]",  # run A's trackers are read back elsewhere
        ]
        config_file = write_config(e2e_dir / "run_full_disk.yaml", overrides)
        run = run_trainer(config_file, save_dir, e2e_dir / "run_full_disk.log")
        assert run.returncode == 1, run.output[-4000:]
        expected = (
            f"mmrl: training stopped: could not write the checkpoint of step 2 under "
            f"trainer.save_checkpoint_path={save_dir}: "
        )
        assert expected in run.output, run.output[-4000:]
        assert "[Errno 28] No space left on device" in run.output
        assert f"The last complete checkpoint ({save_dir / 'global_step_1'}) is intact." in run.output
        assert latest_committed_step(save_dir) == 1
        assert find_last_checkpoint(save_dir) == save_dir / "global_step_1"
        assert run.leftovers == [], f"processes still running after the trainer exited: {run.leftovers}"


def test_invalid_config_exits_2_naming_the_key(tmp_path, tiny_vl_path, shapes_data_dir):
    overrides = trainer_overrides(tiny_vl_path, shapes_data_dir, tmp_path / "run")
    bad = "worker.actor.micro_batch_size_per_device_for_update=3"
    result = warm.run(
        [sys.executable, "-m", "mmrl.trainer.main", *overrides, bad],
        cwd=REPO_ROOT,
        env=trainer_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "worker.actor.micro_batch_size_per_device_for_update=3" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # nothing started


@trainer_e2e
def test_on_policy_update_without_the_old_log_prob_pass_reproduces_it(
    run_a, e2e_dir, tiny_vl_path, shapes_data_dir
):
    """Run A trains on-policy (one optimizer step per rollout, the KL as a loss), so its steps skip the
    old-log-prob pass and the update supplies those log-probs. Its config with the separate pass (same
    seeds, so the same rollouts; no validation or checkpoints, which change no training number) gives
    the same numbers at every step: losses, gradient norms, entropies and the rollout/trainer log-prob
    gap."""
    assert_succeeded(run_a)
    save_dir = e2e_dir / "run_separate_old_log_prob"
    overrides = trainer_overrides(tiny_vl_path, shapes_data_dir, save_dir) + [
        "worker.actor.skip_old_log_prob_on_policy=false",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "trainer.save_freq=-1",
    ]
    config_file = write_config(e2e_dir / "run_separate_old_log_prob.yaml", overrides)
    assert_succeeded(run_trainer(config_file, save_dir, e2e_dir / "run_separate_old_log_prob.log"))
    skipping = [row for row in metrics_lines(run_a.save_dir) if "actor/grad_norm" in row]
    separate = [row for row in metrics_lines(save_dir) if "actor/grad_norm" in row]
    assert [row["step"] for row in skipping] == [row["step"] for row in separate] == [1, 2, 3, 4]
    for skipped, passed in zip(skipping, separate):
        assert "timing_s/old_log_prob" in passed and "timing_s/old_log_prob" not in skipped
        for key in (
            "actor/pg_loss",
            "actor/kl_loss",
            "actor/grad_norm",
            "actor/entropy",
            "actor/entropy_rollout",
            "rollout/log_prob_gap_mean",
            "rollout/log_prob_gap_max",
            "critic/score/mean",
        ):
            assert skipped[key] == pytest.approx(passed[key], rel=1e-4, abs=1e-6), key
        assert skipped["rollout/log_prob_gap_max"] < 1e-5


@dataclass
class GaeHubRun:
    """A 2-step GAE run whose model path is a hub id read offline from a local cache, with one critic
    warm-up step, saved at step 2 (``rows``: its metrics lines)."""

    snapshot: Path  # the cache's snapshot folder of the hub id
    env: dict[str, str]  # the offline cache's environment
    overrides: list[str]
    save_dir: Path
    rows: list[dict]


@pytest.fixture(scope="module")
def gae_hub_run(tiny_vl_path, shapes_data_dir, tmp_path_factory) -> GaeHubRun:
    """Shared by the warm-up test (the step plan) and the hub-id test (save, resume, merge)."""
    from _models import build_hub_cache
    from _trainer_run import run_main

    root = tmp_path_factory.mktemp("gae_hub")
    hub_cache = root / "hub"
    snapshot = build_hub_cache(tiny_vl_path, hub_cache, "mmrl-tests/tiny-vl")
    env = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    save_dir = root / "run"
    overrides = gae_overrides("mmrl-tests/tiny-vl", shapes_data_dir, save_dir) + ["trainer.critic_warmup=1"]
    return GaeHubRun(snapshot, env, overrides, save_dir, run_main(overrides, save_dir, env=env))


@trainer_e2e
def test_gae_with_critic_warmup_follows_the_step_plan(gae_hub_run):
    """GAE with one warm-up step: step 1 trains the critic only (the old log-probs come from their own
    pass, no weight push), step 2 trains both, the actor on-policy, and pushes its weights; step 2's
    generation first pushes the unchanged ones the warm-up's phases freed."""
    warmup, trained = [row for row in gae_hub_run.rows if "critic/vf_loss" in row]
    for step in (warmup, trained):
        assert {"timing_s/values", "timing_s/update_critic", "critic/values/mean"} <= set(step)
    assert "actor/pg_loss" not in warmup and "timing_s/sync" not in warmup
    assert "timing_s/old_log_prob" in warmup  # no actor update yet to supply them
    assert "actor/pg_loss" in trained and "timing_s/sync" in trained
    assert "timing_s/old_log_prob" not in trained  # on-policy: the update computes them
    # the warm-up step's critic phases freed the rollout's weights and no update pushed new ones: step
    # 2's generation pushes them itself (step 1's had the constructor's push)
    assert warmup["rollout/weight_pushes_before_generate"] == 0
    assert trained["rollout/weight_pushes_before_generate"] == 1


def training_processes() -> int:
    """Live Ray actors hosting a training rank, from Ray's actor table (the state API needs the dashboard,
    which the trainer leaves off)."""
    from ray._private.state import actors

    return sum(
        actor["ActorClassName"].endswith("_WorkerHost") and actor["State"] == "ALIVE"
        for actor in actors().values()
    )


def gae_overrides(model_path, data_dir, save_dir) -> list[str]:
    """small_run_overrides with GAE: a critic on the actor's model, no reference."""
    from _trainer_run import small_run_overrides

    return small_run_overrides(model_path, data_dir, save_dir) + [
        "algorithm.adv_estimator=gae",
        "algorithm.disable_kl=true",
        "worker.critic.global_batch_size=4",
        "worker.critic.model.enable_gradient_checkpointing=false",
        "worker.rollout.name=hf",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
    ]


@trainer_e2e
def test_gae_critic_shares_the_actors_processes_and_learns(tiny_vl_path, shapes_data_dir, tmp_path):
    """The critic lives in the 2 training processes: Ray holds 2 bundles (not 4) and 2 worker actors, and
    starts no idle workers beside them;
    and an 8-step GAE run on the dense fingerprint reward raises the reward clearly above its start.
    The trainer runs in this process, on a real local Ray cluster, so Ray's own tables can be read."""
    import ray

    from mmrl.single_controller import init_ray
    from mmrl.trainer.ray_trainer import RayPPOTrainer, local_cluster_cpus

    steps = 8
    config = load_config(
        gae_overrides(tiny_vl_path, shapes_data_dir, tmp_path / "gae") + [f"trainer.max_steps={steps}"]
    )
    # a CPU per training process, the reward worker's, one spare: no second set of processes for a critic
    assert local_cluster_cpus(config) == max(os.cpu_count() or 1, WORLD_SIZE + 1 + 1)
    assert not ray.is_initialized(), "this test starts its own Ray cluster"
    init_ray(num_cpus=local_cluster_cpus(config), object_store_memory_bytes=300_000_000)
    trainer = None
    try:
        trainer = RayPPOTrainer(config)
        placed = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        assert [len(group["bundles"]) for group in placed] == [WORLD_SIZE]  # one node group of 2 bundles
        assert trainer.model_workers.world_size == WORLD_SIZE
        assert training_processes() == WORLD_SIZE
        # and no idle Python worker that Ray would have started for plain tasks (mmrl runs none)
        idle = [p for p in psutil.Process().children(recursive=True) if "ray::IDLE" in command_of(p)]
        assert idle == [], idle
        trainer.fit()
    finally:
        if trainer is not None:
            trainer.shutdown()
            trainer.model_workers.shutdown()
        ray.shutdown()
    rows = metrics_lines(tmp_path / "gae")
    scores = [row["critic/score/mean"] for row in rows]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert all("critic/vf_loss" in row and "actor/pg_loss" in row for row in rows)
    assert sum(scores[-2:]) / 2 > sum(scores[:2]) / 2 + 0.2, scores
    assert (tmp_path / "gae" / f"global_step_{steps}" / "critic" / "model" / ".metadata").is_file()


@trainer_e2e
def test_hub_id_model_path_saves_resumes_and_merges(gae_hub_run, tmp_path):
    """worker.actor.model.model_path is a hub id, read offline from a local Hugging Face cache (the
    layout snapshot_download leaves): a GAE run (the warm-up test's) saves actor and critic at step 2, a
    second run resumes them and trains step 3, and the merged step-3 actor holds exactly the trained
    weights."""
    from _trainer_run import run_main
    from transformers import AutoModelForImageTextToText

    from mmrl.checkpoint.merger import load_full_state_dict

    snapshot, env, save_dir = gae_hub_run.snapshot, gae_hub_run.env, gae_hub_run.save_dir
    step_2 = save_dir / "global_step_2"
    assert (step_2 / "actor" / "huggingface" / "config.json").read_text() == (
        snapshot / "config.json"
    ).read_text()
    assert (step_2 / "critic" / "model" / ".metadata").is_file()

    rows = run_main([*gae_hub_run.overrides, "trainer.max_steps=3"], save_dir, env=env)
    assert [row["step"] for row in rows] == [1, 2, 3]  # resumed after step 2
    actor_dir = save_dir / "global_step_3" / "actor"
    merge_checkpoint(actor_dir, tmp_path / "merged", env=env)
    merged = AutoModelForImageTextToText.from_pretrained(
        tmp_path / "merged", dtype=torch.float32
    ).state_dict()
    trained = load_full_state_dict(actor_dir / "model")
    initial = AutoModelForImageTextToText.from_pretrained(snapshot, dtype=torch.float32).state_dict()
    assert trained.keys() <= merged.keys()
    assert all(torch.equal(merged[key], trained[key]) for key in trained)
    assert any(not torch.equal(initial[key], trained[key]) for key in trained)


@trainer_e2e(seconds=95)
def test_online_filtering_fills_steps_with_useful_groups_and_resumes_exactly(
    tiny_vl_path, shapes_data_dir, tmp_path
):
    """DAPO dynamic sampling on a coarse 0/1 reward (about a third of the groups score all 0): 2 prompts a
    round until 4 useful groups are kept. Every update trains on exactly 4 groups, none of them with
    zero advantage; the dropped and kept groups add up to those generated. The live trainer then
    gives up after trainer.max_try_make_batch rounds when no group can pass, or with
    algorithm.unfilled_step=train trains on groups it dropped. A second trainer resumed
    from step 2 repeats step 3 exactly: the loader's position counts rounds, not steps (and the
    learning rate's scale of worker.actor.kl_step_control is restored). Every third prompt is longer, so
    rounds (loader batches of their own) pad their prompts to different widths, which a step joins."""
    import ray
    from _trainer_run import small_run_overrides, with_longer_prompts

    from mmrl.single_controller import init_ray
    from mmrl.trainer.dynamic_sampling import DynamicSamplingError, FilterOptions
    from mmrl.trainer.ray_trainer import RayPPOTrainer, build_filter, local_cluster_cpus

    data_dir = with_longer_prompts(shapes_data_dir, tmp_path / "data")

    def overrides(save_dir: Path, *extra: str) -> list[str]:
        return small_run_overrides(tiny_vl_path, data_dir, save_dir) + [
            f"worker.reward.reward_function={ASSETS / 'coarse_reward.py'}:compute_score",
            "worker.rollout.name=hf",
            "algorithm.online_filtering=true",
            "data.mini_rollout_batch_size=2",
            "trainer.max_try_make_batch=10",
            "trainer.max_steps=3",
            "trainer.save_freq=2",
            "trainer.val_before_train=false",
            "trainer.val_freq=-1",
            # the collapse gate opens on a second step in a row with any all-equal group: the recovery
            # term reaches the workers' loss, and its state is part of what a resume restores
            "worker.actor.collapse_recovery.enabled=true",
            "worker.actor.collapse_recovery.all_equal_share=0.01",
            "worker.actor.collapse_recovery.patience=2",
            # two optimizer steps a step; the second sees how far the first moved the policy: above
            # twice this tiny target every step, so each step's learning rate is 1 / 1.5 of the last's
            "worker.actor.global_batch_size=2",
            "worker.actor.kl_step_control.enabled=true",
            "worker.actor.kl_step_control.target_kl=1e-6",
            *extra,
        ]

    # no group can have a mean score in [2, 2]: a step gives up after max_rounds rounds
    hopeless = build_filter(load_config(overrides(tmp_path / "c", "algorithm.unfilled_step=stop")))
    hopeless = dataclasses.replace(hopeless, low=2.0, high=2.0, max_rounds=2)
    assert hopeless == FilterOptions("overall", 2.0, 2.0, groups_per_step=4, max_rounds=2, groups_per_round=2)
    resume = f"trainer.load_checkpoint_path={tmp_path / 'a' / 'global_step_2'}"
    config = load_config(overrides(tmp_path / "a"))
    init_ray(num_cpus=local_cluster_cpus(config), object_store_memory_bytes=300_000_000)
    try:
        for run_config in (config, None):  # the resumed run's config is valid once step 2 is saved
            trainer = RayPPOTrainer(run_config or load_config(overrides(tmp_path / "b", resume)))
            try:
                trainer.fit()
                if run_config is config:
                    with pytest.raises(
                        DynamicSamplingError, match=r"in 2 rounds \(trainer.max_try_make_batch=2\)"
                    ):
                        trainer._filtered_rollout(trainer._training_batches(), hopeless, trainer.global_step)
                    # algorithm.unfilled_step=train: the step trains on the groups it dropped instead
                    top_up = build_filter(
                        load_config(overrides(tmp_path / "c", "algorithm.unfilled_step=train"))
                    )
                    top_up = dataclasses.replace(top_up, low=2.0, high=2.0, max_rounds=2)
                    batch, scores, metrics = trainer._filtered_rollout(
                        trainer._training_batches(), top_up, trainer.global_step
                    )
                    assert len(set(batch.non_tensor_batch["uid"])) == 4 and len(batch) == len(scores) == 16
                    assert (metrics["rollout/kept_groups"], metrics["rollout/unfilled_groups"]) == (0, 4)
                    assert (metrics["rollout/rounds"], metrics["rollout/dropped_groups"]) == (2, 4)
                    # every mean is below 2: each top-up group failed, and trains
                    assert metrics["rollout/left_out_groups"] == 0 and not batch.batch["left_out"].any()
                    # no mean is below -1: no top-up group failed, all are left out of the loss
                    passed = dataclasses.replace(top_up, low=-1.0, high=-1.0)
                    batch, _, metrics = trainer._filtered_rollout(
                        trainer._training_batches(), passed, trainer.global_step
                    )
                    assert metrics["rollout/left_out_groups"] == 4 and batch.batch["left_out"].all()
            finally:
                trainer.shutdown()
                trainer.model_workers.shutdown()
    finally:
        ray.shutdown()

    rows = metrics_by_step(metrics_lines(tmp_path / "a"))
    assert sorted(rows) == [1, 2, 3]
    streak = 0
    for step, row in rows.items():
        assert row["rollout/kept_groups"] == 4, step
        assert row["rollout/rounds"] >= 2, step  # 2 prompts a round, 4 groups a step
        generated = row["rollout/rounds"] * 2
        assert row["rollout/kept_groups"] + row["rollout/dropped_groups"] == generated, step
        assert row["rollout/generated_responses"] == generated * 4
        assert 0 < row["rollout/generated_response_tokens"] <= generated * 4 * 4
        assert row["rollout/zero_adv_group_frac"] == 0.0, step
        # the collapse signs count every round's groups: a 0/1 reward's dropped groups are its all-equal ones
        all_equal = row["rollout/dropped_groups"] - row["rollout/surplus_groups"]
        assert row["rollout/all_equal_group_frac"] == pytest.approx(all_equal / generated), step
        assert row["rollout/steps_since_mixed_group"] == 0  # every step kept mixed groups
        streak = streak + 1 if row["rollout/all_equal_group_frac"] >= 0.01 else 0
        assert row["actor/collapse_coeff"] == (0.05 if streak >= 2 else 0.0), step
        assert ("actor/collapse_spread" in row) == (streak >= 2), step
        assert 0.0 <= row["actor/saturated_token_frac"] <= 1.0
        assert row["actor/grad_norm"] > 0
        assert row["actor/ppo_kl_k3"] > 2e-6, step
        assert row["actor/lr_scale"] == pytest.approx(1.5 ** (1 - step)), step  # resumed: step 3's too
        assert row["actor/lr"] == pytest.approx(0.02 * row["actor/lr_scale"]), step
        # the rounds of a step share the last update's push; only the save of step 2 freed the weights
        assert row["rollout/weight_pushes_before_generate"] == (1.0 if step == 3 else 0.0), step
    assert sum(row["rollout/dropped_groups"] - row["rollout/surplus_groups"] for row in rows.values()) > 0
    assert any(row["actor/collapse_coeff"] > 0 for row in rows.values())
    state = json.loads((tmp_path / "a" / "global_step_2" / "trainer_state.json").read_text())
    rounds = rows[1]["rollout/rounds"] + rows[2]["rollout/rounds"]
    assert state["loader"] == {"epoch": 0, "batch_index": rounds}  # one mini-batch of the loader a round

    resumed_rows = metrics_by_step(metrics_lines(tmp_path / "b"))
    assert sorted(resumed_rows) == [3]
    assert deterministic_part(resumed_rows[3]) == deterministic_part(rows[3])
