"""The trusted side of one sandboxed run: ``python -I -S _launcher.py <spec.json>``.

Started by :class:`mmrl.sandbox.runner.Sandbox` in a session of its own, with the program's stdin
(an open file), stdout and stderr (pipes to the parent) and a status pipe (``spec["status_fd"]``) on
which it writes one JSON line at the end: how the program ended, its CPU time and memory, and how
many processes had to be killed after it. Standard library only: it runs before anything untrusted,
in a fresh interpreter, and must not import mmrl (the sandbox may not see it).

``isolation = "namespaces"`` (the kernel enforces everything, nothing relies on the program's
cooperation)::

    launcher (host)            waits with the wall-time deadline; on timeout or SIGTERM kills `init`
    └─ ns-child                unshare(user, mount, pid, net, ipc, uts, cgroup); uid 0 = nobody
       │                       (65534) outside when the launcher is root, else the caller's uid
       └─ init (pid 1)         builds a read-only root on a tmpfs and chroots into it; reaps orphans
          └─ program           own session, rlimits, every capability dropped, no_new_privs, exec

When ``init`` exits the kernel kills every process left in its pid namespace, and the ns-child's
``waitpid`` returns only once they are all gone: nothing the program starts (daemons, double forks,
``setsid``) outlives the run. The network namespace has only a loopback device, down: no socket
reaches the host (not even 127.0.0.1) or anything beyond.

``isolation = "process"`` (no namespaces: for kernels that refuse them): the program runs in its own
session with rlimits, as ``nobody`` when the launcher is root, in a private folder, with a Python
audit hook (``_guard.py``) that refuses sockets, process creation, ctypes, signals to other processes
and files outside its folder. Code that escapes the interpreter (a C extension) is not contained.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import resource
import select
import signal
import socket
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
# flags a bind remount inside a user namespace must keep (the kernel locks them on the original mount)
_KEPT_MOUNT_FLAGS = MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048 | 4096  # + atime flags

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP = 1, 4, 24
PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 28, 38, 47, 4
# NOROOT, NO_SETUID_FIXUP, KEEP_CAPS and NO_CAP_AMBIENT_RAISE, each with its lock: uid 0 gains nothing
_SECUREBITS_LOCKED = 0xEF
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

NOBODY = 65534
NEW_ROOT = "/tmp"  # a fresh tmpfs is mounted over it inside the mount namespace; the host's /tmp is untouched
WORK_DIR = "/sandbox"  # the program's folder inside the new root
DEVICES = ("null", "zero", "full", "random", "urandom")
EXIT_SETUP_FAILED = 70

_libc = ctypes.CDLL(None, use_errno=True)
_victim: list[int] = []  # [pid] (or [-pgid]) to SIGKILL when the parent asks the run to stop
_stop_requested = [False]


class SetupError(Exception):
    """The sandbox could not be built (not the program's fault)."""


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} (errno {err})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None, what: str):
    encode = lambda text: None if text is None else text.encode()  # noqa: E731
    _check(_libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), what)


def _prctl(option: int, value: int, what: str) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), what)


def main() -> None:
    with open(sys.argv[1]) as spec_file:
        spec = json.load(spec_file)
    signal.signal(signal.SIGTERM, _on_stop)
    # the run dies with the process that started it (a reward worker killed mid-batch leaves nothing)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != spec["parent_pid"]:
        return  # that process is already gone
    status_fd = spec["status_fd"]
    started = time.monotonic()
    try:
        if spec["isolation"] == "namespaces":
            report = _run_in_namespaces(spec)
        else:
            report = _run_as_process(spec)
    except SetupError as err:
        report = {"outcome": "setup_error", "error": str(err)}
    report["wall_s"] = round(time.monotonic() - started, 4)
    os.write(status_fd, json.dumps(report).encode() + b"\n")
    os.close(status_fd)


def _on_stop(signum, frame) -> None:
    _stop_requested[0] = True
    _kill_victim()


def _kill_victim() -> None:
    for pid in _victim:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(-pid, signal.SIGKILL) if pid < 0 else os.kill(pid, signal.SIGKILL)


def _wait_with_deadline(pid: int, wall_s: float) -> bool:
    """Waits for child ``pid`` to end; kills the victim at the deadline. True when the deadline hit."""
    pidfd = os.pidfd_open(pid)
    deadline = time.monotonic() + wall_s
    timed_out = False
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and not timed_out:
                timed_out = True
                _kill_victim()
            readable, _, _ = select.select([pidfd], [], [], max(remaining, 0) if not timed_out else None)
            if readable:
                return timed_out and not _stop_requested[0]
    finally:
        os.close(pidfd)


# ---------------------------------------------------------------------------------------------------
# isolation = namespaces


def _run_in_namespaces(spec: dict) -> dict:
    to_parent_r, to_parent_w = os.pipe()  # ns-child -> launcher: "unshared", then init's host pid
    go_r, go_w = os.pipe()  # launcher -> ns-child: the id maps are written
    status_r, status_w = os.pipe()  # init -> launcher: how the program ended
    if os.geteuid() == 0:
        os.setgroups([])  # the children must not keep root's supplementary groups
    child = os.fork()
    if child == 0:
        os.close(to_parent_r), os.close(go_w), os.close(status_r)
        try:
            _namespace_child(spec, to_parent_w, go_r, status_w)
        except BaseException as err:  # noqa: BLE001 - reported to the launcher, never raised on
            _write_quietly(to_parent_w, f"E{type(err).__name__}: {err}\n".encode())
        os._exit(EXIT_SETUP_FAILED)
    os.close(to_parent_w), os.close(go_r), os.close(status_w)
    messages = os.fdopen(to_parent_r, "rb", buffering=0)
    ns_fd = None
    try:
        _expect(messages, b"unshared")
        _write_id_maps(child)
        os.write(go_w, b"g")
        init_pid = int(_expect(messages, None))
        _victim.append(init_pid)
        # held open, the namespace keeps its inode number (no later namespace reuses it before our scan)
        ns_fd = os.open(f"/proc/{child}/ns/pid_for_children", os.O_RDONLY)
        os.write(go_w, b"a")
        if _stop_requested[0]:
            _kill_victim()
        timed_out = _wait_with_deadline(child, spec["limits"]["wall_s"])
        os.waitpid(child, 0)
        report = _read_status(status_r)
        if timed_out:
            report = {"outcome": "wall_timeout", **{k: v for k, v in report.items() if k != "outcome"}}
        elif _stop_requested[0] and report.get("outcome") is None:
            report["outcome"] = "stopped"
        report["leftover_processes"] = _kill_namespace_leftovers(os.fstat(ns_fd).st_ino)
        return report
    except (SetupError, OSError) as err:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        raise err if isinstance(err, SetupError) else SetupError(f"starting the namespaces: {err}") from err
    finally:
        if ns_fd is not None:
            os.close(ns_fd)
        os.close(status_r), os.close(go_w), messages.close()


def _write_quietly(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):
        os.write(fd, data)


def _expect(stream, word: bytes | None) -> bytes:
    line = stream.readline().strip()
    if line.startswith(b"E") or not line:
        raise SetupError(line[1:].decode(errors="replace") or "the sandbox's namespace child died")
    if word is not None and line != word:
        raise SetupError(f"unexpected message {line!r} from the sandbox's namespace child")
    return line


def _write_id_maps(child: int) -> None:
    """uid/gid 0 inside the namespace is `nobody` outside when we are root, else our own uid."""
    outer_uid, outer_gid = (NOBODY, NOBODY) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    try:
        with open(f"/proc/{child}/setgroups", "w") as setgroups:
            setgroups.write("deny")
        with open(f"/proc/{child}/uid_map", "w") as uid_map:
            uid_map.write(f"0 {outer_uid} 1")
        with open(f"/proc/{child}/gid_map", "w") as gid_map:
            gid_map.write(f"0 {outer_gid} 1")
    except OSError as err:
        raise SetupError(f"writing the user namespace's id maps: {err}") from err


def _namespace_child(spec: dict, to_parent: int, go: int, status_w: int) -> None:
    launcher = os.getppid()
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")
    flags = (
        CLONE_NEWUSER
        | CLONE_NEWNS
        | CLONE_NEWPID
        | CLONE_NEWNET
        | CLONE_NEWIPC
        | CLONE_NEWUTS
        | CLONE_NEWCGROUP
    )
    _check(_libc.unshare(flags), "unshare(user, mount, pid, net, ipc, uts, cgroup namespaces)")
    # Opened in the new mount namespace (a bind mount's source must be of it) but still with the
    # caller's uid: as `nobody`, the path to e.g. /root/.pyenv could not be traversed.
    spec["sources"] = [_open_source(path) for path in spec["read_only_paths"]]
    os.write(to_parent, b"unshared\n")
    if os.read(go, 1) != b"g":
        raise SetupError("the launcher did not write the id maps")
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)  # now `nobody` (or the caller) outside, with capabilities inside only
    # a change of credentials clears the parent-death signal: set it again, then check the launcher lives
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != launcher:
        raise SetupError("the launcher died")
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None, "making mounts private")
    init = os.fork()
    if init == 0:
        try:
            _init(spec, status_w)
        except BaseException as err:  # noqa: BLE001 - reported as a setup error, never raised on
            _write_quietly(status_w, json.dumps({"outcome": "setup_error", "error": str(err)}).encode())
        os._exit(EXIT_SETUP_FAILED)
    os.write(to_parent, f"{init}\n".encode())
    os.read(go, 1)  # the launcher holds the namespace open now (it needs this process alive for that)
    os.waitpid(init, 0)  # returns once every process of the pid namespace is gone
    os._exit(0)


def _init(spec: dict, status_w: int) -> None:
    """pid 1 of the new pid namespace: builds the root, starts the program, reaps, reports."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # pid 1 ignores default-handled signals from inside
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    proc_mounted = _build_root(spec)
    _prctl(PR_SET_DUMPABLE, 0, "prctl(PR_SET_DUMPABLE)")  # the program cannot ptrace or read init
    program = os.fork()
    if program == 0:
        os.close(status_w)
        _exec_program(spec, in_namespaces=True)
    while True:
        pid, status, usage = os.wait4(-1, 0)
        if pid == program:
            break
    report = _describe_exit(status, usage)
    report["proc_mounted"] = proc_mounted
    os.write(status_w, json.dumps(report).encode())
    os._exit(0)


def _build_root(spec: dict) -> bool:
    """Mounts the new root (read-only system folders, private tmpfs /sandbox and /tmp) and enters it."""
    disk = int(spec["limits"]["disk_bytes"])
    _mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755", "mounting the root tmpfs")
    for path, link, fd in spec["sources"]:
        _bind_read_only(path, link, fd)
    _make_dev(NEW_ROOT + "/dev")
    os.mkdir(NEW_ROOT + "/proc")
    try:  # refused where /proc is partly masked (some containers): Python runs without it
        _mount("proc", NEW_ROOT + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, None, "mounting /proc")
        proc_mounted = True
    except SetupError:
        proc_mounted = False
    _forbid_nested_namespaces(NEW_ROOT + "/proc" if proc_mounted else "/proc")
    for folder, mode in ((WORK_DIR, "755"), ("/tmp", "1777")):
        os.makedirs(NEW_ROOT + folder, exist_ok=True)
        options = f"size={disk},mode={mode}"
        _mount("tmpfs", NEW_ROOT + folder, "tmpfs", MS_NOSUID | MS_NODEV, options, f"mounting {folder}")
    for name, text in spec["files"].items():
        with open(os.path.join(NEW_ROOT + WORK_DIR, name), "w") as file:
            file.write(text)
    remount = MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
    _mount(None, NEW_ROOT, None, remount, "size=1m,mode=755", "making the root read-only")
    os.chroot(NEW_ROOT)
    os.chdir(WORK_DIR)
    socket.sethostname("sandbox")
    return proc_mounted


def _open_source(path: str) -> tuple[str, str | None, int | None]:
    """(path, symlink target or None, O_PATH descriptor or None) of a read-only path."""
    if os.path.islink(path):  # e.g. /lib -> usr/lib on merged-/usr systems: recreated, not bound
        return path, os.readlink(path), None
    try:
        return path, None, os.open(path, os.O_PATH)
    except OSError as err:
        raise SetupError(f"opening read-only path {path}: {err}") from err


def _forbid_nested_namespaces(proc: str) -> None:
    """Per user namespace limits: the program may create no namespace of its own (none is needed)."""
    for kind in ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup", "time"):
        try:
            with open(f"{proc}/sys/user/max_{kind}_namespaces", "w") as limit:
                limit.write("0")
        except OSError:
            continue  # an older kernel without that limit: the locked mounts and no capabilities remain


def _bind_read_only(source: str, link: str | None, fd: int | None) -> None:
    target = NEW_ROOT + source
    if link is not None:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            os.symlink(link, target)
        return
    if os.path.isdir(f"/proc/self/fd/{fd}"):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "w").close()
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND, None, f"binding {source}")
    kept = os.statvfs(target).f_flag & _KEPT_MOUNT_FLAGS
    flags = kept | MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
    _mount(None, target, None, flags, None, f"making {source} read-only")


def _make_dev(dev: str) -> None:
    os.mkdir(dev)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755", "mounting /dev")
    for name in DEVICES:
        open(f"{dev}/{name}", "w").close()
        _mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND, None, f"binding /dev/{name}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0")):
        os.symlink(target, f"{dev}/{name}")
    for number, name in ((1, "stdout"), (2, "stderr")):
        os.symlink(f"/proc/self/fd/{number}", f"{dev}/{name}")


def _drop_capabilities() -> None:
    """No capability now or after exec, even as uid 0 of the namespace; no setuid gains either."""
    _prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl(PR_SET_NO_NEW_PRIVS)")
    _prctl(PR_SET_SECUREBITS, _SECUREBITS_LOCKED, "prctl(PR_SET_SECUREBITS)")
    _check(_libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clearing ambient capabilities")
    for capability in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0 and ctypes.get_errno() != 22:  # EINVAL
            _check(-1, f"dropping capability {capability} from the bounding set")
    header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable x 2 words, all zero
    _check(_libc.capset(header, data), "capset (dropping every capability)")


# ---------------------------------------------------------------------------------------------------
# isolation = process


def _run_as_process(spec: dict) -> dict:
    program = os.fork()
    if program == 0:
        _exec_program(spec, in_namespaces=False)
    _victim.append(-program)  # its process group (the program leads a new session)
    if _stop_requested[0]:
        _kill_victim()
    timed_out = _wait_with_deadline(program, spec["limits"]["wall_s"])
    _, status, usage = os.wait4(program, 0)
    report = _describe_exit(status, usage)
    if timed_out:
        report["outcome"] = "wall_timeout"
    elif _stop_requested[0]:
        report["outcome"] = "stopped"
    report["leftover_processes"] = _kill_session_leftovers(program)
    return report


# ---------------------------------------------------------------------------------------------------
# the program


def _exec_program(spec: dict, in_namespaces: bool) -> None:
    """In the forked program process: session, limits, privileges, then exec. Never returns."""
    try:
        os.setsid()
        _set_limits(spec["limits"], in_namespaces)
        if in_namespaces:
            _drop_capabilities()
        else:
            if spec["as_nobody"]:
                os.setgroups([])
                os.setresgid(NOBODY, NOBODY, NOBODY)
                os.setresuid(NOBODY, NOBODY, NOBODY)
            _prctl(PR_SET_NO_NEW_PRIVS, 1, "prctl(PR_SET_NO_NEW_PRIVS)")
            _prctl(PR_SET_PDEATHSIG, signal.SIGKILL, "prctl(PR_SET_PDEATHSIG)")  # after the uid change
            os.chdir(spec["work_dir"])
        os.closerange(3, 65536)
        argv = spec["argv"]
        os.execve(argv[0], argv, spec["env"])
    except BaseException as err:  # noqa: BLE001 - the program's stderr is the only channel left
        os.write(2, f"mmrl-sandbox: could not start the program: {err}\n".encode())
    os._exit(EXIT_SETUP_FAILED)


def _set_limits(limits: dict, in_namespaces: bool) -> None:
    cpu_s = max(1, math.ceil(limits["cpu_s"]))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU, then SIGKILL a second later
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_size_bytes"],) * 2)
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits["max_open_files"],) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if in_namespaces:
        # counted per (user namespace, uid): the ns-child and init are 2 of them
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"] + 2,) * 2)


def _describe_exit(status: int, usage) -> dict:
    report = {
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 4),
        "max_rss_bytes": usage.ru_maxrss * 1024,
    }
    if os.WIFSIGNALED(status):
        report.update(outcome="signaled", signal=os.WTERMSIG(status))
    else:
        report.update(outcome="exited", exit_code=os.WEXITSTATUS(status))
    return report


def _read_status(status_r: int) -> dict:
    chunks = []
    while chunk := os.read(status_r, 65536):
        chunks.append(chunk)
    if not chunks:
        return {"outcome": None}  # init was killed (wall time, or the parent stopped the run)
    return json.loads(b"".join(chunks))


# ---------------------------------------------------------------------------------------------------
# what outlives a run


def _processes() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def _kill_namespace_leftovers(namespace_inode: int) -> int:
    """Kills processes still in the run's pid namespace (the kernel leaves none; this checks it)."""
    leftovers = []
    for pid in _processes():
        try:
            if os.stat(f"/proc/{pid}/ns/pid").st_ino == namespace_inode:
                leftovers.append(pid)
        except OSError:
            continue
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(leftovers)


def _kill_session_leftovers(session: int) -> int:
    """Kills processes still in the program's session or process group (isolation = process)."""
    leftovers = []
    for pid in _processes():
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == session or int(fields[3]) == session:  # process group, session
            leftovers.append(pid)
    for pid in leftovers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(leftovers)


if __name__ == "__main__":
    main()
