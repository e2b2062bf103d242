"""Attention over packed sequences: several sequences concatenated into one row, with their boundaries.

A packed micro-batch is one row ``[1, T]`` holding the valid tokens of all its sequences back to back
(no padding). Each token may attend only to earlier tokens of its own sequence, so attention needs
the boundaries ``cu_seqlens = [0, L_0, L_0 + L_1, ..., T]``. They travel as one forward keyword,
``packed_sequences`` (a :class:`PackedSequences`), from ``model(...)`` down to every attention call:
transformers v5 hands unknown forward keywords through the decoder layers to the attention function
(and to the vision/audio towers, whose attention functions ignore it).

:data:`PACKED_ATTENTION` is registered with transformers' ``AttentionInterface`` and
``AttentionMaskInterface`` and set on the text decoder only (:func:`enable_packed_attention`):

- with ``packed_sequences``: flash-attn's ``flash_attn_varlen_func`` when the package is installed and
  the tensors are fp16/bf16 on CUDA; otherwise torch sdpa run causally on each sequence in turn,
  which is exact (a padded batch computes the same sums, with masked keys adding exp(-inf) = 0).
- without it (the padded path): exactly transformers' own sdpa attention and sdpa mask;
- with a :class:`~mmrl.parallel.sequence.ShardedSequences` (sequence parallelism): this rank's tokens
  of the row, attended through Ulysses and ring attention (:mod:`mmrl.parallel.ring_attention`).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, NamedTuple

import torch
from torch import nn

from mmrl.parallel.sequence import ShardedSequences

PACKED_ATTENTION = "mmrl_packed"


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


@functools.cache
def _flash_attn_varlen_func():
    """flash-attn's varlen kernel, or None when the package is not installed (imported on first use)."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def _can_use_flash_attn(query: torch.Tensor) -> bool:
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and _flash_attn_varlen_func() is not None
    )


def varlen_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packed: PackedSequences,
    scaling: float | None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Causal attention within each packed sequence.

    ``query`` ``[1, H, T, D]``, ``key``/``value`` ``[1, H_kv, T, D]`` (grouped-query heads allowed);
    returns ``[1, T, H, D]`` (transformers' attention-output layout).
    """
    if _can_use_flash_attn(query):
        # flash-attn layout: [T, heads, D]; it handles H_kv < H itself.
        output = _flash_attn_varlen_func()(
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            cu_seqlens_q=packed.cu_seqlens,
            cu_seqlens_k=packed.cu_seqlens,
            max_seqlen_q=packed.max_seqlen,
            max_seqlen_k=packed.max_seqlen,
            dropout_p=dropout,
            softmax_scale=scaling,
            causal=True,
        )
        return output.unsqueeze(0)  # [1, T, H, D]
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    outputs = [
        sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling, is_causal=True)[0]
        for q, k, v in zip(
            query.split(packed.lengths, dim=2),
            key.split(packed.lengths, dim=2),
            value.split(packed.lengths, dim=2),
        )
    ]
    return torch.cat(outputs, dim=1)  # [1, T, H, D]


def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_sequences: PackedSequences | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` function of :data:`PACKED_ATTENTION`: varlen attention on a packed row,
    transformers' sdpa attention on anything else."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if packed_sequences is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError(
            f"packed attention has no sliding-window variant (layer {getattr(module, 'layer_idx', '?')} "
            f"uses a window of {kwargs['sliding_window']}); set worker.actor.padding_free=false for this model"
        )
    if isinstance(packed_sequences, ShardedSequences):  # this rank's tokens of a sequence-parallel row
        from mmrl.parallel.ring_attention import sharded_attention

        return sharded_attention(module, query, key, value, packed_sequences, scaling), None
    if query.shape[0] != 1 or query.shape[2] != sum(packed_sequences.lengths):
        raise ValueError(
            f"packed attention: expected one row of {sum(packed_sequences.lengths)} tokens (the sum of the "
            f"packed lengths), got query of shape {tuple(query.shape)} [batch, heads, tokens, head_dim]"
        )
    return varlen_attention(module, query, key, value, packed_sequences, scaling, dropout), None


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

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, packed_attention_mask)


def enable_packed_attention(model: nn.Module) -> None:
    """Make the text decoder of ``model`` use :data:`PACKED_ATTENTION` (idempotent).

    Only the decoder's config changes: the vision/audio towers keep their own attention, and a padded
    forward computes what transformers' sdpa computes.
    """
    register_packed_attention()
    config = model.get_decoder().config
    if config._attn_implementation != PACKED_ATTENTION:
        config._attn_implementation = PACKED_ATTENTION
