"""Merge a sharded training checkpoint into a Hugging Face model folder (safetensors).

``merge_checkpoint(".../global_step_N/actor")`` runs in one process without ``torch.distributed``:

1. builds the trained model class (``mmrl_state.json``) from the trained config (``model_config.json``)
   on the meta device, allocates it empty on CPU in the checkpoint's dtype and re-ties shared weights
   (``lm_head`` tied to the embeddings);
2. loads the DCP model shards into it in place (DCP joins the shards of any number of ranks), after
   checking that the checkpoint's keys are exactly the model's;
3. writes ``save_pretrained`` safetensors. Transformers v5 writes the checkpoint key names of the
   original format (``model.embed_tokens.*``, ``visual.*`` for Qwen2.5-VL instead of the in-memory
   ``model.language_model.*``, ``model.visual.*``), which both ``from_pretrained`` and vLLM read. Tied
   weights are stored once;
4. copies the tokenizer, processor, chat template and generation config from ``huggingface/``.

LoRA checkpoints (``mmrl_state.json`` has ``lora``) hold the adapter alone. Merging loads the base
model (``lora.base_model_path``, or ``base_model``) as the trainer did and adds ``(alpha / r) * B @ A``
to each adapted layer's weight, in fp32, before writing it as above. With ``adapter_only`` the adapter
itself is written instead, as PEFT saves one (``adapter_config.json`` + ``adapter_model.safetensors``,
keys ``base_model.model.<module>.lora_A.weight``), for ``peft.PeftModel.from_pretrained`` on the base.

The output is by default ``<local_dir>/huggingface``, the folder that already holds the copied
tokenizer and processor files, so that it becomes a complete model folder next to the shards.

Models trained as part of a larger checkpoint class are written as that class: the Qwen2.5-Omni
thinker goes back into ``Qwen2_5OmniForConditionalGeneration`` (``thinker.*`` keys, the original
config) when it is the class's only weights. Critics: mmrl's critic is the actor's class with
``lm_head`` replaced by a ``[1, hidden]`` value head with a bias, which no transformers class loads,
so merging a critic folder stops with ``MergeNotSupportedError`` naming the mismatched tensors
(resume uses the DCP checkpoint directly and needs no merge). A critic that is a plain transformers
class (e.g. ``Qwen2ForTokenClassification``) merges as that class.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mmrl.checkpoint.safe_load import read_dcp_metadata
from mmrl.checkpoint.state import (
    HF_DIR,
    MODEL_CONFIG_FILE,
    MODEL_DIR,
    copy_hf_metadata,
    load_dcp,
    read_state_info,
)
from mmrl.models.loading import MergeNotSupportedError, as_source_class, load_model
from mmrl.models.lora import ADAPTER, merged_weight, require_peft

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Written by save_pretrained itself; the other metadata files come from the checkpoint's huggingface/.
_FILES_WRITTEN_BY_SAVE = ("config.json", "generation_config.json")


# Packages a merged model's class may come from (``mmrl_state.json`` names it): importing a module runs
# it, and the file is part of a checkpoint, which may have been tampered with.
MODEL_CLASS_PACKAGES = ("transformers", "transformers_modules")


def _import_model_class(class_path: str, local_dir: Path) -> type:
    module_name, _, qualname = class_path.partition(":")
    if module_name.split(".")[0] not in MODEL_CLASS_PACKAGES:
        raise MergeNotSupportedError(
            f"{local_dir / 'mmrl_state.json'} names the model class {class_path}, outside "
            f"{' and '.join(MODEL_CLASS_PACKAGES)}: not imported (a checkpoint must not choose code to run)"
        )
    try:
        cls = getattr(importlib.import_module(module_name), qualname)
    except (ImportError, AttributeError) as error:
        raise MergeNotSupportedError(
            f"{local_dir}: the trained model class {class_path} (from mmrl_state.json) cannot be imported: "
            f"{error}"
        ) from error
    from transformers import PreTrainedModel

    if not issubclass(cls, PreTrainedModel):
        raise MergeNotSupportedError(
            f"merge of {local_dir} is not supported: its model class {class_path} is not a transformers "
            f"PreTrainedModel, so there is no Hugging Face format to write it in"
        )
    return cls


def _checkpoint_tensors(model_dir: Path) -> dict[str, TensorStorageMetadata]:
    metadata = read_dcp_metadata(model_dir).state_dict_metadata
    return {key: value for key, value in metadata.items() if isinstance(value, TensorStorageMetadata)}


def _checkpoint_dtype(tensors: dict[str, TensorStorageMetadata]) -> torch.dtype:
    """The most common floating dtype of the saved tensors (the training weights' dtype)."""
    counts: dict[torch.dtype, int] = {}
    for value in tensors.values():
        if value.properties.dtype.is_floating_point:
            counts[value.properties.dtype] = counts.get(value.properties.dtype, 0) + 1
    return max(counts, key=counts.__getitem__) if counts else torch.float32


def load_full_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP model checkpoint, unsharded, in one process (fine for small models)."""
    model_dir = Path(model_dir)
    state = {
        key: torch.empty(value.size, dtype=value.properties.dtype)
        for key, value in _checkpoint_tensors(model_dir).items()
    }
    load_dcp(state, model_dir)
    return state


def _build_empty_model(cls: type, config: Any, dtype: torch.dtype) -> nn.Module:
    """``cls(config)`` with uninitialised CPU weights in ``dtype``, shared weights tied again.

    ``to_empty`` gives every module its own new tensor, untying ``lm_head`` from the embeddings;
    ``tie_weights`` restores the sharing the config asks for. Non-persistent buffers (rotary
    frequencies) stay uninitialised: they are not saved, and ``from_pretrained`` recomputes them.
    """
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype).to_empty(device="cpu")
    model.tie_weights()
    return model.eval()


def _mismatches(model_state: dict[str, torch.Tensor], saved: dict[str, TensorStorageMetadata]) -> list[str]:
    """Human-readable differences between the class's tensors and the checkpoint's ([] when equal)."""
    problems = [f"{key} missing from the checkpoint" for key in sorted(set(model_state) - set(saved))]
    problems += [f"{key} not in the class" for key in sorted(set(saved) - set(model_state))]
    for key in sorted(set(model_state) & set(saved)):
        if tuple(model_state[key].shape) != tuple(saved[key].size):
            problems.append(
                f"{key} is {list(saved[key].size)} in the checkpoint, {list(model_state[key].shape)} in the class"
            )
    return problems


def _load_checkpoint_into(model: nn.Module, model_dir: Path, local_dir: Path) -> None:
    model_state = model.state_dict()
    problems = _mismatches(model_state, _checkpoint_tensors(model_dir))
    if problems:
        shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
        raise MergeNotSupportedError(
            f"merge of {local_dir} is not supported: its tensors do not match {type(model).__name__} ({shown}). "
            f"A critic's value head (lm_head of shape [1, hidden] with a bias) has no Hugging Face class to "
            f"be written as: merge the actor, and resume the critic from the checkpoint itself"
        )
    load_dcp(model_state, model_dir)  # in place: tied entries share one tensor and load the same values


def _resolve_dtype(dtype: str) -> torch.dtype | None:
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def _base_folder(local_dir: Path, adapter: dict[str, Any], base_model: str | Path | None) -> Path:
    folder = Path(base_model) if base_model is not None else Path(adapter["base_model_path"])
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"{local_dir} holds a LoRA adapter on base model {folder}, which is not a model folder (no "
            f"config.json): pass the base model's folder as --base_model"
        )
    return folder


def _merged_lora_model(local_dir: Path, adapter: dict[str, Any], base_model: str | Path | None) -> nn.Module:
    """The base model with the checkpoint's adapter merged into its weights: ``W + (alpha / r) B @ A``."""
    tensors = load_full_state_dict(local_dir / MODEL_DIR)  # {"<module>.lora_A.default.weight": [r, in], ...}
    dtype = _checkpoint_dtype(_checkpoint_tensors(local_dir / MODEL_DIR))
    model = load_model(str(_base_folder(local_dir, adapter, base_model)), role="actor", torch_dtype=dtype)
    scale = adapter["alpha"] / adapter["rank"]
    with torch.no_grad():
        for name in adapter["modules"]:
            layer = model.get_submodule(name)
            lora_a = tensors[f"{name}.lora_A.{ADAPTER}.weight"]
            lora_b = tensors[f"{name}.lora_B.{ADAPTER}.weight"]
            layer.weight.copy_(merged_weight(layer.weight, lora_a, lora_b, scale))
    return model.eval()


def export_adapter(local_dir: str | Path, target_dir: str | Path | None = None) -> Path:
    """Writes the LoRA adapter of role folder ``local_dir`` in PEFT's format into ``target_dir``
    (default ``local_dir/adapter``); returns ``target_dir``."""
    from safetensors.torch import save_file

    peft = require_peft()
    local_dir = Path(local_dir)
    adapter = read_state_info(local_dir).get("lora")
    if adapter is None:
        raise MergeNotSupportedError(f"{local_dir} holds a full model, not a LoRA adapter: merge it instead")
    target_dir = Path(target_dir) if target_dir is not None else local_dir / "adapter"
    config = peft.LoraConfig(
        r=adapter["rank"],
        lora_alpha=adapter["alpha"],
        target_modules=adapter["modules"],
        base_model_name_or_path=adapter["base_model_path"],
    )
    config.save_pretrained(str(target_dir))
    tensors = load_full_state_dict(local_dir / MODEL_DIR)
    # PEFT's saved names: the PeftModel's prefix, no adapter name
    saved = {
        f"base_model.model.{key.replace(f'.{ADAPTER}.', '.')}": t.contiguous() for key, t in tensors.items()
    }
    save_file(saved, str(target_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    return target_dir


def merge_checkpoint(
    local_dir: str | Path,
    target_dir: str | Path | None = None,
    dtype: str = "auto",
    base_model: str | Path | None = None,
) -> Path:
    """Writes the model of role folder ``local_dir`` (``global_step_N/actor`` or ``critic``) as a Hugging
    Face folder into ``target_dir`` (default ``local_dir/huggingface``); returns ``target_dir``.

    ``dtype``: ``auto`` keeps the checkpoint's dtype (fp32 master weights), else float32 / bfloat16 /
    float16. A LoRA checkpoint is merged into its base model (``base_model``: default the folder the
    run trained from).
    """
    from transformers import GenerationConfig

    local_dir = Path(local_dir)
    info = read_state_info(local_dir)
    hf_dir = local_dir / HF_DIR
    target_dir = Path(target_dir) if target_dir is not None else hf_dir
    if "lora" in info:
        model = _merged_lora_model(local_dir, info["lora"], base_model)
    else:
        model = _full_model(local_dir, info)
    target_dtype = _resolve_dtype(dtype)
    if target_dtype is not None:
        model = model.to(target_dtype)
    output = as_source_class(model, hf_dir)
    if output.can_generate() and (hf_dir / "generation_config.json").is_file():
        output.generation_config = GenerationConfig.from_pretrained(hf_dir)

    target_dir.mkdir(parents=True, exist_ok=True)
    if hf_dir.is_dir() and hf_dir.resolve() != target_dir.resolve():
        copied = copy_hf_metadata(hf_dir, target_dir)
        for name in set(copied) & set(_FILES_WRITTEN_BY_SAVE):
            (target_dir / name).unlink()
    output.save_pretrained(target_dir)
    return target_dir


def _full_model(local_dir: Path, info: dict[str, Any]) -> nn.Module:
    """The trained model class filled with the checkpoint's full weights."""
    cls = _import_model_class(info["model_class"], local_dir)
    if not (local_dir / MODEL_CONFIG_FILE).is_file():
        raise MergeNotSupportedError(
            f"{local_dir / MODEL_CONFIG_FILE} is missing: the model saved in {local_dir} had no Hugging Face "
            f"config, so there is nothing to build the merged model from"
        )
    config = cls.config_class.from_json_file(str(local_dir / MODEL_CONFIG_FILE))
    model_dir = local_dir / MODEL_DIR
    model = _build_empty_model(cls, config, _checkpoint_dtype(_checkpoint_tensors(model_dir)))
    _load_checkpoint_into(model, model_dir, local_dir)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Merge an mmrl checkpoint (global_step_N/actor or critic) into Hugging Face safetensors."
    )
    parser.add_argument(
        "--local_dir", required=True, help="role folder, e.g. checkpoints/x/global_step_10/actor"
    )
    parser.add_argument("--target_dir", default=None, help="output folder (default: <local_dir>/huggingface)")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", *DTYPES], help="auto keeps the saved dtype"
    )
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="LoRA checkpoints: write the PEFT adapter (adapter_config.json + adapter_model.safetensors, "
        "default <local_dir>/adapter) instead of merged weights",
    )
    parser.add_argument(
        "--base_model", default=None, help="LoRA checkpoints: the base model folder (default: the run's)"
    )
    args = parser.parse_args(argv)
    if args.adapter:
        target_dir = export_adapter(args.local_dir, args.target_dir)
    else:
        target_dir = merge_checkpoint(args.local_dir, args.target_dir, args.dtype, args.base_model)
    files = sorted(path.name for path in target_dir.iterdir() if path.is_file())
    print(
        json.dumps({"merged": str(args.local_dir), "target_dir": str(target_dir), "files": files}, indent=2)
    )


if __name__ == "__main__":
    main()
