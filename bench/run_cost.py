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

    python bench/run_cost.py --suite [--pytest-args "-k lengths"]

runs ``make test`` (what CI runs) instead, once, and prints its CPU seconds by kind of process, the
share of the machine's cores it kept busy, and its wall time (``bench/results/suite_cost.json``). This
process is the suite's subreaper, so a process whose parent exits first stays in the suite's lineage.
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

from harness import REPO, busy_cpu_seconds, markdown_table, write_json

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
        records.append(
            {"pid": fields[6], "ppid": fields[7], "comm": comm, "cpu_s": cpu_s, "started": fields[8]}
        )
    return records


def records_by_pid(records: list[dict]) -> dict[int, list[dict]]:
    """Each pid's records, in the order they were written: a suite outlives the kernel's 32,768 pids,
    so a pid may be reused."""
    by_pid: dict[int, list[dict]] = {}
    for record in records:
        by_pid.setdefault(record["pid"], []).append(record)
    return by_pid


def parent_of(record: dict, by_pid: dict[int, list[dict]]) -> dict | None:
    """The record of ``record``'s parent: of the processes that held its parent's pid, the last one
    started before it (None when the parent had not exited when the records were read)."""
    earlier = [other for other in by_pid.get(record["ppid"], []) if other["started"] <= record["started"]]
    return max(reversed(earlier), key=lambda other: other["started"], default=None)  # ties: the last


def lineage_of(record: dict, by_pid: dict[int, list[dict]], root: int | None = None) -> list[dict]:
    """``record``, then its recorded ancestors (those that exited too), up to the one whose parent is
    ``root`` (the kernel may write a record of ``root``'s pid too: the walk stops short of it)."""
    lineage = [record]
    while lineage[-1]["ppid"] != root and len(lineage) < 64:
        if (parent := parent_of(lineage[-1], by_pid)) is None:
            break
        lineage.append(parent)
    return lineage


def kind_of(record: dict, by_pid: dict[int, list[dict]], driver: int) -> str | None:
    """What ``record``'s process was to the run whose driver is ``driver``; None when it is not one of
    the run's (every process of a run descends from its driver: Ray's too, the driver starts them)."""
    lineage = lineage_of(record, by_pid)
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
    by_pid = records_by_pid(records)
    kinds: dict[str, float] = {}
    processes: dict[str, int] = {}
    for record in records:
        kind = kind_of(record, by_pid, driver)
        if kind is not None:
            kinds[kind] = kinds.get(kind, 0.0) + record["cpu_s"]
            processes[kind] = processes.get(kind, 0) + 1
    return {"wall_s": wall_s, "cpu_s": kinds, "processes": processes, "records": records}


PR_SET_CHILD_SUBREAPER = 36  # prctl(2)

SUITE_KINDS = (  # a process's command name (``comm``, 15 characters) → its kind, first match wins
    ("ray::_WorkerHos", "training ranks (Ray actors)"),
    ("ray::RewardScor", "reward workers"),
    ("VLLM::", "vLLM's engine processes"),
    ("[pytest-xdist", "the pytest workers (the tests in-process)"),
    (RAY_HELPERS + ("ray::IDLE", "ray::Idle"), "Ray's own native processes and agents"),
)


def suite_kind(record: dict, by_pid: dict[int, list[dict]], root: int) -> str | None:
    """What ``record``'s process was to the suite run under ``root`` (this process, its subreaper):
    None when it is not the suite's. A Python process is told by where it sits: started by a pytest
    worker, further down (a forked trainer driver, Ray's helpers, gloo ranks), or adopted by ``root``
    when its parent exited first."""
    lineage = lineage_of(record, by_pid, root)
    if lineage[-1]["ppid"] != root or record["pid"] == root:
        return None
    comm = record["comm"]
    for prefix, kind in SUITE_KINDS:
        if comm.startswith(prefix):
            return kind
    if comm != "python":
        return "other programs (make, shells, compilers, trackers' helpers)"
    if record["ppid"] == root:
        return "Python processes whose parent exited first"
    if lineage[1]["comm"].startswith("[pytest-xdist"):  # its parent
        return "Python processes a test starts (trainer commands, CLI checks, merges, warm servers)"
    if any(ancestor["comm"].startswith("ray::") for ancestor in lineage[1:]):
        return "processes Ray's actors start"
    if lineage[-1]["comm"] == "python" or any(a["comm"].startswith("[pytest-xdist") for a in lineage[1:]):
        # under a pytest worker, or under a server the root adopted when its worker exited first
        return "their Python children (forked trainer drivers, Ray's helpers, gloo ranks)"
    return "pytest's main process"


def reap_until(pid: int | None) -> int | None:
    """Reap this process's children, its own and those it adopted as their subreaper, as they exit
    (an unreaped one stays a zombie, which tests that count what a run left behind would see), until
    ``pid`` exits: its exit status; with None, those that have exited now."""
    while True:
        try:
            child, status = os.waitpid(-1, 0 if pid is not None else os.WNOHANG)
        except ChildProcessError:
            return None
        if pid is None and child == 0:
            return None
        if child == pid:
            return os.waitstatus_to_exitcode(status)


def suite_cost(pytest_args: str) -> None:
    """``make test`` under process accounting: its CPU by kind of process, printed and written."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise SystemExit(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")
    command = ["make", "test", *([f"PYTEST_ARGS={pytest_args}"] if pytest_args else [])]
    with accounting() as path:
        busy_before, started = busy_cpu_seconds(), time.perf_counter()
        make = subprocess.Popen(command, cwd=REPO)
        returncode = make.returncode = reap_until(make.pid)
        wall_s, busy_s = time.perf_counter() - started, busy_cpu_seconds() - busy_before
        time.sleep(3)  # what outlives the suite ends (its Ray sessions' last helpers)
        reap_until(None)
    with open(path, "rb") as records_file:
        records = read_records(records_file.read())
    os.unlink(path)
    by_pid = records_by_pid(records)
    cpu: dict[str, float] = {}
    processes: dict[str, int] = {}
    for record in records:
        if (kind := suite_kind(record, by_pid, os.getpid())) is not None:
            cpu[kind] = cpu.get(kind, 0.0) + record["cpu_s"]
            processes[kind] = processes.get(kind, 0) + 1
    total = sum(cpu.values())
    rows = [
        [kind, f"{seconds:,.0f}", f"{100 * seconds / total:.0f} %", processes[kind]]
        for kind, seconds in sorted(cpu.items(), key=lambda item: -item[1])
    ]
    rows.append(["all", f"{total:,.0f}", "", sum(processes.values())])
    print(markdown_table(["kind", "CPU-s", "share", "processes"], rows))
    cores = os.cpu_count() or 1
    print(
        f"`{' '.join(command)}` exited {returncode} after {wall_s / 60:.1f} min; the machine's "
        f"{cores} cores were busy {100 * busy_s / (wall_s * cores):.0f} % of it"
    )
    path = write_json(
        "suite_cost.json",
        {
            "command": command,
            "returncode": returncode,
            "wall_s": wall_s,
            "busy_cpu_s": busy_s,
            "cpu_s": cpu,
            "root": os.getpid(),
            "records": records,
        },
    )
    print(f"written to {path}")
    if returncode != 0:
        raise SystemExit(returncode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--backends", nargs="*", choices=("hf", "vllm"), default=["hf", "vllm"])
    parser.add_argument("--config", default="examples/tiny_cpu.yaml")
    parser.add_argument("--suite", action="store_true", help="run `make test` once instead: its CPU by kind")
    parser.add_argument("--pytest-args", default="", help="with --suite: `make test`'s PYTEST_ARGS")
    args = parser.parse_args()
    if args.suite:
        suite_cost(args.pytest_args)
        return
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
