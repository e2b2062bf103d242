"""Model inputs of a padded micro-batch: media tensors of its rows joined, position ids made explicit.

Rows are left-padded prompts followed by right-padded responses (``attention_mask`` 0 on both kinds of
padding). Position ids are computed here rather than left to the model, because a model that infers
them from the sequence length counts left padding as positions and so shifts every valid token:

- Qwen-VL / Qwen-Omni: M-RoPE ids ``[3, B, L]`` from the model's own ``get_rope_index`` over the valid
  tokens of each row, called as the model's family says (:mod:`mmrl.models.families`);
- Text models: ``(attention_mask.cumsum(-1) - 1).clamp(min=0)`` ``[B, L]``.

:func:`response_token_outputs` (and :func:`response_head_outputs`, its [B, R, D] layout) is the one
place a micro-batch goes through the model, padded or packed (``padding_free``). Packed, the valid
tokens of all rows form one row ``[1, T]`` in row order, each sequence numbered by the model's own
``get_rope_index`` on that sequence alone, the media tensors joined in the same row order, and
attention gets the sequence boundaries (:mod:`mmrl.models.attention`): no padding token is computed.
Packed and sequence-parallel passes need a model prepared for them where it was built
(:func:`mmrl.models.prepare.prepare_for_training`); nothing here changes the model.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mmrl.columns import concat_multi_modal_inputs, prompt_inputs, response_inputs
from mmrl.models.attention import PackedSequences, SharedPrefixSequences
from mmrl.models.encoding_cache import announce_media
from mmrl.models.families import family_of
from mmrl.models.loading import vision_modules
from mmrl.models.prepare import check_prepared
from mmrl.models.token_scoring import scoring_tokens
from mmrl.parallel.sequence import (
    SequenceParallelGroups,
    ShardedSequences,
    ShardLayout,
    gather_token_outputs,
    token_owners,
)


def joined_media(
    model: nn.Module, parts: Sequence[dict[str, Any]], device: torch.device | str
) -> dict[str, Any]:
    """The processor outputs ``parts`` joined in order on ``device`` (what ``model(**inputs)`` takes),
    their items announced to the towers' encoding caches (:func:`~mmrl.models.encoding_cache.announce_media`)."""
    media = concat_multi_modal_inputs(parts, device=device)
    if media:
        announce_media(vision_modules(model), media, parts)
    return media


def compute_position_ids(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    media: dict[str, Any],
    mm_token_type_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Position ids of a padded batch: M-RoPE ``[3, B, L]`` or 1-D ``[B, L]``; padding gets 0 or 1.

    ``media`` is the joined output of :func:`concat_multi_modal_inputs` for the same rows; the model's
    family computes the ids (Qwen-VL: ``mm_token_type_ids`` derived from the placeholder ids when not
    given).
    """
    return family_of(model).position_ids(model, input_ids, attention_mask, media, mm_token_type_ids)


def build_forward_inputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    multi_modal_inputs: Sequence[dict[str, Any]] | None,
    mm_token_type_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``model(**inputs)`` on a padded micro-batch.

    ``input_ids``/``attention_mask`` [B, L]; ``multi_modal_inputs`` one processor-output dict per row
    (``{}`` for text rows; None for a text model); ``position_ids`` the rows' ids when already known
    (the batch column of :func:`sequence_position_ids`), else computed here. Returns ``input_ids``,
    ``attention_mask``, ``position_ids`` and the joined media tensors on ``input_ids.device``.
    """
    media = joined_media(model, multi_modal_inputs or [], input_ids.device)
    if position_ids is None:
        position_ids = compute_position_ids(model, input_ids, attention_mask, media, mm_token_type_ids)
    else:
        position_ids = model_layout(position_ids)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        **family_of(model).forward_media(media),
    }


def model_layout(position_ids: torch.Tensor) -> torch.Tensor:
    """Batch-first ``[B, 3, L]`` / ``[B, L]`` (a batch column) → what the model takes (``[3, B, L]``
    for M-RoPE); the same swap turns the model's layout back into the column's."""
    return position_ids.transpose(0, 1) if position_ids.dim() == 3 else position_ids


def next_text_position(position_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The id of the first text token after each prompt: its largest valid position id + 1 over all
    rotary axes, ``[G]``, from the prompts' ids (``[3, G, P]`` or ``[G, P]``) and ``attention_mask`` [G, P]."""
    per_axis = position_ids if position_ids.dim() == 3 else position_ids.unsqueeze(0)  # [A, G, P]
    return per_axis.masked_fill(~attention_mask.bool().unsqueeze(0), -1).amax(dim=(0, 2)) + 1


def _same_media(first: dict[str, Any] | None, other: dict[str, Any] | None) -> bool:
    """Whether two rows' processor outputs are equal (the same object, or equal tensors and values)."""
    if first is other:
        return True
    first, other = first or {}, other or {}
    if first.keys() != other.keys():
        return False
    for key, value in first.items():
        if isinstance(value, torch.Tensor) or isinstance(other[key], torch.Tensor):
            a, b = torch.as_tensor(value), torch.as_tensor(other[key])
            if a.shape != b.shape or not torch.equal(a, b):
                return False
        elif value != other[key]:
            return False
    return True


def prompt_groups(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, multi_modal_inputs: Sequence[dict[str, Any]] | None
) -> list[int]:
    """For each row, the first row with the same prompt: equal valid tokens and equal media (the
    prompt's own: a trajectory's observation media are not the prompt's)."""
    rows_media = (
        [prompt_inputs(media) for media in multi_modal_inputs]
        if multi_modal_inputs is not None
        else [None] * len(prompt_ids)
    )
    candidates: dict[bytes, list[int]] = {}
    first_of = []
    ids, valid = prompt_ids.cpu().numpy(), prompt_mask.bool().cpu().numpy()  # one copy to the host
    for row in range(len(prompt_ids)):
        tokens = ids[row, valid[row]].tobytes()
        same = candidates.setdefault(tokens, [])
        match = next((first for first in same if _same_media(rows_media[first], rows_media[row])), None)
        if match is None:
            same.append(row)
            match = row
        first_of.append(match)
    return first_of


def sequence_position_ids(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    multi_modal_inputs: Sequence[dict[str, Any]] | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Position ids of rollout rows (left-padded prompt + R response tokens), batch-first:
    ``[B, 3, L]`` (M-RoPE) or ``[B, L]``, computed once per step and kept as the batch column
    ``position_ids`` so that no training pass calls ``get_rope_index`` again.

    The model's ``get_rope_index`` numbers each distinct prompt once (:func:`prompt_groups`: the n
    responses of a prompt share it); a response is text, which every Qwen RoPE variant
    numbers on from the prompt's largest id + 1, one per token, on all axes. Equal to numbering each
    whole row with ``get_rope_index`` (tests check it per media kind). A trajectory whose observations
    returned media (``multi_modal_inputs`` with a response part) is not text after its prompt: such a
    row is numbered whole, by ``get_rope_index`` over its prompt and response with all its media.
    """
    prompt_length = input_ids.shape[1] - response_length
    prompt_ids, prompt_mask = input_ids[:, :prompt_length], attention_mask[:, :prompt_length]
    rows_media = list(multi_modal_inputs) if multi_modal_inputs is not None else [None] * len(input_ids)
    group_of_row = prompt_groups(prompt_ids, prompt_mask, multi_modal_inputs)
    firsts = sorted(set(group_of_row))
    family = family_of(model)
    prompt_media = concat_multi_modal_inputs(
        [family.position_media(prompt_inputs(rows_media[row])) for row in firsts], device=input_ids.device
    )
    prompt_positions = compute_position_ids(
        model,
        prompt_ids[firsts],
        prompt_mask[firsts],
        prompt_media,
        None if mm_token_type_ids is None else mm_token_type_ids[firsts, :prompt_length],
    )  # [3, G, P] or [G, P]
    mrope = prompt_positions.dim() == 3
    per_axis = prompt_positions if mrope else prompt_positions.unsqueeze(0)  # [A, G, P]
    start = next_text_position(prompt_positions, prompt_mask[firsts])  # [G]
    offsets = torch.arange(response_length, device=input_ids.device)
    response_positions = (start.unsqueeze(-1) + offsets).expand(per_axis.shape[0], -1, -1)  # [A, G, R]
    group_index = torch.tensor([firsts.index(first) for first in group_of_row], device=input_ids.device)
    positions = torch.cat([per_axis, response_positions], dim=-1)[:, group_index]  # [A, B, L]
    for row, media in enumerate(rows_media):
        if response_inputs(media):  # media inside the response: the whole row through get_rope_index
            positions[:, row : row + 1] = _row_positions(
                model, input_ids[row : row + 1], attention_mask[row : row + 1], media, mm_token_type_ids, row
            ).reshape(per_axis.shape[0], 1, -1)
    return model_layout(positions) if mrope else positions[0]


def _row_positions(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    media: dict[str, Any],
    mm_token_type_ids: torch.Tensor | None,
    row: int,
) -> torch.Tensor:
    """Position ids of one padded row ``[1, L]`` with all its media: ``[3, 1, L]`` or ``[1, L]``."""
    return compute_position_ids(
        model,
        input_ids,
        attention_mask,
        concat_multi_modal_inputs([family_of(model).position_media(media)], device=input_ids.device),
        None if mm_token_type_ids is None else mm_token_type_ids[row : row + 1],
    )


def packed_position_ids(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    multi_modal_inputs: Sequence[dict[str, Any]] | None,
    mm_token_type_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Position ids of the rows packed into one: ``[3, 1, T]`` (M-RoPE) or ``[1, T]``.

    Each row's valid tokens go through :func:`compute_position_ids` alone, with that row's own grids,
    audio lengths and flags, exactly as the model's ``get_rope_index`` would number that sequence by
    itself; the rows' ids are then concatenated, so they restart at every sequence.
    """
    family = family_of(model)
    positions = []
    for row in range(input_ids.shape[0]):
        valid = attention_mask[row].bool()
        row_ids = input_ids[row, valid].unsqueeze(0)  # [1, L_row]
        row_media = (multi_modal_inputs[row] or {}) if multi_modal_inputs is not None else {}
        position_media = family.position_media(row_media)
        row_types = None if mm_token_type_ids is None else mm_token_type_ids[row, valid].unsqueeze(0)
        positions.append(
            compute_position_ids(
                model,
                row_ids,
                torch.ones_like(row_ids),
                concat_multi_modal_inputs([position_media], device=input_ids.device),
                row_types,
            )
        )
    return torch.cat(positions, dim=-1)


def build_packed_forward_inputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    multi_modal_inputs: Sequence[dict[str, Any]] | None,
    mm_token_type_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    lengths: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``model(**inputs)`` on the rows of a padded micro-batch packed into one.

    ``input_ids`` [1, T] are the valid tokens (``attention_mask`` 1) in row order, ``position_ids``
    the valid tokens' ids from the given batch-first ``position_ids`` (see
    :func:`sequence_position_ids`) or else :func:`packed_position_ids`, ``packed_sequences`` the
    boundaries for attention, the media tensors joined in row order, and no ``attention_mask``.
    ``model`` must be prepared for packing (:func:`mmrl.models.prepare.prepare_for_training`), or
    ``packed_sequences`` would be ignored: raises otherwise. ``lengths``: the rows' valid token
    counts when already read to the host (else read here).
    """
    check_prepared(model, sequence_parallel=False, where="build_packed_forward_inputs")
    valid = attention_mask.bool()  # [B, L]
    media = joined_media(model, multi_modal_inputs or [], input_ids.device)
    if position_ids is None:
        packed_positions = packed_position_ids(
            model, input_ids, attention_mask, multi_modal_inputs, mm_token_type_ids
        )
    else:  # [B, 3, L] -> [3, 1, T]; [B, L] -> [1, T]
        packed_positions = model_layout(position_ids)[..., valid].unsqueeze(-2)
    return {
        "input_ids": input_ids[valid].unsqueeze(0),  # [1, T]
        "position_ids": packed_positions,
        "packed_sequences": PackedSequences.from_lengths(
            valid.sum(-1).tolist() if lengths is None else lengths, input_ids.device
        ),
        **family_of(model).forward_media(media),
    }


def build_shared_prefix_inputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    multi_modal_inputs: Sequence[dict[str, Any]] | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    lengths: Sequence[int] | None = None,
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """Keyword arguments for ``model(**inputs)`` on the rows packed with each distinct prompt once:
    ``[prompt, its rows' responses, next prompt, ...]``, and where the outputs predicting the response
    tokens are: ``(inputs, indices [K], response_valid [B, R])`` as :func:`packed_response_indices`.

    With n responses per prompt (GRPO) a prompt's tokens, and its images, videos and audio, go through
    the model once instead of n times; attention (:class:`~mmrl.models.attention.SharedPrefixSequences`)
    lets each response see its prompt and itself, so every output equals the one of the row alone,
    and gradients reach the shared prompt from all its responses. A response's first token is
    predicted by the prompt's last token, whose output is gathered once per response. ``model`` must be
    prepared for packing (:func:`mmrl.models.prepare.prepare_for_training`).
    """
    check_prepared(model, sequence_parallel=False, where="build_shared_prefix_inputs")
    device = input_ids.device
    prompt_length = input_ids.shape[1] - response_length
    valid = attention_mask.bool()
    prompt_valid, response_valid = valid[:, :prompt_length], valid[:, prompt_length:]
    check_rollout_layout(valid, prompt_length)
    if position_ids is None:
        position_ids = sequence_position_ids(
            model, input_ids, attention_mask, response_length, multi_modal_inputs, mm_token_type_ids
        )
    positions = model_layout(position_ids)  # [3, B, L] or [B, L]
    first_of = prompt_groups(input_ids[:, :prompt_length], prompt_valid, multi_modal_inputs)
    members: dict[int, list[int]] = {}
    for row, first in enumerate(first_of):
        members.setdefault(first, []).append(row)

    token_pieces, position_pieces, segments = [], [], []
    predicting: dict[int, list[int]] = {}  # row -> packed positions predicting its response tokens
    prompt_columns, prompt_counts = _prompt_columns(prompt_valid)
    response_counts = (  # one host sync, not one per row, or none with the rows' ``lengths`` known
        response_valid.sum(-1).tolist()
        if lengths is None
        else [length - count for length, count in zip(lengths, prompt_counts)]
    )
    cursor = 0
    for first, rows in members.items():
        columns = prompt_columns[first]
        token_pieces.append(input_ids[first, :prompt_length][columns])
        position_pieces.append(positions[..., first, :prompt_length][..., columns])
        prompt_start, prompt_count = cursor, token_pieces[-1].shape[0]
        # a prompt with one response is that row packed whole: one segment attending to itself only
        whole_row = len(rows) == 1 and response_counts[rows[0]] > 0
        if not whole_row:
            segments.append((prompt_start, prompt_count, [(prompt_start, prompt_count)]))
        cursor += prompt_count
        for row in rows:
            count = response_counts[row]
            predicting[row] = [prompt_start + prompt_count - 1, *range(cursor, cursor + count - 1)][:count]
            if count == 0:
                continue
            token_pieces.append(input_ids[row, prompt_length:][:count])
            position_pieces.append(positions[..., row, prompt_length : prompt_length + count])
            if whole_row:
                segments.append((prompt_start, prompt_count + count, [(prompt_start, prompt_count + count)]))
            else:
                segments.append((cursor, count, [(prompt_start, prompt_count), (cursor, count)]))
            cursor += count
    # in packed order: each prompt's media, then the media inside its rows' responses (trajectories)
    media = joined_media(
        model,
        [
            part
            for first, rows in members.items()
            for part in [prompt_inputs(multi_modal_inputs[first])]
            + [response_inputs(multi_modal_inputs[row]) for row in rows]
        ]
        if multi_modal_inputs is not None
        else [],
        device,
    )
    inputs = {
        "input_ids": torch.cat(token_pieces).unsqueeze(0),  # [1, T]
        "position_ids": torch.cat(position_pieces, dim=-1).unsqueeze(-2),  # [3, 1, T] or [1, T]
        "packed_sequences": SharedPrefixSequences.from_segments(segments, device),
        **family_of(model).forward_media(media),
    }
    indices = torch.tensor(
        [position for row in range(len(input_ids)) for position in predicting[row]], dtype=torch.long
    ).to(device)
    return inputs, indices, response_valid


def _prompt_columns(prompt_valid: torch.Tensor) -> tuple[list[slice | torch.Tensor], list[int]]:
    """Each row's valid prompt columns: a slice (a view, no device sync) when they are the last ones
    (left padding, as the rollout hands rows over), else the row's mask; and each row's count of them.
    One copy to the host in all."""
    valid = prompt_valid.cpu().numpy()
    width = valid.shape[1]
    columns: list[slice | torch.Tensor] = []
    counts = []
    for row, row_valid in enumerate(valid):
        count = int(row_valid.sum())
        left_padded = bool(row_valid[width - count :].all())
        columns.append(slice(width - count, width) if left_padded else prompt_valid[row])
        counts.append(count)
    return columns, counts


def check_rollout_layout(valid: torch.Tensor, prompt_length: int) -> None:
    """Every valid response token follows a valid token: left-padded prompts, right-padded responses
    (so the output at position t predicts token t + 1 within a sequence)."""
    bad = valid[:, prompt_length:] & ~valid[:, prompt_length - 1 : -1]  # [B, R]
    if bool(bad.any()):
        rows = torch.nonzero(bad.any(-1)).flatten().tolist()
        raise ValueError(
            f"rows {rows}: a valid response token follows a padding token; expected left-padded prompts "
            "followed by right-padded responses (attention_mask 1 on the last prompt column)"
        )


def packed_response_indices(
    attention_mask: torch.Tensor, response_length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the packed row's outputs predict the response tokens.

    Returns ``(indices [K], response_valid [B, R])``: ``response_valid`` marks the valid response
    tokens (K of them) and ``indices`` the packed positions predicting them, in row-major order (the
    output at position ``t`` predicts token ``t + 1``; for the first response token that is the last
    prompt token, so prompts must be left-padded).
    """
    valid = attention_mask.bool()  # [B, L]
    prompt_length = valid.shape[1] - response_length
    packed_index = valid.flatten().cumsum(0).view_as(valid) - 1  # [B, L]: each valid token's place in the row
    response_valid = valid[:, prompt_length:]  # [B, R]
    check_rollout_layout(valid, prompt_length)
    return packed_index[:, prompt_length - 1 : -1][response_valid], response_valid


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(type(model).forward).parameters


@dataclass(frozen=True)
class ResponseScoring:
    """Score the response tokens inside the model's head (:mod:`mmrl.models.token_scoring`): the
    outputs become ``[..., 4]`` = (``log_softmax(logits / temperature)`` of the response token,
    entropy, spread term, whole-vocabulary entropy), computed ``chunk_tokens`` rows at a time; ``entropy_grad``: the entropy is differentiable
    (an entropy bonus) rather than logged only; ``entropy_top_k`` > 0: over the top-k logits only;
    ``spread_top_k`` > 0: the collapse-recovery spread term in the third column (else 0)."""

    temperature: float
    chunk_tokens: int
    entropy_grad: bool = False
    entropy_top_k: int = 0
    spread_top_k: int = 0


def _scoring_scope(
    model: nn.Module, scoring: ResponseScoring | None, targets: torch.Tensor, rows: torch.Tensor | None = None
) -> contextlib.AbstractContextManager:
    """The block in which ``model``'s head scores ``targets`` (one per row it gets, or per row of
    ``rows`` of its input), or nothing."""
    if scoring is None:
        return contextlib.nullcontext()
    return scoring_tokens(
        model,
        targets,
        scoring.temperature,
        scoring.chunk_tokens,
        scoring.entropy_grad,
        rows,
        scoring.entropy_top_k,
        scoring.spread_top_k,
    )


def _head_rows(
    model: nn.Module,
    inputs: dict[str, Any],
    rows: torch.Tensor,
    tokens: torch.Tensor,
    scoring: ResponseScoring | None,
) -> torch.Tensor:
    """The head's outputs at packed positions ``rows`` [K] (predicting ``tokens`` [K]): [K, D]."""
    if _accepts_logits_to_keep(model):
        with _scoring_scope(model, scoring, tokens):
            return model(**inputs, use_cache=False, logits_to_keep=rows).logits[0]
    if scoring is None:
        return model(**inputs, use_cache=False).logits[0, rows]
    # every position reaches the head, which scores only ``rows`` (shared prompts repeat one of them)
    with _scoring_scope(model, scoring, tokens, rows):
        return model(**inputs, use_cache=False).logits


def response_head_outputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    multi_modal_inputs: Sequence[dict[str, Any]] | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
    padding_free: bool = False,
    position_ids: torch.Tensor | None = None,
    scoring: ResponseScoring | None = None,
) -> torch.Tensor:
    """The head's outputs at the positions that predict the response tokens: ``[B, R, D]``.

    ``input_ids`` [B, P + R] ends with the R response tokens; the output at position ``t`` predicts
    token ``t + 1``, so positions ``P - 1 .. P + R - 2`` are kept. ``D`` is the vocabulary for a policy
    (logits, before temperature), 4 with ``scoring`` (log-prob, entropy, spread, whole-vocabulary entropy) and 1
    for a critic (values of the states before each response token).
    At padded response slots: whatever the model computes there, or 0 with ``padding_free``.
    """
    if padding_free:
        outputs, response_valid = response_token_outputs(
            model,
            input_ids,
            attention_mask,
            response_length,
            multi_modal_inputs,
            mm_token_type_ids,
            padding_free=True,
            position_ids=position_ids,
            scoring=scoring,
        )
        return scatter_response_tokens(outputs, response_valid)
    inputs = build_forward_inputs(
        model, input_ids, attention_mask, multi_modal_inputs, mm_token_type_ids, position_ids
    )
    return _last_positions_outputs(model, inputs, input_ids, response_length, scoring)


def _last_positions_outputs(
    model: nn.Module,
    inputs: dict[str, Any],
    input_ids: torch.Tensor,
    response_length: int,
    scoring: ResponseScoring | None,
) -> torch.Tensor:
    """The head's outputs of ``model(**inputs)`` (a padded batch, ``input_ids`` [B, P + R]) at the
    positions predicting the R response tokens: ``[B, R, D]``."""
    # Only the last R + 1 positions reach lm_head: a [B, P + R, vocab] tensor is the largest of the pass.
    keep = {"logits_to_keep": response_length + 1} if _accepts_logits_to_keep(model) else {}
    # position t predicts token t + 1; the last position predicts nothing (target 0, never read)
    next_tokens = nn.functional.pad(input_ids[:, 1:], (0, 1))  # [B, L]
    targets = next_tokens[:, -response_length - 1 :] if keep else next_tokens
    with _scoring_scope(model, scoring, targets):
        logits = model(**inputs, use_cache=False, **keep).logits
    return logits[:, -response_length - 1 : -1]  # [B, R, D]


def response_token_outputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    multi_modal_inputs: Sequence[dict[str, Any]] | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
    padding_free: bool = False,
    sequence_parallel: SequenceParallelGroups | None = None,
    position_ids: torch.Tensor | None = None,
    share_prompts: bool = False,
    scoring: ResponseScoring | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's outputs predicting the K valid response tokens only: ``(outputs [K, D],
    response_valid [B, R])``, in row-major order of ``response_valid`` (``attention_mask`` on the
    response columns). What callers compute per token from them (log-probs, entropies, values) is
    then K-sized, never ``[B, R, vocab]``; :func:`scatter_response_tokens` lays results out as [B, R].

    ``padding_free``: one forward over the rows packed into one sequence, and only the K predicting
    positions reach the head; a micro-batch without padding (and, with ``share_prompts``, no prompt
    shared by two rows) runs as the dense batch it is, which computes the same. Otherwise the padded
    forward of :func:`response_head_outputs`.
    ``position_ids``: the rows' batch-first ids when known (the batch column), else computed here.
    ``share_prompts`` (packed, without sequence parallelism): rows with the same prompt share one copy
    of it (:func:`build_shared_prefix_inputs`).
    ``sequence_parallel`` (packed only): this rank runs the decoder on its share of the packed row
    (:mod:`mmrl.parallel.sequence`) and the K outputs are gathered from the SP group, the same on
    every SP rank.
    ``scoring``: the head scores the response tokens in chunks, ``D`` = 2 (log-prob, entropy), and
    no ``[K, vocab]`` logits exist (:class:`ResponseScoring`).
    """
    if not padding_free:
        response_valid = attention_mask[:, -response_length:].bool()
        outputs = response_head_outputs(
            model,
            input_ids,
            attention_mask,
            response_length,
            multi_modal_inputs,
            mm_token_type_ids,
            position_ids=position_ids,
            scoring=scoring,
        )
        return outputs[response_valid], response_valid
    sharded = sequence_parallel is not None and sequence_parallel.size > 1
    lengths = attention_mask.sum(-1).tolist()  # one host sync: the boundaries of the packed row
    if not sharded and min(lengths) == attention_mask.shape[1]:
        # no padding: unless rows share a prompt, the packed row would be the rows end to end, and the
        # dense batch [B, L] computes the same without a decoder layer reshaping a packed row into
        # sequences for attention (host work per layer, counted by bench/gpu_mfu.py)
        valid = attention_mask.bool()
        prompt_length = input_ids.shape[1] - response_length
        if not share_prompts or _distinct_prompts(
            input_ids[:, :prompt_length], valid[:, :prompt_length], multi_modal_inputs
        ):
            # the same contract as a packed pass: a model not prepared for packing fails here too
            check_prepared(model, sequence_parallel=False, where="response_token_outputs")
            inputs = build_forward_inputs(
                model, input_ids, attention_mask, multi_modal_inputs, mm_token_type_ids, position_ids
            )
            inputs["attention_mask"] = None  # every token is valid: causal attention, no mask to build
            outputs = _last_positions_outputs(model, inputs, input_ids, response_length, scoring)
            return outputs.flatten(0, 1), valid[:, prompt_length:]  # [B * R = K, D]
    if share_prompts and not sharded:
        inputs, indices, response_valid = build_shared_prefix_inputs(
            model,
            input_ids,
            attention_mask,
            response_length,
            multi_modal_inputs,
            mm_token_type_ids,
            position_ids,
            lengths,
        )
    else:
        inputs = build_packed_forward_inputs(
            model, input_ids, attention_mask, multi_modal_inputs, mm_token_type_ids, position_ids, lengths
        )
        indices, response_valid = packed_response_indices(attention_mask, response_length)
    tokens = input_ids[:, -response_length:][response_valid]  # [K]: the token each index predicts
    if sharded:
        outputs = _sequence_parallel_outputs(model, inputs, indices, tokens, sequence_parallel, scoring)
        return outputs, response_valid
    return _head_rows(model, inputs, indices, tokens, scoring), response_valid  # [K, D]


def _distinct_prompts(
    prompt_ids: torch.Tensor, prompt_valid: torch.Tensor, multi_modal_inputs: Sequence[dict[str, Any]] | None
) -> bool:
    """Whether no two rows have the same prompt (:func:`prompt_groups`)."""
    first_of = prompt_groups(prompt_ids, prompt_valid, multi_modal_inputs)
    return first_of == list(range(len(first_of)))


def _sequence_parallel_outputs(
    model: nn.Module,
    inputs: dict[str, Any],
    indices: torch.Tensor,
    tokens: torch.Tensor,
    groups: SequenceParallelGroups,
    scoring: ResponseScoring | None,
) -> torch.Tensor:
    """Head outputs [K, D] at packed ``indices`` (predicting ``tokens`` [K]), each computed by the SP
    rank holding its position."""
    check_prepared(model, sequence_parallel=True, where="response_token_outputs(sequence_parallel=...)")
    packed = inputs["packed_sequences"]
    layout = ShardLayout(packed.lengths, groups.ring_size, groups.ulysses_size)
    inputs["packed_sequences"] = ShardedSequences(packed, layout, groups)
    owners, local_index = token_owners(layout, indices)  # [K] each
    is_mine = owners == groups.rank
    mine = local_index[is_mine].to(indices.device)  # ascending in K order
    local = _head_rows(model, inputs, mine, tokens[is_mine.to(tokens.device)], scoring)
    return gather_token_outputs(local, owners, groups.rank, groups.sp_group)


def scatter_response_tokens(values: torch.Tensor, response_valid: torch.Tensor) -> torch.Tensor:
    """``values`` [K, ...] of the valid response tokens laid out as [B, R, ...], zeros elsewhere
    (differentiable in ``values``)."""
    scattered = values.new_zeros(*response_valid.shape, *values.shape[1:])
    scattered[response_valid] = values
    return scattered
