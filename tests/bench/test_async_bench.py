"""bench/async.py: step records become seconds per step and idle shares, and phase times a prediction."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH_DIR))  # bench/ holds scripts, not a package (async.py imports harness)
# "async" is a keyword: the script is loaded from its file
_SPEC = importlib.util.spec_from_file_location("async_bench", BENCH_DIR / "async.py")
async_bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(async_bench)


def test_idle_shares_of_a_one_step_off_run_by_hand():
    rows = [
        {"step": 1, "timing_s/step": 9.0, "timing_s/gen": 4.0},  # the warm-up step, left out
        # the trainer waited 0.1 + 0.4 s of 2 s; the rollout worker generated 1.5 s of them
        {"step": 2, "timing_s/step": 2.0, "timing_s/gen": 0.1, "timing_s/gen_wait": 0.4,
         "timing_s/gen_ahead": 1.5, "timing_s/sync": 0.2, "transfer/weight_push_bytes": 1024.0},
    ]  # fmt: skip
    summary = async_bench.summarize(rows, warmup=1, responses_per_step=16)
    assert summary["s_per_step"] == 2.0 and summary["samples_per_s"] == 8.0
    assert summary["trainer_idle"] == pytest.approx(0.25)
    assert summary["rollout_idle"] == pytest.approx(0.25)
    assert summary["rest_s"] == pytest.approx(2.0 - 0.1 - 0.2) and summary["push_bytes"] == 1024.0


def test_cost_model_by_hand():
    # G = 8 s of generation, T = 4 s of the rest on one device, P = 0.5 s of push, S = 0.5 s of copy:
    # colocated on 8: 12 / 8 + 0.5 = 2; 4/4: max(2, 1) + 0.5 = 2.5; 6/2: max(8/6, 2) + 0.5 = 2.5
    predictions = async_bench.cost_model({"gen_s": 8.0, "rest_s": 4.0, "push_s": 0.5}, colocated_sync_s=0.5)
    assert [(p["split"], p["colocated_s"], p["one_step_off_s"]) for p in predictions] == [
        ("4/4", 2.0, 2.5),
        ("6/2", 2.0, 2.5),
    ]
    assert predictions[0]["speedup"] == pytest.approx(0.8)


def test_a_streamed_runs_summary_by_hand():
    # streaming: the rollout worker's idle share is not known to the driver (n/a); staleness is a median
    # over the measured steps, partial responses a mean, dropped groups a sum
    rows = [
        {"step": 1, "timing_s/step": 9.0, "timing_s/gen": 4.0},  # the warm-up step, left out
        {"step": 2, "timing_s/step": 2.0, "timing_s/gen": 0.5, "rollout/stream_outstanding_groups": 4,
         "rollout/staleness_mean": 0.5, "rollout/staleness_max": 1.0, "rollout/partial_response_frac": 0.25,
         "rollout/stream_dropped_groups": 1.0},
        {"step": 3, "timing_s/step": 2.0, "timing_s/gen": 0.5, "rollout/stream_outstanding_groups": 4,
         "rollout/staleness_mean": 1.5, "rollout/staleness_max": 3.0, "rollout/partial_response_frac": 0.75,
         "rollout/stream_dropped_groups": 2.0},
    ]  # fmt: skip
    summary = async_bench.summarize(rows, warmup=1, responses_per_step=16)
    assert summary["rollout_idle"] is None and summary["trainer_idle"] == pytest.approx(0.25)
    assert (summary["staleness_mean"], summary["staleness_max"]) == (1.0, 3.0)
    assert summary["partial_frac"] == 0.5 and summary["dropped_groups"] == 3.0
