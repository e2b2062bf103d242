"""Vision towers sharded as FSDP2 units of their own, called on every rank in the same micro-batches.

FSDP2's all-gathers and reduce-scatters are collectives: a unit's parameters are gathered when it is
called, and a rank whose micro-batch holds no image never calls the tower. So either every rank
gathers the tower in every micro-batch (the tower in the root unit: a gather and a bf16 cast of all
its tensors even on text rows, where no rank needs it), or the ranks agree beforehand on the
micro-batches that have media on some rank. This module does the latter:

- :func:`shard_towers` (from ``apply_fsdp2``) shards each Qwen-VL vision tower as one unit outside
  the root, kept gathered from its first call in a forward to the end of the backward
  (``reshard_after_forward=False``). One unit, not one per block: a forward calls the tower once for
  images and once more for videos, and per-block units would gather and reduce once per call, so
  ranks with different media would issue different collectives. A whole-tower unit gathers once per
  forward whatever the calls, and its inputs (pixels) need no gradient, so FSDP reduces its gradients
  once, in the backward's final callback (a rank whose calls differ still issues the same collectives).
  Audio towers (Omni) stay in the root unit.
- :func:`agreed_media` takes each micro-batch's "has media" flag on this rank and returns, with one
  all-reduce for a whole pass, whether any rank has media in each micro-batch; the loops run each
  micro-batch's forward inside :func:`media_step`.
- In a micro-batch with media somewhere, a rank whose own rows did not call a tower calls it, right
  before the text decoder (where the tower's real call would have happened: the collectives stay in
  order), on a placeholder of one merged token's patches; the output is added to the decoder's input
  embeddings times 0, so its gradient is 0 and the values are unchanged. In a micro-batch without
  media on any rank no rank calls the tower: nothing is gathered, cast or reduced.

A forward outside :func:`media_step` (a direct call of the model) agrees with one all-reduce of its
own, before the tower could be called.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mmrl.columns import media_segments
from mmrl.models.families import family_of
from mmrl.parallel.encoders import takes_grid

MEDIA_COLUMN = "multi_modal_inputs"
# what calls a Qwen-VL vision tower in the model's forward
TOWER_INPUTS = ("pixel_values", "pixel_values_videos")


class TowerSync:
    """The model's separately sharded towers and the current forward's state (see the module doc)."""

    def __init__(self, towers: list[nn.Module], group: dist.ProcessGroup | None):
        self.towers, self.group = towers, group
        self.agreed: bool | None = None  # set by media_step; None: agree in the forward itself
        self.expected = False  # this forward: some rank calls the towers
        self.called: set[int] = set()
        self.reduce_unused = False  # the towers' set_reduce_scatter_unused_params (apply_fsdp2: False)
        self.placeholder_calls = 0  # placeholders run (tests)

    def model_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        local = any(_has_rows(kwargs.get(key)) for key in TOWER_INPUTS)
        if self.agreed is None:
            flag = torch.tensor([float(local)], device=_device(self.towers[0]))
            if dist.is_initialized() and dist.get_world_size(self.group) > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            self.expected = bool(flag.item())
        else:
            if local and not self.agreed:
                raise RuntimeError(
                    "a micro-batch with media ran in a step agreed to have none on any rank; "
                    "its flags must come from mmrl.workers.towers.agreed_media of the same rows"
                )
            self.expected = self.agreed
        self.called.clear()
        if self.expected != self.reduce_unused:  # zeros for unused gradients only where the tower ran
            for tower in self.towers:
                if hasattr(tower, "set_reduce_scatter_unused_params"):  # torch >= 2.13
                    tower.set_reduce_scatter_unused_params(self.expected, recurse=False)
            self.reduce_unused = self.expected

    def tower_pre_hook(self, tower: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self.expected:
            raise RuntimeError(
                f"{type(tower).__name__} was called in a forward that no rank agreed to have media in: "
                "the other ranks would not gather it (call the model with its media keywords, or inside "
                "mmrl.workers.towers.media_step)"
            )
        self.called.add(id(tower))

    def decoder_pre_hook(self, decoder: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        missing = [tower for tower in self.towers if id(tower) not in self.called]
        if not self.expected or not missing:
            return None
        self.placeholder_calls += len(missing)
        outputs = [tower(*placeholder_inputs(tower)) for tower in missing]
        if not torch.is_grad_enabled():
            return None
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            raise RuntimeError(
                f"{type(decoder).__name__} was called without inputs_embeds: the towers' placeholder "
                "cannot join the graph; its model family needs support in mmrl.workers.towers"
            )
        zero = sum(tensor.float().sum() for output in outputs for tensor in output_tensors(output)) * 0.0
        kwargs["inputs_embeds"] = embeds + zero.to(embeds.dtype)
        return args, kwargs


def _has_rows(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.numel() > 0


def _device(module: nn.Module) -> torch.device:
    parameter = next(module.parameters())
    mesh = getattr(parameter, "device_mesh", None)
    if mesh is not None and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return parameter.device


def output_tensors(output: Any) -> Iterator[torch.Tensor]:
    """Every floating tensor in a tower's output (pooled embeddings, Qwen3-VL's deepstack features)."""
    if isinstance(output, torch.Tensor):
        if output.is_floating_point():
            yield output
    elif isinstance(output, (list, tuple)):
        for item in output:
            yield from output_tensors(item)
    elif isinstance(output, dict) or hasattr(output, "values"):
        for item in output.values():
            yield from output_tensors(item)


def placeholder_inputs(tower: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pixel rows, grid_thw)`` of the smallest image a Qwen-VL tower takes: one temporal patch of
    ``merge × merge`` patches (one merged token), all zeros."""
    embed = tower.patch_embed
    merge = tower.spatial_merge_size
    width = embed.in_channels * embed.temporal_patch_size * embed.patch_size**2
    device = _device(tower)
    pixels = torch.zeros(merge * merge, width, device=device)
    return pixels, torch.tensor([[1, merge, merge]], device=device)


def shard_towers(model: nn.Module, shard, mesh) -> list[nn.Module]:
    """Shard each Qwen-VL vision tower of ``model`` as its own unit (``shard``: ``fully_shard`` with the
    policies; call before sharding the root) and install the hooks; returns the towers."""
    towers = [tower for _, tower in family_of(model).tower_modules(model) if takes_grid(tower)]
    if not towers:
        return []
    for tower in towers:
        shard(tower, reshard_after_forward=False)
    sync = TowerSync(towers, None if mesh is None else mesh.get_group())
    model.register_forward_pre_hook(sync.model_pre_hook, with_kwargs=True)
    for tower in towers:
        tower.register_forward_pre_hook(sync.tower_pre_hook, with_kwargs=True)
    model.get_decoder().register_forward_pre_hook(sync.decoder_pre_hook, with_kwargs=True)
    model._mmrl_tower_sync = sync
    return towers


def tower_sync(model: nn.Module) -> TowerSync | None:
    return getattr(model, "_mmrl_tower_sync", None)


def sharded_towers(model: nn.Module) -> list[nn.Module]:
    """The towers :func:`shard_towers` sharded on their own (none for a text model or an unsharded one)."""
    sync = tower_sync(model)
    return sync.towers if sync is not None else []


def rows_have_media(rows: Sequence[Any] | None) -> bool:
    """Whether any row's ``multi_modal_inputs`` (prompt or response part) holds media."""
    return rows is not None and any(parts for row in rows for _, parts in media_segments(row))


def micro_batch_media(batch: Any, plan: Sequence[Sequence[int]]) -> list[Sequence[Any] | None]:
    """The ``multi_modal_inputs`` rows of each micro-batch (row indices ``plan``) of ``batch`` (a
    ``DataProto``); None for a batch without the column."""
    rows = batch.non_tensor_batch.get(MEDIA_COLUMN)
    return [None if rows is None else [rows[row] for row in micro] for micro in plan]


def agreed_media(
    model: nn.Module,
    media: Sequence[Sequence[Any] | None],
    device: torch.device | str,
    group: dist.ProcessGroup | None,
) -> list[bool | None]:
    """Per micro-batch, given each one's ``multi_modal_inputs`` rows (None: no such column) in the
    order every rank runs them: whether some rank of ``group`` has media in it. One all-reduce for all
    of them, and none for a model without separately sharded towers (then None: nothing to agree).
    ``group`` holds one rank per data-parallel share: sequence-parallel ranks hold the same rows."""
    if not sharded_towers(model):
        return [None] * len(media)
    flags = torch.tensor([float(rows_have_media(rows)) for rows in media] or [0.0], device=device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return [bool(flag) for flag in flags.tolist()[: len(media)]]


@contextlib.contextmanager
def media_step(model: nn.Module, agreed: bool | None) -> Iterator[None]:
    """A forward (and its backward) of one micro-batch whose "media on some rank" flag ``agreed`` came
    from :func:`agreed_media`: the model's forward then issues no collective of its own to agree."""
    sync = tower_sync(model)
    if sync is None or agreed is None:
        yield
        return
    sync.agreed = agreed
    try:
        yield
    finally:
        sync.agreed = None


def unshard_towers(model: nn.Module) -> None:
    """Gather the separately sharded towers (with the root, for a call outside the forward)."""
    for tower in sharded_towers(model):
        tower.unshard()


def reshard_towers(model: nn.Module) -> None:
    for tower in sharded_towers(model):
        tower.reshard()


@contextlib.contextmanager
def towers_gathered(model: nn.Module) -> Iterator[None]:
    """Calls of the towers outside a forward, on every rank or not, while :func:`unshard_towers` holds
    them gathered (no call gathers)."""
    sync = tower_sync(model)
    if sync is None:
        yield
        return
    before, sync.expected = sync.expected, True
    try:
        yield
    finally:
        sync.expected = before
