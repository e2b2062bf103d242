"""Per-token log-probs and entropies straight from the hidden states, in token chunks.

A policy's log-prob pass needs ``log_softmax(h W^T / T)[y]`` (and the entropy of the same
distribution) at K response tokens. Through full logits that is a ``[K, vocab]`` tensor plus its fp32
log-softmax, and the same again in backward: at Qwen's 151,936-token vocabulary 0.6 MB per token and
buffer, ~10 GB for 8 responses of 2,048 tokens. Here the K rows go through the head ``chunk_tokens``
at a time and only ``[K]`` results are kept; backward recomputes each chunk's logits
(:class:`_ChunkedTokenScores`), so no ``[K, vocab]`` tensor exists in either direction, only
``[chunk, vocab]`` ones.

The computation stays inside the model's forward: :func:`install_token_scoring_head` (called by
:func:`mmrl.models.prepare.prepare_for_training`, once, where the model is built) puts a
:class:`TokenScoringHead` in place of ``lm_head``, holding the same weight Parameter (tied embeddings
stay tied, state-dict names unchanged). FSDP2 gathers that weight for the root module's forward and
reduce-scatters its gradient after the root's backward, exactly as for a plain head. Inside
``with scoring_tokens(model, targets, temperature, ...)`` the head returns ``[..., 2]`` =
``(log-prob, entropy)`` of ``targets`` (one target id per hidden row it is given) instead of logits,
then two more columns: the collapse-recovery spread term (``spread_top_k`` > 0:
``KL(u_K || softmax(z))``, ``u_K`` uniform over the ``spread_top_k`` largest logits, whose logit
gradient ``softmax(z) - u_K`` does not vanish at a saturated softmax; else 0) and the whole-vocabulary
entropy (logged only; the entropy column itself when it is not a top-k one): ``[..., 4]``. Outside it
is the plain linear head (generation, warm-up, rollout weight sync are untouched).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class TokenScoring:
    """What the head computes while :func:`scoring_tokens` is active.

    ``targets`` [N]: the token id scored at each of the N hidden rows the head receives (row-major over
    its leading dims), or, with ``rows`` [N], at those rows of its flattened input (for a model without
    ``logits_to_keep``, whose head gets every position; a row may be picked twice); ``chunk_tokens``
    rows per chunk (> 0); ``entropy_grad``: whether gradients flow through the entropy (an entropy
    bonus), or it is computed for logging only; ``entropy_top_k`` > 0: the entropy of the distribution
    renormalised over the ``entropy_top_k`` largest logits (``core_algos.entropy_from_logits``).
    """

    targets: torch.Tensor
    temperature: float
    chunk_tokens: int
    entropy_grad: bool = False
    rows: torch.Tensor | None = None
    entropy_top_k: int = 0
    spread_top_k: int = 0  # > 0: a third output, KL(u_K || p) over the spread_top_k largest logits


def _top_k_or_none(top_k: int, vocab_size: int) -> int | None:
    """``top_k`` when it selects part of the vocabulary, else None (the whole vocabulary)."""
    return top_k if 0 < top_k < vocab_size else None


def _scaled_fp32(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / T`` in fp32: in place on fp32 ``logits`` when eager (no second ``[C, V]`` buffer; the
    caller passes the head output it no longer needs), out of place when compiled (a graph input changed
    in place is copied back after the graph: one more pass)."""
    if torch.compiler.is_compiling():
        return logits.float() / temperature
    return logits.float().div_(temperature)


def _chunk_scores(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_k: int | None, spread_k: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's ``(log p(y), H, lse, spread, whole-vocabulary H)``, fp32 ``[C]`` each, from its head
    output ``logits = h W^T + b`` [C, V] (the head's dtype; consumed), ``z = logits / T`` in fp32."""
    logits = _scaled_fp32(logits, temperature)  # [C, V]: z (a bf16 head output is freed here)
    picked = logits.gather(-1, targets[:, None]).squeeze(-1)  # [C]
    spreads = torch.zeros_like(picked)
    if spread_k is not None:  # KL(u_K || p) = lse - mean(z_K) - log k; lse added below
        spreads = -logits.topk(spread_k, dim=-1, sorted=False).values.mean(-1) - math.log(spread_k)
    entropies = None
    if top_k is not None:  # before z is changed in place below
        top = logits.topk(top_k, dim=-1, sorted=False).values  # [C, k]
        top_lse = torch.logsumexp(top, dim=-1)
        entropies = top_lse - (top - top_lse[:, None]).exp_().mul_(top).sum(-1)
    maxes = logits.amax(-1, keepdim=True)  # [C, 1]: m
    # One [C, V] buffer, changed in place (logsumexp and a probability tensor would take two more):
    # e = exp(z - m), S = sum e, lse = m + log S, and with p = e / S the entropy
    # H = -sum p log p = log S - sum e (z - m) / S, where e (z - m) = xlogy(e, e): 0 where e underflows
    # to 0, so never 0 * -inf
    shifted = logits.sub_(maxes).exp_()
    sums = shifted.sum(-1)  # [C]
    lses = maxes.squeeze(-1) + sums.log()
    weighted = shifted.xlogy_(shifted).sum(-1)  # [C]: sum e (z - m)
    full_entropies = sums.log() - weighted / sums
    if spread_k is not None:
        spreads = spreads + lses
    return picked - lses, full_entropies if entropies is None else entropies, lses, spreads, full_entropies


def _chunk_logits_grad(
    logits: torch.Tensor,
    lses: torch.Tensor,
    targets: torch.Tensor,
    grad_log_probs: torch.Tensor | None,
    grad_entropies: torch.Tensor | None,
    entropies: torch.Tensor,
    temperature: float,
    top_k: int | None,
    spread: tuple[torch.Tensor, int] | None,
    bias_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk's gradient wrt its head output ``logits`` [C, V] (consumed; ``dz / dlogits = 1 / T``), in
    the logits' dtype, and its fp32 sum over the rows (the bias's gradient) with ``bias_grad``."""
    dtype = logits.dtype
    log_p = _scaled_fp32(logits, temperature).sub_(lses[:, None])  # [C, V]
    del logits  # a bf16 head output: freed before the gradient's buffers
    grad = _chunk_logit_grad(log_p, targets, grad_log_probs, grad_entropies, entropies, top_k, spread)
    grad = grad.div_(temperature)
    return grad.to(dtype), grad.sum(0) if bias_grad else None


@dataclass(frozen=True)
class ChunkMath:
    """What the head runs on each chunk's ``[C, V]`` output: :func:`_chunk_scores` in the forward,
    :func:`_chunk_logits_grad` in the backward, eagerly or compiled
    (:func:`mmrl.models.compiled.compiled_chunk_math`); the matrix products around them stay outside."""

    scores: Callable = _chunk_scores
    logits_grad: Callable = _chunk_logits_grad


EAGER_CHUNK_MATH = ChunkMath()


class _ChunkedTokenScores(torch.autograd.Function):
    """``(log p(y), H)`` per row of ``hidden`` [N, D], computed ``chunk`` rows at a time.

    With ``z = (h W^T + b) / T``, ``log p = z - lse(z)``, ``p = exp(log p)``, ``H = -sum p log p``:
    ``d log p(y) / dz = onehot(y) - p`` and ``dH / dz = -p (log p + H)``. With ``top_k``, ``H`` is the
    entropy of ``q = softmax(z_K)`` over the set ``K`` of the ``top_k`` largest logits, and
    ``dH / dz_K = -q (log q + H)`` (0 elsewhere). Backward recomputes one chunk's ``z`` (and ``K``) from
    the saved ``h`` and its saved ``lse``, so memory beyond ``[N]`` vectors is one ``[C, V]`` buffer in
    forward (changed in place: 1/3 of logsumexp's and a probability tensor's; plus ``[C, k]`` for a
    top-k entropy) and two in backward, each freed before the next chunk's. ``chunk_math`` runs the
    math on each chunk's head output (:class:`ChunkMath`).
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, temperature, chunk, entropy_grad, top_k, spread_k, chunk_math
    ):
        columns = [[] for _ in range(5)]  # per chunk: log p(y), H, lse, spread, whole-vocabulary H
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            # the head output [C, V] (the weight's dtype) is passed unnamed: the chunk math consumes it
            scores = chunk_math.scores(
                F.linear(hidden[rows], weight, bias), targets[rows], temperature, top_k, spread_k
            )
            for column, values in zip(columns, scores):
                column.append(values)
        log_probs, entropies, lses, spreads, full_entropies = (
            torch.cat(column) if column else hidden.new_empty(0, dtype=torch.float32) for column in columns
        )
        ctx.save_for_backward(hidden, weight, bias, targets, lses, entropies)
        ctx.temperature, ctx.chunk, ctx.entropy_grad, ctx.top_k = temperature, chunk, entropy_grad, top_k
        ctx.spread_k, ctx.chunk_math = spread_k, chunk_math
        # one call: each call replaces the set of non-differentiable outputs
        ctx.mark_non_differentiable(
            full_entropies, *([] if entropy_grad else [entropies]), *([] if spread_k else [spreads])
        )
        ctx.set_materialize_grads(False)
        return log_probs, entropies, spreads, full_entropies

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropies, grad_spreads, _grad_full_entropies):
        hidden, weight, bias, targets, lses, entropies = ctx.saved_tensors
        if not ctx.entropy_grad:
            grad_entropies = None
        if ctx.spread_k is None:
            grad_spreads = None
        if grad_log_probs is None and grad_entropies is None and grad_spreads is None:
            return None, None, None, None, None, None, None, None, None, None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # one running sum over the chunks ([V, D]: it does not grow with the tokens), in the weight's dtype
        # and updated in place: a bf16 sum is rounded once per chunk (what the unchunked matmul does
        # once), where an fp32 one would cost two more [V, D] buffers (2.4 GB at 3B widths)
        fp32 = {"dtype": torch.float32, "device": weight.device}
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_bias = torch.zeros(bias.shape, **fp32) if bias is not None and ctx.needs_input_grad[2] else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            grad_logits, grad_bias_part = ctx.chunk_math.logits_grad(
                F.linear(hidden[rows], weight, bias),
                lses[rows],
                targets[rows],
                None if grad_log_probs is None else grad_log_probs[rows],
                None if grad_entropies is None else grad_entropies[rows],
                entropies[rows],
                ctx.temperature,
                ctx.top_k,
                None if grad_spreads is None else (grad_spreads[rows], ctx.spread_k),
                grad_bias is not None,
            )
            if grad_hidden is not None:
                grad_hidden[rows] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.T, hidden[rows])  # in place: no second [V, D]
            if grad_bias is not None:
                grad_bias += grad_bias_part
            del grad_logits  # freed before the next chunk's buffers are allocated
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None


def _chunk_logit_grad(
    log_p: torch.Tensor,
    targets: torch.Tensor,
    grad_log_probs: torch.Tensor | None,
    grad_entropies: torch.Tensor | None,
    entropies: torch.Tensor,
    top_k: int | None,
    spread: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """The gradient wrt one chunk's ``z`` [C, V], built in ``log_p``'s buffer (``log_p`` is consumed):
    ``p * (-g_lp - g_H (log p + H)) + g_lp * onehot(y)``, or with ``top_k`` the entropy part
    ``-g_H q (log q + H)`` on the top-k logits only; with ``spread = (g_S, k)`` plus
    ``g_S (p - u_K)``, ``u_K`` = 1/k on the k largest logits."""
    probs = log_p.exp()
    top_grad = spread_index = None
    if grad_entropies is not None and top_k is not None:
        top_log_p, top_index = log_p.topk(top_k, dim=-1, sorted=False)  # [C, k]: log p differs from z by lse
        top_log_q = top_log_p - torch.logsumexp(top_log_p, dim=-1, keepdim=True)
        top_grad = top_log_q.exp() * (top_log_q + entropies[:, None]) * -grad_entropies[:, None]
    if spread is not None:
        spread_index = log_p.topk(spread[1], dim=-1, sorted=False).indices  # [C, k]
    if grad_entropies is not None and top_k is None:
        grad_z = log_p.add_(entropies[:, None]).mul_(-grad_entropies[:, None])
    else:
        grad_z = log_p.zero_()
    if grad_log_probs is not None:
        grad_z.sub_(grad_log_probs[:, None])
    if spread is not None:
        grad_z.add_(spread[0][:, None])
    grad_z.mul_(probs)
    del probs
    if grad_log_probs is not None:
        grad_z.scatter_add_(-1, targets[:, None], grad_log_probs[:, None])
    if top_grad is not None:
        grad_z.scatter_add_(-1, top_index, top_grad)
    if spread is not None:
        uniform = (-spread[0] / spread[1])[:, None].expand(-1, spread[1])
        grad_z.scatter_add_(-1, spread_index, uniform)
    return grad_z


def chunked_token_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    scoring: TokenScoring,
    chunk_math: ChunkMath = EAGER_CHUNK_MATH,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log_softmax(z)[targets], entropy(softmax(z)), spread, full entropy)`` with
    ``z = (hidden W^T + b) / T``, fp32 (the entropy over the top ``scoring.entropy_top_k`` logits when
    that is in ``(0, V)``; the spread ``KL(u_K || softmax(z))`` with ``scoring.spread_top_k`` > 0, else
    0; the whole-vocabulary entropy, never differentiable),
    both ``hidden.shape[:-1]`` (``[N]`` with ``scoring.rows``); differentiable in ``hidden``, ``weight``
    and ``bias`` (the entropy only with ``scoring.entropy_grad``). ``scoring.targets`` holds one id per
    row of ``hidden`` or of ``scoring.rows``."""
    flat = hidden.reshape(-1, hidden.shape[-1])  # [N, D]
    shape = hidden.shape[:-1]
    if scoring.rows is not None:
        flat = flat[scoring.rows.to(hidden.device)]
        shape = flat.shape[:-1]
    targets = scoring.targets.reshape(-1).long().to(hidden.device)
    if targets.shape[0] != flat.shape[0]:
        raise ValueError(
            f"token scoring: {targets.shape[0]} target ids for {flat.shape[0]} hidden rows; pass one "
            "target per row the head receives"
        )
    if scoring.chunk_tokens <= 0:
        raise ValueError(f"token scoring: chunk_tokens={scoring.chunk_tokens} must be > 0")
    top_k = _top_k_or_none(scoring.entropy_top_k, weight.shape[0])
    spread_k = min(scoring.spread_top_k, weight.shape[0]) if scoring.spread_top_k > 0 else None
    outputs = _ChunkedTokenScores.apply(
        flat,
        weight,
        bias,
        targets,
        scoring.temperature,
        scoring.chunk_tokens,
        scoring.entropy_grad,
        top_k,
        spread_k,
        chunk_math,
    )
    return tuple(output.reshape(shape) for output in outputs)


class TokenScoringHead(nn.Linear):
    """The model's output head: the plain ``nn.Linear`` unless :func:`scoring_tokens` has set
    :attr:`scoring`, then ``[..., 4]`` = (log-prob of each row's target, entropy, spread term,
    whole-vocabulary entropy), fp32 (``[N, 4]`` with ``scoring.rows``)."""

    scoring: TokenScoring | None = None
    chunk_math: ChunkMath = EAGER_CHUNK_MATH  # compiled by mmrl.models.compiled.compile_head

    @classmethod
    def replacing(cls, head: nn.Linear) -> TokenScoringHead:
        """A head holding ``head``'s own weight and bias Parameters (no copy: ties and shards stay)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = head.in_features, head.out_features
        new.weight = head.weight
        new.bias = head.bias
        return new

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.scoring is None:
            return super().forward(hidden)
        scores = chunked_token_scores(hidden, self.weight, self.bias, self.scoring, self.chunk_math)
        return torch.stack(scores, dim=-1)


def token_scoring_head(model: nn.Module) -> TokenScoringHead | None:
    """``model``'s scoring head, or None when it has the plain one (a critic's value head too)."""
    head = model.get_output_embeddings()
    return head if isinstance(head, TokenScoringHead) else None


def install_token_scoring_head(model: nn.Module) -> nn.Module:
    """Put a :class:`TokenScoringHead` in place of ``model``'s linear output head (idempotent)."""
    head = model.get_output_embeddings()
    if isinstance(head, TokenScoringHead):
        return model
    if type(head) is not nn.Linear:
        raise TypeError(
            f"token scoring needs a plain nn.Linear output head; {type(model).__name__} has "
            f"{type(head).__name__}"
        )
    model.set_output_embeddings(TokenScoringHead.replacing(head))
    return model


@contextlib.contextmanager
def scoring_tokens(
    model: nn.Module,
    targets: torch.Tensor,
    temperature: float,
    chunk_tokens: int,
    entropy_grad: bool = False,
    rows: torch.Tensor | None = None,
    entropy_top_k: int = 0,
    spread_top_k: int = 0,
) -> Iterator[None]:
    """Within the block, ``model``'s head returns ``[..., 4]`` (log-prob of ``targets``, entropy, spread,
    whole-vocabulary entropy) for the rows it gets, or ``[N, 4]`` for its ``rows`` (see :class:`TokenScoring`). ``model`` must have
    been prepared with :func:`install_token_scoring_head`."""
    head = token_scoring_head(model)
    if head is None:
        raise RuntimeError(
            f"{type(model).__name__} has no token scoring head: call "
            "mmrl.models.prepare.prepare_for_training(model, ..., score_tokens=True) where the model is built"
        )
    head.scoring = TokenScoring(
        targets, temperature, chunk_tokens, entropy_grad, rows, entropy_top_k, spread_top_k
    )
    try:
        yield
    finally:
        head.scoring = None
