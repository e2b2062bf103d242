"""`DataProto`: the one container that travels between the Ray driver and the workers.

A `DataProto` of length B holds three things:

- `batch`: a `tensordict.TensorDict` with `batch_size=[B]`; every value is a tensor whose first dim is B
  (token ids, masks, log-probs, advantages, ...). Nested TensorDicts are not used.
- `non_tensor_batch`: `dict[str, np.ndarray]`, each a 1-D `dtype=object` array of length B (raw prompts,
  media dicts, uids, ground truths). Elements may be any picklable Python object.
- `meta_info`: a plain dict for the whole batch; in training only `metrics` (what a worker returns; see
  `mmrl.columns`: modes are arguments of the worker methods, not meta keys).

Rules that hold for every method:

- Methods return new `DataProto` objects and leave `self` untouched, except `pop`, whose job is to
  remove columns. Results are shallow: tensors and object elements are shared, not copied, unless a
  method says otherwise (`select(deepcopy=True)`).
- Rows are always selected together across tensor and object columns, so row i of every column keeps
  describing the same sample.

Pickling (what Ray does to every argument and return value) writes each tensor as a NumPy byte view, so
pickle protocol 5 can hand the bytes over out-of-band without copies, and a slice ships only its own
rows. Unpickled tensors always live on the CPU.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["DataProto", "DataProtoItem"]


@dataclass(eq=False)
class DataProtoItem:
    """One row of a `DataProto`: `batch` has `batch_size=[]`, `non_tensor_batch` holds the row's objects."""

    batch: TensorDict
    non_tensor_batch: dict[str, Any] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class DataProto:
    """A batch of B samples: tensor columns, object columns and batch-level meta info (see module doc)."""

    batch: TensorDict | None = None
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.batch is None:
            # An empty TensorDict still records B, so len() never depends on which columns exist.
            lengths = [len(value) for value in self.non_tensor_batch.values()]
            self.batch = TensorDict({}, batch_size=[lengths[0] if lengths else 0])
        self.check_consistency()

    # ------------------------------------------------------------------ construction and checks

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Sequence[Any] | np.ndarray] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> DataProto:
        """Build a DataProto; every column must have the same length B along its first dim.

        Non-tensor columns (lists, tuples or arrays) become 1-D object arrays of length B whose elements
        are the original items: a list of lists stays a column of lists, never a 2-D array.
        """
        tensors = dict(tensors or {})
        non_tensors = dict(non_tensors or {})
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                raise TypeError(
                    f"DataProto.from_dict: tensors[{key!r}] must be a torch.Tensor with a batch dim, "
                    f"got {type(value).__name__} {tuple(getattr(value, 'shape', ()))}. "
                    "Put Python objects in non_tensors and batch-level values in meta_info."
                )
        object_columns = {key: _to_object_column(key, value) for key, value in non_tensors.items()}

        lengths = {f"tensors[{key!r}]": value.shape[0] for key, value in tensors.items()}
        lengths.update({f"non_tensors[{key!r}]": len(value) for key, value in object_columns.items()})
        if len(set(lengths.values())) > 1:
            first_name, batch_size = next(iter(lengths.items()))
            mismatched = ", ".join(f"{name} has {n}" for name, n in lengths.items() if n != batch_size)
            raise ValueError(
                f"DataProto.from_dict: all columns must share the batch length; {first_name} has "
                f"{batch_size} rows but {mismatched}."
            )
        batch_size = next(iter(lengths.values()), 0)
        return cls(
            batch=TensorDict(tensors, batch_size=[batch_size]),
            non_tensor_batch=object_columns,
            meta_info=dict(meta_info or {}),
        )

    def check_consistency(self) -> None:
        """Raise if any column breaks the layout described in the module docstring."""
        if not isinstance(self.batch, TensorDict) or self.batch.batch_dims != 1:
            raise TypeError(
                f"DataProto.batch must be a TensorDict with one batch dim, got {type(self.batch).__name__} "
                f"with batch_size {getattr(self.batch, 'batch_size', None)}."
            )
        batch_size = len(self)
        for key, value in self.batch.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"DataProto.batch[{key!r}] must be a tensor, got {type(value).__name__}.")
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray) or value.dtype != object or value.ndim != 1:
                found = f"{type(value).__name__} {getattr(value, 'dtype', '')} {getattr(value, 'shape', '')}"
                raise TypeError(
                    f"DataProto.non_tensor_batch[{key!r}] must be a 1-D object np.ndarray, got {found}. "
                    "Build columns with DataProto.from_dict, which converts lists."
                )
            if len(value) != batch_size:
                raise ValueError(
                    f"DataProto.non_tensor_batch[{key!r}] has {len(value)} rows but the batch has {batch_size}."
                )
        shared_keys = set(self.batch.keys()) & set(self.non_tensor_batch)
        if shared_keys:
            raise ValueError(f"DataProto keys {sorted(shared_keys)} are both tensor and non-tensor columns.")
        if not isinstance(self.meta_info, dict):
            raise TypeError(f"DataProto.meta_info must be a dict, got {type(self.meta_info).__name__}.")

    # ------------------------------------------------------------------ row access

    def __len__(self) -> int:
        return self.batch.batch_size[0]

    def __getitem__(self, index: int | slice | Sequence[int] | np.ndarray | torch.Tensor) -> Any:
        """`proto[i]` → `DataProtoItem`; a slice, integer indices or a bool mask of length B → `DataProto`."""
        if isinstance(index, (int, np.integer)) and not isinstance(index, (bool, np.bool_)):
            row = int(index)
            if not -len(self) <= row < len(self):
                raise IndexError(f"DataProto index {row} is out of range for length {len(self)}.")
            return DataProtoItem(
                batch=self.batch[row],
                non_tensor_batch={key: value[row] for key, value in self.non_tensor_batch.items()},
                meta_info=dict(self.meta_info),
            )
        if isinstance(index, slice):
            # Slices are views of the same storage; pickling still ships only the selected rows.
            return self._with_rows(self.batch[index], {k: v[index] for k, v in self.non_tensor_batch.items()})
        rows = self._row_indices(index)
        return self._with_rows(
            self.batch[torch.from_numpy(rows)], {k: v[rows] for k, v in self.non_tensor_batch.items()}
        )

    def _row_indices(self, index: Sequence[int] | np.ndarray | torch.Tensor) -> np.ndarray:
        """Integer indices or a bool mask → int64 row numbers in [0, B), with errors naming the problem."""
        if isinstance(index, torch.Tensor):
            index = index.cpu().numpy()
        rows = np.asarray(index)
        if rows.size == 0:
            return np.zeros(0, dtype=np.int64)
        if rows.ndim != 1:
            raise IndexError(f"DataProto index must be 1-D, got shape {rows.shape}.")
        if rows.dtype == np.bool_:
            if len(rows) != len(self):
                raise IndexError(f"DataProto bool mask has length {len(rows)} but the batch has {len(self)}.")
            return np.flatnonzero(rows)
        if not np.issubdtype(rows.dtype, np.integer):
            raise IndexError(f"DataProto index must hold integers or bools, got dtype {rows.dtype}.")
        out_of_range = rows[(rows < -len(self)) | (rows >= len(self))]
        if out_of_range.size:
            raise IndexError(
                f"DataProto indices {out_of_range.tolist()} are out of range for length {len(self)}."
            )
        return np.where(rows < 0, rows + len(self), rows).astype(np.int64)

    def _with_rows(self, batch: TensorDict, non_tensor_batch: dict[str, np.ndarray]) -> DataProto:
        return DataProto(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=dict(self.meta_info))

    def reorder(self, indices: Sequence[int] | np.ndarray | torch.Tensor) -> DataProto:
        """Return a new DataProto with rows in the order `indices`, which must be a permutation of range(B).

        Unlike EasyR1's in-place `reorder`, `self` is left as it was: write `batch = batch.reorder(idx)`.
        """
        rows = self._row_indices(indices)
        if len(rows) != len(self) or not np.array_equal(np.sort(rows), np.arange(len(self))):
            missing = sorted(set(range(len(self))) - set(rows.tolist()))
            raise ValueError(
                f"DataProto.reorder needs a permutation of range({len(self)}); got {len(rows)} indices, "
                f"missing rows {missing[:10]}."
            )
        return self[rows]

    # ------------------------------------------------------------------ columns

    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_keys: Iterable[str] | None = None,
        meta_info_keys: Iterable[str] | None = None,
        deepcopy: bool = False,
    ) -> DataProto:
        """Keep only the named keys (None keeps all of that kind). `deepcopy=True` copies tensors (clone),
        object elements and meta info, so the result can be changed without touching `self`."""
        batch_keys = list(self.batch.keys()) if batch_keys is None else list(batch_keys)
        non_tensor_keys = list(self.non_tensor_batch) if non_tensor_keys is None else list(non_tensor_keys)
        meta_info_keys = list(self.meta_info) if meta_info_keys is None else list(meta_info_keys)
        _check_keys_exist("select", "batch", batch_keys, self.batch.keys())
        _check_keys_exist("select", "non_tensor_batch", non_tensor_keys, self.non_tensor_batch)
        _check_keys_exist("select", "meta_info", meta_info_keys, self.meta_info)

        batch = TensorDict({key: self.batch[key] for key in batch_keys}, batch_size=[len(self)])
        non_tensor_batch = {key: self.non_tensor_batch[key] for key in non_tensor_keys}
        meta_info = {key: self.meta_info[key] for key in meta_info_keys}
        if deepcopy:
            batch = batch.clone()
            non_tensor_batch = copy.deepcopy(non_tensor_batch)
            meta_info = copy.deepcopy(meta_info)
        return DataProto(batch=batch, non_tensor_batch=non_tensor_batch, meta_info=meta_info)

    def pop(
        self,
        batch_keys: Iterable[str] = (),
        non_tensor_keys: Iterable[str] = (),
        meta_info_keys: Iterable[str] = (),
    ) -> DataProto:
        """Remove the named keys from `self` and return them as a new DataProto of the same length."""
        batch_keys, non_tensor_keys, meta_info_keys = (
            list(batch_keys),
            list(non_tensor_keys),
            list(meta_info_keys),
        )
        _check_keys_exist("pop", "batch", batch_keys, self.batch.keys())
        _check_keys_exist("pop", "non_tensor_batch", non_tensor_keys, self.non_tensor_batch)
        _check_keys_exist("pop", "meta_info", meta_info_keys, self.meta_info)
        return DataProto(
            batch=TensorDict({key: self.batch.pop(key) for key in batch_keys}, batch_size=[len(self)]),
            non_tensor_batch={key: self.non_tensor_batch.pop(key) for key in non_tensor_keys},
            meta_info={key: self.meta_info.pop(key) for key in meta_info_keys},
        )

    def rename(self, mapping: dict[str, str]) -> DataProto:
        """Return a new DataProto with columns renamed `{old: new}`; tensor and object columns alike."""
        tensors, objects = dict(self.batch.items()), dict(self.non_tensor_batch)
        existing = set(tensors) | set(objects)
        for old, new in mapping.items():
            if old not in existing:
                raise KeyError(f"DataProto.rename: no column {old!r}; columns are {sorted(existing)}.")
            if new in existing and new not in mapping:
                raise KeyError(
                    f"DataProto.rename: {old!r} → {new!r} would overwrite existing column {new!r}."
                )
        renamed_tensors = {mapping.get(key, key): value for key, value in tensors.items()}
        renamed_objects = {mapping.get(key, key): value for key, value in objects.items()}
        return DataProto(
            batch=TensorDict(renamed_tensors, batch_size=[len(self)]),
            non_tensor_batch=renamed_objects,
            meta_info=dict(self.meta_info),
        )

    def union(self, other: DataProto) -> DataProto:
        """Merge the columns and meta info of two protos of equal length into a new DataProto.

        A key present in both must hold equal values (tensors equal, objects `==`); otherwise ValueError.
        """
        if len(self) != len(other):
            raise ValueError(f"DataProto.union needs equal lengths, got {len(self)} and {len(other)}.")
        for kind, mine, theirs in (
            ("batch", dict(self.batch.items()), dict(other.batch.items())),
            ("non_tensor_batch", self.non_tensor_batch, other.non_tensor_batch),
            ("meta_info", self.meta_info, other.meta_info),
        ):
            for key in mine.keys() & theirs.keys():
                if not _values_equal(mine[key], theirs[key]):
                    raise ValueError(f"DataProto.union: {kind}[{key!r}] differs between the two protos.")
        return DataProto(
            batch=TensorDict(
                {**dict(self.batch.items()), **dict(other.batch.items())}, batch_size=[len(self)]
            ),
            non_tensor_batch={**self.non_tensor_batch, **other.non_tensor_batch},
            meta_info={**self.meta_info, **other.meta_info},
        )

    # ------------------------------------------------------------------ splitting and joining

    @classmethod
    def concat(cls, protos: Sequence[DataProto]) -> DataProto:
        """Stack protos row-wise in the given order. All must have the same column keys.

        meta_info is the union of all meta infos; a key whose value differs between protos raises
        ValueError (pop per-shard values such as timings before concatenating).
        """
        if not protos:
            raise ValueError("DataProto.concat needs at least one DataProto, got an empty list.")
        first = protos[0]
        meta_info = dict(first.meta_info)
        for position, proto in enumerate(protos[1:], start=1):
            for kind, expected, found in (
                ("batch", set(first.batch.keys()), set(proto.batch.keys())),
                ("non_tensor_batch", set(first.non_tensor_batch), set(proto.non_tensor_batch)),
            ):
                if expected != found:
                    raise ValueError(
                        f"DataProto.concat: proto {position} has {kind} keys {sorted(found)}, "
                        f"proto 0 has {sorted(expected)}."
                    )
            for key, value in proto.meta_info.items():
                if key in meta_info and not _values_equal(meta_info[key], value):
                    raise ValueError(
                        f"DataProto.concat: meta_info[{key!r}] of proto {position} differs from earlier protos."
                    )
                meta_info.setdefault(key, value)
        total = sum(len(proto) for proto in protos)
        # list(keys()): iterating a TensorDict itself walks its rows, not its keys.
        tensor_keys = list(first.batch.keys())
        tensors = {key: torch.cat([proto.batch[key] for proto in protos]) for key in tensor_keys}
        objects = {
            key: np.concatenate([p.non_tensor_batch[key] for p in protos]) for key in first.non_tensor_batch
        }
        return cls(
            batch=TensorDict(tensors, batch_size=[total]), non_tensor_batch=objects, meta_info=meta_info
        )

    def split(self, size: int) -> list[DataProto]:
        """Consecutive pieces of `size` rows; the last one holds the remainder and may be shorter."""
        if size <= 0:
            raise ValueError(f"DataProto.split: size must be positive, got {size}.")
        return [self[start : start + size] for start in range(0, len(self), size)]

    def chunk(self, num_chunks: int) -> list[DataProto]:
        """`num_chunks` consecutive pieces of equal length; B must be divisible by `num_chunks`."""
        if num_chunks <= 0 or len(self) % num_chunks != 0:
            raise ValueError(
                f"DataProto.chunk: length {len(self)} is not divisible into {num_chunks} equal chunks; "
                "use pad_to_divisor first or pick a divisor of the length."
            )
        size = len(self) // num_chunks
        return [self[i * size : (i + 1) * size] for i in range(num_chunks)]

    def repeat(self, repeat_times: int, interleave: bool = True) -> DataProto:
        """Repeat every row `repeat_times` times: interleaved [a, a, b, b] (n responses per prompt, rows of
        one prompt adjacent) or tiled [a, b, a, b]. Object elements are shared between copies, not copied."""
        if repeat_times <= 0:
            raise ValueError(f"DataProto.repeat: repeat_times must be positive, got {repeat_times}.")
        rows = np.arange(len(self))
        rows = np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times)  # [B * n]
        return self[rows]

    def pad_to_divisor(self, divisor: int) -> tuple[DataProto, int]:
        """Append copies of rows 0, 1, 2, ... (wrapping around) until the length divides by `divisor`.

        Returns (padded proto, pad_size); `unpad(pad_size)` on the padded proto gives back the original rows.
        """
        if divisor <= 0:
            raise ValueError(f"DataProto.pad_to_divisor: divisor must be positive, got {divisor}.")
        pad_size = -len(self) % divisor
        if pad_size == 0:
            return self[:], 0
        if len(self) == 0:
            raise ValueError(
                "DataProto.pad_to_divisor: cannot pad an empty DataProto, there is no row to repeat."
            )
        padding = self[np.arange(pad_size) % len(self)]
        return DataProto.concat([self, padding]), pad_size

    def unpad(self, pad_size: int) -> DataProto:
        """Drop the last `pad_size` rows (the inverse of `pad_to_divisor`)."""
        if not 0 <= pad_size <= len(self):
            raise ValueError(f"DataProto.unpad: pad_size must be in [0, {len(self)}], got {pad_size}.")
        return self[: len(self) - pad_size]

    # ------------------------------------------------------------------ devices, printing, pickling

    def to(self, device: torch.device | str) -> DataProto:
        """Return a new DataProto with all tensors on `device` (object columns are untouched)."""
        return self._with_rows(self.batch.to(device), dict(self.non_tensor_batch))

    def __repr__(self) -> str:
        tensors = ", ".join(
            f"{key}: {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
            for key, value in self.batch.items()
        )
        return (
            f"DataProto(len={len(self)}, batch={{{tensors}}}, "
            f"non_tensor_batch={sorted(self.non_tensor_batch)}, meta_info={sorted(self.meta_info)})"
        )

    def __getstate__(self) -> dict[str, Any]:
        """Tensors become (uint8 NumPy view, dtype name): pickle 5 then passes the bytes out-of-band
        (Ray's zero-copy path). Plain tensor pickling would also write each view's whole storage, so a
        chunk of a big batch would ship the full batch."""
        tensors = {}
        for key, value in self.batch.items():
            value = value.detach().cpu().contiguous()
            # uint8 views cover every dtype, bfloat16 included, which NumPy lacks.
            tensors[key] = (value.view(torch.uint8).numpy(), str(value.dtype).removeprefix("torch."))
        return {
            "batch_size": len(self),
            "tensors": tensors,
            "non_tensor_batch": self.non_tensor_batch,
            "meta_info": self.meta_info,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        tensors = {}
        for key, (byte_view, dtype_name) in state["tensors"].items():
            if not byte_view.flags.writeable:
                # Out-of-band buffers (Ray's object store) are read-only; copy once so tensors can be written.
                byte_view = byte_view.copy()
            tensors[key] = torch.from_numpy(byte_view).view(getattr(torch, dtype_name))
        self.batch = TensorDict(tensors, batch_size=[state["batch_size"]])
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]


def _to_object_column(key: str, values: Sequence[Any] | np.ndarray) -> np.ndarray:
    """A sequence of B items → 1-D object array whose elements are exactly those items."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return values
    if isinstance(values, (str, bytes, dict, torch.Tensor)) or not isinstance(values, (Sequence, np.ndarray)):
        raise TypeError(
            f"DataProto.from_dict: non_tensors[{key!r}] must be a list, tuple or np.ndarray with one item "
            f"per sample, got {type(values).__name__}. Tensors belong in `tensors`."
        )
    if isinstance(values, np.ndarray) and values.ndim == 0:
        raise TypeError(
            f"DataProto.from_dict: non_tensors[{key!r}] is a 0-d array; it needs one item per sample."
        )
    items = list(values)  # for an N-d array: its rows
    column = np.empty(len(items), dtype=object)
    # Element-wise fill: `np.array(items, dtype=object)` would turn equal-length lists into a 2-D array.
    for row, item in enumerate(items):
        column[row] = item
    return column


def _check_keys_exist(method: str, kind: str, keys: list[str], available: Iterable[str]) -> None:
    available = list(available)
    missing = [key for key in keys if key not in available]
    if missing:
        raise KeyError(f"DataProto.{method}: {kind} has no keys {missing}; it has {sorted(available)}.")


def _values_equal(a: Any, b: Any) -> bool:
    """Equality for column and meta-info values: tensors, arrays (object ones element-wise), containers."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and torch.equal(a.cpu(), b.cpu())
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype == object or b.dtype == object:
            return all(_values_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False
