"""Loss aggregation: a per-token loss ``[B, L]`` reduced to a scalar by a mode chosen by name, so that
the shares of micro-batches and ranks sum to the value of the whole batch."""

from __future__ import annotations

import torch

LOSS_AGG_MODES: tuple[str, ...] = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    global_num_tokens: int | float | torch.Tensor | None = None,
    global_num_seqs: int | float | torch.Tensor | None = None,
    max_response_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, L]`` to a scalar. ``mask`` ``[B, L]`` is 0/1.

    With ``N`` valid tokens, ``S`` sequences (rows with at least one valid token), ``n_i`` valid tokens
    in row ``i`` and ``l_it`` the loss:

    - ``token_mean``:              ``sum_it l_it / N``                (DAPO; every token weighs the same)
    - ``seq_mean_token_mean``:     ``sum_i (sum_t l_it / n_i) / S``   (original GRPO)
    - ``seq_mean_token_sum``:      ``sum_i sum_t l_it / S``
    - ``seq_mean_token_sum_norm``: ``sum_i sum_t l_it / (S * max_response_length)`` (Dr. GRPO: a constant
      horizon instead of the length, so long answers are not down-weighted. verl omits the ``1 / S``.)

    **Splitting over micro-batches and data-parallel ranks.** A mean of micro-batch means is not the
    mean of the batch when pieces hold different numbers of tokens or sequences. So, as in OpenRLHF,
    the caller counts ``N`` and ``S`` once over the whole global (mini-)batch, all ranks included, and
    passes them as ``global_num_tokens`` / ``global_num_seqs`` (``S`` as
    ``(mask.sum(-1) > 0).sum()`` summed over pieces). Then this returns the piece's *share*
    ``sum_piece / global_count``, and the shares summed over all micro-batches and ranks equal the
    global value exactly, whatever the split and padding. Only the normaliser a mode needs is read;
    without it the piece's own count is used (correct for an unsplit batch). Gradient accumulation must
    therefore *sum* micro-batch losses, and since DDP/FSDP *average* gradients over ranks, the caller
    multiplies the loss by the data-parallel world size (or reduces with a sum).
    ``max_response_length`` must be given for ``seq_mean_token_sum_norm``: a padded width would vary
    between micro-batches.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"Unknown loss aggregation mode {mode!r}. Valid modes: {', '.join(LOSS_AGG_MODES)}.")
    mask = mask.to(loss_mat.dtype)
    token_sums = (loss_mat * mask).sum(dim=-1)  # [B]
    tokens_per_seq = mask.sum(dim=-1)  # [B]

    if mode == "token_mean":
        num_tokens = tokens_per_seq.sum() if global_num_tokens is None else global_num_tokens
        return token_sums.sum() / _at_least_one(num_tokens, loss_mat)

    num_seqs = (tokens_per_seq > 0).sum() if global_num_seqs is None else global_num_seqs
    if mode == "seq_mean_token_mean":
        seq_losses = token_sums / tokens_per_seq.clamp(min=1.0)  # [B]; empty rows contribute 0
    elif mode == "seq_mean_token_sum":
        seq_losses = token_sums
    else:  # seq_mean_token_sum_norm
        if max_response_length is None or max_response_length <= 0:
            raise ValueError(
                "Loss aggregation 'seq_mean_token_sum_norm' needs max_response_length (the rollout's "
                f"maximum response length in tokens, > 0); got {max_response_length}."
            )
        seq_losses = token_sums / max_response_length
    return seq_losses.sum() / _at_least_one(num_seqs, loss_mat)


def _at_least_one(count: int | float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A normaliser as a tensor on ``like``'s device, clamped to >= 1 so empty pieces give 0, not NaN."""
    return torch.as_tensor(count, dtype=like.dtype, device=like.device).clamp(min=1.0)
