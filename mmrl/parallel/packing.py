"""Grouping sequences by length: micro-batches by token budget, ranks balanced by tokens, padding counts.

All pure functions of per-row token counts (``attention_mask.sum(-1)``: prompt plus response tokens,
i.e. a row's length once packed). The forward on packed rows lives in :mod:`mmrl.models.inputs`.

- :func:`token_budget_groups` forms micro-batches whose packed length stays within a budget
  (first-fit decreasing); :func:`split_groups` raises their number to what another rank needs, since
  every rank of an FSDP group must run the same number of forward passes.
- :func:`balance_by_length` splits rows into parts of equal row count (FSDP ranks hold the same number
  of rows) with token sums as equal as it can (Karmarkar–Karp largest differencing);
  :func:`balance_batch` applies it to a :class:`DataProto` before the driver cuts it into rank chunks.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from mmrl.protocol import DataProto


def token_budget_groups(seq_lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Rows grouped so that each group's token sum is at most ``max_tokens`` (first-fit decreasing).

    A row longer than the budget gets a group of its own. Groups are listed in the order they were
    opened (longest first), each with its rows in ascending order.
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {max_tokens}")
    groups: list[list[int]] = []
    sums: list[int] = []
    for row in sorted(range(len(seq_lengths)), key=lambda row: (-seq_lengths[row], row)):
        length = seq_lengths[row]
        target = next((g for g, total in enumerate(sums) if total + length <= max_tokens), None)
        if target is None:
            groups.append([row])
            sums.append(length)
        else:
            groups[target].append(row)
            sums[target] += length
    return [sorted(group) for group in groups]


def split_groups(groups: list[list[int]], seq_lengths: Sequence[int], num_groups: int) -> list[list[int]]:
    """Split the heaviest splittable group in two until there are ``num_groups`` groups.

    Each half is a subset of a group, so a token budget that held still holds. Needs at least
    ``num_groups`` rows in all.
    """
    num_rows = sum(len(group) for group in groups)
    if num_groups > num_rows:
        raise ValueError(
            f"cannot form {num_groups} non-empty micro-batches from {num_rows} rows; every rank must hold "
            "the same number of rows"
        )
    groups = [list(group) for group in groups]
    while len(groups) < num_groups:
        splittable = [g for g, group in enumerate(groups) if len(group) > 1]
        heaviest = max(splittable, key=lambda g: sum(seq_lengths[row] for row in groups[g]))
        halves = _split_in_two(groups.pop(heaviest), seq_lengths)
        groups.extend(halves)
    return groups


def _split_in_two(rows: list[int], seq_lengths: Sequence[int]) -> list[list[int]]:
    """``rows`` in two non-empty halves of near-equal token sums (longest first, onto the lighter half)."""
    halves: list[list[int]] = [[], []]
    sums = [0, 0]
    for row in sorted(rows, key=lambda row: (-seq_lengths[row], row)):
        lighter = 0 if (sums[0], len(halves[0])) <= (sums[1], len(halves[1])) else 1
        halves[lighter].append(row)
        sums[lighter] += seq_lengths[row]
    if not halves[1]:  # only when every row has length 0
        halves[1].append(halves[0].pop())
    return [sorted(half) for half in halves]


def balance_by_length(seq_lengths: Sequence[int], num_parts: int) -> list[list[int]]:
    """Rows split into ``num_parts`` parts of equal row count with near-equal token sums.

    Karmarkar–Karp largest differencing, with equal sizes: the rows sorted by length are cut into
    sets of ``num_parts`` consecutive rows (one row per part); the two sets whose part sums differ
    most are merged repeatedly, the heaviest part of one joined with the lightest of the other.
    A merge never widens the spread beyond the wider of the two, so
    ``max part sum <= sum / num_parts + max(seq_lengths)``. Returns the parts, each with its rows in
    ascending order, heaviest part first.
    """
    num_rows = len(seq_lengths)
    if num_parts <= 0 or num_rows % num_parts:
        raise ValueError(
            f"balance_by_length: {num_rows} rows do not split into {num_parts} parts of equal size; "
            "pad the batch to a multiple of the number of ranks first (DataProto.pad_to_divisor)"
        )
    order = sorted(range(num_rows), key=lambda row: (seq_lengths[row], row))
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for tie_break, start in enumerate(range(0, num_rows, num_parts)):
        # a set: (part sum, rows) per part, heaviest first
        parts = sorted(((seq_lengths[row], [row]) for row in order[start : start + num_parts]), reverse=True)
        heapq.heappush(heap, (-(parts[0][0] - parts[-1][0]), tie_break, parts))
    tie_break = len(heap)
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        merged = sorted(
            (
                (sum_a + sum_b, rows_a + rows_b)
                for (sum_a, rows_a), (sum_b, rows_b) in zip(first, reversed(second))
            ),
            reverse=True,
        )
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie_break, merged))
        tie_break += 1
    return [sorted(rows) for _, rows in heap[0][2]] if heap else [[] for _ in range(num_parts)]


def balance_batch(batch: DataProto, num_parts: int) -> tuple[DataProto, np.ndarray]:
    """``batch`` reordered so that its ``num_parts`` consecutive equal chunks (what the driver sends to
    the data-parallel ranks) hold near-equal token counts (:func:`balance_by_length` on
    ``attention_mask.sum(-1)``).

    Returns ``(reordered, restore)``; ``reordered.reorder(restore)`` gives back the original order.
    Rows keep their ``uid``, so grouping by prompt is unaffected.
    """
    seq_lengths = batch.batch["attention_mask"].sum(-1).tolist()
    order = np.concatenate(
        [np.asarray(part, dtype=np.int64) for part in balance_by_length(seq_lengths, num_parts)]
    )
    return batch.reorder(order), np.argsort(order)


def padding_counts(lengths: list[int], rows: list[int], width: int, padding_free: bool) -> tuple[int, int]:
    """``(computed tokens, of which padding)`` of one forward pass over ``rows`` of a batch whose rows
    hold ``lengths`` valid tokens of ``width`` columns: packed it computes the valid tokens only;
    padded, all ``len(rows) * width`` positions. Plain ints: no host sync per micro-batch."""
    valid = sum(lengths[row] for row in rows)
    if padding_free:
        return valid, 0
    return len(rows) * width, len(rows) * width - valid
