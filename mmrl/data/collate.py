"""Batching of encoded prompts into a :class:`DataProto`, left-padded for generation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmrl.data.dataset import TOKEN_COLUMNS
from mmrl.protocol import DataProto


def left_pad(sequences: Sequence[torch.Tensor], pad_value: int) -> torch.Tensor:
    """Stack 1-D tensors of different lengths into ``[B, max_len]``, padding on the left."""
    max_len = max(seq.shape[0] for seq in sequences)
    out = torch.full((len(sequences), max_len), pad_value, dtype=sequences[0].dtype)
    for row, seq in enumerate(sequences):
        out[row, max_len - seq.shape[0] :] = seq
    return out


def collate_prompts(items: Sequence[dict[str, Any]], pad_token_id: int) -> DataProto:
    """Encoded prompts (``PromptDataset`` items) → one batch.

    Token columns become left-padded ``[B, L]`` tensors (``attention_mask`` 0 on padding, other
    columns padded with ``pad_token_id`` or 0); every other key becomes a non-tensor column.
    """
    if not items:
        raise ValueError("collate_prompts needs at least one item")
    tensors = {}
    for key in TOKEN_COLUMNS:
        if key in items[0]:
            pad = pad_token_id if key == "input_ids" else 0
            tensors[key] = left_pad([item[key] for item in items], pad)
    other_keys = [key for key in items[0] if key not in tensors]
    missing = {key for item in items for key in other_keys if key not in item}
    non_tensors = {key: [item.get(key) for item in items] for key in other_keys}
    if missing:
        # rows of different files can have different extra columns: absent values are None
        for key in missing:
            non_tensors[key] = [item.get(key) for item in items]
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
