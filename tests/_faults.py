"""Real file-system faults for tests: a small tmpfs that fills up, a folder that cannot be written."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(path: Path, size_bytes: int):
    path.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def fill_disk(folder: Path) -> Path:
    """Writes a file under ``folder`` until the file system is full; returns it."""
    filler = folder / "filler.bin"
    with open(filler, "wb", buffering=0) as file, contextlib.suppress(OSError):
        while True:
            file.write(b"\0" * 4096)
    assert shutil.disk_usage(folder).free < 8192
    return filler


@contextlib.contextmanager
def unwritable(folder: Path):
    """``folder`` made unwritable for real: immutable as root (root ignores permission bits), read-only
    permission bits otherwise."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(folder)], check=True)
        try:
            yield
        finally:
            subprocess.run(["chattr", "-i", str(folder)], check=True)
    else:
        folder.chmod(0o555)
        try:
            yield
        finally:
            folder.chmod(0o755)
