"""What a sandboxed run costs: per-run latency and throughput of the code sandbox against a bare subprocess.

    python bench/sandbox.py [--runs 24] [--concurrency 1 2 4]

The same trivial program (``print(sum(map(int, input().split())))`` on one line of stdin) runs
``--runs`` times in each way:

- ``subprocess``: ``python -I -B main.py`` in a temporary folder, nothing else (the floor);
- ``process``: the sandbox's fallback (launcher, rlimits, audit hook);
- ``namespaces``: the default (launcher, user/mount/pid/net namespaces, read-only root, rlimits).

For each, at every ``--concurrency`` (runs at once), the median latency of one run and the runs per
second of the whole batch. Prints a table and writes ``bench/results/sandbox.json``. On a shared
machine, other jobs stretch every number; compare rows of one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mmrl.sandbox import Sandbox, SandboxLimits

RESULTS = Path(__file__).resolve().parent / "results"
PROGRAM = "print(sum(map(int, input().split())))\n"
STDIN = "1 2 3\n"


def _bare_run(_: int) -> float:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "main.py").write_text(PROGRAM)
        done = subprocess.run(
            [sys.executable, "-I", "-B", "main.py"],
            input=STDIN,
            capture_output=True,
            text=True,
            cwd=folder,
            env={},
        )
    assert done.stdout.strip() == "6", done.stderr
    return time.perf_counter() - started


def _sandbox_runner(isolation: str):
    python = "/usr/bin/python3" if isolation == "process" and os.path.exists("/usr/bin/python3") else None
    sandbox = Sandbox(SandboxLimits(), isolation=isolation, max_concurrency=64, python=python)

    def run(_: int) -> float:
        started = time.perf_counter()
        result = sandbox.run(sandbox.python_program(PROGRAM, stdin=STDIN))
        assert result.ok and result.stdout.strip() == "6", result.reason
        return time.perf_counter() - started

    return run


def measure(run, runs: int, concurrency: int) -> dict:
    run(0)  # warm-up
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        latencies = list(pool.map(run, range(runs)))
    elapsed = time.perf_counter() - started
    return {"median_latency_ms": 1e3 * statistics.median(latencies), "runs_per_s": runs / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=24)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    ways = {
        "subprocess": _bare_run,
        "process": _sandbox_runner("process"),
        "namespaces": _sandbox_runner("namespaces"),
    }
    rows = []
    for concurrency in args.concurrency:
        for name, run in ways.items():
            rows.append({"way": name, "concurrency": concurrency, **measure(run, args.runs, concurrency)})
    print("| way | runs at once | median latency (ms) | runs/s |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['way']} | {row['concurrency']} | {row['median_latency_ms']:.0f} | {row['runs_per_s']:.1f} |"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sandbox.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
