"""Python audit hook for ``isolation = "process"``: ``python -I -B _guard.py <policy.json> <program.py>``.

Runs inside the sandboxed interpreter before the program and refuses, from then on, what the
program could otherwise do with the launcher's user's rights (no namespaces isolate it in this
mode): sockets of any kind, creating processes (fork, exec, spawn, ``os.system``, ``subprocess``),
ctypes (a way around every other check), signals to other processes, and opening, listing or
changing files outside the allowed folders (its own folder for writing; that folder and the
interpreter's for reading). A refused call raises ``PermissionError`` naming the event.

An audit hook cannot be removed once added, but it only sees what goes through the interpreter:
a C extension's own system calls are not seen. That is why ``namespaces`` is the default.
Standard library only.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

_REFUSED_PREFIXES = ("socket.", "ctypes.", "subprocess.", "os.exec", "os.spawn", "os.posix_spawn")
_REFUSED_EVENTS = {
    "os.fork",
    "os.forkpty",
    "os.system",
    "os.startfile",
    "pty.spawn",
    "_posixsubprocess.fork_exec",
}
_WRITE_EVENTS = {
    "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.symlink", "os.link", "os.truncate",
    "os.chmod", "os.chown", "os.utime", "os.setxattr", "os.removexattr", "shutil.rmtree",
}  # fmt: skip
_READ_EVENTS = {"os.listdir", "os.scandir", "os.chdir", "glob.glob", "os.listxattr", "os.getxattr"}


def _install(policy: dict) -> None:
    write_roots = tuple(os.path.realpath(path) for path in policy["write_roots"])
    read_roots = write_roots + tuple(os.path.realpath(path) for path in policy["read_roots"])
    own_pid = os.getpid()

    def inside(path, roots) -> bool:
        if isinstance(path, int):  # an already open descriptor
            return True
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            return True  # e.g. None for os.listdir(): the current folder, checked on chdir
        real = os.path.realpath(path)
        return any(real == root or real.startswith(root.rstrip("/") + "/") for root in roots)

    def hook(event: str, args: tuple) -> None:
        if event in _REFUSED_EVENTS or event.startswith(_REFUSED_PREFIXES):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event in ("os.kill", "os.killpg", "signal.pthread_kill") and args and args[0] not in (0, own_pid):
            raise PermissionError(f"sandbox: {event} of another process is not allowed")
        if event == "open":
            path, mode = args[0], args[1] or "r"
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            writing = any(c in str(mode) for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
            if not inside(path, write_roots if writing else read_roots):
                raise PermissionError(f"sandbox: opening {path!r} is not allowed")
        elif event in _WRITE_EVENTS:
            for path in args[:2]:
                if isinstance(path, (str, bytes)) and not inside(path, write_roots):
                    raise PermissionError(f"sandbox: {event} on {path!r} is not allowed")
        elif event in _READ_EVENTS and args and not inside(args[0], read_roots):
            raise PermissionError(f"sandbox: {event} on {args[0]!r} is not allowed")

    sys.addaudithook(hook)


def main() -> None:
    policy = json.loads(sys.argv[1])
    program = sys.argv[2]
    sys.argv = sys.argv[2:]
    _install(policy)
    runpy.run_path(program, run_name="__main__")


if __name__ == "__main__":
    main()
