"""Reading checkpoint files without running code from them.

A checkpoint folder may come from a shared filesystem, another team or a download; unpickling a file
from it with plain ``pickle`` (or ``torch.load(weights_only=False)``) runs whatever callable the file
names, on every rank, at resume. Every file mmrl reads from a checkpoint goes through this module:

- ``extra_state_rank{r}.pt`` and ``extra.pt``: ``torch.load(weights_only=True)`` (tensors, numbers,
  strings, lists, tuples, dicts). The allow-list adds only NumPy's array reconstruction, which
  checkpoints written before this reader stored their NumPy RNG state with, so those still load.
- DCP ``.metadata`` (a pickle of torch's checkpoint index): an unpickler that builds only the index's
  own data classes, ``torch.Size``, dtypes, layouts and paths (:data:`DCP_METADATA_GLOBALS`).
- DCP non-tensor entries (the optimizer's ``param_groups`` numbers): ``torch.load(weights_only=True)``
  instead of DCP's default ``weights_only=False``. Tensors DCP reads weights-only itself.

Anything else is refused with :class:`UnsafeCheckpointError`, naming the file and what it asked for.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from mmrl.errors import UserInputError

try:  # NumPy 2 (which pickles name); NumPy 1 kept it in numpy.core
    from numpy._core.multiarray import _reconstruct
except ImportError:  # pragma: no cover - NumPy 1
    from numpy.core.multiarray import _reconstruct

# Checkpoints written before mmrl saved RNG states as plain data hold numpy.random.get_state()'s array.
_LEGACY_NUMPY_GLOBALS = [_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]

_DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
# (module, name) pairs a DCP index pickle may name: its own records and what they hold
DCP_METADATA_GLOBALS = {
    (_DCP_METADATA_MODULE, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by name in torch's own table
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class UnsafeCheckpointError(UserInputError):
    """A checkpoint file asks to build something that is not tensors or plain data; nothing ran."""


def _refusal(path: Path, detail: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path} was refused: it holds a pickled object that is not tensors or plain data ({detail}), and "
        f"unpickling it could run code. A checkpoint written by mmrl (of any version) holds none: this "
        f"file was changed or written by other software. Resume from a checkpoint you wrote, or if you "
        f"trust this one, convert it to tensors and plain data (torch.load(weights_only=False) once, "
        f"then torch.save of the plain values) outside mmrl"
    )


def load_plain(path: str | Path, map_location: str | torch.device | None = "cpu") -> Any:
    """``torch.load`` of a checkpoint file that may hold only tensors and plain data (see module doc)."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(_LEGACY_NUMPY_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        raise _refusal(path, _unsupported_global(error)) from None


def _unsupported_global(error: pickle.UnpicklingError) -> str:
    # torch's message: "Weights only load failed ... Unsupported global: GLOBAL posix.system ..."
    return next((line.strip() for line in str(error).splitlines() if "GLOBAL" in line), str(error)[:200])


def check_role_folder(directory: str | Path) -> None:
    """Reads a role folder's small files (rank and extra files, DCP indexes) as a resume does, so that
    a tampered one is refused on the driver before any worker loads the folder."""
    directory = Path(directory)
    for path in sorted(directory.glob("*.pt")):
        load_plain(path)
    for part in ("model", "optimizer"):
        if (directory / part / ".metadata").is_file():
            read_dcp_metadata(directory / part)


class _DcpMetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _refusal(self.path, f"it names {module}.{name}")


def read_dcp_metadata(directory: str | Path, file_name: str = ".metadata") -> Metadata:
    """The index (``.metadata``) of a torch.distributed.checkpoint folder, read by the allow-list."""
    path = Path(directory) / file_name
    with path.open("rb") as file:
        metadata = _DcpMetadataUnpickler(file, path).load()
    if not isinstance(metadata, Metadata):
        raise _refusal(path, f"a {type(metadata).__name__} instead of a DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader, reading the index with :func:`read_dcp_metadata` instead of ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        metadata = read_dcp_metadata(path.parent, path.name)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries weights-only (DCP: ``weights_only=False``)."""

    def __init__(self, directory: Path, **kwargs: Any):
        super().__init__(**kwargs)
        self.directory = directory

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise _refusal(self.directory, f"entry {fqn}: {_unsupported_global(error)}") from None
        # where DefaultLoadPlanner.load_bytes puts an entry (flattened keys map back to nested ones)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded
