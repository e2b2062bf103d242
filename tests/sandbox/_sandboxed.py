"""What the sandbox tests look for on the host: processes that are in some sandbox."""

from __future__ import annotations

import os


def foreign_processes() -> set[int]:
    """Processes in another user namespace than this one's (every sandboxed process is in one)."""
    ours = os.stat("/proc/self/ns/user").st_ino
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}/ns/user").st_ino != ours:
                    found.add(int(name))
            except OSError:
                continue
    return found
