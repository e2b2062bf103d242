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

A tower labelled with the digest of the weights it computes with (:func:`label_weights`, set where a
frozen model is built) is keyed by that digest instead of by the module: two towers of equal weights
(the actor's frozen tower and the reference's) then share each other's encodings, and with a
:class:`~mmrl.models.encoding_store.EncodingStore` its encodings are also kept on disk across epochs
(read before encoding, written after). Under sequence parallelism the ranks of an SP group agree on
which items the disk gave every one of them (another rank's eviction may remove a file between two
reads): the sharded tower's collectives need the same items encoded on every rank of the group.

An item's key needs a digest of its pixel rows. The forward helpers (:mod:`mmrl.models.inputs`)
announce each call's items to the cache (:func:`announce_media`) with digests taken once per
processed prompt, on the processor's CPU tensors (:func:`item_digests`, kept while the tensor lives:
a worker keeps a step's processed media for all its passes); the tower's call then hashes nothing
(on a GPU, each hashing copied the pixel rows to the host: at 64 frames of 448 px, 0.4 s per call,
most of a cached step). A call nobody announced is hashed as before.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mmrl.columns import concat_multi_modal_inputs
from mmrl.models.encoding_store import EncodingStore


def media_key(grid: list[int], rows: torch.Tensor) -> tuple:
    """``(t, h, w, digest)``: equal only for equal pixel rows of an item of that grid."""
    data = rows.detach().contiguous().view(torch.uint8).cpu().numpy()
    return (*grid, str(rows.dtype), hashlib.blake2b(memoryview(data), digest_size=16).hexdigest())


_SOURCE_DIGESTS: dict[int, tuple[weakref.ref, list[tuple]]] = {}


def item_digests(pixels: torch.Tensor, grids: torch.Tensor) -> list[tuple]:
    """:func:`media_key` of each item of ``pixels`` (split by ``grids``), computed once per tensor
    object and kept while it lives."""
    entry = _SOURCE_DIGESTS.get(id(pixels))
    if entry is not None and entry[0]() is pixels:
        return entry[1]
    grid_rows = grids.tolist()
    sizes = [t * h * w for t, h, w in grid_rows]
    keys = [media_key(grid, part) for grid, part in zip(grid_rows, pixels.split(sizes))]
    _SOURCE_DIGESTS[id(pixels)] = (weakref.ref(pixels, functools.partial(_forget, id(pixels))), keys)
    return keys


def _forget(key: int, ref: weakref.ref) -> None:
    if _SOURCE_DIGESTS.get(key, (None,))[0] is ref:
        del _SOURCE_DIGESTS[key]


# processor keys of the towers' inputs: (pixel rows, grid) of images and of videos
_PIXEL_KEYS = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))


def announce_media(
    towers: Sequence[nn.Module], media: dict[str, Any], parts: Sequence[dict[str, Any]]
) -> None:
    """Tell the caches of ``towers`` the item keys of the call ``media`` (the joined processor outputs
    of ``parts``, in order) is about to make; nothing when no tower has a cache."""
    caches = {id(c): c for t in towers if (c := getattr(t, "_mmrl_encoding_cache", None)) is not None}
    for pixels_key, grid_key in _PIXEL_KEYS:
        joined = media.get(pixels_key)
        if not caches or joined is None:
            continue
        keys = [
            key
            for part in parts
            if part and part.get(pixels_key) is not None
            for key in item_digests(part[pixels_key], part[grid_key])
        ]
        for cache in caches.values():
            cache.announce(joined, media[grid_key].tolist(), keys)


def _same_rows(announced: torch.Tensor, hidden_states: torch.Tensor, chunk: int = 1 << 16) -> bool:
    """``hidden_states`` is ``announced`` (the model may have cast it to the tower's dtype)."""
    if announced is hidden_states:
        return True
    if announced.shape != hidden_states.shape or announced.device != hidden_states.device:
        return False
    return all(
        torch.equal(a.to(hidden_states.dtype), b)
        for a, b in zip(announced.split(chunk), hidden_states.split(chunk))
    )


def weights_digest(tower: nn.Module, compute_dtype: torch.dtype) -> str:
    """A digest of the weights ``tower`` computes with: its parameters cast to ``compute_dtype`` (what
    mixed precision hands the kernels, whatever the stored dtype) and its buffers as they are, by name.
    Call it on whole tensors (before sharding)."""
    digest = hashlib.blake2b(str(compute_dtype).encode(), digest_size=16)
    named = [(name, p.detach().to(compute_dtype)) for name, p in tower.named_parameters()]
    named += [(name, b) for name, b in tower.named_buffers() if b is not None]
    for name, tensor in named:
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        data = tensor.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        digest.update(memoryview(data))
    return digest.hexdigest()


def label_weights(tower: nn.Module, digest: str) -> None:
    """Key ``tower``'s encodings by ``digest`` (:func:`weights_digest`) rather than by the module."""
    tower._mmrl_weights_digest = digest


def _output_type(tower: nn.Module, deepstack: bool) -> type:
    """The tower's output class where every item came from disk (no call of the tower to learn it)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    name = "BaseModelOutputWithDeepstackFeatures" if deepstack else "BaseModelOutputWithPooling"
    return getattr(sys.modules[type(tower).__module__], name, BaseModelOutputWithPooling)


def _agreed(found: list[bool], sharded: Any, device: torch.device) -> list[bool]:
    """``found`` and-ed over the SP group of a sequence-parallel call (its ``packed_sequences``)."""
    groups = getattr(sharded, "groups", None)
    if groups is None or groups.size == 1:
        return found
    flags = torch.tensor(found, dtype=torch.int32, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=groups.sp_group)
    return [bool(flag) for flag in flags.tolist()]


class EncodingCache:
    """Tower output rows per media item (see the module docstring); ``hits`` counts items reused from
    memory, ``loaded`` those read from ``store``, ``misses`` those encoded."""

    def __init__(self, max_bytes: int = 4 << 30, store: EncodingStore | None = None):
        self.max_bytes = max_bytes
        self.store = store
        self.loaded = 0
        self.entries: OrderedDict[tuple, tuple[torch.Tensor, list[torch.Tensor] | None]] = OrderedDict()
        self.stored_bytes = 0
        self.hits = self.misses = 0
        self.output_type: type | None = None
        self.announced: list[tuple[weakref.ref, list[list[int]], list[tuple]]] = []
        self.hashed_items = 0  # items whose pixel rows a tower call hashed (nobody announced them)

    def clear(self) -> None:
        self.entries.clear()
        self.stored_bytes = 0
        self.announced.clear()

    def announce(self, pixels: torch.Tensor, grids: list[list[int]], keys: list[tuple]) -> None:
        """The next tower call on ``pixels`` (or its cast) of items ``grids`` has item keys ``keys``."""
        self.announced = [entry for entry in self.announced if entry[0]() is not None][-7:]
        self.announced.append((weakref.ref(pixels), grids, keys))

    def _media_keys(
        self, hidden_states: torch.Tensor, grids: list[list[int]], patches: list[int]
    ) -> list[tuple]:
        for ref, announced_grids, keys in reversed(self.announced):
            pixels = ref()
            if pixels is not None and announced_grids == grids and _same_rows(pixels, hidden_states):
                return keys
        self.hashed_items += len(grids)
        starts = [sum(patches[:i]) for i in range(len(patches))]
        return [media_key(g, hidden_states[s : s + n]) for g, s, n in zip(grids, starts, patches)]

    def take_counts(self) -> dict[str, int]:
        """Items encoded, reused from memory, read from disk and keyed by hashing the tower call's
        pixel rows (nobody announced them) since the last call (then zeroed)."""
        counts = {
            "encoded_items": self.misses,
            "reused_items": self.hits,
            "disk_read_items": self.loaded,
            "hashed_items": self.hashed_items,
        }
        self.misses = self.hits = self.loaded = self.hashed_items = 0
        return counts

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
        weights = getattr(tower, "_mmrl_weights_digest", None)
        identity = weights or f"module-{id(tower)}"  # an unlabelled tower shares with no other
        keys = [(identity, *key) for key in self._media_keys(hidden_states, grids, patches)]
        merge = tower.spatial_merge_size**2
        found = {key: self.entries[key] for key in keys if key in self.entries}
        first: dict[tuple, int] = {}  # each distinct key not in memory: its first item in call order
        for i, key in enumerate(keys):
            if key not in found:
                first.setdefault(key, i)
        sharded = kwargs.get("packed_sequences")
        stored = self.store if weights is not None else None  # an unlabelled tower's key lives one run
        loaded = 0
        if stored is not None and first:
            read = {
                key: stored.load(key, patches[i] // merge, hidden_states.device) for key, i in first.items()
            }
            agreed = _agreed([rows is not None for rows in read.values()], sharded, hidden_states.device)
            for (key, rows), ok in zip(read.items(), agreed):
                if ok:
                    found[key] = rows
                    self._store(key, *rows)
                    del first[key]
                    loaded += 1
        missing = sorted(first.values())
        self.misses += len(missing)
        self.loaded += loaded
        self.hits += len(keys) - len(missing) - loaded
        if missing:
            rows = torch.cat([hidden_states[starts[i] : starts[i] + patches[i]] for i in missing])
            output = forward(rows, grid_thw[missing], **kwargs)
            self.output_type = type(output)
            counts = [patches[i] // merge for i in missing]
            pooled = output.pooler_output.detach().split(counts)
            deepstack = getattr(output, "deepstack_features", None)
            deep_parts = [f.detach().split(counts) for f in deepstack] if deepstack is not None else None
            groups = getattr(sharded, "groups", None)
            write = stored is not None and (groups is None or groups.rank == 0)  # one writer per SP group
            for n, i in enumerate(missing):
                found[keys[i]] = (pooled[n], [parts[n] for parts in deep_parts] if deep_parts else None)
                self._store(keys[i], *found[keys[i]])
                if write:
                    stored.save(keys[i], *found[keys[i]])
        for key in found:
            if key in self.entries:
                self.entries.move_to_end(key)
        parts = [found[key] for key in keys]
        result: dict[str, Any] = {"pooler_output": torch.cat([pooled for pooled, _ in parts])}
        if parts[0][1] is not None:
            result["deepstack_features"] = [
                torch.cat([deep[layer] for _, deep in parts]) for layer in range(len(parts[0][1]))
            ]
        return (self.output_type or _output_type(tower, "deepstack_features" in result))(
            last_hidden_state=None, **result
        )


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


# towers whose encodings vLLM takes as ``{modality}_embeds`` with the grid (its Qwen2-VL parser, 0.32)
ENGINE_EMBEDS_TOWERS = ("Qwen2VisionTransformerPretrainedModel", "Qwen2_5_VisionTransformerPretrainedModel")


def prompt_encodings(
    towers: Sequence[nn.Module], rows: Sequence[dict[str, Any] | None], device: torch.device
) -> list[dict[str, dict[str, torch.Tensor]] | None]:
    """Per row of processor outputs ``rows``, the vision tower's encodings of its images and videos
    as a rollout engine takes them (``{"image": {"image_embeds", "image_grid_thw"}, "video": ...}``,
    on the CPU), or None where it has none. One tower call per modality over the distinct rows,
    announced (:func:`announce_media`), so a cache on the tower keeps them for the step's passes.

    Only towers of :data:`ENGINE_EMBEDS_TOWERS`; only videos whose temporal patches are 1 s apart
    (vLLM's embedding input has no field for the time per patch, and takes 1 s for M-RoPE): other
    videos stay media that the engine encodes itself."""
    # by the class or a base: FSDP2 gives a sharded module a subclass of its own (FSDP<name>)
    tower = next(
        (t for t in towers if any(kind.__name__ in ENGINE_EMBEDS_TOWERS for kind in type(t).__mro__)), None
    )
    distinct = {id(row): row for row in rows if row}
    encodings: dict[int, dict[str, dict[str, torch.Tensor]]] = {key: {} for key in distinct}
    if tower is None:
        return [None] * len(rows)
    for (pixels_key, grid_key), modality in zip(_PIXEL_KEYS, ("image", "video")):
        members = [
            key
            for key, row in distinct.items()
            if row.get(pixels_key) is not None
            and (
                modality == "image"
                or bool((torch.as_tensor(row.get("second_per_grid_ts", 1.0)) == 1.0).all())
            )
        ]
        if not members:
            continue
        parts = [
            {pixels_key: distinct[key][pixels_key], grid_key: distinct[key][grid_key]} for key in members
        ]
        media = concat_multi_modal_inputs(parts, device=device)
        announce_media([tower], media, parts)
        pooled = tower(media[pixels_key].to(tower.dtype), grid_thw=media[grid_key]).pooler_output
        merge = tower.spatial_merge_size**2
        sizes = [int(part[grid_key].prod(-1).sum()) // merge for part in parts]
        for key, part, embeds in zip(members, parts, pooled.detach().split(sizes)):
            encodings[key][modality] = {f"{modality}_embeds": embeds.cpu(), grid_key: part[grid_key].cpu()}
    return [encodings[id(row)] or None if row else None for row in rows]
