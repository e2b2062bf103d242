"""A bench script run as a user runs it: its own process (forked warm: tests/_warm_start.py), one CPU
thread; it must exit 0."""

from __future__ import annotations

import sys
from pathlib import Path

import _warm_start as warm

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def run_bench(script: str, *args: str, timeout_s: float = 300) -> str:
    """``python bench/<script> <args>``'s standard output (its table); its output tails on failure."""
    run = warm.run(
        [sys.executable, str(BENCH_DIR / script), *args], capture_output=True, text=True, timeout=timeout_s
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout
