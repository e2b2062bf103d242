"""Worker-side training state: model, optimizer, LR scheduler and random state, saved and loaded.

Every rank of the training process group calls these functions together. One call writes one role's
folder (``global_step_N.tmp/actor`` for instance)::

    model/                    model weights, torch.distributed.checkpoint (DCP), sharded by rank
    optimizer/                optimizer state, DCP (only when an optimizer is given)
    extra_state_rank{r}.pt    LR scheduler state and rank r's RNG states, with the world size
                              (tensors and plain data: read back weights-only)
    extra.pt                  the caller's ``extra`` dict of plain data (rank 0; only when given)
    huggingface/              config, generation config, tokenizer and processor files copied from
                              the model's source folder (rank 0; only when ``hf_source_dir`` is given)
    model_config.json         the trained model's own config (rank 0; Hugging Face models)
    mmrl_state.json           world size, model class and parts written (rank 0); with a LoRA
                              adapter its description (``lora``: rank, alpha, adapted modules, base)

With a LoRA adapter (``adapter`` given) ``model/`` holds the trainable tensors only (the adapter's
``lora_A``/``lora_B``), ``optimizer/`` their states: the frozen base is the model folder the run
started from, recorded as ``lora.base_model_path``, and is not copied.

DCP stores each tensor with its global shape and the offsets of every rank's shard, so a checkpoint
saved by N ranks loads on M ranks (or in one process without ``torch.distributed``) and into FSDP2
(DTensor) or plain parameters alike. Random state is per rank: it is restored only when the world
size is the one it was saved with; otherwise training resumes correctly but not bit-exactly.

Nothing is unpickled on load: every file is read by :mod:`mmrl.checkpoint.safe_load` (weights-only
``torch.load``, an allow-listed DCP index), so a tampered checkpoint is refused instead of running code.
"""

from __future__ import annotations

import copy
import errno
import fnmatch
import json
import logging
import os
import random
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from mmrl.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, load_plain, read_dcp_metadata
from mmrl.models.lora import adapter_layers

logger = logging.getLogger(__name__)

FULL_DISK_BYTES = 1024**2  # less free space than this after a failed write: the disk is full

MODEL_DIR = "model"
OPTIMIZER_DIR = "optimizer"
HF_DIR = "huggingface"
EXTRA_FILE = "extra.pt"
STATE_INFO_FILE = "mmrl_state.json"
MODEL_CONFIG_FILE = "model_config.json"

# Hugging Face files that describe a model without being its weights: configs, tokenizer, processor,
# chat template, and remote code (``trust_remote_code`` folders).
HF_METADATA_PATTERNS = (
    "config.json",
    "generation_config.json",
    "*tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",
    "preprocessor_config.json",
    "*processor_config.json",
    "*.py",
    "spk_dict.pt",  # Qwen2.5-Omni speaker table, read with the model
)


def rank_file(rank: int) -> str:
    """Name of rank ``rank``'s scheduler + RNG file."""
    return f"extra_state_rank{rank}.pt"


def _rank_and_world_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


@contextmanager
def _single_process_quietly() -> Iterator[None]:
    # Without a process group DCP warns that it assumes one process; that is exactly the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled|unavailable)")
        yield


class _RecordingWriter(FileSystemWriter):
    """DCP's file writer, remembering the data files this rank wrote (names relative to its folder)."""

    written: tuple[str, ...] = ()

    def write_data(self, plan: Any, planner: Any) -> Any:
        future = super().write_data(plan, planner)
        self.written = tuple(sorted({result.storage_data.relative_path for result in future.wait()}))
        return future


def _disk_full(directory: Path) -> bool:
    """Whether the filesystem of ``directory`` has less than ``FULL_DISK_BYTES`` left."""
    try:
        return shutil.disk_usage(directory).free < FULL_DISK_BYTES
    except OSError:
        return False


def save_dcp(state_dict: dict[str, Any], directory: Path) -> tuple[list[str], list[str]]:
    """``dcp.save`` of ``state_dict`` into ``directory``; collective, or single-process without a group.

    Returns (the data files this rank wrote, every data file the checkpoint's index names), relative to
    ``directory``; the index (``.metadata``) is written by rank 0.
    """
    from torch.distributed.checkpoint.api import CheckpointException

    writer = _RecordingWriter(directory)
    try:
        with _single_process_quietly():
            metadata = dcp.save(state_dict, storage_writer=writer)
    except CheckpointException as error:
        # a BaseException (Ray would not report it as a task error) holding each failed rank's
        # error; a full disk or an unwritable folder (on any rank) is raised as an OSError naming the folder
        for rank, (failure, _) in sorted(error.failures.items()):
            if isinstance(failure, OSError):
                raise OSError(
                    failure.errno, f"{failure.strerror} (rank {rank}, DCP save)", str(directory)
                ) from None
        if _disk_full(directory):  # torch's zip writer reports ENOSPC as "unexpected pos ..." (RuntimeError)
            rank = min(error.failures)
            raise OSError(
                errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} (rank {rank}, DCP save)", str(directory)
            ) from None
        raise RuntimeError(str(error)) from None
    except OSError as error:  # without a process group DCP lets a writer's error through unwrapped
        if error.filename is not None:
            raise
        raise OSError(error.errno, f"{error.strerror} (DCP save)", str(directory)) from None
    # every rank gets the index DCP wrote, so each knows the files a complete folder holds
    indexed = sorted({info.relative_path for info in metadata.storage_data.values()})
    return list(writer.written), indexed


def load_dcp(state_dict: dict[str, Any], directory: Path) -> None:
    """``dcp.load`` into the tensors of ``state_dict`` (in place), resharding to their layout."""
    if not (directory / ".metadata").is_file():
        raise FileNotFoundError(
            f"{directory} holds no torch.distributed.checkpoint (no .metadata file); expected a folder "
            f"written by mmrl.checkpoint.save_train_state"
        )
    read_dcp_metadata(directory)  # a tampered index is refused here, not wrapped in DCP's per-rank report
    with _single_process_quietly():
        dcp.load(
            state_dict, storage_reader=SafeFileSystemReader(directory), planner=SafeLoadPlanner(directory)
        )


def capture_rng_state() -> dict[str, Any]:
    """RNG states of python ``random``, numpy, torch CPU and (when available) the current CUDA device,
    as tensors and plain data so that they load weights-only (numpy's uint32 key array as the int32
    tensor of the same bits)."""
    bit_generator, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state = {
        "python": random.getstate(),
        "numpy": (
            bit_generator,
            torch.from_numpy(keys.view(np.int32).copy()),
            position,
            has_gauss,
            cached_gaussian,
        ),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng_state``; a saved CUDA state is ignored on a machine without CUDA."""
    random.setstate(state["python"])
    bit_generator, keys, position, has_gauss, cached_gaussian = state["numpy"]
    # keys: an int32 tensor, or the uint32 array of checkpoints written before RNG states were plain data
    keys = (
        keys.numpy().view(np.uint32) if isinstance(keys, torch.Tensor) else np.asarray(keys, dtype=np.uint32)
    )
    np.random.set_state((bit_generator, keys, position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


def model_class_path(model: nn.Module) -> str:
    """``module:QualName`` of the model's own class, seen through FSDP2's dynamic ``FSDP<Name>`` class."""
    from torch.distributed.fsdp import FSDPModule

    for cls in type(model).__mro__:
        if not issubclass(cls, FSDPModule):
            return f"{cls.__module__}:{cls.__qualname__}"
    raise TypeError(f"cannot find the model class of {type(model).__name__}")


def copy_hf_metadata(source_dir: str | Path, target_dir: str | Path) -> list[str]:
    """Copies the non-weight Hugging Face files (``HF_METADATA_PATTERNS``) of ``source_dir``; returns names."""
    source_dir, target_dir = Path(source_dir), Path(target_dir)
    if not source_dir.is_dir():
        raise FileNotFoundError(
            f"Hugging Face folder {source_dir} does not exist; expected the model folder with config.json "
            f"and tokenizer files"
        )
    target_dir.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(source_dir.iterdir()):
        if path.is_file() and any(fnmatch.fnmatch(path.name, pattern) for pattern in HF_METADATA_PATTERNS):
            shutil.copy2(path, target_dir / path.name)
            copied.append(path.name)
    return copied


def _write_model_files(directory: Path, model: nn.Module, hf_source_dir: str | Path | None) -> None:
    """Rank 0: the source folder's config/tokenizer/processor files into ``huggingface/``, and the live
    model config as ``model_config.json``.

    The live config records what was trained (overrides applied at load, a critic's ``num_labels``);
    its ``architectures`` names the class the merger builds. ``huggingface/config.json`` stays the
    source's, which may describe a larger class (Qwen2.5-Omni around the trained thinker).
    """
    if hf_source_dir is not None:
        copy_hf_metadata(hf_source_dir, directory / HF_DIR)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_file"):
        config = copy.deepcopy(config)
        config.architectures = [model_class_path(model).split(":")[1]]
        config.to_json_file(str(directory / MODEL_CONFIG_FILE))


def adapter_info(
    rank: int, alpha: float, module_names: list[str], base_model_path: str | Path
) -> dict[str, Any]:
    """What a LoRA checkpoint records to be merged or exported without the run's config: the adapter's
    rank and alpha (scale ``alpha / rank``), the full names of the adapted modules and the base model
    folder."""
    return {
        "rank": rank,
        "alpha": alpha,
        "modules": list(module_names),
        "base_model_path": str(base_model_path),
    }


def _model_state(model: nn.Module, adapter: dict[str, Any] | None) -> dict[str, Any]:
    """``get_model_state_dict``; with an adapter, its trainable tensors alone (the frozen base of a
    LoRA run is its source model folder). ``ignore_frozen_params`` alone would keep a tied alias of a
    frozen weight (``lm_head.weight``), which ``named_parameters`` does not list."""
    if adapter is None:
        return get_model_state_dict(model)
    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    return {name: tensor for name, tensor in state.items() if name in trainable}


def save_train_state(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any | None = None,
    hf_source_dir: str | Path | None = None,
    extra: dict[str, Any] | None = None,
    adapter: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Saves the training state of ``model`` into ``directory`` (layout in the module docstring).
    ``adapter``: the LoRA adapter's description (:func:`adapter_info`); only the trainable tensors
    are saved then.

    Collective: every rank of the default process group calls it (or one process without one). Model
    and optimizer are sharded DCP checkpoints of ``get_model_state_dict`` / ``get_optimizer_state_dict``
    (FQN keys, so they load into FSDP2 and plain models alike). Returns after every rank has finished,
    with this rank's report (:func:`missing_from_reports` judges a folder complete from all of them).
    """
    directory = Path(directory)
    rank, world_size = _rank_and_world_size()
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    _barrier()

    written, required = [], [STATE_INFO_FILE, *(rank_file(r) for r in range(world_size))]
    parts = [(MODEL_DIR, lambda: _model_state(model, adapter))]
    if optimizer is not None:
        parts.append((OPTIMIZER_DIR, lambda: get_optimizer_state_dict(model, optimizer)))
        required.append(f"{OPTIMIZER_DIR}/.metadata")
    for subdir, state in parts:
        mine, indexed = save_dcp(state(), directory / subdir)
        written += [f"{subdir}/{name}" for name in mine]
        required += [f"{subdir}/{name}" for name in (".metadata", *indexed)]

    rank_state = {
        "world_size": world_size,
        "rank": rank,
        "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "rng": capture_rng_state(),
    }
    torch.save(rank_state, directory / rank_file(rank))
    written.append(rank_file(rank))
    if extra is not None:
        required.append(EXTRA_FILE)
    if rank == 0:
        written += [f"{subdir}/.metadata" for subdir, _ in parts]
        if extra is not None:
            torch.save(extra, directory / EXTRA_FILE)
            written.append(EXTRA_FILE)
        _write_model_files(directory, model, hf_source_dir)
        info = {
            "world_size": world_size,
            "model_class": model_class_path(model),
            "has_optimizer": optimizer is not None,
            "has_lr_scheduler": lr_scheduler is not None,
            "has_extra": extra is not None,
        }
        if adapter is not None:
            info["lora"] = adapter
        (directory / STATE_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")
        written.append(STATE_INFO_FILE)
    _barrier()
    return {
        "rank": rank,
        "world_size": world_size,
        "files": {name: (directory / name).stat().st_size for name in written},
        "required": sorted(set(required)),
    }


def read_state_info(directory: str | Path) -> dict[str, Any]:
    """The ``mmrl_state.json`` of a folder written by ``save_train_state``."""
    path = Path(directory) / STATE_INFO_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: {directory} is not a complete mmrl checkpoint role folder (expected "
            f"{MODEL_DIR}/, {rank_file(0)} and {STATE_INFO_FILE} written by save_train_state)"
        )
    return json.loads(path.read_text())


def missing_state_files(directory: str | Path) -> list[str]:
    """Files of a complete ``save_train_state`` folder that ``directory`` lacks ([] when complete)."""
    directory = Path(directory)
    if not (directory / STATE_INFO_FILE).is_file():
        return [STATE_INFO_FILE]
    info = read_state_info(directory)
    required = [f"{MODEL_DIR}/.metadata", *(rank_file(rank) for rank in range(info["world_size"]))]
    if info["has_optimizer"]:
        required.append(f"{OPTIMIZER_DIR}/.metadata")
    if info["has_extra"]:
        required.append(EXTRA_FILE)
    return [name for name in required if not (directory / name).is_file()]


def missing_from_reports(reports: list[dict[str, Any]]) -> list[str]:
    """What a role folder lacks according to its ranks' reports ([] when complete), without reading it.

    Each rank's :func:`save_train_state` report lists the files it wrote (name → bytes) and the files a
    complete folder needs (its index names every data file of every rank). Complete: every rank of the
    world reported, and every needed file was written by some rank. The driver judges with this, not by
    listing the folder: on several machines it may not see (yet) what the other machines wrote.
    """
    if not reports:
        return ["every rank's report (none came)"]
    world_size = reports[0]["world_size"]
    problems = [
        f"rank {rank}'s report" for rank in range(world_size) if rank not in {r["rank"] for r in reports}
    ]
    written = set().union(*(report["files"] for report in reports))
    required = set().union(*(report["required"] for report in reports))
    return problems + sorted(required - written)


def _load_rank_state(directory: Path, rank: int) -> dict[str, Any]:
    return load_plain(directory / rank_file(rank))


def _drop_unsaved_parameter_states(optimizer_state: dict[str, Any], directory: Path) -> None:
    """Removes the states of parameters that had none when saved (no gradient yet: e.g. a vision tower
    before the first image batch), so they start fresh on their first step as in the original run.

    DCP flattens ``optimizer_state["state"][fqn][name]`` to the key ``state.{fqn}.{name}``.
    """
    saved_keys = set(read_dcp_metadata(directory).state_dict_metadata)
    for fqn, parameter_state in list(optimizer_state["state"].items()):
        keys = [f"state.{fqn}.{name}" for name in parameter_state]
        present = [key in saved_keys for key in keys]
        if not any(present):
            del optimizer_state["state"][fqn]
        elif not all(present):
            missing = [key for key, found in zip(keys, present) if not found]
            raise KeyError(
                f"optimizer checkpoint {directory} holds only part of the state of {fqn} (missing {missing}); "
                f"was it saved with a different optimizer class?"
            )


def _load_optimizer_state(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    # get_optimizer_state_dict first creates every state tensor (a zero-lr step) if the optimizer has
    # not stepped yet, so that DCP has tensors with this run's sharding to load into.
    optimizer_state = get_optimizer_state_dict(model, optimizer)
    _drop_unsaved_parameter_states(optimizer_state, directory)
    load_dcp(optimizer_state, directory)
    # strict=False: parameters dropped above are left without state instead of being an error.
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=StateDictOptions(strict=False))


def _check_same_kind(directory: Path, adapter: dict[str, Any] | None, model: nn.Module) -> None:
    """A LoRA checkpoint resumes a LoRA model with the same adapted modules, a full one a full model."""
    adapted = [name for name, _ in adapter_layers(model)]
    if adapter is None and adapted:
        raise ValueError(
            f"{directory} holds a full model, but the model has a LoRA adapter "
            f"(worker.actor.model.lora.rank > 0): resume it with lora.rank=0"
        )
    if adapter is not None and sorted(adapter["modules"]) != sorted(adapted):
        raise ValueError(
            f"{directory} holds a LoRA adapter on {len(adapter['modules'])} modules (rank {adapter['rank']}), "
            f"the model has adapters on {len(adapted)}: resume with the run's worker.actor.model.lora settings"
        )


def _keep_peak_lrs(optimizer: torch.optim.Optimizer, lr_scheduler: Any | None, peak_lrs: list[float]) -> None:
    """Put the peak rates ``optimizer`` was built with back after a load overwrote them (the optimizer
    state's ``param_groups``, the scheduler's ``base_lrs``): every rate is scaled by new peak / saved
    peak, so the scheduler's position (warm-up, decay) is kept. Same peak: nothing changes."""
    for group, peak in zip(optimizer.param_groups, peak_lrs):
        saved_peak = group.get("initial_lr", peak)
        if saved_peak != peak and saved_peak > 0:
            group["lr"] = group["lr"] * peak / saved_peak
        group["initial_lr"] = peak
    if lr_scheduler is not None:
        lr_scheduler.base_lrs = list(peak_lrs)
        lr_scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def load_train_state(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any | None = None,
) -> dict[str, Any]:
    """Loads what ``save_train_state`` wrote into ``model`` / ``optimizer`` / ``lr_scheduler``, in place.

    Collective, like the save. Works on any world size: weights and optimizer are resharded by DCP.
    RNG states are restored only when the world size equals the saved one (a warning otherwise); the
    scheduler comes from this rank's file then, else from rank 0's. Returns the saved ``extra`` dict
    ({} when none was saved).

    The peak learning rates stay those ``optimizer`` was built with (the config's): the checkpoint
    gives the moments and the scheduler's position, so a stage of a multi-stage schedule that changes
    the learning rate gets its own (the same as the saved one on a plain resume).
    """
    directory = Path(directory)
    peak_lrs = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups] if optimizer else []
    info = read_state_info(directory)
    rank, world_size = _rank_and_world_size()

    adapter = info.get("lora")
    _check_same_kind(directory, adapter, model)
    model_state = _model_state(model, adapter)
    load_dcp(model_state, directory / MODEL_DIR)
    set_model_state_dict(model, model_state, options=StateDictOptions(strict=adapter is None))
    if optimizer is not None:
        if not info["has_optimizer"]:
            raise ValueError(
                f"{directory} was saved without an optimizer state; load it with optimizer=None or resume "
                f"from a checkpoint written during training"
            )
        _load_optimizer_state(directory / OPTIMIZER_DIR, model, optimizer)

    same_world_size = info["world_size"] == world_size
    rank_state = _load_rank_state(directory, rank if same_world_size else 0)
    if lr_scheduler is not None:
        if rank_state["lr_scheduler"] is None:
            raise ValueError(
                f"{directory} was saved without an LR scheduler state; load it with lr_scheduler=None"
            )
        lr_scheduler.load_state_dict(rank_state["lr_scheduler"])
    if optimizer is not None:
        _keep_peak_lrs(optimizer, lr_scheduler, peak_lrs)
    if same_world_size:
        restore_rng_state(rank_state["rng"])
    elif rank == 0:
        logger.warning(
            "checkpoint %s was saved by %d ranks and is loaded by %d: random states are not restored, so "
            "the resumed run is correct but not bit-identical to an uninterrupted one",
            directory,
            info["world_size"],
            world_size,
        )
    _barrier()
    return load_plain(directory / EXTRA_FILE) if info["has_extra"] else {}
