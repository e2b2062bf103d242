"""A checkpoint is read as tensors and plain data: a file whose unpickling would run a command is
refused with a message naming it, and the command never runs. Checkpoints written before RNG states
were plain data (NumPy arrays in the rank files) still resume."""

from __future__ import annotations

import io
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from mmrl.checkpoint.safe_load import SafeLoadPlanner, UnsafeCheckpointError
from mmrl.checkpoint.state import EXTRA_FILE, load_train_state, rank_file, save_train_state
from mmrl.workers.fsdp_engine import build_lr_scheduler


class _RunsCommand:
    """Unpickles as ``os.system(command)``: what a tampered checkpoint would carry."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def _trained(directory: Path, extra: dict | None = None) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = build_lr_scheduler(optimizer, 10, 0, "cosine")
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    scheduler.step()
    save_train_state(directory, model, optimizer, scheduler, extra=extra)
    return model, optimizer, scheduler


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer, object]:
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, optimizer, build_lr_scheduler(optimizer, 10, 0, "cosine")


def _assert_refused(directory: Path, tampered: Path, marker: Path) -> None:
    with pytest.raises(UnsafeCheckpointError) as refused:
        load_train_state(directory, *_fresh())
    message = str(refused.value)
    assert str(tampered) in message and "posix.system" in message, message
    assert not marker.exists(), "the checkpoint's payload ran"
    # the payload is real: the unsafe reader mmrl used before would have run it
    with open(tampered, "rb") as file:
        (torch.load(file, weights_only=False) if tampered.suffix == ".pt" else pickle.load(file))
    assert marker.exists()


def test_a_rank_file_carrying_a_command_is_refused_and_runs_nothing(tmp_path):
    _trained(tmp_path / "actor")
    marker = tmp_path / "ran"
    tampered = tmp_path / "actor" / rank_file(0)
    state = torch.load(tampered, weights_only=True)
    torch.save({**state, "rng": _RunsCommand(f"touch {marker}")}, tampered)
    _assert_refused(tmp_path / "actor", tampered, marker)


def test_an_extra_file_carrying_a_command_is_refused(tmp_path):
    _trained(tmp_path / "actor", extra={"step": 3})
    marker = tmp_path / "ran"
    tampered = tmp_path / "actor" / EXTRA_FILE
    torch.save({"step": _RunsCommand(f"touch {marker}")}, tampered)
    _assert_refused(tmp_path / "actor", tampered, marker)


def test_a_dcp_index_carrying_a_command_is_refused(tmp_path):
    """The model folder's ``.metadata`` is a plain pickle that DCP itself would ``pickle.load``."""
    _trained(tmp_path / "actor")
    marker = tmp_path / "ran"
    tampered = tmp_path / "actor" / "model" / ".metadata"
    tampered.write_bytes(pickle.dumps(_RunsCommand(f"touch {marker}")))
    _assert_refused(tmp_path / "actor", tampered, marker)


def test_a_dcp_non_tensor_entry_carrying_a_command_is_refused(tmp_path):
    """The optimizer's ``param_groups`` numbers are stored as torch.save bytes inside the .distcp files."""
    marker = tmp_path / "ran"
    payload = io.BytesIO()
    torch.save(_RunsCommand(f"touch {marker}"), payload)
    payload.seek(0)
    planner = SafeLoadPlanner(tmp_path / "optimizer")
    planner.flatten_state_dict = False
    planner.state_dict = {}

    class _Item:
        class dest_index:  # noqa: N801 - the shape of DCP's ReadItem.dest_index
            fqn = "param_groups.0.lr"

    with pytest.raises(UnsafeCheckpointError, match=r"optimizer.*param_groups\.0\.lr.*posix\.system"):
        planner.load_bytes(_Item, payload)
    assert not marker.exists()
    payload = io.BytesIO()
    torch.save(0.25, payload)
    payload.seek(0)
    planner.load_bytes(_Item, payload)
    assert planner.state_dict == {"param_groups.0.lr": 0.25}


def test_a_checkpoint_written_before_plain_rng_states_still_resumes(tmp_path):
    """Rank files of earlier versions held numpy.random.get_state() itself (a uint32 array): the
    allow-list reads them, and the NumPy random stream continues where it was saved."""
    model, optimizer, scheduler = _trained(tmp_path / "actor")
    np.random.seed(7)
    random.seed(7)
    rank_path = tmp_path / "actor" / rank_file(0)
    state = torch.load(rank_path, weights_only=True)
    state["rng"] = {**state["rng"], "numpy": np.random.get_state(), "python": random.getstate()}
    torch.save(state, rank_path)  # what save_train_state wrote before
    expected = np.random.rand(3)

    np.random.seed(0)
    restored, restored_optimizer, restored_scheduler = _fresh()
    load_train_state(tmp_path / "actor", restored, restored_optimizer, restored_scheduler)
    np.testing.assert_array_equal(np.random.rand(3), expected)
    assert restored_scheduler.last_epoch == scheduler.last_epoch == 1
    torch.testing.assert_close(restored.weight, model.weight, rtol=0, atol=0)


def test_rank_files_hold_only_what_a_weights_only_load_accepts(tmp_path):
    _trained(tmp_path / "actor")
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(tmp_path / "actor" / rank_file(0))) == []


def test_the_merger_imports_no_module_a_checkpoint_names_outside_transformers(tmp_path, monkeypatch):
    """``mmrl_state.json`` names the model class the merger builds: a tampered one naming a module whose
    import runs a command (here one on ``sys.path``) is refused before the import."""
    import json

    from mmrl.checkpoint.merger import MergeNotSupportedError, merge_checkpoint

    _trained(tmp_path / "actor")
    marker = tmp_path / "ran"
    (tmp_path / "modules").mkdir()
    (tmp_path / "modules" / "planted_model.py").write_text(f"import os\nos.system('touch {marker}')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "modules"))
    info_path = tmp_path / "actor" / "mmrl_state.json"
    info_path.write_text(
        json.dumps({**json.loads(info_path.read_text()), "model_class": "planted_model:Model"})
    )
    with pytest.raises(
        MergeNotSupportedError, match=r"mmrl_state.json names the model class planted_model:Model"
    ):
        merge_checkpoint(tmp_path / "actor", tmp_path / "merged")
    assert not marker.exists()


def test_the_driver_checks_a_role_folder_before_the_workers_load_it(tmp_path):
    """``check_role_folder`` (preflight and resume, on the driver) reads the rank, extra and index files."""
    from mmrl.checkpoint.safe_load import check_role_folder

    _trained(tmp_path / "actor", extra={"step": 3})
    check_role_folder(tmp_path / "actor")  # a folder mmrl wrote passes
    marker = tmp_path / "ran"
    tampered = tmp_path / "actor" / "optimizer" / ".metadata"
    tampered.write_bytes(pickle.dumps(_RunsCommand(f"touch {marker}")))
    with pytest.raises(UnsafeCheckpointError, match=r"optimizer/\.metadata was refused.*posix\.system"):
        check_role_folder(tmp_path / "actor")
    assert not marker.exists()
