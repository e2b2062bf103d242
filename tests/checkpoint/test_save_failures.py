"""A checkpoint save that fails for real — a full disk (a small tmpfs filled up), a folder that cannot be
written (immutable as root, read-only otherwise) — raises the OS error and leaves the last complete
checkpoint, and the tracker, intact and loadable; the partial ``.tmp`` folder is ignored by
find-last and removed by the next save.

A tmpfs mount needs root (CAP_SYS_ADMIN), as on the project's machines; elsewhere the disk-full test
is skipped with that reason.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from _faults import fill_disk, small_tmpfs, unwritable
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
