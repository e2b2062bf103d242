"""What the driver moves through Ray's object store, and the one place it puts prompts' media there.

:class:`TransferCounter` adds up, by kind, the size of every object the driver puts in the object store
(dispatched batch chunks, shared call arguments, media) and of every result it gets back, as Ray's
object directory reports them (``ray.experimental.get_object_locations``: the serialized size, inlined
small objects included). It counts sizes, never times; the trainer logs the bytes of each step
(``transfer/*``) and ``bench/scale_media.py`` reads them.

:func:`put_media` replaces a batch's compact media (``prompt_media``) by Ray refs, one ``ray.put`` per
prompt: every later dispatch of the step then ships only the refs, and each worker reads a prompt's
bytes from the object store when it first needs them (from shared memory on its own node; Ray moves
them once to another node).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray

if TYPE_CHECKING:
    # every worker process imports this module (through worker_group); torch only where it is used
    from mmrl.protocol import DataProto

__all__ = ["ENCODED_MEDIA", "KINDS", "MEDIA", "RECEIVED", "SENT", "TENSORS", "TransferCounter", "put_media"]

SENT = "sent"  # batch chunks and call arguments the driver puts for the workers
RECEIVED = "received"  # results the workers return
MEDIA = "media"  # prompts' compact media, put once per step
ENCODED_MEDIA = "encoded_media"  # the encoded file bytes inside those (what the media weigh as files)
TENSORS = "tensors"  # the tensor columns' bytes inside the batches sent and received (part of both)
KINDS = (SENT, RECEIVED, MEDIA, ENCODED_MEDIA, TENSORS)


class TransferCounter:
    """Bytes through Ray's object store by kind (:data:`SENT`, :data:`RECEIVED`, :data:`MEDIA`) since the
    counter was made; also the encoded file bytes of the media put (:data:`ENCODED_MEDIA`) and the
    tensor columns' share of the batches sent and received (:data:`TENSORS`), for comparison."""

    def __init__(self) -> None:
        self.bytes: Counter[str] = Counter()
        self._lock = threading.Lock()  # the driver's rollout thread counts beside its main one

    def add(self, kind: str, size: int) -> None:
        """Add ``size`` bytes to ``kind``."""
        with self._lock:
            self.bytes[kind] += size

    def count(self, kind: str, refs: Sequence[ray.ObjectRef]) -> None:
        """Add the sizes of the objects behind ``refs`` (each distinct ref once) to ``kind``."""
        unique = list({ref.hex(): ref for ref in refs}.values())
        if not unique:
            return
        locations = ray.experimental.get_object_locations(unique)
        self.add(kind, sum(int(location.get("object_size") or 0) for location in locations.values()))

    def put(self, value: Any, kind: str = SENT) -> ray.ObjectRef:
        """``ray.put(value)``, counted under ``kind``."""
        ref = ray.put(value)
        self.count(kind, [ref])
        return ref

    def received(self, refs: Sequence[ray.ObjectRef]) -> None:
        """Count the results behind ``refs`` (the caller has them) under :data:`RECEIVED`."""
        self.count(RECEIVED, refs)

    def add_tensor_bytes(self, protos: Sequence[Any]) -> None:
        """Add the tensor columns' bytes of the DataProtos in ``protos`` (other values are skipped)."""
        for proto in protos:
            batch = getattr(proto, "batch", None)
            if batch is not None:
                self.add(TENSORS, sum(t.numel() * t.element_size() for t in batch.values()))

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.bytes)

    def since(self, snapshot: dict[str, int]) -> dict[str, int]:
        """Bytes per kind moved since ``snapshot`` (an earlier :meth:`snapshot`), every kind present."""
        return {kind: self.bytes[kind] - snapshot.get(kind, 0) for kind in KINDS}


def put_media(batch: DataProto, transfers: TransferCounter | None = None) -> DataProto:
    """``batch`` with each prompt's :class:`PromptMedia` put in the object store once and replaced by
    its ref (rows sharing one object share one ref); rows without media keep None. Counted under
    :data:`MEDIA` (and their file bytes under :data:`ENCODED_MEDIA`) when ``transfers`` is given."""
    import numpy as np

    from mmrl.data.processing import PROMPT_MEDIA, PromptMedia
    from mmrl.protocol import DataProto

    if PROMPT_MEDIA not in batch.non_tensor_batch:
        return batch
    put = transfers.put if transfers is not None else (lambda value, _kind: ray.put(value))
    refs: dict[int, Any] = {}
    column = np.empty(len(batch), dtype=object)
    for row, value in enumerate(batch.non_tensor_batch[PROMPT_MEDIA]):
        if isinstance(value, PromptMedia) and id(value) not in refs:
            refs[id(value)] = put(value, MEDIA)
            if transfers is not None:
                transfers.add(ENCODED_MEDIA, value.encoded_bytes)
        column[row] = refs[id(value)] if isinstance(value, PromptMedia) else value
    return DataProto(batch.batch, {**batch.non_tensor_batch, PROMPT_MEDIA: column}, batch.meta_info)
