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


def _record(bench, pid: int, ppid: int, comm: str, utime: int, stime: int = 0) -> bytes:
    return bench.RECORD.pack(
        0, 3, 0, 0, 0, 0, pid, ppid, 0, 0.0, utime, stime, 0, 0, 0, 0, 0, 0, comm.encode()
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
    assert records[2] == {"pid": rank, "ppid": raylet, "comm": "ray::_WorkerHost", "cpu_s": 10.0}
    by_pid = {record["pid"]: record for record in records}
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
