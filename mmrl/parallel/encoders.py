"""Vision towers sharded over the sequence-parallel ranks: each SP rank encodes its share of the frames
and images, and the embeddings are all-gathered, so that a long video's encoder work (and its
activation memory) is split ``R × U`` ways instead of repeated on every rank.

The unit of work is one temporal patch of one item (an image is one; a video of ``grid_t`` temporal
patches is ``grid_t``): Qwen2/2.5/3-VL towers attend within a temporal patch (their ``cu_seqlens``
cut every item at each temporal patch, window attention too, and rotary/interpolated positions depend
on the height and width only), so encoding a run of temporal patches alone gives the rows the whole
call gives. The units are cut into ``S`` contiguous runs of about equal patch counts
(:func:`split_units`); rank ``s`` encodes run ``s`` and the runs are gathered in rank order, which is
the order of the whole call's output. Every SP rank holds the same rows, so every rank computes the
same cut and the collectives match. Where there are fewer units than ranks, every rank encodes the
whole call (as without sharding).

Gradients: every SP rank computes the same loss, and each rank's decoder sends gradient only into the
embeddings of the tokens it holds (:mod:`mmrl.parallel.sequence`). The gather's backward therefore
sums the embedding gradients of all SP ranks and hands each rank its own run's rows: the owner's
tower then receives the whole gradient of its units, and the towers' parameter gradients, summed
over the SP ranks as FSDP sums them, equal the unsharded computation's.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mmrl.parallel.sequence import ShardedSequences


def split_units(patches: list[int], parts: int) -> list[tuple[int, int]] | None:
    """``parts`` contiguous runs ``(first, end)`` of the units whose patch counts are ``patches``, about
    equal in patches (a unit goes to the run its first patch falls in); None when some run would be
    empty (fewer units than parts, or one unit larger than the others together)."""
    total = sum(patches)
    runs, start, before = [], 0, 0
    for part in range(parts):
        end = start
        while end < len(patches) and (part == parts - 1 or before * parts < (part + 1) * total):
            before += patches[end]
            end += 1
        if end == start:
            return None
        runs.append((start, end))
        start = end
    return runs


def _units(grid_thw: torch.Tensor) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Per unit (one temporal patch of one item): its patch count and its ``(item, h, w)``."""
    patches, owners = [], []
    for item, (t, h, w) in enumerate(grid_thw.tolist()):
        for _ in range(t):
            patches.append(h * w)
            owners.append((item, h, w))
    return patches, owners


def _run_grid(owners: list[tuple[int, int, int]], first: int, end: int, like: torch.Tensor) -> torch.Tensor:
    """``grid_thw`` [n, 3] of units ``first..end``: consecutive units of one item become one row."""
    rows: list[list[int]] = []
    last = None
    for item, h, w in owners[first:end]:
        if item == last:
            rows[-1][0] += 1
        else:
            rows.append([1, h, w])
        last = item
    return torch.tensor(rows, dtype=like.dtype, device=like.device)


class _GatherRuns(torch.autograd.Function):
    """All SP ranks' runs of rows, concatenated in rank order; backward: the sum of every rank's
    gradient at this rank's rows."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, counts: list[int], rank: int, group) -> torch.Tensor:
        ctx.counts, ctx.rank, ctx.group = counts, rank, group
        width = max(counts)
        padded = local.new_zeros(width, *local.shape[1:])
        padded[: local.shape[0]] = local
        gathered = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(gathered, padded.contiguous(), group=group)
        return torch.cat([rows[:count] for rows, count in zip(gathered, counts)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)  # each rank's decoder gave gradient to its own tokens only
        start = sum(ctx.counts[: ctx.rank])
        return grad[start : start + ctx.counts[ctx.rank]], None, None, None


def gather_runs(local: torch.Tensor, counts: list[int], rank: int, group) -> torch.Tensor:
    """``local`` [counts[rank], ...] of each rank -> [sum(counts), ...] in rank order (differentiable)."""
    return _GatherRuns.apply(local, counts, rank, group)


def _gather_output(output: Any, counts: list[int], rank: int, group) -> Any:
    """The tower's output with every per-merged-token tensor gathered: ``pooler_output`` (the
    embeddings) and, for Qwen3-VL, each ``deepstack_features`` entry. ``last_hidden_state`` (the
    patch-level states before the merger, in the tower's window order) is this rank's only and is
    dropped: nothing downstream of the towers reads it."""
    output.pooler_output = gather_runs(output.pooler_output, counts, rank, group)
    deepstack = getattr(output, "deepstack_features", None)
    if deepstack is not None:
        output.deepstack_features = [gather_runs(features, counts, rank, group) for features in deepstack]
    output.last_hidden_state = None
    return output


def _sharded_forward(
    tower: nn.Module, forward, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs
):
    sharded = kwargs.get("packed_sequences")
    if not isinstance(sharded, ShardedSequences) or sharded.groups.size == 1:
        return forward(hidden_states, grid_thw, **kwargs)
    groups = sharded.groups
    patches, owners = _units(grid_thw)
    runs = split_units(patches, groups.size)
    if runs is None:
        return forward(hidden_states, grid_thw, **kwargs)
    merge = tower.spatial_merge_size**2
    first, end = runs[groups.rank]
    row_start, row_end = sum(patches[:first]), sum(patches[:end])
    local = forward(hidden_states[row_start:row_end], _run_grid(owners, first, end, grid_thw), **kwargs)
    counts = [sum(patches[a:b]) // merge for a, b in runs]  # merged tokens per rank
    return _gather_output(local, counts, groups.rank, groups.sp_group)


def takes_grid(tower: nn.Module) -> bool:
    """Whether ``tower`` is a Qwen-VL vision tower (``forward(hidden_states, grid_thw, **kwargs)``);
    audio towers are not sharded."""
    parameters = inspect.signature(tower.forward).parameters
    return "grid_thw" in parameters and hasattr(tower, "spatial_merge_size")


def enable_sharded_encoders(towers: list[nn.Module]) -> int:
    """Make each vision tower of ``towers`` encode only this SP rank's share when called inside a
    sequence-parallel forward (its ``packed_sequences`` a :class:`ShardedSequences`); elsewhere it runs
    as before. Idempotent; returns how many towers are sharded."""
    count = 0
    for tower in towers:
        if not sharded_encoders_enabled(tower):
            if not takes_grid(tower):
                continue
            tower.forward = functools.partial(_sharded_forward, tower, tower.forward)
            tower._mmrl_sharded_encoder = True
        count += 1
    return count


def sharded_encoders_enabled(tower: nn.Module) -> bool:
    return bool(getattr(tower, "_mmrl_sharded_encoder", False))
