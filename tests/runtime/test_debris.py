"""Start-up cleaning of what killed runs left (mmrl.runtime.debris): everything of a dead owner goes, with
the orphaned processes of its Ray session; nothing of a live process is touched."""

from __future__ import annotations

import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from mmrl.runtime import debris

REPO_ROOT = Path(__file__).resolve().parents[2]

# A driver that starts a local Ray cluster with one actor, and makes one piece of each other kind of
# debris: a temp folder, a vLLM-like shared-memory segment it maps, a socket file it binds.
DRIVER = """
import json, mmap, os, socket, tempfile, time, uuid
import ray
from mmrl.runtime.debris import make_temp_dir
from mmrl.single_controller import init_ray

init_ray(num_cpus=1, object_store_memory_bytes=80_000_000)

@ray.remote(num_cpus=0)
class Idle:
    def pid(self):
        return os.getpid()

actor = Idle.remote()
worker_pid = ray.get(actor.pid.remote())
segment = f"/dev/shm/mmrl-test-{os.getpid()}-cpushm_0"
with open(segment, "wb") as handle:
    handle.write(bytes(4096))
handle = open(segment, "r+b")
mapping = mmap.mmap(handle.fileno(), 4096)
sock = socket.socket(socket.AF_UNIX)
sock.bind(os.path.join(tempfile.gettempdir(), str(uuid.uuid4())))
print(json.dumps({"worker_pid": worker_pid, "folder": make_temp_dir("test"), "segment": segment,
                  "socket": sock.getsockname()}), flush=True)
time.sleep(600)
"""


def _holders(prefix: str) -> list[int]:
    """Processes with a file open under ``prefix`` (a removed folder's files read '... (deleted)')."""
    return [
        pid for pid, (_, files) in debris.user_processes().items() if any(f.startswith(prefix) for f in files)
    ]


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _live_debris(tmp_path: Path) -> tuple[list[Path], mmap.mmap, socket.socket]:
    """One piece of each kind owned by this (live) process: the cleaning must leave all of them."""
    folder = Path(debris.make_temp_dir("test"))
    segment = Path(f"/dev/shm/mmrl-test-live-{os.getpid()}-cpushm_0")
    segment.write_bytes(bytes(4096))
    with open(segment, "r+b") as handle:
        mapping = mmap.mmap(handle.fileno(), 4096)
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(tempfile.gettempdir(), str(uuid.uuid4())))
    return [folder, segment, Path(sock.getsockname())], mapping, sock


@pytest.mark.distributed
@pytest.mark.shares("vllm")  # its live segments match what the vLLM tests find left on the machine
def test_start_up_cleans_what_a_sigkilled_driver_left_and_nothing_live(tmp_path):
    live, mapping, live_socket = _live_debris(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        made = json.loads(driver.stdout.readline())
        sessions = list(Path(debris.ray_temp_dir()).glob(f"session_*_{driver.pid}"))
        assert len(sessions) == 1, sessions
        session = str(sessions[0]) + os.sep
        # no other run or test starting beside this one cleans the killed driver's debris before this does
        with debris.cleaning_lock():
            os.kill(driver.pid, signal.SIGKILL)  # the driver alone, as a crash or the OOM killer does
            driver.wait(timeout=30)
            # what it left: Ray's session folder, its segment (mapped by nobody now), folder and socket file
            left = [sessions[0], Path(made["segment"]), Path(made["folder"]), Path(made["socket"])]
            assert all(path.exists() for path in left)

            start = time.perf_counter()
            debris.clean_stale_debris()  # the lock is reentrant
            clean_s = time.perf_counter() - start
        assert [path for path in left if path.exists()] == []
        deadline = time.monotonic() + 10  # SIGKILLed orphans vanish from /proc once reaped
        while (holders := _holders(session)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert holders == [], f"processes of the killed run's Ray session still running: {holders}"
        assert [path for path in live if not path.exists()] == [], "the cleaning removed a live run's debris"
        assert clean_s < 5, clean_s
    finally:
        driver.kill()
        driver.wait()
        mapping.close()
        live_socket.close()
        for path in live:
            if path.is_dir():
                path.rmdir()
            else:
                path.unlink(missing_ok=True)


def test_a_ray_session_is_stale_only_when_its_starter_and_its_cluster_are_dead(tmp_path):
    """A session of a live starter stays; one whose starter is dead but whose GCS server runs (a
    ``ray start`` cluster) stays; one whose starter and cluster are dead goes, with its orphaned Ray
    processes (not another program that reads its logs)."""
    name = "session_2026-11-24_05-35-03_545350_{}"
    mine, started, dead = (tmp_path / name.format(pid) for pid in (os.getpid(), _dead_pid(), _dead_pid()))
    for session in (mine, started, dead):
        (session / "logs").mkdir(parents=True)
        (session / "logs" / "agent.log").write_text("")
    hold = "import os, time; f = open(os.environ['LOG']); time.sleep(60)"

    def named(name: str, log: Path) -> subprocess.Popen:  # exec -a sets the command line's first word
        env = {**os.environ, "NAME": name, "HOLD": hold, "LOG": str(log)}
        return subprocess.Popen(["bash", "-c", f'exec -a "$NAME" {sys.executable} -c "$HOLD"'], env=env)

    # the "GCS server" names its session folder on its command line (--log_dir=...); the orphaned agent
    # only holds one of its logs open (Ray rewrites its command line to its name)
    gcs_server = f"{debris.ray_package_dir()}/core/src/ray/gcs/gcs_server --log_dir={started}/logs"
    gcs = named(gcs_server, started / "logs" / "agent.log")
    orphan = named("ray::DashboardAgent", dead / "logs" / "agent.log")
    reader = named(f"tail -f {dead}/logs/agent.log", dead / "logs" / "agent.log")  # not Ray's
    try:
        deadline = time.monotonic() + 10
        while {orphan.pid, reader.pid} - set(_holders(str(dead) + os.sep)) and time.monotonic() < deadline:
            time.sleep(0.05)
        debris._remove_stale_ray_sessions(str(tmp_path))
        assert mine.is_dir() and started.is_dir() and not dead.exists()
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        assert gcs.poll() is None and reader.poll() is None
    finally:
        for process in (gcs, orphan, reader):
            process.kill()
            process.wait()


def test_only_temp_folders_of_dead_owners_go(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    live = Path(debris.make_temp_dir("dist"))
    dead = tmp_path / f"mmrl-dist-{_dead_pid()}-abc"
    foreign = tmp_path / "mmrl-bench-cache-x1"  # not ours: no owner pid in its name
    for folder in (dead, foreign):
        folder.mkdir()
    debris._remove_stale_temp_dirs(str(tmp_path))
    assert live.name.startswith(f"mmrl-dist-{os.getpid()}-")
    assert live.is_dir() and foreign.is_dir() and not dead.exists()


def test_cleanings_on_one_machine_take_turns(tmp_path):
    """A cleaning started while another process holds the lock waits for it; a nested hold in one
    thread does not wait for itself."""
    done = tmp_path / "cleaned"
    code = f"from mmrl.runtime import debris; debris.clean_stale_debris(); open({str(done)!r}, 'w').close()"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    with debris.cleaning_lock(), debris.cleaning_lock():  # reentrant
        cleaner = subprocess.Popen([sys.executable, "-c", code], env=env)
        time.sleep(1.5)
        assert cleaner.poll() is None and not done.exists(), "a cleaning ran while the lock was held"
    assert cleaner.wait(timeout=30) == 0
    assert done.exists()
