"""Batching of encoded prompts into a :class:`DataProto`, left-padded for generation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmrl.columns import COLUMNS
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


# what the prompt side of a column is padded with (else 0): the pad id, and HF's position of a pad token
_PROMPT_PAD = {"input_ids": None, "prompts": None, "position_ids": 1, "routed_experts": -1}


def concat_batches(parts: Sequence[DataProto], pad_token_id: int) -> DataProto:
    """``parts`` row-wise in order (:meth:`DataProto.concat`), where each part's prompts are left-padded
    to its own longest (a batch collates them so): the prompt side of every column padded on the left
    to the widest part's (ids with ``pad_token_id``, ``attention_mask`` with 0). Groups of different
    loader batches meet in one step in dynamic sampling's rounds and in a stream."""
    keys = set(parts[0].batch.keys()) if parts else set()
    key = "prompts" if "prompts" in keys else "input_ids" if "input_ids" in keys else None
    widths = [part.batch[key].shape[-1] if key is not None else 0 for part in parts]
    if len(set(widths)) <= 1:  # one width (or no prompt column): nothing to pad
        return DataProto.concat(parts)
    widest = max(widths)
    padded = []
    for part, width in zip(parts, widths):
        tensors = dict(part.batch.items())
        for name, tensor in tensors.items():
            dim = COLUMNS[name].prompt_dim(tensor.dim()) if name in COLUMNS and width < widest else None
            if dim is None:
                continue
            value = _PROMPT_PAD.get(name, 0)
            shape = list(tensor.shape)
            shape[dim] = widest - width
            fill = torch.full(
                shape, pad_token_id if value is None else value, dtype=tensor.dtype, device=tensor.device
            )
            tensors[name] = torch.cat([fill, tensor], dim=dim)
        padded.append(
            DataProto.from_dict(
                tensors=tensors, non_tensors=dict(part.non_tensor_batch), meta_info=dict(part.meta_info)
            )
        )
    return DataProto.concat(padded)
