"""Attention of a sequence-parallel forward: Ulysses all-to-all inside, ring attention across.

:func:`sharded_attention` is what a decoder layer's attention runs when its ``packed_sequences`` is a
:class:`~mmrl.parallel.sequence.ShardedSequences`: query/key/value of this rank's tokens, all heads,
go through the Ulysses all-to-all to "this Ulysses rank's heads, all of the ring rank's tokens";
ring attention (or, with one ring rank, plain varlen attention) runs on those; the inverse all-to-all
brings the output back to this rank's tokens.

Ring attention (:class:`_RingAttention`). Ring rank ``r`` holds chunks ``r`` and ``2R - 1 - r`` of
every packed sequence. Key/value blocks travel around the ring (point-to-point sends to the next
rank, receives from the previous, overlapped with the computation); after ``R`` steps every query
chunk has met every key chunk once. Within one sequence, a query chunk sees earlier chunks entirely,
its own chunk causally, and later chunks not at all, so each block is a few dense or causal attention
calls on chunk pairs of the same sequence. Partial results are merged exactly by log-sum-exp:
``lse = logaddexp(lse_a, lse_b)``, ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``.

The backward pass recomputes each block from the final output and log-sum-exp (the flash-attention
backward: ``P = exp(S - lse)``, ``dS = P * (dP - rowsum(dO * O))``), sending the key/value gradient
accumulators around the ring with their blocks, so that after ``R`` steps each returns to its owner.
No ``[T, T]`` score matrix is ever kept.

Block kernels: on the CPU the flash-attention op that returns the log-sum-exp
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward); on CUDA with fp16/bf16
torch's flash-attention op and its backward, called as torch's own context-parallel attention calls
them (:func:`cuda_flash_backward`); otherwise (e.g. fp32 on CUDA) the same formulas in plain torch.
``bench/gpu_check.py`` compares the CUDA kernels with the plain-torch formulas on one GPU. Key/value
blocks move by grouped point-to-point calls (:func:`_shift`), which NCCL needs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from mmrl.parallel.sequence import ShardedSequences, ShardLayout, head_to_seq, seq_to_head

# ------------------------------------------------------------------ block kernels: [H, L, D] each


def _math_forward(q, k, v, causal: bool, scale: float):
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [H, Lq, Lk]
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    qf, kf, vf, doutf = q.float(), k.float(), v.float(), dout.float()
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(1), float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))  # with the final lse: this block's share of the softmax
    dv = torch.matmul(probs.transpose(-1, -2), doutf)
    dprobs = torch.matmul(doutf, vf.transpose(-1, -2))
    delta = (doutf * out.float()).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    return torch.matmul(dscores, kf), torch.matmul(dscores.transpose(-1, -2), qf), dv


def _uses_cuda_flash(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def cuda_flash_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's flash-attention op on one dense block [H, L, D] (fp16/bf16 on CUDA): (out, lse)."""
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q[None], k[None], v[None], 0.0, causal, False, scale=scale
    )
    return out[0], lse[0]


def cuda_flash_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """The flash-attention backward of one dense block, called with the arguments torch's own
    context-parallel ring attention passes (``torch.distributed.tensor.experimental._context_parallel``:
    the dense forward's outputs). For a dense [B, H, L, D] forward the op returns *undefined*
    ``cum_seq_q``/``cum_seq_k`` (None in Python), and the backward picks the varlen kernel whenever
    ``cum_seq_q`` is defined (``_flash_attention_backward``: ``cumulative_sequence_length_q.defined()``):
    so they must be None, not an empty tensor, which is defined and selects the varlen kernel, which
    rejects 4-D inputs. ``max_q``/``max_k`` are the block lengths; the philox seed/offset are only read
    with dropout (here 0), so empty tensors of the forward's dtypes stand in for them."""
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)  # the forward's (seed, offset) layout
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout[None], q[None], k[None], v[None], out[None], lse[None], None, None,
        q.shape[1], k.shape[1], 0.0, causal, seed, offset, scale=scale,
    )  # fmt: skip
    return tuple(grad[0] for grad in grads)


def block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query block [H, Lq, D] on key/value block [H, Lk, D]: (out [H, Lq, D], lse
    [H, Lq] float32). ``causal`` masks key j > query i (equal lengths)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], 0.0, causal, scale=scale
        )
        return out[0], lse[0]
    if _uses_cuda_flash(q):
        return cuda_flash_forward(q, k, v, causal, scale)
    return _math_forward(q, k, v, causal, scale)


def block_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients (dq, dk, dv) of one block, given the *final* output and log-sum-exp of the queries."""
    if q.device.type == "cpu":
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout[None], q[None], k[None], v[None], out[None], lse[None], 0.0, causal, scale=scale
        )
        return tuple(grad[0] for grad in grads)
    if _uses_cuda_flash(q):
        return cuda_flash_backward(dout, q, k, v, out, lse, causal, scale)
    return _math_backward(dout, q, k, v, out, lse, causal, scale)


# ------------------------------------------------------------------ ring attention


class BlockPair(NamedTuple):
    """A query chunk and a key chunk of the same sequence that attend: slices of the local tokens."""

    query_start: int
    query_length: int
    key_start: int
    key_length: int
    causal: bool


def block_pairs(layout: ShardLayout, ring_rank: int, source: int) -> list[BlockPair]:
    """Chunk pairs of ring rank ``ring_rank``'s queries and ring rank ``source``'s keys that attend."""
    pairs = []
    for query in layout.pieces[ring_rank]:
        for key in layout.pieces[source]:
            if key.sequence != query.sequence or key.chunk > query.chunk:
                continue
            if query.length and key.length:
                pairs.append(
                    BlockPair(
                        query.local_start, query.length, key.local_start, key.length, key.chunk == query.chunk
                    )
                )
    return pairs


def _shift(send: torch.Tensor, recv_numel: int, ring: tuple[int, ...], ring_rank: int, group):
    """Send ``send`` to the next ring rank and receive ``recv_numel`` elements from the previous one;
    returns a function that waits for both and gives the received buffer.

    One grouped call (``batch_isend_irecv``) on every backend: with separate ``isend``/``irecv`` calls
    NCCL runs each as its own kernel, and with two ring ranks (each rank's previous rank is its next)
    both ranks' receives wait for sends that queue behind them: a hang. gloo buffers its sends, so
    separate calls happen to work there; the grouped call behaves the same on both (gloo issues the
    pair in turn)."""
    size = len(ring)
    if size == 1:  # a ring of one (bench/gpu_check.py runs the ring on one device): what it sends arrives
        return lambda: send
    recv = send.new_empty(recv_numel)
    requests = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.irecv, recv, ring[(ring_rank - 1) % size], group),
            dist.P2POp(dist.isend, send.contiguous(), ring[(ring_rank + 1) % size], group),
        ]
    )

    def wait() -> torch.Tensor:
        for request in requests:
            request.wait()
        return recv

    return wait


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, ring_rank, ring, group, scale):
        size = len(ring)
        heads, _, dim = k.shape
        tokens = [len(positions) for positions in layout.ring_positions]
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        block = torch.stack([k, v])  # [2, H, T_source, D]
        for step in range(size):
            source = (ring_rank - step) % size
            wait = None
            if step < size - 1:  # the next block travels while this one is computed
                incoming = tokens[(source - 1) % size]
                wait = _shift(block.reshape(-1), 2 * heads * incoming * dim, ring, ring_rank, group)
            for pair in block_pairs(layout, ring_rank, source):
                rows = slice(pair.query_start, pair.query_start + pair.query_length)
                cols = slice(pair.key_start, pair.key_start + pair.key_length)
                part, part_lse = block_forward(
                    q[:, rows], block[0][:, cols], block[1][:, cols], pair.causal, scale
                )
                merged = torch.logaddexp(lse[:, rows], part_lse)
                out[:, rows] = out[:, rows] * torch.exp(lse[:, rows] - merged).unsqueeze(
                    -1
                ) + part.float() * (torch.exp(part_lse - merged).unsqueeze(-1))
                lse[:, rows] = merged
            if wait is not None:
                block = wait().view(2, heads, incoming, dim)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (layout, ring_rank, ring, group, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        layout, ring_rank, ring, group, scale = ctx.args
        size = len(ring)
        heads, _, dim = k.shape
        tokens = [len(positions) for positions in layout.ring_positions]
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        block = torch.stack([k, v])
        grads = torch.zeros(block.shape, dtype=torch.float32, device=q.device)  # travels with its block
        for step in range(size):
            source = (ring_rank - step) % size
            for pair in block_pairs(layout, ring_rank, source):
                rows = slice(pair.query_start, pair.query_start + pair.query_length)
                cols = slice(pair.key_start, pair.key_start + pair.key_length)
                dq_part, dk_part, dv_part = block_backward(
                    dout[:, rows].contiguous(),
                    q[:, rows].contiguous(),
                    block[0][:, cols].contiguous(),
                    block[1][:, cols].contiguous(),
                    out[:, rows].contiguous(),
                    lse[:, rows].contiguous(),
                    pair.causal,
                    scale,
                )
                dq[:, rows] += dq_part.float()
                grads[0][:, cols] += dk_part.float()
                grads[1][:, cols] += dv_part.float()
            # the gradients follow their block to the next rank; after `size` shifts they are home
            incoming = tokens[(source - 1) % size]
            send = (
                grads.reshape(-1)
                if step == size - 1
                else torch.cat([block.float().reshape(-1), grads.reshape(-1)])
            )
            numel = 2 * heads * incoming * dim
            received = _shift(send, numel if step == size - 1 else 2 * numel, ring, ring_rank, group)()
            if step < size - 1:
                block = received[:numel].view(2, heads, incoming, dim).to(k.dtype)
                grads = received[numel:].view(2, heads, incoming, dim)
            else:
                grads = received.view(2, heads, incoming, dim)
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None, None


def ring_attention(q, k, v, layout: ShardLayout, ring_rank: int, ring: tuple[int, ...], group, scale: float):
    """Causal attention of this ring rank's tokens on the whole packed row: q/k/v [H, T_ring_rank, D]
    (equal head counts) -> [H, T_ring_rank, D]. Differentiable; collective over the ring."""
    return _RingAttention.apply(
        q.contiguous(), k.contiguous(), v.contiguous(), layout, ring_rank, ring, group, scale
    )


# ------------------------------------------------------------------ the attention function


def _repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    """[H_kv, T, D] -> [H_kv * times, T, D], each head repeated ``times`` times in place (GQA order)."""
    return x if times == 1 else x.repeat_interleave(times, dim=0)


def _causal_per_sequence(q, k, v, lengths: tuple[int, ...], scale: float) -> torch.Tensor:
    """Causal attention within each of the consecutive sequences of ``lengths``: [H, T, D] each (key /
    value heads may be fewer) -> [H, T, D]."""
    outputs = [
        torch.nn.functional.scaled_dot_product_attention(
            q_part[None], k_part[None], v_part[None], is_causal=True, scale=scale, enable_gqa=True
        )[0]
        for q_part, k_part, v_part in zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1))
    ]
    return torch.cat(outputs, dim=1)


def sharded_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sharded: ShardedSequences,
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention within each packed sequence, on this rank's tokens of a sequence-parallel
    forward: ``query`` [1, H, T_rank, D], ``key``/``value`` [1, H_kv, T_rank, D] -> [1, T_rank, H, D]."""
    groups, layout = sharded.groups, sharded.layout
    heads, kv_heads = query.shape[1], key.shape[1]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if heads % groups.ulysses_size:
        raise ValueError(
            f"ulysses_size={groups.ulysses_size} must divide the {heads} attention heads of "
            f"{type(module).__name__}; choose a Ulysses size that does, or use ring_size instead"
        )
    q, k, v = query[0], key[0], value[0]  # [H, T_rank, D]
    if kv_heads % groups.ulysses_size:  # too few key/value heads to split: give each query head its own
        k, v = _repeat_heads(k, heads // kv_heads), _repeat_heads(v, heads // kv_heads)
    if groups.ulysses_size > 1:
        sizes, rank, group = layout.ulysses_sizes(groups.ring_rank), groups.ulysses_rank, groups.ulysses_group
        q, k, v = (seq_to_head(x, sizes, rank, group) for x in (q, k, v))  # [H / U, T_ring_rank, D]
    if groups.ring_size > 1:
        times = q.shape[0] // k.shape[0]
        out = ring_attention(
            q,
            _repeat_heads(k, times),
            _repeat_heads(v, times),
            layout,
            groups.ring_rank,
            groups.ring_ranks,
            groups.ring_group,
            scale,
        )
    else:  # one ring rank: it holds every sequence whole, in order
        out = _causal_per_sequence(q, k, v, sharded.packed.lengths, scale)
    if groups.ulysses_size > 1:
        out = head_to_seq(
            out.contiguous(),
            layout.ulysses_sizes(groups.ring_rank),
            groups.ulysses_rank,
            groups.ulysses_group,
        )
    return out.transpose(0, 1).unsqueeze(0)  # [1, T_rank, H, D]
