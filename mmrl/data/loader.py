"""A resumable prompt loader: epoch-seeded shuffling, whole batches, a position that checkpoints.

The order of epoch ``e`` is a permutation drawn from ``seed + e`` alone, so resuming at
``(epoch, batch_index)`` reproduces exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from mmrl.protocol import DataProto


class PromptLoader:
    """Yields ``DataProto`` batches of ``batch_size`` prompts (the last partial batch is dropped
    unless ``drop_last=False``), decoding with ``num_workers`` processes when > 0."""

    def __init__(
        self,
        dataset: torch.utils.data.Dataset,
        batch_size: int,
        collate_fn: Callable[[list[dict[str, Any]]], DataProto],
        shuffle: bool = True,
        seed: int = 1,
        drop_last: bool = True,
        num_workers: int = 0,
    ):
        if batch_size > len(dataset) and drop_last:
            raise ValueError(
                f"batch size {batch_size} exceeds the {len(dataset)} prompts of the dataset "
                "(lower data.rollout_batch_size or add data)"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.num_workers = num_workers
        self.epoch = 0
        self.batch_index = 0  # next batch to yield within the epoch

    def __len__(self) -> int:
        full, rest = divmod(len(self.dataset), self.batch_size)
        return full + (0 if self.drop_last or rest == 0 else 1)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def _batches(self, epoch: int, start: int) -> list[list[int]]:
        order = self._epoch_order(epoch)
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        return batches[start:]

    def __iter__(self) -> Iterator[DataProto]:
        """Iterate the rest of the current epoch, then move to the next one."""
        batches = self._batches(self.epoch, self.batch_index)
        if self.num_workers > 0:
            loader = torch.utils.data.DataLoader(
                self.dataset, batch_sampler=batches, collate_fn=self.collate_fn, num_workers=self.num_workers
            )
        else:
            loader = (self.collate_fn([self.dataset[i] for i in batch]) for batch in batches)
        for batch in loader:
            self.batch_index += 1
            yield batch
        self.epoch += 1
        self.batch_index = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_index": self.batch_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])
