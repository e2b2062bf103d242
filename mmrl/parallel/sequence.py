"""Sequence parallelism: one packed sequence split over several ranks (Ulysses inside, ring across).

Ranks form a ``(dp, ring, ulysses)`` grid, ulysses fastest: ``rank = (dp_rank * R + ring_rank) * U +
ulysses_rank``. The ``R * U`` ranks of one data-parallel rank (its *SP group*) receive the same rows
and each computes the decoder on a slice of the packed row (:class:`ShardLayout`):

- Ring: every packed sequence is cut into ``2R`` chunks and ring rank ``r`` holds chunks ``r`` and
  ``2R - 1 - r`` of each (the load-balanced "zigzag" order: under a causal mask every ring rank then
  does the same attention work). Attention passes key/value blocks around the ring
  (:mod:`mmrl.parallel.ring_attention`).
- Ulysses: the ring rank's tokens are split into ``U`` contiguous parts. Around attention an
  all-to-all turns "all heads, 1/U of the tokens" into "1/U of the heads, all of the ring rank's
  tokens", and back afterwards (:func:`seq_to_head` / :func:`head_to_seq`).

Everything before the decoder (embeddings, M-RoPE ids of the whole sequence, audio towers) runs on
the whole row on every SP rank, but for the vision towers, which encode each rank's share of the
frames and gather the embeddings (:mod:`mmrl.parallel.encoders`); a forward pre-hook on the text
decoder then keeps this rank's tokens (:func:`enable_sequence_parallel`, installed where the model is built). The head's outputs at
the response tokens are gathered back in the row's order (:func:`gather_token_outputs`), so every SP rank computes the same loss; the
gather's backward keeps each rank's own rows, so the SP ranks' gradients add up to the whole row's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch import nn


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` items in ``parts`` contiguous parts, sizes differing by at most one (larger first)."""
    base, extra = divmod(total, parts)
    return [base + (index < extra) for index in range(parts)]


# ------------------------------------------------------------------ process groups


@dataclass(frozen=True)
class SequenceParallelGroups:
    """This rank's place in the ``(dp, ring, ulysses)`` grid and the groups it belongs to."""

    ulysses_size: int
    ring_size: int
    dp_size: int
    ulysses_rank: int
    ring_rank: int
    dp_rank: int
    ulysses_group: Any
    ring_group: Any
    sp_group: Any  # the R * U ranks sharing this rank's rows
    dp_group: Any  # one rank per SP group: where token counts and metrics are summed
    ring_ranks: tuple[int, ...]  # global ranks of this rank's ring, in ring order

    @property
    def size(self) -> int:
        return self.ulysses_size * self.ring_size

    @property
    def rank(self) -> int:
        """Place in the SP group (``ring_rank * U + ulysses_rank``)."""
        return self.ring_rank * self.ulysses_size + self.ulysses_rank


def init_sequence_parallel(ulysses_size: int, ring_size: int) -> SequenceParallelGroups:
    """Create the groups of the ``(dp, ring, ulysses)`` grid over the default group (collective: every
    rank calls it with the same sizes)."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    sp_size = ulysses_size * ring_size
    if ulysses_size < 1 or ring_size < 1 or world_size % sp_size:
        raise ValueError(
            f"sequence parallel: ulysses_size={ulysses_size} x ring_size={ring_size} must divide the "
            f"{world_size} ranks"
        )
    dp_size = world_size // sp_size
    grid = np.arange(world_size).reshape(dp_size, ring_size, ulysses_size)
    dp_rank, ring_rank, ulysses_rank = (int(i[0]) for i in np.nonzero(grid == rank))

    def new_groups(rank_lists) -> Any:
        mine = None
        for ranks in rank_lists:  # every rank creates every group, in the same order
            group = dist.new_group([int(r) for r in ranks])
            if rank in ranks:
                mine = group
        return mine

    return SequenceParallelGroups(
        ulysses_size=ulysses_size,
        ring_size=ring_size,
        dp_size=dp_size,
        ulysses_rank=ulysses_rank,
        ring_rank=ring_rank,
        dp_rank=dp_rank,
        ulysses_group=new_groups(grid.reshape(-1, ulysses_size).tolist()),
        ring_group=new_groups(grid.transpose(0, 2, 1).reshape(-1, ring_size).tolist()),
        sp_group=new_groups(grid.reshape(dp_size, -1).tolist()),
        dp_group=new_groups(grid.reshape(dp_size, -1).T.tolist()),
        ring_ranks=tuple(int(r) for r in grid[dp_rank, :, ulysses_rank]),
    )


# ------------------------------------------------------------------ which tokens a rank holds


class RingPiece(NamedTuple):
    """One chunk of one packed sequence held by a ring rank."""

    sequence: int
    chunk: int  # 0 .. 2R - 1 within its sequence
    start: int  # first position in the packed row
    length: int
    local_start: int  # first position in the ring rank's tokens


class ShardLayout:
    """Which packed positions each ``(ring_rank, ulysses_rank)`` holds, for sequence ``lengths``.

    A pure function of the lengths and sizes, so every rank computes every other rank's share.
    """

    def __init__(self, lengths: tuple[int, ...] | list[int], ring_size: int, ulysses_size: int):
        self.lengths = tuple(int(length) for length in lengths)
        self.ring_size, self.ulysses_size = ring_size, ulysses_size
        starts = np.concatenate([[0], np.cumsum(self.lengths)[:-1]]).astype(int)
        chunk_starts = []  # per sequence: the 2R chunks as (start, length)
        for start, length in zip(starts, self.lengths):
            sizes = split_sizes(length, 2 * ring_size)
            offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
            chunk_starts.append([(int(start + o), s) for o, s in zip(offsets, sizes)])
        self.pieces: list[list[RingPiece]] = []
        self.ring_positions: list[np.ndarray] = []
        for ring_rank in range(ring_size):
            pieces, local = [], 0
            for sequence, chunks in enumerate(chunk_starts):
                for chunk in (ring_rank, 2 * ring_size - 1 - ring_rank):
                    start, length = chunks[chunk]
                    pieces.append(RingPiece(sequence, chunk, start, length, local))
                    local += length
            self.pieces.append(pieces)
            self.ring_positions.append(
                np.concatenate([np.arange(p.start, p.start + p.length) for p in pieces]).astype(np.int64)
            )

    def ulysses_sizes(self, ring_rank: int) -> list[int]:
        """Token counts of the ring rank's ``U`` Ulysses parts."""
        return split_sizes(len(self.ring_positions[ring_rank]), self.ulysses_size)

    def local_positions(self, ring_rank: int, ulysses_rank: int) -> np.ndarray:
        """Packed positions held by ``(ring_rank, ulysses_rank)``, in its order."""
        sizes = self.ulysses_sizes(ring_rank)
        start = sum(sizes[:ulysses_rank])
        return self.ring_positions[ring_rank][start : start + sizes[ulysses_rank]]


class ShardedSequences(NamedTuple):
    """``packed_sequences`` of a sequence-parallel forward: the whole row's boundaries, the layout,
    this rank's groups (a NamedTuple: FSDP and checkpointing pass it through)."""

    packed: Any  # mmrl.models.attention.PackedSequences of the whole row
    layout: ShardLayout
    groups: SequenceParallelGroups

    @property
    def local_index(self) -> torch.Tensor:
        positions = self.layout.local_positions(self.groups.ring_rank, self.groups.ulysses_rank)
        return torch.from_numpy(positions).to(self.packed.cu_seqlens.device)


# ------------------------------------------------------------------ decoder inputs


def _keep_local_tokens(
    module: nn.Module,
    args: tuple,
    kwargs: dict,
    shard_extra_inputs: Callable[[dict[str, Any], torch.Tensor], None] | None = None,
) -> tuple[tuple, dict] | None:
    """Forward pre-hook of the text decoder: keep this rank's tokens of the embeddings (or ids), of the
    position ids, whose last dimension is the packed row, and (``shard_extra_inputs``, from the model's
    family) of any other per-token decoder input."""
    sharded = kwargs.get("packed_sequences")
    if not isinstance(sharded, ShardedSequences):
        return None
    index = sharded.local_index
    for key in ("inputs_embeds", "input_ids"):
        if kwargs.get(key) is not None:
            kwargs[key] = kwargs[key].index_select(1, index)
    if kwargs.get("position_ids") is not None:
        kwargs["position_ids"] = kwargs["position_ids"].index_select(-1, index)
    if shard_extra_inputs is not None:
        shard_extra_inputs(kwargs, index)
    if args:
        raise TypeError(
            f"{type(module).__name__}: sequence parallelism expects the decoder to be called with "
            "keyword arguments only (transformers v5 models do)"
        )
    return args, kwargs


def enable_sequence_parallel(
    model: nn.Module, shard_extra_inputs: Callable[[dict[str, Any], torch.Tensor], None] | None = None
) -> None:
    """Install the pre-hook that shards the text decoder's inputs (idempotent). Called by
    :func:`mmrl.models.prepare.prepare_for_training` where the model is built."""
    decoder = model.get_decoder()
    if not sequence_parallel_enabled(model):
        hook = functools.partial(_keep_local_tokens, shard_extra_inputs=shard_extra_inputs)
        decoder.register_forward_pre_hook(hook, with_kwargs=True)
        decoder._mmrl_sequence_parallel = True


def sequence_parallel_enabled(model: nn.Module) -> bool:
    """Whether :func:`enable_sequence_parallel` prepared ``model``'s text decoder."""
    return bool(getattr(model.get_decoder(), "_mmrl_sequence_parallel", False))


# ------------------------------------------------------------------ Ulysses all-to-all


def _all_to_all(send: torch.Tensor, send_counts: list[int], recv_counts: list[int], group) -> torch.Tensor:
    recv = send.new_empty(sum(recv_counts))
    dist.all_to_all_single(recv, send.contiguous(), recv_counts, send_counts, group=group)
    return recv


def _seq_to_head(x: torch.Tensor, seq_sizes: list[int], rank: int, group) -> torch.Tensor:
    """[H, T_rank, D] (all heads, this rank's tokens) -> [H / U, sum(seq_sizes), D]."""
    heads, _, dim = x.shape
    size = len(seq_sizes)
    group_heads = heads // size
    send = x.reshape(size, group_heads, seq_sizes[rank], dim).reshape(-1)  # head group j goes to rank j
    recv = _all_to_all(
        send, [group_heads * seq_sizes[rank] * dim] * size, [group_heads * n * dim for n in seq_sizes], group
    )
    parts = recv.split([group_heads * n * dim for n in seq_sizes])
    return torch.cat([part.view(group_heads, n, dim) for part, n in zip(parts, seq_sizes)], dim=1)


def _head_to_seq(x: torch.Tensor, seq_sizes: list[int], rank: int, group) -> torch.Tensor:
    """[H / U, sum(seq_sizes), D] -> [H, T_rank, D]: the inverse of :func:`_seq_to_head`."""
    group_heads, _, dim = x.shape
    size = len(seq_sizes)
    send = torch.cat([part.reshape(-1) for part in x.split(seq_sizes, dim=1)])  # tokens of rank j to j
    recv = _all_to_all(
        send, [group_heads * n * dim for n in seq_sizes], [group_heads * seq_sizes[rank] * dim] * size, group
    )
    return recv.view(size * group_heads, seq_sizes[rank], dim)


class _AllToAll(torch.autograd.Function):
    """One of the two all-to-alls (``to_heads``: :func:`_seq_to_head`, else :func:`_head_to_seq`); its
    backward is the other one."""

    @staticmethod
    def forward(ctx, x, seq_sizes, rank, group, to_heads: bool):
        ctx.args, ctx.to_heads = (seq_sizes, rank, group), to_heads
        return (_seq_to_head if to_heads else _head_to_seq)(x, seq_sizes, rank, group)

    @staticmethod
    def backward(ctx, grad):
        inverse = _head_to_seq if ctx.to_heads else _seq_to_head
        return inverse(grad.contiguous(), *ctx.args), None, None, None, None


def seq_to_head(x: torch.Tensor, seq_sizes: list[int], rank: int, group) -> torch.Tensor:
    """Ulysses all-to-all (differentiable): [H, T_rank, D] -> [H / U, T, D], heads split in rank order."""
    return _AllToAll.apply(x, seq_sizes, rank, group, True)


def head_to_seq(x: torch.Tensor, seq_sizes: list[int], rank: int, group) -> torch.Tensor:
    """The inverse all-to-all (differentiable): [H / U, T, D] -> [H, T_rank, D]."""
    return _AllToAll.apply(x, seq_sizes, rank, group, False)


# ------------------------------------------------------------------ gathering outputs back


def _all_gather_rows(local: torch.Tensor, counts: list[int], group) -> list[torch.Tensor]:
    """Every rank's rows (``counts[i]`` of them on rank i) of ``local`` [n, ...]; padded to the largest."""
    width = max(counts)
    padded = local.new_zeros(width, *local.shape[1:])
    padded[: local.shape[0]] = local
    gathered = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(gathered, padded.contiguous(), group=group)
    return [rows[:count] for rows, count in zip(gathered, counts)]


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, owners, counts, rank, group):
        owners = owners.to(local.device)
        ctx.rows_of_rank = torch.nonzero(owners == rank).squeeze(-1)
        parts = _all_gather_rows(local, counts, group)
        out = local.new_empty(owners.shape[0], *local.shape[1:])
        for owner, part in enumerate(parts):
            out[owners == owner] = part
        return out

    @staticmethod
    def backward(ctx, grad):
        # every SP rank computes the same loss from the gathered rows: each keeps its own rows' gradient
        return grad[ctx.rows_of_rank], None, None, None, None


def gather_token_outputs(local: torch.Tensor, owners: torch.Tensor, rank: int, group) -> torch.Tensor:
    """The rows of all SP ranks in the row order of ``owners`` [K] (the SP rank computing each row;
    each rank's rows in ascending order): ``local`` [K_rank, ...] -> [K, ...], differentiable."""
    counts = torch.bincount(owners, minlength=dist.get_world_size(group)).tolist()
    return _GatherRows.apply(local, owners, counts, rank, group)


def token_owners(layout: ShardLayout, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For packed ``positions`` [K]: the SP rank holding each (``ring_rank * U + ulysses_rank``) and
    its index among that rank's tokens."""
    total = sum(layout.lengths)
    owner = torch.empty(total, dtype=torch.long)
    index = torch.empty(total, dtype=torch.long)
    for ring_rank in range(layout.ring_size):
        for ulysses_rank in range(layout.ulysses_size):
            held = torch.from_numpy(layout.local_positions(ring_rank, ulysses_rank))
            owner[held] = ring_rank * layout.ulysses_size + ulysses_rank
            index[held] = torch.arange(len(held))
    positions = positions.cpu()
    return owner[positions], index[positions]
