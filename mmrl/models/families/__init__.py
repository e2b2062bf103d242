"""Model families: everything mmrl knows about a kind of model, in one small spec per family.

A :class:`ModelFamily` says how the trained model is loaded (its Auto class; Qwen2.5-Omni: from the
thinker's sub-config), where its vision/audio towers are, which tokens only the processor may place
(never sampled), how its position ids are computed (a plain function calling the model's own
``get_rope_index`` with the arguments that family takes) and the fix it needs, which processor
outputs serve only the position ids, how its weights are named for vLLM (and what vLLM must be told
of its config to build the same layers), where the routers of a
mixture-of-experts model are, where one placeholder id serves several media kinds (GLM-4.1V), how
its tokens' media kinds follow from the ids, and whether its decoder carries a state along each
sequence (Qwen3.5's linear attention), which rules out token layouts that cut a sequence.

Families are looked up by the config's ``model_type`` (:func:`family_for`, :func:`family_of`). Every
module of this package defining ``FAMILY`` is registered on first lookup, so adding a family is one
new file here (plus a tiny test model); code elsewhere may also call :func:`register_family`.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mmrl.errors import UserInputError

# (model, input_ids [B, L], attention_mask [B, L], media, mm_token_type_ids [B, L] | None) -> position ids:
# [3, B, L] (M-RoPE) or [B, L]; ``media`` holds the joined processor outputs of the B rows.
PositionIdsFn = Callable[
    [nn.Module, torch.Tensor, torch.Tensor, dict[str, Any], "torch.Tensor | None"], torch.Tensor
]


@dataclass(frozen=True)
class ModelFamily:
    """What mmrl must know about one family of models (see the module docstring)."""

    name: str
    model_types: tuple[str, ...]  # config.model_type values: of the folder, and of the trained model
    auto_class: str  # the transformers Auto class that loads the trained model
    position_ids: PositionIdsFn  # numbers the valid tokens of a padded batch (padding gets 0 or 1)
    towers: tuple[str, ...] = ()  # attribute paths of the encoder towers on the trained model
    placeholder_tokens: tuple[str, ...] = ()  # media tokens only the processor places: never sampled
    position_keys: tuple[str, ...] = ()  # processor outputs that ``position_ids`` reads
    position_only_keys: tuple[str, ...] = ()  # of those, the ones the model's forward must not get
    trained_config: Callable[[Any], Any] | None = None  # folder config -> trained model's (Omni: thinker)
    # folder config -> the prefix under which vLLM reads the trained model's weights (None: no prefix)
    vllm_weight_prefix: Callable[[Any], str] | None = None
    # A fix of the model's own code, applied once where the model is built (returns whether it changed
    # anything); idempotent.
    fix_model: Callable[[nn.Module], bool] | None = None
    # Sequence parallelism: slices family-specific decoder keyword arguments (besides the embeddings
    # and position ids) to this rank's ``local_index`` [T_local] of the packed row, in place.
    shard_decoder_inputs: Callable[[dict[str, Any], torch.Tensor], None] | None = None
    # Mixture-of-experts: the name, below a decoder layer, of each sparse block's router (a module
    # returning ``(logits [T, E], weights [T, k], experts [T, k])`` with ``top_k`` and ``num_experts``);
    # None: a dense model. Read by :mod:`mmrl.models.moe`.
    moe_router: str | None = None
    # What vLLM must read in the folder's config to build the model transformers builds, set in place
    # on the config vLLM parses (GLM-4.1V: q/k/v biases); read by :mod:`mmrl.workers.rollout.vllm_spmd`.
    fix_vllm_config: Callable[[Any], None] | None = None
    # (name, full tensor) under a Hugging Face weight name -> the tensor in the layout vLLM's loader reads
    # under that name (Qwen3-VL MoE: fused experts transposed); None: as transformers holds it. Read by
    # :mod:`mmrl.workers.rollout.vllm_spmd` for every weight push.
    to_vllm_layout: Callable[[str, torch.Tensor], torch.Tensor] | None = None
    # (config, input_ids [B, L]) -> ``mm_token_type_ids`` [B, L] (1 image, 2 video), for a family whose
    # placeholder ids alone do not tell the media kinds apart (GLM-4.1V: a video's frames are image
    # tokens); None: each kind has its own placeholder id. Read by :mod:`mmrl.models.alignment`.
    token_types_from_ids: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    # What in the decoder carries a state along each sequence (Qwen3.5: "linear-attention (gated delta
    # net) layers"): the model must see each packed sequence whole, from its first token, so sequence
    # parallelism is refused at config load (:mod:`mmrl.config.files`) and prompts are not shared
    # (:func:`mmrl.workers.forward.prompts_shared`); None: none.
    sequence_state: str | None = None

    @property
    def multimodal(self) -> bool:
        return bool(self.towers)

    def training_config(self, config: Any) -> Any:
        """The config of the model mmrl trains, from a folder's config."""
        return config if self.trained_config is None else self.trained_config(config)

    def weight_prefix_for_vllm(self, folder_config: Any) -> str:
        """What to prepend to the trained model's weight names for a vLLM engine serving the folder."""
        return "" if self.vllm_weight_prefix is None else self.vllm_weight_prefix(folder_config)

    def position_media(self, media: dict[str, Any]) -> dict[str, Any]:
        """The processor outputs of ``media`` that position ids need."""
        return {key: value for key, value in media.items() if key in self.position_keys}

    def forward_media(self, media: dict[str, Any]) -> dict[str, Any]:
        """The processor outputs of ``media`` that the forward takes (position ids come finished)."""
        return {key: value for key, value in media.items() if key not in self.position_only_keys}

    def placeholder_token_ids(self, tokenizer: Any) -> list[int]:
        """Ids of this family's placeholder tokens that ``tokenizer`` knows."""
        vocab = tokenizer.get_vocab()
        return sorted({vocab[token] for token in self.placeholder_tokens if token in vocab})

    def router_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(name, module)`` of each MoE router of ``model``, in layer order (none for a dense model)."""
        if self.moe_router is None:
            return []
        suffix = f".{self.moe_router}"
        return [(name, module) for name, module in model.named_modules() if name.endswith(suffix)]

    def tower_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """``(attribute path, module)`` of each encoder tower ``model`` has."""
        towers = []
        for path in self.towers:
            module = model
            for attribute in path.split("."):
                module = getattr(module, attribute, None)
            if isinstance(module, nn.Module):
                towers.append((path, module))
        return towers


class UnknownModelFamilyError(UserInputError, ValueError):
    """A model whose ``model_type`` no registered family covers."""


_FAMILIES: dict[str, ModelFamily] = {}


def register_family(family: ModelFamily) -> ModelFamily:
    """Make ``family`` the one looked up for each of its model types; returns it."""
    for model_type in family.model_types:
        known = _FAMILIES.get(model_type)
        if known is not None and known != family:
            raise ValueError(
                f"model_type {model_type!r} belongs to family {known.name!r} already; "
                f"family {family.name!r} cannot claim it too"
            )
        _FAMILIES[model_type] = family
    return family


@functools.cache
def _register_package_families() -> None:
    """Import every module of this package and register its ``FAMILY`` (once per process)."""
    for module_info in pkgutil.iter_modules(__path__):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        family = getattr(module, "FAMILY", None)
        if isinstance(family, ModelFamily):
            register_family(family)


def known_model_types() -> list[str]:
    _register_package_families()
    return sorted(_FAMILIES)


def family_for(config: Any) -> ModelFamily:
    """The family of a Hugging Face config (a folder's, or a model's), by ``config.model_type``."""
    _register_package_families()
    model_type = getattr(config, "model_type", None)
    family = _FAMILIES.get(model_type)
    if family is None:
        raise UnknownModelFamilyError(
            f"mmrl has no model family for model_type {model_type!r} ({type(config).__name__}); known "
            f"model types: {', '.join(known_model_types())}. Add a family: a file in mmrl/models/families/ "
            "defining FAMILY = ModelFamily(...)"
        )
    return family


def family_of(model: nn.Module) -> ModelFamily:
    """The family of a loaded model (FSDP-wrapped or not)."""
    config = getattr(model, "config", None)
    if config is None:
        raise UnknownModelFamilyError(
            f"{type(model).__name__} has no Hugging Face `config`; mmrl cannot tell its family"
        )
    return family_for(config)


# ---------------------------------------------------------------- helpers shared by family specs


def text_position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """1-D RoPE ids [B, L] of left-padded rows: 0, 1, ... over the valid tokens, 0 on padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


MM_TOKEN_TYPES = {"image_token_id": 1, "video_token_id": 2}  # Qwen-VL v5: 0 text, 1 image, 2 video


def mm_token_types_from_ids(config: Any, input_ids: torch.Tensor) -> torch.Tensor:
    """Qwen-VL ``mm_token_type_ids`` [B, L] from the placeholder ids: 1 image, 2 video, 0 otherwise."""
    token_types = torch.zeros_like(input_ids)
    for attribute, token_type in MM_TOKEN_TYPES.items():
        token_id = getattr(config, attribute, None)
        if token_id is not None:
            token_types[input_ids == token_id] = token_type
    return token_types


def token_type_position_ids(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    media: dict[str, Any],
    mm_token_type_ids: torch.Tensor | None = None,
    **family_arguments: Any,
) -> torch.Tensor:
    """M-RoPE ids [3, B, L] from ``model.model.get_rope_index`` of the Qwen-VL families that number
    media by ``mm_token_type_ids`` (transformers v5), derived from the placeholder ids when not given;
    ``family_arguments`` are the ones only that family's ``get_rope_index`` takes."""
    owner = model.model
    if mm_token_type_ids is None:
        mm_token_type_ids = mm_token_types_from_ids(owner.config, input_ids)
    positions, _ = owner.get_rope_index(
        input_ids,
        mm_token_type_ids=mm_token_type_ids,
        image_grid_thw=media.get("image_grid_thw"),
        video_grid_thw=media.get("video_grid_thw"),
        attention_mask=attention_mask,
        **family_arguments,
    )
    return positions
