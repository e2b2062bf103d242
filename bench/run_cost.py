"""What a whole trainer run costs in CPU, process by process, short-lived ones included.

    python bench/run_cost.py [--repeats 3] [--backends hf vllm] [--config examples/tiny_cpu.yaml]

Sampling ``/proc`` misses what a process spends between its last sample and its exit, and every
process that lives less than a sampling period (a compiler's workers, its C++ preprocessor): on the
2-core machine it put a 2-step run at ~22 CPU-s when the machine's own counters said 22 to 38. Here the
kernel writes one record per process as it exits, with its whole CPU time (BSD process accounting,
``acct(2)``: root only), for a 2-step run of the config (2 training ranks, no validation, no
checkpoint) on each rollout backend, ``--repeats`` times, interleaved. The table holds the medians
per kind of process (the rank, the driver, Ray's own processes, compilation's helpers) and the run's
wall time; ``bench/results/run_cost.json`` keeps every record.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

from harness import REPO, markdown_table, write_json

# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime, etime,
# utime, stime, mem, io, rw, minflt, majflt, swaps (comp_t each), comm[16]
RECORD = struct.Struct("<BBHIIIIIIf8H16s")
TICKS_PER_S = 100  # AHZ: the unit of the record's utime and stime
RAY_HELPERS = ("raylet", "gcs_server", "ray::DashboardA", "ray::RuntimeEnv")


def comp_t(value: int) -> int:
    """A ``comp_t``: 13-bit mantissa, 3-bit base-8 exponent."""
    return (value & 0x1FFF) << (3 * (value >> 13))


def read_records(data: bytes) -> list[dict]:
    """The records of an ``acct_v3`` file: pid, ppid, comm and CPU seconds of each exited process."""
    records = []
    for offset in range(0, len(data) - RECORD.size + 1, RECORD.size):
        fields = RECORD.unpack_from(data, offset)
        if fields[1] != 3:
            raise SystemExit(f"not a version-3 process accounting record at byte {offset}")
        comm = fields[-1].split(b"\0")[0].decode(errors="replace")
        cpu_s = (comp_t(fields[10]) + comp_t(fields[11])) / TICKS_PER_S
        records.append({"pid": fields[6], "ppid": fields[7], "comm": comm, "cpu_s": cpu_s})
    return records


def kind_of(record: dict, by_pid: dict[int, dict], driver: int) -> str | None:
    """What ``record``'s process was to the run whose driver is ``driver``; None when it is not one of
    the run's (every process of a run descends from its driver: Ray's too, the driver starts them)."""
    lineage, pid = [], record["pid"]
    while pid in by_pid and len(lineage) < 64:  # the process, then its ancestors that exited too
        lineage.append(by_pid[pid])
        pid = by_pid[pid]["ppid"]
    if not any(ancestor["pid"] == driver for ancestor in lineage):
        return None
    comm = record["comm"]
    if record["pid"] == driver:
        return "driver"
    if comm.startswith("ray::_WorkerHos"):
        return "training rank"
    if comm.startswith("ray::RewardScor"):
        return "reward worker"
    if any(ancestor["comm"].startswith("ray::_WorkerHos") for ancestor in lineage[1:]):
        return "started by a rank"
    if comm.startswith(RAY_HELPERS) or (comm == "python" and record["ppid"] == driver):
        return "Ray's processes"
    return f"other ({comm})"


@contextlib.contextmanager
def accounting() -> Iterator[str]:
    """Process accounting on for the block, into a file whose path the block gets."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    handle, path = tempfile.mkstemp(prefix="mmrl-acct-")
    os.close(handle)
    if libc.acct(path.encode()) != 0:
        os.unlink(path)
        raise SystemExit(f"process accounting refused: {os.strerror(ctypes.get_errno())} (it needs root)")
    try:
        yield path
    finally:
        libc.acct(None)


def one_run(config: str, backend: str, save_dir: str) -> dict:
    """A 2-step run on ``backend``; its wall seconds and CPU seconds per kind of process."""
    overrides = [
        f"config={config}",
        f"worker.rollout.name={backend}",
        "worker.rollout.enforce_eager=true",
        "trainer.max_steps=2",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "trainer.save_freq=-1",
        "trainer.logger=[jsonl]",
        f"trainer.save_checkpoint_path={save_dir}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with accounting() as path:
        started = time.perf_counter()
        run = subprocess.run(
            [sys.executable, "-m", "mmrl.trainer.main", *overrides], cwd=REPO, env=env, capture_output=True
        )
        wall_s = time.perf_counter() - started
        time.sleep(3)  # Ray's processes end after the driver
    with open(path, "rb") as records_file:
        records = read_records(records_file.read())
    os.unlink(path)
    if run.returncode != 0:
        raise SystemExit(f"the {backend} run failed:\n{run.stderr.decode(errors='replace')[-3000:]}")
    driver = next(r["pid"] for r in records if r["comm"] == "python" and r["ppid"] == os.getpid())
    by_pid = {record["pid"]: record for record in records}
    kinds: dict[str, float] = {}
    processes: dict[str, int] = {}
    for record in records:
        kind = kind_of(record, by_pid, driver)
        if kind is not None:
            kinds[kind] = kinds.get(kind, 0.0) + record["cpu_s"]
            processes[kind] = processes.get(kind, 0) + 1
    return {"wall_s": wall_s, "cpu_s": kinds, "processes": processes, "records": records}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", nargs="*", choices=("hf", "vllm"), default=["hf", "vllm"])
    parser.add_argument("--config", default="examples/tiny_cpu.yaml")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {backend: [] for backend in args.backends}
    with tempfile.TemporaryDirectory(prefix="mmrl-run-cost-") as scratch:
        for repeat in range(args.repeats):
            for backend in args.backends:
                runs[backend].append(
                    one_run(args.config, backend, os.path.join(scratch, f"{backend}{repeat}"))
                )
    kinds = sorted({kind for backend in runs.values() for run in backend for kind in run["cpu_s"]})
    rows = []
    for kind in [*kinds, "all"]:
        cells = []
        for backend in args.backends:
            values = [
                sum(run["cpu_s"].values()) if kind == "all" else run["cpu_s"].get(kind, 0.0)
                for run in runs[backend]
            ]
            counts = [
                sum(run["processes"].values()) if kind == "all" else run["processes"].get(kind, 0)
                for run in runs[backend]
            ]
            cells.append(f"{statistics.median(values):.2f} ({statistics.median(counts):g})")
        rows.append([kind, *cells])
    rows.append(
        ["wall s", *(f"{statistics.median(r['wall_s'] for r in runs[b]):.1f}" for b in args.backends)]
    )
    print(markdown_table(["CPU-s (processes)", *args.backends], rows))
    path = write_json("run_cost.json", {"config": args.config, "runs": runs})
    print(f"medians of {args.repeats} runs each, interleaved; written to {path}")


if __name__ == "__main__":
    main()
