"""Run untrusted programs, one sandboxed subprocess per run, a bounded number at a time.

:class:`Sandbox` writes a run's spec into a private temporary folder, starts the trusted launcher
(``_launcher.py``, a fresh interpreter in a session of its own) and collects what the program
printed and how it ended, as a :class:`RunResult` with a ``reason`` when it did not end well. The
temporary folder is removed afterwards. Which layer enforces what:

=====================  =========================================  =========================================
limit                  isolation = namespaces (default)           isolation = process (fallback)
=====================  =========================================  =========================================
wall time              launcher kills the pid namespace's init    launcher kills the program's group
CPU time               RLIMIT_CPU (SIGXCPU, SIGKILL 1 s later)    same
memory                 RLIMIT_AS (address space)                  same
file size / disk       RLIMIT_FSIZE; tmpfs ``size=`` (/sandbox,   RLIMIT_FSIZE only
                       /tmp)
processes              RLIMIT_NPROC in its own user namespace     audit hook refuses fork/exec/spawn
open files             RLIMIT_NOFILE                              same
output                 parent stops the run at max_output_bytes   same
network                empty network namespace (lo down)          audit hook refuses sockets
files outside          chroot into a tmpfs root: system folders   audit hook refuses paths outside;
                       read-only, nothing else of the host         nobody's file rights when root
other processes        pid namespace; no capabilities             audit hook refuses kill; nobody
leftover processes     the kernel kills the namespace with init   the launcher kills session + group
environment            only ``env`` (PATH, LANG, ...) is passed   same
=====================  =========================================  =========================================
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from mmrl.errors import UserInputError
from mmrl.runtime.debris import make_temp_dir

ISOLATIONS = ("namespaces", "process")
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_launcher.py")
GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_guard.py")
SYSTEM_PATHS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin")
WORK_DIR = "/sandbox"  # the program's folder inside the namespaces' root (see _launcher.py)
PROGRAM_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "HOME": "/tmp",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",  # numerical libraries would start one thread per core and hit max_processes
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_STDERR_TAIL_BYTES = 4096  # stderr kept for the reason and for debugging
_LAUNCHER_GRACE_S = 10.0  # beyond the wall time, before the parent kills the launcher itself
_READ_CHUNK = 65536


class SandboxError(UserInputError, RuntimeError):
    """The sandbox cannot run here (namespaces refused, no interpreter) or a launcher failed."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. Times in seconds, sizes in bytes."""

    cpu_time_s: float = 5.0  # CPU time of the program (all its threads and children), whole seconds
    wall_time_s: float = 10.0  # wall-clock time from start to end, however idle
    memory_bytes: int = 1 << 30  # address space of each process (a run: at most max_processes x this)
    file_size_bytes: int = 16 << 20  # largest file the program may write
    disk_bytes: int = 64 << 20  # tmpfs size of /sandbox and of /tmp each (namespaces)
    max_processes: int = 8  # processes and threads at once (namespaces)
    max_open_files: int = 64  # file descriptors per process
    max_output_bytes: int = 1 << 20  # stdout + stderr; the run is stopped beyond it

    def as_launcher_limits(self) -> dict:
        return {
            "cpu_s": self.cpu_time_s,
            "wall_s": self.wall_time_s,
            "memory_bytes": self.memory_bytes,
            "file_size_bytes": self.file_size_bytes,
            "disk_bytes": self.disk_bytes,
            "max_processes": self.max_processes,
            "max_open_files": self.max_open_files,
        }


@dataclass
class RunResult:
    """How one run ended. ``outcome``: exited | signaled | wall_timeout | output_limit | sandbox_error."""

    outcome: str
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""  # its last _STDERR_TAIL_BYTES
    wall_s: float = 0.0
    cpu_s: float = 0.0
    max_rss_bytes: int = 0
    leftover_processes: int = 0  # processes killed after the run ended (0 under namespaces)
    limits: SandboxLimits = field(default_factory=SandboxLimits, repr=False)
    error: str = ""  # the launcher's message for sandbox_error

    @property
    def ok(self) -> bool:
        return self.outcome == "exited" and self.exit_code == 0

    @property
    def reason(self) -> str | None:
        """Why the run did not succeed, in a short phrase (None when it exited with 0)."""
        if self.ok:
            return None
        limits = self.limits
        if self.outcome == "sandbox_error":
            return f"sandbox error: {self.error}"
        if self.outcome == "wall_timeout":
            return f"wall time limit ({limits.wall_time_s:g} s) exceeded"
        if self.outcome == "output_limit":
            return f"output limit ({limits.max_output_bytes} bytes) exceeded"
        if self.outcome == "signaled":
            if self.signal == signal.SIGXCPU or (
                self.signal == signal.SIGKILL and self.cpu_s >= int(limits.cpu_time_s) - 0.05
            ):
                return f"CPU time limit ({limits.cpu_time_s:g} s) exceeded"
            if self.signal == signal.SIGXFSZ:
                return f"file size limit ({limits.file_size_bytes} bytes) exceeded"
            return f"killed by {signal.Signals(self.signal).name}"
        last_line = next((line for line in reversed(self.stderr.splitlines()) if line.strip()), "")
        return f"exit code {self.exit_code}" + (f": {last_line.strip()[:200]}" if last_line else "")


@dataclass(frozen=True)
class Program:
    """One run's input: files written into the program's folder, the command, its stdin."""

    files: dict[str, str]  # file name (no folders) -> text
    argv: Sequence[str]  # the command; relative file names are in the program's folder
    stdin: str = ""


class Sandbox:
    """Runs :class:`Program` s under ``limits`` with at most ``max_concurrency`` runs at a time.

    Args:
        limits: the default limits of a run (:meth:`run` may pass others).
        isolation: ``namespaces`` (kernel-enforced, the default) or ``process`` (the fallback where
            the kernel refuses user namespaces; see the module docstring for what each enforces).
        max_concurrency: runs at once, over every thread using this sandbox.
        python: the interpreter programs run with (``python_program``); default this one.
        read_only_paths: further host folders or files the program may read (namespaces).
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        isolation: str = "namespaces",
        max_concurrency: int = 4,
        python: str | None = None,
        read_only_paths: Sequence[str] = (),
    ):
        if isolation not in ISOLATIONS:
            raise SandboxError(f"sandbox isolation {isolation!r} is not one of {list(ISOLATIONS)}")
        if max_concurrency < 1:
            raise SandboxError(f"sandbox max_concurrency must be at least 1, got {max_concurrency}")
        self.limits = limits or SandboxLimits()
        self.isolation = isolation
        self.max_concurrency = max_concurrency
        self.python = python or sys.executable
        if not os.path.isfile(self.python):
            raise SandboxError(f"sandbox python {self.python!r} is not a file")
        self.read_only_paths = _read_only_paths(self.python, read_only_paths)
        # process isolation as root: the program runs as `nobody` when `nobody` can run the interpreter
        # (not e.g. one under /root); otherwise as the caller, guarded by the audit hook alone
        self.runs_as_nobody = isolation == "process" and os.geteuid() == 0 and _others_can_run(self.python)
        self._slots = threading.BoundedSemaphore(max_concurrency)
        _check_supported(self)

    def python_program(self, source: str, stdin: str = "", files: dict[str, str] | None = None) -> Program:
        """A Python program: ``source`` as ``main.py`` (with ``files`` beside it), run isolated (-I)."""
        return Program(files={**(files or {}), "main.py": source}, argv=("main.py",), stdin=stdin)

    def run(self, program: Program, limits: SandboxLimits | None = None) -> RunResult:
        """Runs ``program`` once in a fresh sandbox; waits for a free slot first."""
        limits = limits or self.limits
        with self._slots:
            return self._run(program, limits)

    def run_many(self, programs: Sequence[Program], limits: SandboxLimits | None = None) -> list[RunResult]:
        """Runs ``programs`` concurrently (``max_concurrency`` at a time); results in order."""
        if not programs:
            return []
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(programs))) as pool:
            return list(pool.map(lambda program: self.run(program, limits), programs))

    def _run(self, program: Program, limits: SandboxLimits) -> RunResult:
        for name in program.files:
            if not name or "/" in name or name in (".", ".."):
                raise SandboxError(f"sandbox file name {name!r} must be a plain file name")
        folder = make_temp_dir("sandbox")  # a later start-up removes it if this process is killed meanwhile
        try:
            spec_path, stdin_path = os.path.join(folder, "spec.json"), os.path.join(folder, "stdin")
            with open(stdin_path, "w") as stdin_file:
                stdin_file.write(program.stdin)
            status_r, status_w = os.pipe()
            spec = self._spec(program, limits, folder, status_w)
            with open(spec_path, "w") as spec_file:
                json.dump(spec, spec_file)
            with open(stdin_path, "rb") as stdin_file:
                launcher = subprocess.Popen(
                    [sys.executable, "-I", "-S", LAUNCHER, spec_path],
                    stdin=stdin_file,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(status_w,),
                    start_new_session=True,
                    env={},
                    cwd=folder,
                )
            os.close(status_w)
            return _collect(launcher, status_r, limits)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _spec(self, program: Program, limits: SandboxLimits, folder: str, status_fd: int) -> dict:
        argv = (
            [self.python, "-I", "-B", *program.argv]
            if program.argv[0].endswith(".py")
            else list(program.argv)
        )
        spec = {
            "isolation": self.isolation,
            "limits": limits.as_launcher_limits(),
            "env": dict(PROGRAM_ENV),
            "status_fd": status_fd,
            "parent_pid": os.getpid(),
            "files": dict(program.files),
            "read_only_paths": list(self.read_only_paths),
        }
        if self.isolation == "process":
            work_dir = os.path.join(folder, "work")
            _make_process_work_dir(folder, work_dir, program.files, self.runs_as_nobody)
            policy = {"write_roots": [work_dir], "read_roots": list(self.read_only_paths) + ["/dev/urandom"]}
            if argv[0] == self.python:
                argv[3:3] = [GUARD, json.dumps(policy)]  # python -I -B _guard.py <policy> main.py ...
            spec.update(work_dir=work_dir, env={**spec["env"], "HOME": work_dir, "TMPDIR": work_dir})
            spec["as_nobody"] = self.runs_as_nobody
        spec["argv"] = argv
        return spec


def _others_can_run(python: str) -> bool:
    """Whether a user other than the owner can reach and run ``python`` (and this one's stdlib)."""
    paths = [os.path.realpath(python)]
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        paths.append(os.path.realpath(sys.base_prefix))
    for path in paths:
        parts = path.split("/")
        for index in range(2, len(parts) + 1):
            mode = os.stat("/".join(parts[:index]) or "/").st_mode
            if not mode & stat.S_IXOTH:
                return False
    return True


def _make_process_work_dir(folder: str, work_dir: str, files: dict[str, str], as_nobody: bool) -> None:
    os.mkdir(work_dir)
    for name, text in files.items():
        with open(os.path.join(work_dir, name), "w") as file:
            file.write(text)
    if as_nobody:  # its folder must be its own
        os.chmod(folder, 0o711)
        for path in [work_dir, *(os.path.join(work_dir, name) for name in files)]:
            os.chown(path, 65534, 65534)


def _read_only_paths(python: str, extra: Sequence[str]) -> list[str]:
    """System folders, the interpreter's installation (venv and base) and ``extra``, without nesting."""
    candidates = [*SYSTEM_PATHS]
    prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    if os.path.realpath(python) != os.path.realpath(sys.executable):  # another interpreter: its folders
        prefixes = [os.path.dirname(os.path.dirname(os.path.abspath(python)))]
    candidates += prefixes + [os.path.dirname(os.path.dirname(os.path.realpath(python)))]
    for path in extra:
        if not os.path.exists(path):
            raise SandboxError(f"sandbox read_only_paths: {path!r} does not exist")
        candidates.append(path)
    # a symlinked path (a venv linked from elsewhere) is recreated as a link: its target is bound too
    candidates += [os.path.realpath(path) for path in candidates]
    chosen: list[str] = []
    for path in sorted({os.path.abspath(p) for p in candidates if os.path.lexists(p)}):
        if path == "/" or any(path.startswith(kept.rstrip("/") + "/") for kept in chosen):
            continue
        if path == WORK_DIR or path.startswith(WORK_DIR + "/") or path in ("/proc", "/dev", "/tmp"):
            raise SandboxError(f"sandbox read_only_paths: {path!r} would hide the sandbox's own {path}")
        chosen.append(path)
    return chosen


def _collect(launcher: subprocess.Popen, status_r: int, limits: SandboxLimits) -> RunResult:
    """Reads the program's output (bounded) and the launcher's status until all three pipes close."""
    stdout, stderr_tail, total = bytearray(), bytearray(), 0
    status = bytearray()
    over_output = False
    deadline = time.monotonic() + limits.wall_time_s + _LAUNCHER_GRACE_S
    selector = selectors.DefaultSelector()
    selector.register(launcher.stdout, selectors.EVENT_READ, "stdout")
    selector.register(launcher.stderr, selectors.EVENT_READ, "stderr")
    status_file = os.fdopen(status_r, "rb", buffering=0)
    selector.register(status_file, selectors.EVENT_READ, "status")
    backstop = False
    try:
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:  # the launcher itself is stuck: kill it and everything of its session
                backstop = True
                _kill_group(launcher.pid)
                deadline = float("inf")
            for key, _ in selector.select(timeout=None if remaining <= 0 else remaining):
                chunk = os.read(key.fileobj.fileno(), _READ_CHUNK)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                if key.data == "status":
                    status += chunk
                    continue
                total += len(chunk)
                if key.data == "stdout" and not over_output:
                    stdout += chunk
                elif key.data == "stderr":
                    stderr_tail = (stderr_tail + chunk)[-_STDERR_TAIL_BYTES:]
                if total > limits.max_output_bytes and not over_output:
                    over_output = True
                    launcher.send_signal(signal.SIGTERM)  # the launcher kills the run
    finally:
        selector.close()
        status_file.close()
        launcher.stdout.close()
        launcher.stderr.close()
        launcher.wait()
    return _result(bytes(status), stdout, stderr_tail, limits, over_output, backstop, launcher.returncode)


def _result(status, stdout, stderr_tail, limits, over_output, backstop, returncode) -> RunResult:
    text = functools.partial(bytes.decode, encoding="utf-8", errors="replace")
    try:
        report = json.loads(status) if status else {}
    except json.JSONDecodeError:
        report = {}
    outcome = report.get("outcome")
    if over_output:
        outcome = "output_limit"
    elif outcome in ("setup_error", None, "stopped") or backstop:
        lines = [line for line in text(bytes(stderr_tail)).splitlines() if line.strip()]
        ended = f"the launcher ended with code {returncode}" + (f": {lines[-1][:200]}" if lines else "")
        error = report.get("error") or ("the launcher did not finish in time" if backstop else ended)
        return RunResult("sandbox_error", stderr=text(bytes(stderr_tail)), limits=limits, error=error)
    return RunResult(
        outcome=outcome,
        exit_code=report.get("exit_code"),
        signal=report.get("signal"),
        stdout=text(bytes(stdout)),
        stderr=text(bytes(stderr_tail)),
        wall_s=report.get("wall_s", 0.0),
        cpu_s=report.get("cpu_s", 0.0),
        max_rss_bytes=report.get("max_rss_bytes", 0),
        leftover_processes=report.get("leftover_processes", 0),
        limits=limits,
    )


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


_SUPPORTED: dict[tuple[str, str], str | None] = {}
_SUPPORTED_LOCK = threading.Lock()


def _check_supported(sandbox: Sandbox) -> None:
    """Runs ``print('ok')`` once per (isolation, interpreter) and process; a failure is a clear error."""
    key = (sandbox.isolation, sandbox.python)
    with _SUPPORTED_LOCK:
        if key not in _SUPPORTED:
            probe = replace(SandboxLimits(), wall_time_s=30.0, cpu_time_s=10.0)
            result = sandbox._run(sandbox.python_program("print('ok')"), probe)
            _SUPPORTED[key] = (
                None if result.ok and result.stdout.strip() == "ok" else (result.reason or "no output")
            )
    problem = _SUPPORTED[key]
    if problem is not None:
        hint = (
            " The kernel must allow user namespaces (sysctl user.max_user_namespaces > 0, and "
            "kernel.unprivileged_userns_clone=1 or apparmor_restrict_unprivileged_userns=0 where those "
            "exist); or set isolation: process (weaker: see mmrl/sandbox/runner.py)."
            if sandbox.isolation == "namespaces"
            else ""
        )
        raise SandboxError(
            f"the code sandbox (isolation={sandbox.isolation}, python={sandbox.python}) cannot run a "
            f"trivial program here: {problem}.{hint}"
        )
