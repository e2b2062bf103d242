"""Loading Hugging Face models for training, and finding their parts (towers, decoder layers).

Which class loads a folder, from which (sub-)config, and where its towers are is the model family's
knowledge (:mod:`mmrl.models.families`, looked up by the folder's ``model_type``); e.g. a Qwen2.5-Omni
folder loads only its thinker. Packed and sequence-parallel passes need the loaded model prepared
where it is built (:func:`mmrl.models.prepare.prepare_for_training`).

A critic is the same model whose ``lm_head`` is replaced by a value head ``nn.Linear(hidden, 1)``, so
``model(...).logits`` is ``[B, L, 1]``: one value per position.

A ``model_path`` (or tokenizer path) may be a hub id: :func:`resolve_model_path` turns it into its
folder in the Hugging Face cache once per process, and every load, checkpoint and merge reads that
folder.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from mmrl.errors import UserInputError
from mmrl.models.families import ModelFamily, family_for, family_of

ROLES = ("actor", "critic")
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")  # `owner/name`, as on the Hugging Face hub
# everything but the weights: config, tokenizer and processor files, chat template, remote code
METADATA_FILES = ("*.json", "*.py", "*.jinja", "*.txt", "*.model", "*.tiktoken")


class ModelPathError(UserInputError, ValueError):
    """A model or tokenizer path that is neither a folder nor a hub id that can be resolved."""


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` forbids downloads (the values huggingface_hub takes as true)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def resolve_model_path(path: str, key: str, *, without_weights: bool = False) -> str:
    """The local folder holding ``path``'s files: ``path`` itself when it is a folder; for a hub id
    (``owner/name``) its snapshot folder in the Hugging Face cache (``HF_HUB_CACHE``, else under
    ``HF_HOME``), downloaded there unless ``HF_HUB_OFFLINE`` is set. Resolved once per process.

    ``without_weights`` fetches only the config, tokenizer and processor files and remote code (what
    the config loader and the tokenizer loads read); a later full resolution fills the same snapshot
    folder. ``key`` names the config key in the :class:`ModelPathError` raised otherwise.
    """
    if os.path.isdir(path):
        return os.path.abspath(path)
    if os.path.exists(path) or not HUB_ID.match(path):
        what = "is a file" if os.path.exists(path) else "does not exist"
        raise ModelPathError(
            f"{key}: '{path}' {what}; give a Hugging Face model folder (config.json, weights, tokenizer "
            "files) or a hub id such as Qwen/Qwen2.5-VL-7B-Instruct"
        )
    from huggingface_hub import constants

    try:
        return _hub_snapshot(
            path, constants.HF_HUB_CACHE, hub_offline(), METADATA_FILES if without_weights else None
        )
    except (OSError, ValueError) as error:  # huggingface_hub's errors derive from these
        fix = (
            f"HF_HUB_OFFLINE is set: download it first (`hf download {path}`) or unset HF_HUB_OFFLINE"
            if hub_offline()
            else "check the id (and HF_TOKEN for a gated model) and the network"
        )
        raise ModelPathError(
            f"{key}: '{path}' is neither a local folder nor a model id found in the Hugging Face cache "
            f"{constants.HF_HUB_CACHE} ({type(error).__name__}: {str(error).splitlines()[0]}); {fix}, or "
            "give the model's folder"
        ) from None


@functools.cache
def _hub_snapshot(repo_id: str, cache_dir: str, offline: bool, patterns: tuple[str, ...] | None) -> str:
    from huggingface_hub import snapshot_download

    allow = list(patterns) if patterns is not None else None
    return snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=offline, allow_patterns=allow)


def check_model_folder(folder: str, key: str, trust_remote_code: bool = False) -> Any:
    """The Hugging Face config of model ``folder`` (named by config ``key``), read without any weights;
    :class:`ModelPathError` saying what is wrong when it has no readable ``config.json`` or its
    ``model_type`` is one mmrl has no family for."""
    import transformers

    from mmrl.models.families import UnknownModelFamilyError

    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise ModelPathError(
            f"{key}: '{folder}' has no config.json, so it is no Hugging Face model folder; give the folder "
            "that save_pretrained wrote (config.json, weights, tokenizer files), or a checkpoint merged with "
            "python -m mmrl.checkpoint.merger"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as err:  # bad JSON, an unknown model_type, remote code refused
        raise ModelPathError(
            f"{key}: cannot read '{os.path.join(folder, 'config.json')}' ({type(err).__name__}: "
            f"{str(err).splitlines()[0]}); check its model_type (and worker.actor.model.trust_remote_code "
            "for models with their own code)"
        ) from None
    try:
        family_for(config)
    except UnknownModelFamilyError as err:
        raise ModelPathError(f"{key}: '{folder}': {err}") from None
    return config


def folder_family(folder: str) -> ModelFamily | None:
    """The family of model ``folder`` by its ``config.json``'s ``model_type``, read as plain JSON (the
    config checks run before anything imports transformers); None when the file is missing, unreadable
    or of no known family (:func:`check_model_folder` says which, in the preflight)."""
    try:
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as file:
            model_type = json.load(file).get("model_type")
        return family_for(SimpleNamespace(model_type=model_type))
    except (OSError, ValueError, AttributeError):  # missing, bad JSON, no object, unknown family
        return None


def attention_heads(folder: str, trust_remote_code: bool = False) -> tuple[int, int]:
    """``(attention heads, key/value heads)`` of the text decoder mmrl trains from ``folder`` (the heads
    sequence parallelism splits; the towers are not head-split: the vision towers split their frames
    over the SP ranks instead, mmrl.parallel.encoders)."""
    import transformers

    folder_config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    text_config = family_for(folder_config).training_config(folder_config).get_text_config()
    heads = text_config.num_attention_heads
    return heads, getattr(text_config, "num_key_value_heads", None) or heads


class MergeNotSupportedError(ValueError):
    """The checkpoint's model cannot be expressed as a Hugging Face class (e.g. a custom value head)."""


# The value head starts from the same weights on every rank and in every run.
_VALUE_HEAD_SEED = 0


def load_model(
    path: str,
    role: str = "actor",
    torch_dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    override_config: dict[str, Any] | None = None,
    attn_implementation: str = "sdpa",
    empty: bool = False,
) -> nn.Module:
    """The trainable model in ``path`` on the CPU, as ``role`` ("actor" or "critic").

    ``override_config`` entries are set on the Hugging Face config before the weights load; a nested
    dict updates a sub-config (``{"text_config": {"rms_norm_eps": 1e-5}}``). The critic's value head
    is initialised the same way on every rank (fixed seed), since FSDP shards whatever each rank holds.
    ``empty``: the same model on the meta device, no weight read or allocated (the ranks that receive
    their shards from rank 0's copy, :func:`mmrl.workers.fsdp_engine.broadcast_from_rank0`).
    """
    import transformers

    if role not in ROLES:
        raise ValueError(f"load_model: role must be one of {ROLES}, got {role!r}")
    folder_config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    family = family_for(folder_config)
    config = family.training_config(folder_config)  # e.g. Qwen2.5-Omni: the thinker; no talker is trained
    apply_config_overrides(config, override_config or {}, where="override_config")
    auto_class = getattr(transformers, family.auto_class)
    common = {"attn_implementation": attn_implementation, "trust_remote_code": trust_remote_code}
    if empty:
        with torch.device("meta"):
            model = auto_class.from_config(config, dtype=torch_dtype, **common)
    else:
        model = auto_class.from_pretrained(path, config=config, dtype=torch_dtype, **common)
    if family.fix_model is not None:  # the family's fix (e.g. Qwen2.5-VL text positions after a video)
        family.fix_model(model)
    if role == "critic":
        attach_value_head(model)
    return model


def apply_config_overrides(config, overrides: dict[str, Any], where: str) -> None:
    """Set ``overrides`` on ``config``; dict values recurse into sub-configs. Unknown keys raise."""
    from transformers import PretrainedConfig

    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(value, dict) and isinstance(current, PretrainedConfig):
            apply_config_overrides(current, value, where=f"{where}.{key}")
        elif hasattr(config, key):
            setattr(config, key, value)
        else:
            raise KeyError(
                f"{where}: {type(config).__name__} has no attribute {key!r}; check the spelling, or nest "
                f"it under the sub-config that owns it (e.g. text_config)"
            )


def attach_value_head(model: nn.Module) -> nn.Linear:
    """Replace ``model.lm_head`` by ``nn.Linear(hidden, 1)``: weights ~ N(0, 0.02^2/hidden), bias 0.

    The small init keeps first values near 0, so early GAE advantages are close to the returns.
    Word-embedding tying is switched off in the config, or a later ``tie_weights()`` would put the
    embedding matrix back in place of the head.
    """
    hidden_size = model.config.get_text_config().hidden_size
    reference = model.get_input_embeddings().weight
    head = nn.Linear(hidden_size, 1, bias=True, dtype=reference.dtype, device=reference.device)
    if not reference.is_meta:  # a model on the meta device gets its values from a rank that has them
        generator = torch.Generator().manual_seed(_VALUE_HEAD_SEED)
        with torch.no_grad():
            scale = 0.02 / hidden_size**0.5
            head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * scale)
            head.bias.zero_()
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False
    model.lm_head = head
    return head


def tower_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every vision/audio encoder tower, e.g. ``model.visual``."""
    return family_of(model).tower_modules(model)


def vision_modules(model: nn.Module) -> list[nn.Module]:
    """The encoder towers (vision, and audio for Omni); empty for a text model."""
    return [tower for _, tower in tower_modules(model)]


def is_multimodal(model: nn.Module) -> bool:
    """True when the model has a vision or audio tower."""
    return bool(vision_modules(model))


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The language model's transformer blocks (``get_decoder().layers``)."""
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__}: its decoder {type(decoder).__name__} has no `layers` ModuleList; "
            "its model family (mmrl.models.families) needs a decoder mmrl can find"
        )
    return layers


def freeze_vision_tower(model: nn.Module) -> int:
    """Set ``requires_grad=False`` on every vision/audio tower parameter (projector included).

    Returns the number of parameters frozen; raises for a model without towers, where the setting
    must be a configuration mistake.
    """
    towers = vision_modules(model)
    if not towers:
        raise ValueError(
            f"freeze_vision_tower: {type(model).__name__} has no vision or audio tower; "
            "set worker.actor.model.freeze_vision_tower=false for text models"
        )
    frozen = 0
    for tower in towers:
        for parameter in tower.parameters():
            parameter.requires_grad_(False)
            frozen += parameter.numel()
    return frozen


def as_source_class(model: nn.Module, source_dir: str | Path) -> nn.Module:
    """``model`` itself, or the class of ``source_dir/config.json`` around it when that class consists of
    exactly one submodule of ``model``'s class: the Qwen2.5-Omni thinker goes back into its full model
    (``thinker.*`` keys, the original config), the layout vLLM and ``from_pretrained`` users expect.
    Used when saving a trained model next to (or from) the folder it was loaded from."""
    from transformers import AutoConfig

    hf_dir = Path(source_dir)
    if not (hf_dir / "config.json").is_file():
        return model
    source_config = AutoConfig.from_pretrained(hf_dir)
    if type(source_config) is type(model.config) or not source_config.architectures:
        return model
    import transformers

    wrapper_cls = getattr(transformers, source_config.architectures[0], None)
    if wrapper_cls is None:
        return model
    with torch.device("meta"):
        wrapper = wrapper_cls(source_config)
    for name, child in wrapper.named_children():
        if type(child) is type(model):
            other = [key for key in wrapper.state_dict() if not key.startswith(f"{name}.")]
            if other:
                raise MergeNotSupportedError(
                    f"{hf_dir}/config.json describes {wrapper_cls.__name__}, which holds weights beyond the "
                    f"trained {type(model).__name__} ({other[:5]}...) that the checkpoint does not have; set "
                    f"the config so that the trained part is the only one (Qwen2.5-Omni: "
                    f"enable_audio_output=false) and merge again"
                )
            setattr(wrapper, name, model)
            return wrapper.eval()
    return model
