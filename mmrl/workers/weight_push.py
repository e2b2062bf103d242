"""Weights from the training ranks to rollout workers of their own (``worker.rollout.placement=separate``).

The push group is a process group of its own: training rank 0 (group rank 0) and every rollout worker
(group ranks 1..N), built from a ``TCPStore`` that training rank 0 opens on a free port, so it neither
joins nor disturbs the training ranks' default group (nor the rollout workers' own). NCCL on GPUs, gloo
on CPUs. A push broadcasts the full tensors that :func:`~mmrl.workers.weight_sync.iter_full_state_dict`
yields on rank 0 (each shard cast to the rollout's dtype before it is gathered, as the colocated sync
does), one at a time in the order of the manifest (:func:`~mmrl.workers.weight_sync.full_state_manifest`)
that every receiver got when the group was built: the receivers allocate each buffer from it, so nothing
but the tensors' bytes travels per push.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

Manifest = list[tuple[str, tuple[int, ...], torch.dtype]]
STORE_PREFIX = "mmrl-weight-push"


class WeightPushGroup:
    """This process's member of the push group: ``rank`` 0 sends, the others receive."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float = 1800.0,
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
        self.rank, self.world_size, self.device = rank, world_size, device

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], manifest: Manifest) -> int:
        """Broadcast every tensor (rank 0); returns the bytes each receiver got. Each must be the next
        entry of ``manifest``, which the receivers read their buffers from."""
        sent = 0
        entries = iter(manifest)
        for name, tensor in named_tensors:
            expected = next(entries, None)
            if expected is None or (name, tuple(tensor.shape), tensor.dtype) != expected:
                raise RuntimeError(
                    f"weight push: {name} {tuple(tensor.shape)} {tensor.dtype} is not the manifest's next "
                    f"entry {expected}: the model changed since the push group was built"
                )
            self.group.broadcast(tensor.contiguous(), 0).wait()
            sent += tensor.numel() * tensor.element_size()
        if next(entries, None) is not None:
            raise RuntimeError("weight push: the model yielded fewer tensors than its manifest lists")
        return sent

    def receive(self, manifest: Manifest) -> Iterator[tuple[str, torch.Tensor]]:
        """The pushed ``(name, tensor)`` pairs, each received into a buffer allocated from ``manifest``
        as it is asked for (a receiver holds one pushed tensor at a time beside its engine)."""
        for name, shape, dtype in manifest:
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            self.group.broadcast(buffer, 0).wait()
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
