"""``torch.compile`` of a model's decoder layers, each on its own (regional compilation), and of its
log-prob head's per-chunk math (:func:`compile_head`).

A compiled layer runs its norms, rotary embedding, residual adds and MLP activation as few fused
kernels, forward and backward; the matrix products and the attention kernel stay library calls. On an
H200 this took the actor update's elementwise kernels from 506 to 93 ms and the update from 16,395 to
19,065 tokens/s (docs/throughput.md). Every layer shares its compiled graphs; the token count turns
dynamic after its first change, and gradient and no-gradient passes, trained and frozen weights compile
apart; the first steps pay the compilation.

The packed rows' boundaries never enter the compiled code: the layer's ``packed_sequences`` argument is
taken off its call (:func:`mmrl.models.attention.layer_packed_sequences`) and its packed attention runs
eagerly and reads them there (:func:`mmrl.models.attention.eager_under_compile`); a dense
micro-batch's attention (no padding, no shared prompt) is compiled with the rest of the layer.
Traced, the boundaries (how many sequences and shared-prompt buckets, their lengths) became guards,
and every new batch layout compiled the layer again until the compiler gave up. Left eager: layers that route tokens to experts (mixture of experts:
data-dependent shapes, host syncs), and every layer of a decoder that carries a state along each
sequence (Qwen3.5's linear attention runs each packed sequence on its own, by its boundaries).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from torch import nn

from mmrl.models.attention import eager_under_compile, layer_packed_sequences
from mmrl.models.families import family_of
from mmrl.models.loading import decoder_layers
from mmrl.models.token_scoring import EAGER_CHUNK_MATH, ChunkMath, token_scoring_head

logger = logging.getLogger(__name__)

# compiled graphs one layer call may keep (torch's default is 8): token count static and dynamic, times
# gradient and no-gradient passes, times trained and frozen weights, with room to spare
RECOMPILE_LIMIT = 32


def compiled_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers :func:`compile_layers` compiles: none of a decoder that carries a state along
    each sequence, else those without an expert router."""
    family = family_of(model)
    if family.sequence_state is not None:
        return []
    routers = {id(router) for _, router in family.router_modules(model)}
    return [
        layer
        for layer in decoder_layers(model)
        if not any(id(module) in routers for module in layer.modules())
    ]


def _without_packed_sequences(compiled_call: Callable) -> Callable:
    """``compiled_call`` with the layer's ``packed_sequences`` set aside for its attention."""

    def call(*args, packed_sequences=None, **kwargs):
        with layer_packed_sequences(packed_sequences):
            return compiled_call(*args, **kwargs)

    return call


def compile_layers(model: nn.Module, backend: str | Callable = "inductor") -> int:
    """Compile (in place, before sharding) each of ``model``'s decoder layers :func:`compiled_layers`
    names with ``backend``; returns how many were compiled."""
    import torch._dynamo

    layers = compiled_layers(model)
    eager_under_compile()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for layer in layers:
        layer.compile(backend=backend)
        layer._compiled_call_impl = _without_packed_sequences(layer._compiled_call_impl)
    total = len(decoder_layers(model))
    if len(layers) < total:
        logger.warning(
            "compile_layers: %d of %d decoder layers compiled (left eager: layers routing tokens to "
            "experts, decoders carrying a state along each sequence)",
            len(layers),
            total,
        )
    return len(layers)


@functools.cache
def compiled_chunk_math(backend: str | Callable = "inductor") -> ChunkMath:
    """The log-prob head's chunk math (:class:`mmrl.models.token_scoring.ChunkMath`) compiled with
    ``backend``, once per process and backend, each function whole (``fullgraph``: a graph break is an
    error, not a silent eager fallback); the chunk's row count turns dynamic after its first change."""
    import torch
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return ChunkMath(
        torch.compile(EAGER_CHUNK_MATH.scores, backend=backend, fullgraph=True),
        torch.compile(EAGER_CHUNK_MATH.logits_grad, backend=backend, fullgraph=True),
    )


def compile_head(model: nn.Module, backend: str | Callable = "inductor") -> bool:
    """Compile the per-chunk math of ``model``'s log-prob head (``worker.actor.model.compile_head``):
    the log-softmax, entropies and their gradient on each chunk's ``[chunk, vocab]`` logits, fused into
    a few kernels (docs/throughput.md, step 10); the head's matrix products stay library calls. False
    for a model without the head (a critic's value head)."""
    head = token_scoring_head(model)
    if head is None:
        return False
    head.chunk_math = compiled_chunk_math(backend)
    return True
