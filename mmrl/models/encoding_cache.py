"""Vision encodings shared by the passes of a step: each distinct image or video is encoded once and the
tower's output rows are reused by every later call that shows the same media (the n responses of a
prompt, the old-log-prob pass and the update), while the tower's weights cannot change.

An :class:`EncodingCache` wraps a vision tower's forward (``forward(hidden_states, grid_thw)``, the
Qwen-VL towers), outside the sequence-parallel split (:mod:`mmrl.parallel.encoders`): a call looks each
item up by its key (its ``grid_thw`` row and a digest of its pixel rows' bytes, so only equal media
match), encodes the items it lacks in one call of the tower, stores their output rows (detached) and
returns the rows of every item in call order, as one call on all of them would. Items are reused only
where no gradient has to reach the tower: under ``torch.no_grad`` or while none of its parameters
trains (``freeze_vision_tower``); otherwise the tower runs as before and nothing is stored.

The owner calls :meth:`EncodingCache.clear` where the weights may have changed or a step begins; the
cache holds at most ``max_bytes`` of rows (the oldest entries go first).
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from typing import Any

import torch
from torch import nn


def media_key(grid: list[int], rows: torch.Tensor) -> tuple:
    """``(t, h, w, digest)``: equal only for equal pixel rows of an item of that grid."""
    data = rows.detach().contiguous().view(torch.uint8).cpu().numpy()
    return (*grid, str(rows.dtype), hashlib.blake2b(memoryview(data), digest_size=16).hexdigest())


class EncodingCache:
    """Tower output rows per media item (see the module docstring); ``hits``/``misses`` count items."""

    def __init__(self, max_bytes: int = 4 << 30):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple, tuple[torch.Tensor, list[torch.Tensor] | None]] = OrderedDict()
        self.stored_bytes = 0
        self.hits = self.misses = 0
        self.output_type: type | None = None

    def clear(self) -> None:
        self.entries.clear()
        self.stored_bytes = 0

    def _store(self, key: tuple, pooled: torch.Tensor, deepstack: list[torch.Tensor] | None) -> None:
        size = pooled.numel() * pooled.element_size() + sum(
            f.numel() * f.element_size() for f in deepstack or []
        )
        if size > self.max_bytes:
            return
        while self.entries and self.stored_bytes + size > self.max_bytes:
            _, (old, old_deep) = self.entries.popitem(last=False)
            self.stored_bytes -= old.numel() * old.element_size()
            self.stored_bytes -= sum(f.numel() * f.element_size() for f in old_deep or [])
        self.entries[key] = (pooled, deepstack)
        self.stored_bytes += size

    def encode(
        self, tower: nn.Module, forward, hidden_states: torch.Tensor, grid_thw: torch.Tensor, **kwargs
    ):
        """The tower's output for the call, with stored items reused (see the module docstring)."""
        trains = torch.is_grad_enabled() and any(p.requires_grad for p in tower.parameters())
        if trains:
            return forward(hidden_states, grid_thw, **kwargs)
        grids = grid_thw.tolist()
        patches = [t * h * w for t, h, w in grids]
        starts = [sum(patches[:i]) for i in range(len(patches))]
        keys = [media_key(g, hidden_states[s : s + n]) for g, s, n in zip(grids, starts, patches)]
        found = {key: self.entries[key] for key in keys if key in self.entries}
        missing = list({key: i for i, key in reversed(list(enumerate(keys))) if key not in found}.values())
        missing.sort()  # the first item of each distinct missing key, in call order
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        if missing:
            rows = torch.cat([hidden_states[starts[i] : starts[i] + patches[i]] for i in missing])
            output = forward(rows, grid_thw[missing], **kwargs)
            self.output_type = type(output)
            counts = [patches[i] // tower.spatial_merge_size**2 for i in missing]
            pooled = output.pooler_output.detach().split(counts)
            deepstack = getattr(output, "deepstack_features", None)
            deep_parts = [f.detach().split(counts) for f in deepstack] if deepstack is not None else None
            for n, i in enumerate(missing):
                found[keys[i]] = (pooled[n], [parts[n] for parts in deep_parts] if deep_parts else None)
                self._store(keys[i], *found[keys[i]])
        for key in found:
            if key in self.entries:
                self.entries.move_to_end(key)
        parts = [found[key] for key in keys]
        result: dict[str, Any] = {"pooler_output": torch.cat([pooled for pooled, _ in parts])}
        if parts[0][1] is not None:
            result["deepstack_features"] = [
                torch.cat([deep[layer] for _, deep in parts]) for layer in range(len(parts[0][1]))
            ]
        return self.output_type(last_hidden_state=None, **result)


def enable_encoding_cache(towers: list[nn.Module], cache: EncodingCache) -> int:
    """Route the Qwen-VL vision towers among ``towers`` through ``cache``; returns how many."""
    count = 0
    for tower in towers:
        if getattr(tower, "_mmrl_encoding_cache", None) is cache:
            count += 1
            continue
        if not hasattr(tower, "spatial_merge_size"):
            continue  # audio towers
        tower.forward = functools.partial(cache.encode, tower, tower.forward)
        tower._mmrl_encoding_cache = cache
        count += 1
    return count
