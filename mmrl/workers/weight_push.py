"""Weights from the training ranks to rollout workers of their own (``worker.rollout.placement=separate``).

The push group is a process group of its own: training rank 0 (group rank 0) and every rollout worker
(group ranks 1..N), built from a ``TCPStore`` that training rank 0 opens on a free port, so it neither
joins nor disturbs the training ranks' default group (nor the rollout workers' own). NCCL on GPUs, gloo
on CPUs. A push broadcasts the full tensors that :func:`~mmrl.workers.weight_sync.iter_full_state_dict`
yields on rank 0 (each shard cast to the rollout's dtype before it is gathered, as the colocated sync
does), one at a time in the order of the manifest (:func:`~mmrl.workers.weight_sync.full_state_manifest`)
that every receiver got when the group was built: the receivers allocate each buffer from it, so nothing
but the tensors' bytes travels per push.

A member that dies mid-push closes its sockets: the others' broadcast fails at once (gloo: connection
reset). One that lives but stops taking part (hung) is noticed only when the group's timeout
(``worker.rollout.push_timeout_s``) runs out. Either way the error names the push and the members it
waited for.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

Manifest = list[tuple[str, tuple[int, ...], torch.dtype]]
STORE_PREFIX = "mmrl-weight-push"
DEFAULT_TIMEOUT_S = 600.0  # worker.rollout.push_timeout_s's default


class WeightPushGroup:
    """This process's member of the push group: ``rank`` 0 sends, the others receive."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        timeout = datetime.timedelta(seconds=timeout_s)
        # rank 0 listens on host:port; the constructor of the group below waits until all have joined
        self.store = dist.TCPStore(
            host, port, world_size, is_master=rank == 0, wait_for_workers=False, timeout=timeout
        )
        store = dist.PrefixStore(STORE_PREFIX, self.store)
        if device.type == "cuda":
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, timeout)
        else:
            self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self.rank, self.world_size, self.device, self.timeout_s = rank, world_size, device, timeout_s

    def _broadcast(self, tensor: torch.Tensor, name: str, index: int, count: int) -> None:
        """One tensor from rank 0 to the others; a failure (a member died, or the timeout ran out while
        one did not take part) raised naming the tensor and the members this one waited for."""
        started = time.monotonic()
        try:
            self.group.broadcast(tensor, 0).wait()
        except RuntimeError as error:  # gloo/NCCL errors (DistBackendError is one)
            if self.rank == 0:
                peers = ", ".join(
                    f"{rank - 1} (push-group rank {rank})" for rank in range(1, self.world_size)
                )
                who = f"sending to the rollout workers {peers}: one of them died or stopped receiving"
            else:
                who = "receiving from training rank 0 (push-group rank 0): it died or stopped sending"
            raise RuntimeError(
                f"weight push: tensor {index + 1} of {count} ({name}) failed after "
                f"{time.monotonic() - started:.1f} s {who} (a hung member is noticed after "
                f"worker.rollout.push_timeout_s={self.timeout_s:g} s). The error: {error}"
            ) from None

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], manifest: Manifest) -> int:
        """Broadcast every tensor (rank 0); returns the bytes each receiver got. Each must be the next
        entry of ``manifest``, which the receivers read their buffers from."""
        sent = 0
        entries = iter(manifest)
        for index, (name, tensor) in enumerate(named_tensors):
            expected = next(entries, None)
            if expected is None or (name, tuple(tensor.shape), tensor.dtype) != expected:
                raise RuntimeError(
                    f"weight push: {name} {tuple(tensor.shape)} {tensor.dtype} is not the manifest's next "
                    f"entry {expected}: the model changed since the push group was built"
                )
            self._broadcast(tensor.contiguous(), name, index, len(manifest))
            sent += tensor.numel() * tensor.element_size()
        if next(entries, None) is not None:
            raise RuntimeError("weight push: the model yielded fewer tensors than its manifest lists")
        return sent

    def receive(self, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
        """The pushed ``(name, tensor)`` pairs, each received into a buffer allocated from ``manifest``
        as it is asked for (a receiver holds one pushed tensor at a time beside its engine)."""
        for index, (name, shape, dtype) in enumerate(manifest):
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            self._broadcast(buffer, name, index, len(manifest))
            yield name, buffer


def push_from_rank(
    named_tensors: Iterable[tuple[str, torch.Tensor]], group: WeightPushGroup | None, manifest: Manifest
) -> int:
    """One training rank's part of a push: ``named_tensors`` is the rank's collective gather
    (:func:`~mmrl.workers.weight_sync.iter_full_state_dict`), which every rank consumes in step; rank 0,
    the one holding ``group``, broadcasts each tensor, the others send nothing. The bytes each receiver
    got (0 on the ranks without the group)."""
    if group is None:
        for _ in named_tensors:
            pass
        return 0
    return group.send(named_tensors, manifest)


def manifest_bytes(manifest: Manifest) -> int:
    """Bytes of one push: every tensor of ``manifest`` once."""
    return sum(
        torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        for _, shape, dtype in manifest
    )
