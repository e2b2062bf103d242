"""Attention over packed sequences: several sequences concatenated into one row, with their boundaries.

A packed micro-batch is one row ``[1, T]`` holding the valid tokens of all its sequences back to back
(no padding). Each token may attend only to earlier tokens of its own sequence, so attention needs
the boundaries ``cu_seqlens = [0, L_0, L_0 + L_1, ..., T]``. They travel as one forward keyword,
``packed_sequences`` (a :class:`PackedSequences`), from ``model(...)`` down to every attention call:
transformers v5 hands unknown forward keywords through the decoder layers to the attention function
(and to the vision/audio towers, whose attention functions ignore it).

:data:`PACKED_ATTENTION` is registered with transformers' ``AttentionInterface`` and
``AttentionMaskInterface`` and set on the text decoder only (:func:`enable_packed_attention`, where
the model is built):

- with ``packed_sequences``, on fp16/bf16 CUDA tensors: one variable-length kernel call per layer,
  flash-attn's ``flash_attn_varlen_func`` when the package is installed (and loads: a broken install
  warns once and is not used), else torch's own ``torch.nn.attention.varlen.varlen_attn`` (the flash
  kernel torch ships, torch >= 2.10); otherwise (CPU, fp32, an older torch, dropout) torch sdpa run
  causally on each sequence in turn, which is exact (a padded batch computes the same sums, with masked
  keys adding exp(-inf) = 0).
- without it (the padded path): exactly transformers' own sdpa attention and sdpa mask;
- with a :class:`SharedPrefixSequences` (a prompt once, followed by its n responses): each response
  attends to its prompt's keys and causally to its own;
- with a :class:`~mmrl.parallel.sequence.ShardedSequences` (sequence parallelism): this rank's tokens
  of the row, attended through Ulysses and ring attention (:mod:`mmrl.parallel.ring_attention`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import inspect
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from mmrl.parallel.sequence import ShardedSequences

logger = logging.getLogger(__name__)

PACKED_ATTENTION = "mmrl_packed"
# the same, with torch's variable-length kernel where flash-attn is absent (``packed_attention: torch_varlen``)
PACKED_VARLEN_ATTENTION = "mmrl_packed_varlen"
PACKED_ATTENTIONS = {"sdpa": PACKED_ATTENTION, "torch_varlen": PACKED_VARLEN_ATTENTION}


class PackedSequences(NamedTuple):
    """Boundaries of the sequences in a packed row (a NamedTuple: FSDP and checkpointing pass it through).

    ``cu_seqlens`` int32 ``[N + 1]`` on the compute device (flash-attn reads it there);
    ``lengths`` the same boundaries as Python ints ``(L_0, ..., L_{N-1})`` (splitting needs no
    device sync); ``max_seqlen`` = max(lengths).
    """

    cu_seqlens: torch.Tensor
    lengths: tuple[int, ...]
    max_seqlen: int

    @classmethod
    def from_lengths(
        cls, lengths: list[int] | tuple[int, ...], device: torch.device | str
    ) -> PackedSequences:
        lengths = tuple(int(length) for length in lengths)
        if not lengths or min(lengths) <= 0:
            raise ValueError(
                f"PackedSequences: every sequence needs at least one token, got lengths {lengths}"
            )
        cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu_seqlens[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        return cls(cu_seqlens.to(device), lengths, max(lengths))


class SharedPrefixSequences(NamedTuple):
    """A packed row where the n responses of a prompt share one copy of it: ``[prompt, response_1, ...,
    response_n, next prompt, ...]``. Every token belongs to one *segment* (a prompt, a response, or a
    row whose prompt has no other response, packed whole) and attends causally to its segment's keys: a prompt's own tokens, or its prompt's tokens followed
    by the response's own (bottom-right causal: query i of a q-token segment with k keys sees keys
    ``0 .. k - q + i``). Built by :func:`mmrl.models.inputs.build_shared_prefix_inputs`.

    ``q_lengths`` / ``kv_lengths``: per segment, in row order (segments tile the row);
    ``kv_index`` int64 ``[sum(kv_lengths)]``: each segment's keys as positions of the row;
    ``cu_seqlens_q`` / ``cu_seqlens_k`` int32 (flash-attn's varlen layout over the gathered keys);
    ``buckets``: for the torch path, segments of equal (q, k) lengths batched:
    ``(query positions [m, q], key positions [m, k], mask [q, k] or None, span)``, the bottom-right
    causal mask made once per pass rather than in every layer, and None for segments that attend to
    themselves only (q = k: a prompt, or a row whose prompt is not shared), which run causal without a
    mask (no mask: sdpa's fused kernels and grouped-query heads without copying the keys on a GPU);
    ``span`` ``(start, stop)`` when such segments lie back to back from ``start`` to ``stop`` (their
    tokens are then taken as views of the row, not gathered), else None.
    """

    q_lengths: tuple[int, ...]
    kv_lengths: tuple[int, ...]
    kv_index: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    buckets: tuple[tuple[torch.Tensor, torch.Tensor], ...]

    @classmethod
    def from_segments(
        cls, segments: list[tuple[int, int, list[tuple[int, int]]]], device: torch.device | str
    ) -> SharedPrefixSequences:
        """``segments``: ``(q_start, q_length, key ranges [(start, length), ...])`` in row order."""
        q_lengths = tuple(length for _, length, _ in segments)
        kv_lengths = tuple(sum(length for _, length in ranges) for _, _, ranges in segments)
        key_positions = [
            torch.cat([torch.arange(start, start + length) for start, length in ranges])
            for _, _, ranges in segments
        ]
        by_shape: dict[tuple[int, int], list[int]] = {}
        for index, shape in enumerate(zip(q_lengths, kv_lengths)):
            by_shape.setdefault(shape, []).append(index)
        buckets = tuple(
            (
                torch.stack([torch.arange(segments[i][0], segments[i][0] + q) for i in members]).to(device),
                torch.stack([key_positions[i] for i in members]).to(device),
                None if q == k else bottom_right_causal_mask(q, k, device),
                _span(segments, members, q, k),
            )
            for (q, k), members in by_shape.items()
        )
        cu_q = torch.zeros(len(segments) + 1, dtype=torch.int32)
        cu_q[1:] = torch.tensor(q_lengths, dtype=torch.int32).cumsum(0)
        cu_k = torch.zeros(len(segments) + 1, dtype=torch.int32)
        cu_k[1:] = torch.tensor(kv_lengths, dtype=torch.int32).cumsum(0)
        return cls(
            q_lengths,
            kv_lengths,
            torch.cat(key_positions).to(device),
            cu_q.to(device),
            cu_k.to(device),
            max(q_lengths),
            max(kv_lengths),
            buckets,
        )


def _span(
    segments: list[tuple[int, int, list[tuple[int, int]]]], members: list[int], q: int, k: int
) -> tuple[int, int] | None:
    """``(start, stop)`` of the bucket ``members`` of self-attending segments (q = k) lying back to back
    in the row, else None."""
    start = segments[members[0]][0]
    back_to_back = all(segments[i][0] == start + j * q for j, i in enumerate(members))
    return (start, start + len(members) * q) if q == k and back_to_back else None


@functools.cache
def _flash_attn_varlen_func():
    """flash-attn's varlen kernel, or None when the package is not installed or does not load (imported
    on first use, once per process). flash-attn is a compiled extension built against one torch and
    CUDA: installed for another torch it fails to import (``ImportError: ... undefined symbol``), and
    then attention falls back to the exact sdpa path with one warning instead of stopping the run."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except (ImportError, OSError) as err:  # OSError: a shared library that cannot be opened
        logger.warning(
            "flash-attn is installed but does not load (%s: %s); packed attention uses torch sdpa instead "
            "(exact, slower). Reinstall it against this torch: pip install flash-attn --no-build-isolation "
            "(docs/gpu.md)",
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
        )
        return None
    return flash_attn_varlen_func


def flash_attn_available() -> bool:
    """Whether flash-attn's varlen kernel loads in this process (it serves fp16/bf16 CUDA tensors)."""
    return _flash_attn_varlen_func() is not None


@functools.cache
def _torch_varlen_func() -> Callable | None:
    """torch's variable-length flash kernel (``torch.nn.attention.varlen.varlen_attn``, CUDA fp16/bf16)
    behind flash-attn's calling convention, or None when this torch has none (< 2.10). Its keywords
    moved between releases: causal is ``is_causal=True`` (2.10) or ``window_size=(-1, 0)`` (2.11+);
    ``scale`` and ``enable_gqa`` (grouped-query heads) exist only in later releases, and without them the
    query is pre-scaled and the key/value heads repeated."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    causal = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}

    def kernel(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal_
    ):
        if not causal_ or dropout_p:
            raise ValueError("torch's varlen kernel serves causal attention without dropout only")
        keywords = dict(causal)
        if q.shape[1] != k.shape[1]:
            if "enable_gqa" in parameters:
                keywords["enable_gqa"] = True
            else:
                k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        if softmax_scale is not None:
            if "scale" in parameters:
                keywords["scale"] = softmax_scale
            else:  # the kernel's own scale is head_dim ** -0.5
                q = q * (softmax_scale * q.shape[-1] ** 0.5)
        return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **keywords)

    return kernel


def _varlen_kernel(query: torch.Tensor, dropout: float, torch_varlen: bool) -> Callable | None:
    """The variable-length kernel for these tensors (flash-attn's calling convention: ``[T, H, D]``,
    cumulative lengths, causal bottom-right aligned), or None for the per-sequence sdpa path: flash-attn
    when it loads, else with ``torch_varlen`` torch's own (no dropout), on fp16/bf16 CUDA tensors only."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
        return None
    kernel = _flash_attn_varlen_func()
    if kernel is None and torch_varlen and not dropout:
        kernel = _torch_varlen_func()
    return kernel


def _flash_varlen(
    kernel: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: tuple[torch.Tensor, torch.Tensor],
    max_seqlens: tuple[int, int],
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """A varlen ``kernel`` (:func:`_varlen_kernel`), causal (bottom-right aligned when a segment has more
    keys than queries), on ``query`` [H, T, D] and ``key``/``value`` [H_kv, T_k, D] (H_kv < H handled by
    the kernel); ``cu_seqlens``/``max_seqlens`` for (queries, keys). Returns ``[1, T, H, D]``."""
    output = kernel(
        query.transpose(0, 1),
        key.transpose(0, 1),
        value.transpose(0, 1),
        cu_seqlens[0],
        cu_seqlens[1],
        max_seqlens[0],
        max_seqlens[1],
        dropout,
        scaling,
        True,
    )
    return output.unsqueeze(0)


def varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packed: PackedSequences,
    scaling: float | None,
    dropout: float = 0.0,
    torch_varlen: bool = False,
) -> torch.Tensor:
    """Causal attention within each packed sequence.

    ``query`` ``[1, H, T, D]``, ``key``/``value`` ``[1, H_kv, T, D]`` (grouped-query heads allowed);
    returns ``[1, T, H, D]`` (transformers' attention-output layout).
    """
    kernel = _varlen_kernel(query, dropout, torch_varlen)
    if kernel is not None:
        cu, longest = packed.cu_seqlens, packed.max_seqlen
        return _flash_varlen(
            kernel, query[0], key[0], value[0], (cu, cu), (longest, longest), scaling, dropout
        )
    return _causal_runs(module, query, key, value, packed.lengths, scaling, dropout)


@functools.lru_cache(maxsize=64)
def _equal_length_runs(lengths: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """``lengths`` as runs of equal consecutive lengths: ``((count, length), ...)`` in row order (the
    same for every layer of a forward: computed once)."""
    return tuple((len(list(group)), length) for length, group in itertools.groupby(lengths))


def _causal_runs(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: tuple[int, ...],
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """Causal torch sdpa within each of the back-to-back sequences of ``lengths``, one call per run of
    equal lengths (a run of m sequences of q tokens is a [m, H, q, D] batch of views): ``query``
    ``[1, H, T, D]``, ``key``/``value`` ``[1, H_kv, T, D]``; returns ``[1, T, H, D]``. The row is
    split once per tensor (views; its backward is one concatenation, not a zero-filled row per piece)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    runs = _equal_length_runs(lengths)
    sizes = [count * length for count, length in runs]
    pieces = zip(*(x.split(sizes, dim=2) if len(runs) > 1 else (x,) for x in (query, key, value)))
    outputs = []
    for (count, _), (q, k, v) in zip(runs, pieces):
        if count > 1:  # [1, H, m * q, D] -> [m, H, q, D]
            q, k, v = (x.view(x.shape[1], count, -1, x.shape[3]).transpose(0, 1) for x in (q, k, v))
        output, _ = sdpa_attention_forward(
            module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True
        )  # [m, q, H, D]
        outputs.append(output.view(1, -1, *output.shape[2:]) if count > 1 else output)
    return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]  # [1, T, H, D]


def bottom_right_causal_mask(q_length: int, kv_length: int, device: torch.device) -> torch.Tensor:
    """``[q, k]`` bool, True where query i may see key j: ``j <= i + k - q`` (the queries are the last q
    of the k keys' sequence)."""
    rows = torch.arange(q_length, device=device).unsqueeze(-1)
    return torch.arange(kv_length, device=device) <= rows + (kv_length - q_length)


def shared_prefix_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sequences: SharedPrefixSequences,
    scaling: float | None,
    dropout: float = 0.0,
    torch_varlen: bool = False,
) -> torch.Tensor:
    """Each segment's queries against its own keys (see :class:`SharedPrefixSequences`).

    ``query`` ``[1, H, T, D]``, ``key``/``value`` ``[1, H_kv, T, D]``; returns ``[1, T, H, D]``. A varlen
    kernel (flash-attn's or torch's): one call over the gathered keys (its causal mask is bottom-right aligned). Otherwise torch sdpa,
    one call per bucket of equally shaped segments, with an explicit bottom-right causal mask.
    """
    kernel = _varlen_kernel(query, dropout, torch_varlen)
    if kernel is not None:
        return _flash_varlen(
            kernel,
            query[0],
            key[0, :, sequences.kv_index],
            value[0, :, sequences.kv_index],
            (sequences.cu_seqlens_q, sequences.cu_seqlens_k),
            (sequences.max_seqlen_q, sequences.max_seqlen_k),
            scaling,
            dropout,
        )
    if sequences.q_lengths == sequences.kv_lengths:  # no prompt shared: every segment attends to itself
        return _causal_runs(module, query, key, value, sequences.q_lengths, scaling, dropout)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    heads, tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
    buckets = sequences.buckets
    output = None if len(buckets) == 1 else query.new_empty(tokens, heads, head_dim)
    for query_positions, key_positions, mask, span in buckets:  # [m, q], [m, k], [q, k] or None
        if span is not None:  # back-to-back segments: [m, H, q, D] views of the row
            q, k, v = (_segments_view(x, span, query_positions.shape[0]) for x in (query, key, value))
        else:
            q = query[0][:, query_positions].transpose(0, 1)  # [m, H, q, D]
            k = key[0][:, key_positions].transpose(0, 1)  # [m, H_kv, k, D]
            v = value[0][:, key_positions].transpose(0, 1)
        bucket_output, _ = sdpa_attention_forward(
            module,
            q,
            k,
            v,
            None if mask is None else mask.expand(query_positions.shape[0], 1, -1, -1),
            dropout=dropout,
            scaling=scaling,
            is_causal=mask is None,  # q = k: the segment's own keys, causal (top-left = bottom-right)
        )  # [m, q, H, D]
        if output is None:  # one bucket: every token of the row, in row order
            return (
                bucket_output.view(1, tokens, heads, head_dim)
                if span is not None
                else _in_row_order(bucket_output.reshape(-1, heads, head_dim), query_positions)
            )
        bucket_output = bucket_output.reshape(-1, heads, head_dim)
        if span is not None:
            output[span[0] : span[1]] = bucket_output
        else:
            output[query_positions.flatten()] = bucket_output
    return output.unsqueeze(0)


def _segments_view(x: torch.Tensor, span: tuple[int, int], count: int) -> torch.Tensor:
    """The tokens ``span`` of ``x`` [1, H, T, D], ``count`` back-to-back segments of equal length, as
    [count, H, q, D]: views, two ops in all where the span is the whole row (no select or slice, whose
    backward would allocate a zero row and copy into it)."""
    if span != (0, x.shape[2]):
        x = x.narrow(2, span[0], span[1] - span[0])
    return x.view(x.shape[1], count, -1, x.shape[3]).transpose(0, 1)


def _in_row_order(outputs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``outputs`` [T, H, D] of the tokens at ``positions`` (all T of the row, in some order) as [1, T, H, D]
    in row order."""
    ordered = torch.empty_like(outputs)
    ordered[positions.flatten()] = outputs
    return ordered.unsqueeze(0)


def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_sequences: PackedSequences | None = None,
    torch_varlen: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function of :data:`PACKED_ATTENTION` (and, with ``torch_varlen``, of
    :data:`PACKED_VARLEN_ATTENTION`): varlen attention on a packed row, transformers' sdpa attention on
    anything else. In a compiled decoder layer's call on a packed row (:func:`layer_packed_sequences`)
    the packed attention runs eagerly, its rows' boundaries out of the compiler's sight."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_sequences is None and not _IN_PACKED_LAYER[0]:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return _PACKED_ATTENTION[0](
        module, query, key, value, packed_sequences, dropout, scaling, torch_varlen, kwargs
    )


def _packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packed_sequences: PackedSequences | None,
    dropout: float,
    scaling: float | None,
    torch_varlen: bool,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """Attention on a packed row: ``packed_sequences``, or those of the compiled layer being called."""
    if packed_sequences is None:
        packed_sequences = _LAYER_PACKED_SEQUENCES.get()
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(
            f"packed attention has no sliding-window variant (layer {getattr(module, 'layer_idx', '?')} "
            f"uses a window of {kwargs['sliding_window']}); set worker.actor.padding_free=false for this model"
        )
    if isinstance(packed_sequences, SharedPrefixSequences):  # responses sharing their prompt
        output = shared_prefix_attention(
            module, query, key, value, packed_sequences, scaling, dropout, torch_varlen
        )
        return output, None
    if isinstance(packed_sequences, ShardedSequences):  # this rank's tokens of a sequence-parallel row
        from mmrl.parallel.ring_attention import sharded_attention

        return sharded_attention(module, query, key, value, packed_sequences, scaling), None
    if query.shape[0] != 1 or query.shape[2] != sum(packed_sequences.lengths):
        raise ValueError(
            f"packed attention: expected one row of {sum(packed_sequences.lengths)} tokens (the sum of the "
            f"packed lengths), got query of shape {tuple(query.shape)} [batch, heads, tokens, head_dim]"
        )
    return varlen_attention(module, query, key, value, packed_sequences, scaling, dropout, torch_varlen), None


# The packed rows of the compiled decoder layer being called (layer_packed_sequences): its compiled
# code never sees them (traced, their lengths became guards and every new batch layout compiled the layer
# again); the flag tells the traced attention to call the eager packed attention, which reads them.
_LAYER_PACKED_SEQUENCES: contextvars.ContextVar[PackedSequences | None] = contextvars.ContextVar(
    "mmrl_layer_packed_sequences", default=None
)
_IN_PACKED_LAYER = [False]
# the packed attention packed_attention_forward calls; eager_under_compile swaps in its
# compiler-disabled twin (torch._dynamo is imported only then: 1.2 s of every process's start otherwise)
_PACKED_ATTENTION: list[Callable] = [_packed_attention]


def eager_under_compile() -> None:
    """Run packed attention eagerly inside compiled decoder layers (:mod:`mmrl.models.compiled`).
    Idempotent."""
    if _PACKED_ATTENTION[0] is _packed_attention:
        _PACKED_ATTENTION[0] = torch.compiler.disable(_packed_attention)


@contextlib.contextmanager
def layer_packed_sequences(packed_sequences: PackedSequences | None) -> Iterator[None]:
    """Around a compiled decoder layer's call, with its ``packed_sequences`` taken off the call: its
    packed attention reads them here. None (a padded or dense call) changes nothing."""
    if packed_sequences is None:
        yield
        return
    token, flag = _LAYER_PACKED_SEQUENCES.set(packed_sequences), _IN_PACKED_LAYER[0]
    _IN_PACKED_LAYER[0] = True
    try:
        yield
    finally:
        _IN_PACKED_LAYER[0] = flag
        _LAYER_PACKED_SEQUENCES.reset(token)


def packed_attention_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any):
    """The ``AttentionMaskInterface`` function of :data:`PACKED_ATTENTION`.

    A packed row carries no padding mask: the sequence boundaries reach the attention function
    instead, so no ``[T, T]`` mask is built (transformers would build one from the restarting
    position ids). A padded batch gets transformers' sdpa mask.
    """
    from transformers.masking_utils import sdpa_mask

    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


@functools.cache
def register_packed_attention() -> None:
    """Register :data:`PACKED_ATTENTION` with transformers (once per process)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name in PACKED_ATTENTIONS.values():
        forward = functools.partial(packed_attention_forward, torch_varlen=name == PACKED_VARLEN_ATTENTION)
        AttentionInterface.register(name, forward)
        AttentionMaskInterface.register(name, packed_attention_mask)


def enable_packed_attention(model: nn.Module, kernel: str = "sdpa") -> None:
    """Make the text decoder of ``model`` use packed attention (idempotent): :data:`PACKED_ATTENTION`,
    or with ``kernel="torch_varlen"`` :data:`PACKED_VARLEN_ATTENTION` (``worker.*.model.packed_attention``).
    Called by :func:`mmrl.models.prepare.prepare_for_training` where the model is built.

    Only the decoder's config changes: the vision/audio towers keep their own attention, and a padded
    forward computes what transformers' sdpa computes.
    """
    register_packed_attention()
    if torch.cuda.is_available():
        flash_attn_available()  # a broken flash-attn install warns here, where the model is built
    config = model.get_decoder().config
    if config._attn_implementation != PACKED_ATTENTIONS[kernel]:
        config._attn_implementation = PACKED_ATTENTIONS[kernel]


def packed_attention_enabled(model: nn.Module) -> bool:
    """Whether ``model``'s text decoder uses :data:`PACKED_ATTENTION` (:func:`enable_packed_attention`)."""
    return model.get_decoder().config._attn_implementation in PACKED_ATTENTIONS.values()
