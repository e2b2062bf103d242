"""bench/run_cost.py's reading of process accounting records: every exited process of a run, by kind,
found through its recorded ancestors; processes of the machine that are not the run's left out."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "run_cost.py"


@pytest.fixture(scope="module")
def bench():
    import sys

    sys.path.insert(0, str(BENCH.parent))  # its harness module
    spec = importlib.util.spec_from_file_location("run_cost", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(bench, pid: int, ppid: int, comm: str, utime: int, stime: int = 0, started: int = 100) -> bytes:
    return bench.RECORD.pack(
        0, 3, 0, 0, 0, 0, pid, ppid, started, 0.0, utime, stime, 0, 0, 0, 0, 0, 0, comm.encode()
    )


def test_records_are_decoded_and_sorted_by_kind(bench):
    # comp_t: 13-bit mantissa, base-8 exponent (0x2000 | 100 is 100 * 8 ticks)
    assert bench.comp_t(100) == 100 and bench.comp_t(0x2000 | 100) == 800
    driver, raylet, rank = 10, 11, 12
    data = b"".join(
        [
            _record(bench, 20, rank, "python", 50),  # a compile worker the rank started
            _record(bench, 21, 20, "cc1plus", 0x2000 | 5),  # ... and its compiler: 40 ticks
            _record(bench, rank, raylet, "ray::_WorkerHost", 900, 100),
            _record(bench, 13, raylet, "ray::RewardScorer", 60),
            _record(bench, 14, raylet, "ray::DashboardAgent", 80),
            _record(bench, 15, driver, "python", 45),  # the dashboard head, the monitor
            _record(bench, raylet, driver, "raylet", 25),
            _record(bench, driver, 1, "python", 700),
            _record(bench, 99, 1, "python", 300),  # a process of the machine, not the run's
        ]
    )
    records = bench.read_records(data)
    assert records[2] == {
        "pid": rank,
        "ppid": raylet,
        "comm": "ray::_WorkerHost",
        "cpu_s": 10.0,
        "started": 100,
    }
    by_pid = bench.records_by_pid(records)
    kinds = [bench.kind_of(record, by_pid, driver) for record in records]
    assert kinds == [
        "started by a rank",
        "started by a rank",
        "training rank",
        "reward worker",
        "Ray's processes",
        "Ray's processes",
        "Ray's processes",
        "driver",
        None,
    ]
    assert records[1]["cpu_s"] == 0.4


def test_a_record_of_another_version_is_refused(bench):
    data = bench.RECORD.pack(0, 2, 0, 0, 0, 0, 1, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0, b"x")
    with pytest.raises(SystemExit, match="version-3"):
        bench.read_records(data)


def test_a_suites_processes_are_sorted_by_kind_and_by_where_they_sit(bench):
    root, make, pytest_main, worker, server, driver, raylet = 5, 6, 7, 8, 9, 10, 11
    data = b"".join(
        [
            _record(bench, make, root, "make", 1, started=80),
            _record(bench, pytest_main, make, "python", 100, started=80),
            _record(bench, worker, pytest_main, "[pytest-xdist i", 3000, started=80),
            _record(bench, server, worker, "python", 800),  # a warm server the test started
            _record(bench, driver, server, "python", 250),  # a trainer command it forked
            _record(bench, 12, driver, "python", 90),  # Ray's dashboard head, started by the driver
            _record(bench, raylet, driver, "raylet", 40),
            _record(bench, 13, raylet, "ray::_WorkerHost", 1000),
            _record(bench, 14, 13, "python", 20),  # a compile worker of the rank
            _record(bench, 15, raylet, "ray::RewardScorer", 200),
            _record(bench, 16, root, "python", 150),  # a gloo rank whose forkserver exited first
            _record(bench, 17, 1, "python", 300),  # a process of the machine, not the suite's
            _record(bench, 18, 4, "ray::_WorkerHost", 300),  # nor another job's rank
            _record(bench, root, 4, "python", 10),  # nor the bench (a record of its pid may come)
            # pids come round again: the server's pid held before by a test's shell, then by a later
            # rank; the driver's parent is the one of them that started last before it
            _record(bench, server, worker, "bash", 1, started=90),
            _record(bench, server, raylet, "ray::_WorkerHost", 5, started=200),
            # a command forked by a warm server that outlived its pytest worker (root adopted it)
            _record(bench, 19, 20, "python", 300, started=300),
            _record(bench, 20, root, "python", 800, started=250),
        ]
    )
    records = bench.read_records(data)
    by_pid = bench.records_by_pid(records)
    assert bench.parent_of(records[4], by_pid) is records[3]
    kinds = [bench.suite_kind(record, by_pid, root) for record in records]
    assert kinds == [
        "other programs (make, shells, compilers, trackers' helpers)",
        "pytest's main process",
        "the pytest workers (the tests in-process)",
        "Python processes a test starts (trainer commands, CLI checks, merges, warm servers)",
        "their Python children (forked trainer drivers, Ray's helpers, gloo ranks)",
        "their Python children (forked trainer drivers, Ray's helpers, gloo ranks)",
        "Ray's own native processes and agents",
        "training ranks (Ray actors)",
        "processes Ray's actors start",
        "reward workers",
        "Python processes whose parent exited first",
        None,
        None,
        None,
        "other programs (make, shells, compilers, trackers' helpers)",
        "training ranks (Ray actors)",
        "their Python children (forked trainer drivers, Ray's helpers, gloo ranks)",
        "Python processes whose parent exited first",
    ]
