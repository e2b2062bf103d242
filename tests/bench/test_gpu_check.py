"""``make gpu-check`` (bench/gpu_check.py) in its dry mode: every check runs on the CPU at tiny sizes, the
table lists them all, and the exit code follows the rows (the GPU run itself needs a GPU)."""

from __future__ import annotations

import json
import sys

import torch
from _bench_run import BENCH_DIR, run_bench

sys.path.insert(0, str(BENCH_DIR))  # bench/ holds scripts, not a package

import gpu_check  # noqa: E402

CHECKS = (
    "update",
    "flash-attn",
    "ring",
    "weight sync",
    "storage dtypes",
    "cuda rng",
    "memory figures",
    "self-check",
)


def test_the_dry_run_runs_every_check_on_the_cpu_and_exits_0(tmp_path):
    stdout = run_bench("gpu_check.py", "--dry", "--out", str(tmp_path / "check.json"))
    rows = json.loads((tmp_path / "check.json").read_text())["rows"]
    assert {row["check"] for row in rows} == set(CHECKS)
    assert all(row["ok"] for row in rows)
    assert "| check | what | result | ok |" in stdout and f"{len(rows)} ok, 0 mismatched" in stdout
    # the bf16 kernels were compared with something, not skipped
    assert (
        sum(row["check"] == "flash-attn" for row in rows) == 9
        and sum(row["check"] == "ring" for row in rows) == 8
    )


def test_comparisons_flag_mismatches_and_the_table_marks_them():
    ones = torch.ones(4)
    assert gpu_check.within("c", "x", gpu_check.relative_error(ones * 1.001, ones), 1e-2).ok
    assert not gpu_check.within("c", "x", gpu_check.relative_error(ones * 1.1, ones), 1e-2).ok
    assert not gpu_check.within("c", "x", float("nan"), 1e-2).ok
    # flash-attn's bf16 error may be twice sdpa's plus 2e-3, no more
    assert gpu_check.no_worse("x", "c", (0.0109, 0.005), ("a", "b")).ok
    assert not gpu_check.no_worse("x", "c", (0.0121, 0.005), ("a", "b")).ok
    table = gpu_check.table([gpu_check.Row("ring", "dq", "1e-1", False)])
    assert table.splitlines()[-1] == "| ring | dq | 1e-1 | MISMATCH |"


def test_without_a_gpu_the_real_run_says_so():
    assert gpu_check.main([]) == 2
