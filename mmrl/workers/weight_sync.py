"""Full weights out of a sharded model, one tensor at a time, for the rollout engine.

Names. transformers v5 keeps modules and checkpoint files under different names for some families
and converts while loading and saving. Qwen2.5-VL: in memory ``model.language_model.*``,
``model.visual.*``, ``lm_head.weight``; on disk (what ``save_pretrained`` writes) ``model.*``,
``visual.*`` and no ``lm_head.weight`` when tied. ``from_pretrained`` accepts both spellings (its
renaming patterns leave the in-memory names alone); ``load_state_dict`` takes only the in-memory ones.
:func:`iter_full_state_dict` yields the in-memory names by default (``state_dict()`` keys) and the
on-disk names with ``checkpoint_format=True``; :func:`load_into` takes either. A tied weight
(``lm_head.weight`` = input embedding) is yielded once, under its first name.

LoRA. A model with adapters (:mod:`mmrl.models.lora`) is yielded as the plain model the rollout engine
holds: each adapted layer's ``P.base_layer.weight`` as ``P.weight`` = ``W + (alpha / r) * B @ A`` of
the current adapter, and no ``lora_A``/``lora_B`` tensors, so the engine never sees a stale adapter
nor a name it does not know.

Qwen2.5-Omni: the thinker's names carry no ``thinker.`` prefix, while the files of a full Omni
checkpoint do; prepend it where a consumer expects the whole Omni model's names.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from mmrl.models.lora import ADAPTER, adapter_layers, base_name, is_adapter_tensor, lora_scale, merged_weight
from mmrl.workers.fsdp_engine import collective_device


def _unique_state_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``state_dict`` entries (parameters and persistent buffers) in order, each tensor once."""
    seen: set[int] = set()
    entries = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # a tied alias, e.g. lm_head.weight of a tied-embedding model
            continue
        seen.add(id(tensor))
        entries.append((name, tensor))
    return entries


def checkpoint_key_mapping(model: nn.Module, splits: bool = False) -> dict[str, str | None]:
    """``state_dict`` key → the key ``save_pretrained`` writes for it (identity where nothing is renamed).

    Uses transformers' own reverse conversion (``revert_weight_conversion``) on placeholder tensors.
    Families whose conversion merges or splits tensors (Qwen3.5 MoE's fused experts, one tensor per
    expert in its files) are refused, since their on-disk tensors are not the in-memory ones (the
    transformers rollout is pushed the in-memory names).
    With ``splits`` such a key maps to None instead (:func:`saved_pieces` names its saved tensors).
    """
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    keys = list(state.keys())
    if not isinstance(model, PreTrainedModel):
        return {key: key for key in keys}
    # shaped like the weights (on meta): a shape-checked conversion (Qwen3-VL MoE's expert transpose,
    # transformers 5.19) leaves a tensor of the model's own shape as it is, so its name maps 1:1
    placeholders = {key: torch.empty(tuple(tensor.shape), device="meta") for key, tensor in state.items()}
    key_of_placeholder = {id(tensor): key for key, tensor in placeholders.items()}
    mapping: dict[str, str | None] = {}
    for saved_key, tensor in revert_weight_conversion(model, dict(placeholders)).items():
        if id(tensor) not in key_of_placeholder:
            if splits:  # a piece of a split tensor: its source is the key no saved tensor is
                continue
            raise NotImplementedError(
                f"{type(model).__name__}: saving converts {saved_key!r} from several tensors; mmrl's weight "
                "sync only handles renamed weights. Use checkpoint_format=False (in-memory names)."
            )
        mapping[key_of_placeholder[id(tensor)]] = saved_key
    return {key: mapping.get(key, None if splits else key) for key in keys}


def saved_pieces(model: nn.Module, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{saved name: tensor}`` that ``save_pretrained`` writes for the in-memory entry ``name`` whose
    saving splits it (Qwen3-Omni's fused experts [E, 2I, D] -> ``experts.{e}.gate_proj.weight`` and
    ``up_proj.weight`` [I, D] each), by transformers' own reverse conversion of that one entry."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, {name: tensor})


def _full(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The whole tensor, floating-point ones cast to ``dtype`` (None keeps theirs): a sharded (DTensor)
    one is cast shard by shard, then all-gathered on its mesh's device (collective), so fp32 masters
    going to a bf16 engine move (and are held whole) as bf16: half the traffic and transient memory."""
    if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype:
        tensor = tensor.to(dtype)
    if isinstance(tensor, DTensor):
        return tensor.to(collective_device(tensor)).full_tensor()
    return tensor


def _entries(
    model: nn.Module, checkpoint_format: bool
) -> Iterator[tuple[str, torch.Tensor, nn.Module | None, bool]]:
    """``(yielded name, stored tensor, its LoRA layer or None, split)`` of every entry the model is pushed
    as; ``split``: saved as several tensors (:func:`saved_pieces` of the in-memory name it comes with)."""
    key_mapping = checkpoint_key_mapping(model, splits=True) if checkpoint_format else {}
    adapters = dict(adapter_layers(model))
    for name, tensor in _unique_state_tensors(model):
        if is_adapter_tensor(name):  # folded into their layer's weight
            continue
        owner, _, leaf = name.rpartition(".base_layer.")
        layer = adapters.get(owner) if leaf == "weight" else None
        saved = key_mapping.get(name, name)
        yield (name, tensor, layer, True) if saved is None else (base_name(saved), tensor, layer, False)


@torch.no_grad()
def iter_full_state_dict(
    model: nn.Module,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    checkpoint_format: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` for every parameter and persistent buffer, one at a time.

    Floating-point entries are cast to ``dtype`` (None keeps theirs) before a sharded (DTensor) one is
    all-gathered on its mesh's device (``full_tensor``): the shards travel in the rollout's dtype. Each
    is then moved to ``device``: peak memory is one full tensor (with LoRA, one adapted weight and its
    adapter, merged in their stored dtype, then cast), never a second copy of the model. Integer
    buffers keep their dtype. LoRA layers are yielded merged, under the plain model's names (module
    docstring). Collective: every rank of the mesh must consume the iterator in step.
    """
    for name, tensor, layer, split in _entries(model, checkpoint_format):
        if layer is not None:
            lora_a, lora_b = _full(layer.lora_A[ADAPTER].weight), _full(layer.lora_B[ADAPTER].weight)
            full = _full(merged_weight(_full(tensor), lora_a, lora_b, lora_scale(layer)), dtype)
        else:
            full = _full(tensor, dtype)
        if split:  # saved in pieces (fused experts): the pieces, under their saved names
            for piece_name, piece in saved_pieces(model, name, full.detach()).items():
                yield piece_name, piece.to(device=device)
            continue
        yield name, full.detach().to(device=device)


def full_state_manifest(
    model: nn.Module, dtype: torch.dtype | None = None, checkpoint_format: bool = False
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """``(name, shape, dtype)`` of what :func:`iter_full_state_dict` yields with the same arguments, in
    its order, read from the (sharded) model's metadata: nothing is gathered. A receiver of pushed
    weights allocates its buffers from it (:mod:`mmrl.workers.weight_push`)."""
    manifest = []
    for name, tensor, _, split in _entries(model, checkpoint_format):
        entry_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
        pieces = {name: tensor}
        if split:
            pieces = saved_pieces(model, name, torch.empty(tuple(tensor.shape), device="meta"))
        manifest += [(piece_name, tuple(piece.shape), entry_dtype) for piece_name, piece in pieces.items()]
    return manifest


@torch.no_grad()
def load_into(
    model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = True
) -> None:
    """Copy ``(name, tensor)`` pairs into an unsharded model in place (cast to each target's dtype and
    device). Names may be in-memory or on-disk spellings. With ``strict``, every parameter and
    persistent buffer (tied aliases count once) must be written, or a KeyError lists the missing ones.
    """
    targets = model.state_dict(keep_vars=True)
    saved_to_own: dict[str, str] | None = None  # built at the first on-disk name (in-memory ones need none)
    written: set[int] = set()
    for name, tensor in named_tensors:
        if name not in targets and saved_to_own is None:
            saved_to_own = {saved: own for own, saved in checkpoint_key_mapping(model).items()}
        own_name = name if name in targets else saved_to_own.get(name)
        if own_name is None:
            raise KeyError(
                f"load_into: {name!r} is neither a state_dict key of {type(model).__name__} nor the saved "
                f"name of one (e.g. {next(iter(targets), None)!r}); is this the same model family?"
            )
        target = targets[own_name]
        if target.shape != tensor.shape:
            raise ValueError(
                f"load_into: {name!r} has shape {tuple(tensor.shape)} but the model's {own_name!r} has "
                f"{tuple(target.shape)}"
            )
        target.copy_(tensor)
        written.add(id(target))
    missing = [name for name, tensor in _unique_state_tensors(model) if id(tensor) not in written]
    if strict and missing:
        raise KeyError(f"load_into: {len(missing)} tensors were not given, e.g. {missing[:5]}")
