"""LoRA adapters on a policy, injected in place with PEFT, and their merged weights.

The adapter goes into the model itself (``peft.inject_adapter_in_model``), not around it
(``get_peft_model``): the model keeps its class, its ``model.*`` names, its decoder layers and its
family, so the FSDP2 sharding by decoder layer, the family spec, the forward helpers and the
checkpoint code see the model they always see. An adapted ``nn.Linear`` at ``P`` becomes PEFT's
``lora.Linear``: ``P.base_layer.weight`` (frozen) plus ``P.lora_A.default.weight`` [r, in] and
``P.lora_B.default.weight`` [out, r] (the only trainable tensors), computing
``x W^T + (alpha / r) * (x A^T) B^T``. PEFT starts ``B`` at zero, so the adapted model starts as the
base model.

peft is imported only where an adapter is built (:func:`require_peft`); reading adapters
(:func:`adapter_layers`, :func:`merged_weight`) needs only the module attributes.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from torch import nn

ADAPTER = "default"  # PEFT's adapter name; mmrl trains one adapter
TARGET_KEY = "worker.actor.model.lora.target_modules"
PEFT_HINT = 'LoRA (worker.actor.model.lora.rank > 0) needs peft: pip install "mmrl[lora]" (or "peft>=0.17")'


def require_peft():
    """The ``peft`` module, or an ImportError that says how to install it."""
    try:
        import peft
    except ImportError as error:
        raise ImportError(PEFT_HINT) from error
    return peft


def _output_head_names(model: nn.Module) -> set[str]:
    """The output head and everything under it: never adapted (mmrl's TokenScoringHead computes the
    log-probs from its plain weight; an adapter there would be bypassed and untrained)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return set()
    prefix = next(name for name, module in model.named_modules() if module is head)
    return {name for name, _ in model.named_modules() if name == prefix or name.startswith(prefix + ".")}


def lora_target_names(model: nn.Module, target_modules: str, exclude_modules: str | None) -> list[str]:
    """Full names of the ``nn.Linear`` modules that get an adapter.

    ``target_modules``: ``all-linear`` (every linear layer but the output head, vision tower
    included) or comma-separated names, each matching a module's full name or its last components
    (``q_proj`` matches ``model.language_model.layers.0.self_attn.q_proj``, as in PEFT); a name that
    matches no linear layer is an error listing the model's linear layer names. ``exclude_modules``: a
    regex; modules whose full name it matches entirely (``re.fullmatch``, as PEFT) keep no adapter.
    """
    head = _output_head_names(model)
    linears = [
        name for name, module in model.named_modules() if isinstance(module, nn.Linear) and name not in head
    ]
    if target_modules.strip().lower() == "all-linear":
        chosen = linears
    else:
        wanted = [item.strip() for item in target_modules.split(",") if item.strip()]
        matches = {want: [n for n in linears if n == want or n.endswith("." + want)] for want in wanted}
        unmatched = [want for want, found in matches.items() if not found]
        if unmatched or not wanted:
            short = sorted({name.rsplit(".", 1)[-1] for name in linears})
            raise ValueError(
                f"{TARGET_KEY}: {unmatched or target_modules!r} match no linear layer of {type(model).__name__} "
                f"(its output head is never adapted); its linear layers are named {short[:20]}; use "
                f"all-linear or some of these names"
            )
        chosen = [name for name in linears if any(name in found for found in matches.values())]
    if exclude_modules:
        pattern = re.compile(exclude_modules)
        chosen = [name for name in chosen if not pattern.fullmatch(name)]
    if not chosen:
        raise ValueError(
            f"worker.actor.model.lora.exclude_modules={exclude_modules!r} excludes every module that "
            f"{TARGET_KEY}={target_modules!r} selects: no adapter would be trained"
        )
    return chosen


def apply_lora(
    model: nn.Module, rank: int, alpha: float, target_modules: str, exclude_modules: str | None
) -> list[str]:
    """Inject a LoRA adapter (``rank``, scale ``alpha / rank``) into the selected linear layers of
    ``model`` in place (:func:`lora_target_names`) and freeze everything else; returns the adapted
    module names. Call before FSDP sharding: the adapter tensors are then sharded with their layer."""
    peft = require_peft()
    names = lora_target_names(model, target_modules, exclude_modules)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=names)
    peft.inject_adapter_in_model(config, model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(".lora_A." in name or ".lora_B." in name)
    return names


def adapter_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, layer)`` of every LoRA layer of ``model`` (PEFT's ``lora.Linear``: a ``base_layer``
    plus ``lora_A``/``lora_B`` module dicts)."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
    ]


def has_adapters(model: nn.Module) -> bool:
    return bool(adapter_layers(model))


def lora_scale(layer: nn.Module) -> float:
    """``alpha / rank`` of ``layer``'s adapter."""
    return float(layer.scaling[ADAPTER])


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block every LoRA layer computes its base layer alone: the model is the base model.

    The same switch as PEFT's ``PeftModel.disable_adapter`` (``_disable_adapters``), without the
    ``requires_grad`` toggling that PEFT's ``enable_adapters`` adds: FSDP2 creates each unsharded
    parameter once with the ``requires_grad`` of its shard, so a first forward run with adapters
    frozen would leave them without gradients for the rest of the run. Passes inside the block run
    under ``no_grad`` anyway (the reference policy).
    """
    layers = [layer for _, layer in adapter_layers(model)]
    before = [layer._disable_adapters for layer in layers]
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer, disabled in zip(layers, before):
            layer._disable_adapters = disabled


def merged_weight(
    base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
) -> torch.Tensor:
    """``W + scale * B @ A`` (``W`` [out, in], ``A`` [r, in], ``B`` [out, r]) computed in fp32, in
    ``W``'s dtype: the weight that computes what the adapted layer computes."""
    delta = lora_b.float() @ lora_a.float()  # [out, in]
    return (base.float() + scale * delta).to(base.dtype)


def base_name(name: str) -> str:
    """The plain model's name of an adapted layer's tensor: ``P.base_layer.weight`` -> ``P.weight``."""
    return name.replace(".base_layer.", ".")


def is_adapter_tensor(name: str) -> bool:
    """Whether state-dict key ``name`` belongs to an adapter (``P.lora_A.default.weight``, ...)."""
    return ".lora_A." in name or ".lora_B." in name
