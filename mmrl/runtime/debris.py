"""What a run leaves on the machine, and how it goes: at every exit, and at the next start-up after a crash.

A run makes four kinds of files and processes outside its output folder:

- vLLM's CPU tensor-parallel shared memory, ``/dev/shm/{ident}-{group}-cpushm_{rank}``: vLLM 0.32
  never unlinks it and its names are the same in every run, so a leftover segment makes the next
  engine fail with "create shm in SHMManager failed. errno: 17". Unlinked as soon as the engine has
  started (every rank has mapped it by then: the mappings outlive the names).
- vLLM's ZMQ sockets (``{VLLM_RPC_BASE_PATH}/{uuid4}``, by default straight in ``/tmp``; its
  tensor-parallel message queue binds two). mmrl points them at a folder of its own and removes it
  once the engine has started (connected sockets outlive their paths).
- mmrl's temporary folders, named ``mmrl-{kind}-{pid}-*`` after the process that owns them.
- Ray's session folder ``{ray temp dir}/session_{date}_{pid}`` (named after the process that
  started the cluster), with the cluster's processes: the driver removes both at exit
  (:func:`remove_ray_session_at_exit`). After a SIGKILL of the driver, Ray's GCS server and raylet die
  with it (they are started with a parent-death signal) but its dashboard and runtime-env agents live
  on, orphaned.

:func:`clean_stale_debris` removes what earlier runs left: only debris whose owner is dead (no process
maps the segment; the folder's pid is not running; a session whose starting process is dead and
whose GCS server and raylet are gone), so that it never touches a run that is still going. Cleanings on
one machine run one at a time (:func:`cleaning_lock`, a lock file in the temp folder).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import glob
import importlib.util
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "CPU_SHM_PATTERN",
    "clean_stale_debris",
    "cleaning_lock",
    "make_temp_dir",
    "remove_ray_session_at_exit",
    "unlink_cpu_shared_memory",
    "vllm_socket_dir",
]

CPU_SHM_PATTERN = "/dev/shm/*-cpushm_*"  # vLLM 0.32 CPU backend: {ident}-{group}-cpushm_{rank}
TEMP_DIR_RE = re.compile(r"^mmrl-[a-z]+-(\d+)-")  # mmrl-{kind}-{owner pid}-{random}
RAY_SESSION_RE = re.compile(r"^session_\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_\d+_(\d+)$")  # ..._{starter pid}
UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}$")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def make_temp_dir(kind: str) -> str:
    """A new temporary folder ``mmrl-{kind}-{pid}-*``: a later start-up removes it if this process dies
    without removing it."""
    return tempfile.mkdtemp(prefix=f"mmrl-{kind}-{os.getpid()}-")


@functools.cache
def _process_temp_path(kind: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"mmrl-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def vllm_socket_dir() -> Iterator[None]:
    """Inside the block, vLLM's ZMQ socket files go to a folder of this process (unless the user set
    ``VLLM_RPC_BASE_PATH``), which is removed at the block's end: build the engine inside it (its
    sockets are connected by then, and connected sockets outlive their paths). The folder's path is the
    same for every engine of the process, since vLLM caches its environment once an engine has started."""
    path = _process_temp_path("vllm")
    os.environ.setdefault("VLLM_RPC_BASE_PATH", path)
    if os.environ["VLLM_RPC_BASE_PATH"] != path:
        yield
        return
    os.makedirs(path, exist_ok=True)
    try:
        yield
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---- vLLM's CPU shared memory --------------------------------------------------------------------


def _mapped_shm_segments(maps_file: str) -> set[str]:
    with contextlib.suppress(OSError), open(maps_file) as maps:
        return {line.split(maxsplit=5)[-1].strip() for line in maps if "-cpushm_" in line}
    return set()


def unlink_cpu_shared_memory(stale_only: bool) -> None:
    """Unlink vLLM's CPU tensor-parallel shared-memory segments: those no running process maps
    (``stale_only``, before an engine starts), or those this process maps (once its engine has
    started: every rank of the group has opened them by then, and their mappings outlive the names)."""
    if stale_only:
        in_use = set().union(*(_mapped_shm_segments(maps) for maps in glob.glob("/proc/[0-9]*/maps")))
        segments = set(glob.glob(CPU_SHM_PATTERN)) - in_use
    else:
        segments = _mapped_shm_segments("/proc/self/maps")
    for segment in segments:
        with contextlib.suppress(OSError):
            os.unlink(segment)


# ---- temporary folders and sockets --------------------------------------------------------------


def _remove_stale_temp_dirs(root: str) -> None:
    for entry in os.scandir(root):
        match = TEMP_DIR_RE.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and not pid_alive(int(match.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)


def _bound_unix_socket_paths() -> set[str]:
    with contextlib.suppress(OSError), open("/proc/net/unix") as table:
        next(table)  # header
        return {fields[7] for fields in (line.split() for line in table) if len(fields) > 7}
    return set()


def _remove_unbound_uuid_sockets(root: str) -> None:
    """vLLM's ZMQ socket files (``{uuid4}``) that no live socket is bound to, left in ``root`` by runs
    from before mmrl gave them a folder of their own (and by other vLLM users: unbound, they are dead)."""
    bound = None
    for entry in os.scandir(root):
        if not UUID_RE.match(entry.name):
            continue
        with contextlib.suppress(OSError):
            if not stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
                continue
            bound = _bound_unix_socket_paths() if bound is None else bound
            if entry.path not in bound:
                os.unlink(entry.path)


# ---- Ray sessions --------------------------------------------------------------------------------


def ray_temp_dir() -> str:
    """Ray's default temp folder (``ray._common.utils.get_default_ray_temp_dir`` in Ray 2.60)."""
    root = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    return os.path.join(root, "ray")


def user_processes() -> dict[int, tuple[str, set[str]]]:
    """Every process of this user: pid -> (command line, targets of its open files)."""
    processes = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if proc.stat().st_uid != os.getuid():
                continue
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            files = set()
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    files.add(os.readlink(fd))
            processes[int(proc.name)] = (cmdline, files)
    return processes


@functools.cache
def ray_package_dir() -> str | None:
    """Where Ray's code lives (found without importing Ray)."""
    spec = importlib.util.find_spec("ray")
    return os.path.dirname(spec.origin) if spec and spec.origin else None


def _is_ray_process(cmdline: str) -> bool:
    """Ray's workers and agents (``ray::IDLE``, ``ray::DashboardAgent``, ...) or a program of Ray's
    package (``.../ray/core/src/ray/gcs/gcs_server``, ``.../ray/_private/log_monitor.py``); not, say, a
    user's ``tail -f /tmp/ray/session_.../logs/raylet.out``."""
    package = ray_package_dir()
    return cmdline.startswith("ray::") or (package is not None and package + os.sep in cmdline)


def _remove_stale_ray_sessions(root: str) -> None:
    """Session folders whose starting process is dead and whose GCS server and raylet are gone (their
    command lines name the folder; a cluster of ``ray start``, whose starter exits at once, keeps
    them), with the Ray processes still holding files in them (the orphaned agents)."""
    if not os.path.isdir(root):
        return
    stale = [
        entry.path
        for entry in os.scandir(root)
        if (match := RAY_SESSION_RE.match(entry.name))
        and entry.is_dir(follow_symlinks=False)
        and not pid_alive(int(match.group(1)))
    ]
    if not stale:
        return
    processes = user_processes()
    for session in stale:
        prefix = session + os.sep
        if any(prefix in cmdline and _is_ray_process(cmdline) for cmdline, _ in processes.values()):
            continue  # its GCS server or raylet runs: a live cluster
        for pid, (cmdline, files) in processes.items():
            if _is_ray_process(cmdline) and any(path.startswith(prefix) for path in files):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        shutil.rmtree(session, ignore_errors=True)
    latest = os.path.join(root, "session_latest")
    if os.path.islink(latest) and not os.path.exists(latest):
        with contextlib.suppress(OSError):
            os.unlink(latest)


def remove_ray_session_at_exit() -> None:
    """At this process's exit (normal or by an exception), stop the Ray cluster it started and remove
    the cluster's session folder. Call right after ``ray.init`` started a local cluster: handlers run
    in reverse order, so this one runs before Ray's own shutdown handler."""

    def shut_down() -> None:
        import ray

        ray.shutdown()
        for session in glob.glob(os.path.join(ray_temp_dir(), f"session_*_{os.getpid()}")):
            shutil.rmtree(session, ignore_errors=True)

    atexit.register(shut_down)


_lock_depth = threading.local()


@contextlib.contextmanager
def cleaning_lock() -> Iterator[None]:
    """While held, no other process on this machine cleans debris (two runs starting together take turns;
    whoever must look at a dead run's debris before it goes holds it). Reentrant within a thread."""
    if getattr(_lock_depth, "n", 0):
        _lock_depth.n += 1
        try:
            yield
        finally:
            _lock_depth.n -= 1
        return
    with open(os.path.join(tempfile.gettempdir(), "mmrl-debris.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        _lock_depth.n = 1
        try:
            yield
        finally:
            _lock_depth.n = 0
            fcntl.flock(handle, fcntl.LOCK_UN)


def clean_stale_debris() -> None:
    """Remove what runs that died left behind (see the module docstring); never anything of a live run."""
    with cleaning_lock():
        unlink_cpu_shared_memory(stale_only=True)
        _remove_stale_temp_dirs(tempfile.gettempdir())
        _remove_unbound_uuid_sockets(tempfile.gettempdir())
        _remove_stale_ray_sessions(ray_temp_dir())
