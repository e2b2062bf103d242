"""Per-token quantities from logits ``[..., V]``: log-probs of labels and entropies."""

from __future__ import annotations

import math

import torch


def entropy_from_logits(logits: torch.Tensor, top_k: int = 0) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dim: ``[..., V] -> [...]``.

    ``H = logsumexp(z) - sum_v softmax(z)_v * z_v``: no log of a probability is taken, so tokens with
    probability 0 (underflow) cannot produce ``0 * -inf = NaN``. Computed in the input's dtype.

    ``top_k`` in ``(0, V)``: the entropy of the distribution renormalised over the ``top_k`` largest
    logits, ``q = softmax(z_topk)`` (differentiable in those logits only); 0 or ``>= V``: the whole
    vocabulary. A bonus on the whole-vocabulary entropy raises every logit of the tail, which on a small
    model means probability spread over tokens that are not words; the top-k entropy only levels the
    candidates the policy already considers.
    """
    if 0 < top_k < logits.shape[-1]:
        logits = torch.topk(logits, top_k, dim=-1, sorted=False).values  # [..., k]
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def spread_from_logits(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """``KL(u_K || softmax(z))`` over the last dim: ``[..., V] -> [...]``, ``u_K`` uniform over the set
    ``K`` of the ``top_k`` largest logits: ``logsumexp(z) - mean(z_K) - log k`` (>= 0, 0 when the
    policy is uniform on ``K`` and has nothing outside it).

    Its gradient wrt the logits is ``softmax(z) - u_K``: of norm ~1 when one token holds p ~ 1, where
    the gradients of a sampled token's log-prob (``1 - p``) and of the entropy (``p log p``) vanish.
    It is what the collapse-recovery term (``worker.actor.collapse_recovery``) adds to the loss.
    """
    top_k = min(top_k, logits.shape[-1])
    top = torch.topk(logits, top_k, dim=-1, sorted=False).values  # [..., k]
    return torch.logsumexp(logits, dim=-1) - top.mean(dim=-1) - math.log(top_k)


def log_probs_from_logits(logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int = 1024) -> torch.Tensor:
    """``log_softmax(logits)[..., labels]``: ``logits [..., V]``, ``labels [...]`` in ``[0, V)`` -> ``[...]``.

    For float32/64 this is ``logit[label] - logsumexp(logits)``, which never materialises a
    ``[..., V]`` log-softmax copy. bf16/fp16 logsumexp is too coarse, so those rows are upcast to float32
    ``chunk_rows`` at a time rather than all at once (peak memory of one chunk in no-grad passes), and
    the result is float32 (float32/64 inputs keep their dtype).
    """
    labels = labels.long()
    if logits.dtype in (torch.float32, torch.float64):
        picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    vocab_size = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab_size)  # [N, V]
    flat_labels = labels.reshape(-1)  # [N]
    pieces = []
    for start in range(0, flat_logits.shape[0], chunk_rows):
        chunk = flat_logits[start : start + chunk_rows].float()
        picked = torch.gather(chunk, -1, flat_labels[start : start + chunk_rows].unsqueeze(-1)).squeeze(-1)
        pieces.append(picked - torch.logsumexp(chunk, dim=-1))
    if not pieces:
        return logits.new_zeros(labels.shape, dtype=torch.float32)
    return torch.cat(pieces).reshape(labels.shape)
