"""Batches whose prompts were padded to different widths, joined (mmrl/data/collate.py:
``concat_batches``): groups of different loader batches meet in one step in dynamic sampling's rounds
and in a stream. Worked by hand on two rollout parts whose prompts are 2 and 3 tokens wide."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmrl.columns import check_batch
from mmrl.data.collate import collate_prompts, concat_batches
from mmrl.protocol import DataProto

PAD = 7


def rollout_part(prompt: list[int], response: list[int], uid: str) -> DataProto:
    """One row of a rollout batch: ``prompt`` (no padding) and a 2-token ``response``; M-RoPE positions
    counting from 0 over the row, experts 10 + position (one layer, top-1)."""
    ids = torch.tensor([prompt + response])
    width = ids.shape[1]
    positions = torch.arange(width).expand(1, 3, width)
    return DataProto.from_dict(
        tensors={
            "prompts": torch.tensor([prompt]),
            "responses": torch.tensor([response]),
            "response_mask": torch.ones(1, 2, dtype=torch.long),
            "input_ids": ids,
            "attention_mask": torch.ones(1, width, dtype=torch.long),
            "position_ids": positions.clone(),
            "routed_experts": (10 + torch.arange(width, dtype=torch.int16)).reshape(1, width, 1, 1),
        },
        non_tensors={"uid": np.array([uid], dtype=object)},
    )


def test_the_narrower_parts_prompt_side_is_left_padded_to_the_widest():
    joined = concat_batches([rollout_part([1, 2], [3, 4], "a"), rollout_part([5, 6, 8], [9, 4], "b")], PAD)
    batch = joined.batch
    assert batch["prompts"].tolist() == [[PAD, 1, 2], [5, 6, 8]]
    assert batch["input_ids"].tolist() == [[PAD, 1, 2, 3, 4], [5, 6, 8, 9, 4]]
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch["responses"].tolist() == [[3, 4], [9, 4]]  # responses: one width already
    assert batch["response_mask"].tolist() == [[1, 1], [1, 1]]
    # a pad token's position is 1 (as get_rope_index numbers padding), on each M-RoPE axis
    assert batch["position_ids"][0].tolist() == [[1, 0, 1, 2, 3]] * 3
    assert batch["position_ids"][1].tolist() == [[0, 1, 2, 3, 4]] * 3
    assert batch["routed_experts"][:, :, 0, 0].tolist() == [[-1, 10, 11, 12, 13], [10, 11, 12, 13, 14]]
    assert list(joined.non_tensor_batch["uid"]) == ["a", "b"]
    assert check_batch(joined) == []


def test_parts_of_one_width_join_as_they_are_and_prompt_batches_too():
    parts = [rollout_part([1, 2], [3, 4], "a"), rollout_part([5, 6], [9, 4], "b")]
    joined, plain = concat_batches(parts, PAD), DataProto.concat(parts)
    assert all(torch.equal(joined.batch[key], plain.batch[key]) for key in plain.batch.keys())
    # prompt batches as the loader collates them (a stream's stale prompts, sent again together)
    short = collate_prompts([{"input_ids": torch.tensor([1, 2]), "attention_mask": torch.ones(2)}], PAD)
    long = collate_prompts([{"input_ids": torch.tensor([3, 4, 5]), "attention_mask": torch.ones(3)}], PAD)
    prompts = concat_batches([short, long], PAD)
    assert prompts.batch["input_ids"].tolist() == [[PAD, 1, 2], [3, 4, 5]]
    assert prompts.batch["attention_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]


def test_a_column_without_a_prompt_side_keeps_its_width_and_unequal_ones_still_fail():
    a, b = rollout_part([1, 2], [3, 4], "a"), rollout_part([5, 6, 8], [9, 4], "b")
    b.batch["responses"] = torch.tensor([[9, 4, 4]])  # a response width the other part lacks
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        concat_batches([a, b], PAD)
