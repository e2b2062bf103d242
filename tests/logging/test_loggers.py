"""Tests for mmrl.logging: console format and ETA (fake clock), jsonl files, and what tensorboard, wandb
(offline) and MLflow (file store) hold when read back with their own readers; the errors for trackers
that are not installed."""

from __future__ import annotations

import io
import json
import math
import os
import re
import sys
import time

import numpy as np
import psutil
import pytest
import torch
from _trackers import (
    markdown_rows,
    mlflow_run,
    mlflow_run_status,
    offline_tracker_env,
    tensorboard_run,
    wandb_offline_exit_code,
    wandb_offline_run,
)

from mmrl.config import LOGGERS
from mmrl.logging import LOGGER_NAMES, ConsoleLogger, Tracker, build_loggers
from mmrl.logging.console import format_duration, format_value
from mmrl.logging.loggers import flatten_config, generations_markdown

STEP_METRICS = {
    "reward/overall": 0.63,
    "response_length/mean": 7.2,
    "timing_s/step": 1.4237,
    "actor/lr": 1e-6,
}
SAMPLES = [
    {"prompt": "What is 2+2?", "response": "<think>2+2</think> 4", "ground_truth": "4", "score": 1.0},
    {"prompt": "Name | a colour", "response": "red\nor blue", "ground_truth": "blue", "score": 0.0},
]


class FakeClock:
    """Seconds that only move when the test says so."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def console(total_steps: int | None, clock: FakeClock, **kwargs) -> tuple[ConsoleLogger, io.StringIO]:
    stream = io.StringIO()
    return ConsoleLogger(total_steps, stream=stream, clock=clock, **kwargs), stream


# ------------------------------------------------------------------------------------------------ console


def test_number_and_duration_formats():
    assert [format_duration(s) for s in (0, 42.9, 184, 7500)] == ["0s", "42s", "3m04s", "2h05m"]
    assert format_value("timing_s/gen", 1.4237) == "1.42s"
    assert format_value("val/timing_s/gen", 2) == "2.00s"
    assert format_value("response_length/max", 512.0) == "512"
    assert format_value("throughput/tokens_per_s", 12345.6) == "12,346"
    assert format_value("reward/overall", 0.63) == "0.63"
    assert format_value("actor/lr", 1e-6) == "1e-06"
    assert format_value("actor/pg_loss", math.nan) == "nan"


def test_console_line_with_eta_from_the_fake_clock():
    clock = FakeClock(100.0)
    logger, stream = console(100, clock, full_every=0)
    clock.now = 124.0  # 12 steps in 24 s = 2 s/step; 88 steps left -> 176 s
    logger.log(STEP_METRICS, step=12)
    assert stream.getvalue() == (
        "step 12/100 [12%] ETA 2m56s | reward/overall 0.63 | response_length/mean 7.2 | timing_s/step 1.42s\n"
    )


def test_console_eta_of_a_resumed_run_uses_this_sessions_pace():
    clock = FakeClock(0.0)
    logger, stream = console(100, clock, start_step=50, full_every=0)
    logger.log({"val/reward/overall": 0.5}, step=50)  # validation before the first step: no pace yet
    clock.now = 30.0  # 10 steps in 30 s = 3 s/step; 40 left -> 120 s
    logger.log({"reward/overall": 1}, step=60)
    assert stream.getvalue().splitlines() == [
        "step 50/100 [50%] ETA -- | val/reward/overall 0.5",
        "step 60/100 [60%] ETA 2m00s | reward/overall 1",
    ]


def test_console_line_of_a_multi_stage_run_starts_with_the_stage():
    clock = FakeClock(0.0)
    logger, stream = console(5, clock, start_step=3, full_every=0, label="stage 2/2 16k")
    clock.now = 4.0
    logger.log({"reward/overall": 1}, step=4)
    assert stream.getvalue() == "stage 2/2 16k | step 4/5 [80%] ETA 4s | reward/overall 1\n"
    tracker = build_loggers(["console"], "proj", "exp", "unused", {}, total_steps=5, label="stage 1/2 8k")
    assert tracker.backends["console"].label == "stage 1/2 8k"


def test_console_full_dump_every_k_steps_and_when_no_known_key():
    clock = FakeClock()
    logger, stream = console(None, clock, full_every=10)
    logger.log(STEP_METRICS, step=3)
    assert stream.getvalue().splitlines() == [
        "step 3 | reward/overall 0.63 | response_length/mean 7.2 | timing_s/step 1.42s"
    ]
    stream.truncate(0), stream.seek(0)
    logger.log(STEP_METRICS, step=10)
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("step 10 | reward/overall 0.63")
    # sorted by key, grouped by the first name component
    assert lines[1:] == [
        "  actor/            lr 1e-06",
        "  response_length/  mean 7.2",
        "  reward/           overall 0.63",
        "  timing_s/         step 1.42s",
    ]
    stream.truncate(0), stream.seek(0)
    logger.log({"custom/thing": 2.5}, step=11)
    assert stream.getvalue().splitlines() == ["step 11", "  custom/           thing 2.5"]


def test_console_full_dump_wraps_long_groups():
    logger, stream = console(None, FakeClock(), full_every=1)
    logger.log({f"actor/metric_number_{i:02d}": 0.123 for i in range(12)}, step=1)
    dump = stream.getvalue().splitlines()[1:]
    assert len(dump) > 1 and all(len(line) <= 110 for line in dump)
    assert all(line.startswith(" " * 20) for line in dump[1:])
    assert sum(line.count("metric_number_") for line in dump) == 12


def test_console_generations_are_compact():
    logger, stream = console(10, FakeClock(), max_chars=30)
    long_prompt = "system: be helpful. " * 5 + "user: What is 2+2?"
    logger.log_generations([{**SAMPLES[0], "prompt": long_prompt}, SAMPLES[1]], step=4)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "validation generations at step 4 (2 samples)"
    assert lines[1] == "  [1/2] score 1 | ground truth: 4"
    # 30 chars: the first 10, "...", the last 17 (the question sits at the end of a chat prompt)
    assert lines[2] == "      prompt:   system: be...ser: What is 2+2?"
    assert lines[6] == "      response: red\\nor blue"


def test_console_finish_reports_elapsed_time():
    clock = FakeClock(0.0)
    logger, stream = console(5, clock)
    clock.now = 65.0
    logger.log({"reward/overall": 1.0}, step=5)
    logger.finish()
    assert stream.getvalue().splitlines()[-1] == "finished at step 5 after 1m05s"
    logger.finish(failed=True)
    assert stream.getvalue().splitlines()[-1] == "stopped by an error at step 5 after 1m05s"


def test_console_through_build_loggers_writes_stdout(capsys, tmp_path):
    tracker = build_loggers(["console"], "proj", "exp", str(tmp_path / "logs"), {}, total_steps=4)
    tracker.log({"reward/overall": torch.tensor(0.25), "response_length/mean": np.float32(3.0)}, step=1)
    out = capsys.readouterr().out
    assert re.fullmatch(r"step 1/4 \[25%\] ETA \d+s \| reward/overall 0.25 \| response_length/mean 3\n", out)
    assert not (tmp_path / "logs").exists()  # console alone writes no files


# ------------------------------------------------------------------------------------------------ files


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file]


def test_jsonl_lines_are_on_disk_before_finish(tmp_path):
    tracker = build_loggers(["jsonl"], "proj", "exp", str(tmp_path), {"a": 1}, total_steps=10)
    tracker.log({"reward/overall": 0.5, "actor/pg_loss": torch.tensor(-0.25)}, step=1)
    tracker.log({"reward/overall": 0.75, "actor/pg_loss": math.nan}, step=2)
    tracker.log_generations([{**SAMPLES[0], "score": np.float32(1.0)}, SAMPLES[1]], step=2)
    # read while the files are still open: a killed run keeps every line written so far
    assert read_jsonl(tmp_path / "metrics.jsonl") == [
        {"step": 1, "reward/overall": 0.5, "actor/pg_loss": -0.25},
        {"step": 2, "reward/overall": 0.75, "actor/pg_loss": None},  # NaN -> null (strict JSON)
    ]
    assert read_jsonl(tmp_path / "generations.jsonl") == [
        {"step": 2, **SAMPLES[0]},
        {"step": 2, **SAMPLES[1]},
    ]
    tracker.finish()
    tracker.finish()  # idempotent

    resumed = build_loggers(["jsonl"], "proj", "exp", str(tmp_path), {}, total_steps=10)
    resumed.log({"reward/overall": 1.0}, step=3)
    resumed.finish()
    assert [record["step"] for record in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]


# the rows every tracker must hold for SAMPLES, in GENERATION_COLUMNS order
SAMPLE_ROWS = [[sample[col] for col in ("prompt", "response", "ground_truth", "score")] for sample in SAMPLES]


def log_two_steps(tracker: Tracker) -> None:
    """Steps 1 and 2 of known metrics (a NaN at step 2), the generations at step 2."""
    tracker.log({"critic/score/mean": torch.tensor(0.5), "timing_s/step": 2.0}, step=1)
    tracker.log(
        {"critic/score/mean": 0.75, "timing_s/step": np.float32(1.5), "actor/pg_loss": math.nan}, step=2
    )
    tracker.log_generations([{**SAMPLES[0], "score": np.float32(1.0)}, SAMPLES[1]], step=2)


@pytest.fixture
def offline_trackers(tmp_path, monkeypatch):
    """wandb offline and MLflow's files confined to tmp_path; no process of theirs outlives the test."""
    for key, value in offline_tracker_env(tmp_path / "home").items():
        monkeypatch.setenv(key, value)
    # mlflow.set_tracking_uri also writes MLFLOW_TRACKING_URI into os.environ; set through monkeypatch
    # (empty = unset for MlflowLogger), it is removed after the test instead of leading every later
    # trainer subprocess of the session into this test's file store
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")
    children_before = {child.pid for child in psutil.Process().children(recursive=True)}
    yield tmp_path / "logs"
    deadline = time.monotonic() + 10
    while (new := _new_children(children_before)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not new, f"processes left by the trackers: {new}"


def _new_children(before: set[int]) -> list[str]:
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.pid not in before and child.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{child.pid} {child.name()}")
        except psutil.Error:
            continue
    return found


def test_tensorboard_events_are_readable(tmp_path):
    tracker = build_loggers(["tensorboard"], "proj", "exp", str(tmp_path), {"trainer": {"seed": 1}}, 10)
    log_two_steps(tracker)
    # before finish: every log call flushes
    scalars, tables = tensorboard_run(tmp_path)
    assert scalars["critic/score/mean"] == {1: 0.5, 2: 0.75}
    assert scalars["timing_s/step"] == {1: 2.0, 2: 1.5}
    assert list(scalars["actor/pg_loss"]) == [2] and math.isnan(scalars["actor/pg_loss"][2])
    assert list(tables) == [2]
    assert markdown_rows(tables[2]) == [
        ["What is 2+2?", "<think>2+2</think> 4", "4", "1.0"],
        ["Name | a colour", "red<br>or blue", "blue", "0.0"],
    ]
    tracker.finish()


def test_wandb_offline_run_holds_the_metrics_and_generations(offline_trackers, monkeypatch):
    log_dir = offline_trackers
    monkeypatch.chdir(log_dir.parent)  # anything written relative to the working directory shows up
    tracker = build_loggers(["wandb"], "proj", "exp", str(log_dir), {"trainer": {"seed": 1}}, 10)
    log_two_steps(tracker)
    # a ground truth that is a list after a string one: wandb.Table alone would raise a TypeError
    tracker.log_generations([SAMPLES[0], {**SAMPLES[1], "ground_truth": ["red", "blue"]}], step=3)
    tracker.finish()

    history, tables = wandb_offline_run(log_dir)
    assert history["critic/score/mean"] == {1: 0.5, 2: 0.75}
    assert history["timing_s/step"] == {1: 2.0, 2: 1.5}
    assert list(history["actor/pg_loss"]) == [2] and math.isnan(history["actor/pg_loss"][2])
    assert list(tables) == [2, 3]
    assert tables[2]["columns"] == ["prompt", "response", "ground_truth", "score"]
    assert tables[2]["data"] == SAMPLE_ROWS
    assert [row[2] for row in tables[3]["data"]] == ["4", "['red', 'blue']"]
    assert {path.name for path in log_dir.parent.iterdir()} <= {"home", "logs"}  # nothing in the cwd
    assert not (log_dir / "tensorboard").exists() and not (log_dir / "mlruns").exists()


@pytest.mark.parametrize("failed", [False, True])
def test_a_failed_run_is_marked_failed_in_wandb_and_mlflow(offline_trackers, monkeypatch, failed):
    """wandb's run ends with exit code 1 (the W&B app shows it as Failed), MLflow's with status FAILED."""
    log_dir = offline_trackers
    monkeypatch.chdir(log_dir.parent)
    tracker = build_loggers(["wandb", "mlflow"], "proj", "exp", str(log_dir), {}, 10)
    tracker.log({"reward/overall": 0.5}, step=1)
    tracker.finish(failed=failed)
    assert wandb_offline_exit_code(log_dir) == (1 if failed else 0)
    assert mlflow_run_status(log_dir) == ("FAILED" if failed else "FINISHED")


def test_mlflow_file_store_holds_the_metrics_params_and_generations(offline_trackers, monkeypatch):
    log_dir = offline_trackers
    monkeypatch.chdir(log_dir.parent)  # MLflow's own default would be ./mlflow.db here
    config = {"trainer": {"seed": 1, "logger": ["mlflow"]}, "worker": {"actor": {"lr": 1e-6}}}
    tracker = build_loggers(["mlflow"], "proj", "exp", str(log_dir), config, 10)
    log_two_steps(tracker)
    tracker.finish()

    params, metrics, tables = mlflow_run(log_dir)
    assert params == {"trainer.seed": "1", "trainer.logger": "['mlflow']", "worker.actor.lr": "1e-06"}
    assert metrics["critic/score/mean"] == {1: 0.5, 2: 0.75}
    assert metrics["timing_s/step"] == {1: 2.0, 2: 1.5}
    assert list(metrics["actor/pg_loss"]) == [2] and math.isnan(metrics["actor/pg_loss"][2])
    assert tables == {2: {"columns": ["prompt", "response", "ground_truth", "score"], "data": SAMPLE_ROWS}}
    assert {path.name for path in log_dir.parent.iterdir()} <= {"home", "logs"}  # nothing in the cwd
    assert sorted(path.name for path in log_dir.iterdir()) == ["mlruns"]


def test_generations_markdown_escapes_cells():
    assert generations_markdown(SAMPLES[1:]) == (
        "| prompt | response | ground_truth | score |\n"
        "|---|---|---|---|\n"
        "| Name \\| a colour | red<br>or blue | blue | 0.0 |"
    )


# ---------------------------------------------------------------------------------------- selection, errors


@pytest.mark.parametrize("name", ["wandb", "mlflow", "swanlab"])
def test_missing_tracker_package_names_the_pip_package(name, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, name, None)  # makes `import name` fail as if not installed
    with pytest.raises(ImportError, match=rf"pip install {name}`.*remove '{name}' from trainer.logger"):
        build_loggers(["jsonl", name], "proj", "exp", str(tmp_path / "logs"), {}, total_steps=10)
    # checked before any backend starts: the jsonl backend created no files
    assert not os.path.exists(tmp_path / "logs")


def test_unknown_logger_lists_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"unknown loggers \['tensorbord'\]; choose from \['console'"):
        build_loggers(["console", "tensorbord"], "proj", "exp", str(tmp_path), {}, total_steps=10)


def test_logger_names_match_the_config_choices():
    assert LOGGER_NAMES == LOGGERS


def test_tracker_rejects_non_scalar_metrics_by_name():
    tracker = Tracker({})
    with pytest.raises(ValueError, match="'actor/entropy' is a tensor of shape \\(3,\\)"):
        tracker.log({"actor/entropy": torch.ones(3)}, step=1)
    with pytest.raises(TypeError, match="'data/source' must be a number, got str"):
        tracker.log({"data/source": "gsm8k"}, step=1)


def test_tracker_finishes_every_backend_even_if_one_fails(tmp_path):
    class Failing:
        def log(self, metrics, step): ...

        def log_generations(self, samples, step): ...

        def finish(self, failed=False):
            raise OSError("disk full")

    tracker = build_loggers(["jsonl"], "proj", "exp", str(tmp_path), {}, total_steps=1)
    jsonl = tracker.backends["jsonl"]
    tracker.backends = {"failing": Failing(), "jsonl": jsonl}
    with pytest.raises(RuntimeError, match="Logger 'failing' failed to finish: disk full"):
        tracker.finish()
    assert jsonl._metrics_file.closed


def test_flatten_config():
    config = {"worker": {"actor": {"lr": 1e-6}, "rollout": {"n": 5}}, "trainer": {"logger": ["console"]}}
    assert flatten_config(config) == {
        "worker.actor.lr": 1e-6,
        "worker.rollout.n": 5,
        "trainer.logger": ["console"],
    }
