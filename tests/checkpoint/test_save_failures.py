"""A checkpoint save that fails for real — a full disk (a small tmpfs filled up), a folder that cannot be
written (immutable as root, read-only otherwise) — raises the OS error and leaves the last complete
checkpoint, and the tracker, intact and loadable; the partial ``.tmp`` folder is ignored by
find-last and removed by the next save.

A tmpfs mount needs root (CAP_SYS_ADMIN), as on the project's machines; elsewhere the disk-full test
is skipped with that reason.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from mmrl.checkpoint import (
    CheckpointLayout,
    find_last_checkpoint,
    load_train_state,
    load_trainer_state,
    save_train_state,
    save_trainer_state,
)

TMPFS_BYTES = 1 << 20  # one small checkpoint (~10 KB) fits, the filler then takes the rest


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(16, 16)


def _save(layout: CheckpointLayout, step: int, model: nn.Module) -> None:
    tmp_dir = layout.begin(step)
    save_train_state(tmp_dir / "actor", model)
    save_trainer_state(tmp_dir, {"global_step": step})
    layout.commit(step)


def _assert_step_intact(save_dir: Path, step: int, model: nn.Module) -> None:
    """find-last picks ``step``, the tracker says so, and its weights load back equal to ``model``'s."""
    assert find_last_checkpoint(save_dir) == save_dir / f"global_step_{step}"
    assert CheckpointLayout(save_dir).read_tracker()["latest_step"] == step
    assert load_trainer_state(save_dir / f"global_step_{step}")["global_step"] == step
    loaded = _model(seed=99)
    load_train_state(save_dir / f"global_step_{step}" / "actor", loaded)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


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


def test_full_disk_at_save_time_keeps_the_previous_checkpoint(tmp_path):
    with small_tmpfs(tmp_path / "disk", TMPFS_BYTES) as disk:
        save_dir = disk / "checkpoints"
        layout = CheckpointLayout(save_dir)
        first = _model(seed=1)
        _save(layout, 1, first)
        filler = fill_disk(disk)

        with pytest.raises(OSError) as raised:  # DCP's CheckpointException turned back into it
            _save(layout, 2, _model(seed=2))
        assert raised.value.errno == errno.ENOSPC
        assert str(save_dir / "global_step_2.tmp") in str(raised.value.filename)

        _assert_step_intact(save_dir, 1, first)
        assert (save_dir / "global_step_2.tmp").is_dir()  # the partial save, ignored by find-last
        filler.unlink()  # space freed: the next save removes the partial folder and succeeds
        second = _model(seed=2)
        _save(layout, 2, second)
        assert sorted(p.name for p in save_dir.iterdir()) == [
            "checkpoint_tracker.json",
            "global_step_1",
            "global_step_2",
        ]
        _assert_step_intact(save_dir, 2, second)


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


def test_unwritable_folder_at_save_time_keeps_the_previous_checkpoint(tmp_path):
    save_dir = tmp_path / "checkpoints"
    layout = CheckpointLayout(save_dir)
    first = _model(seed=1)
    _save(layout, 1, first)
    with unwritable(save_dir):
        with pytest.raises(PermissionError) as raised:
            _save(layout, 2, _model(seed=2))
        assert str(save_dir / "global_step_2.tmp") in str(raised.value)  # the OS error names the path
        _assert_step_intact(save_dir, 1, first)
    assert not (save_dir / "global_step_2.tmp").exists()  # nothing could be written: no debris
