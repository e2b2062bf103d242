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
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mmrl.checkpoint.state import (
    HF_DIR,
    MODEL_CONFIG_FILE,
    MODEL_DIR,
    copy_hf_metadata,
    load_dcp,
    read_state_info,
)
from mmrl.models.loading import MergeNotSupportedError, as_source_class

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Written by save_pretrained itself; the other metadata files come from the checkpoint's huggingface/.
_FILES_WRITTEN_BY_SAVE = ("config.json", "generation_config.json")


def _import_model_class(class_path: str, local_dir: Path) -> type:
    module_name, _, qualname = class_path.partition(":")
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
    metadata = FileSystemReader(str(model_dir)).read_metadata().state_dict_metadata
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


def merge_checkpoint(
    local_dir: str | Path, target_dir: str | Path | None = None, dtype: str = "auto"
) -> Path:
    """Writes the model of role folder ``local_dir`` (``global_step_N/actor`` or ``critic``) as a Hugging
    Face folder into ``target_dir`` (default ``local_dir/huggingface``); returns ``target_dir``.

    ``dtype``: ``auto`` keeps the checkpoint's dtype (fp32 master weights), else float32 / bfloat16 /
    float16.
    """
    from transformers import GenerationConfig

    local_dir = Path(local_dir)
    info = read_state_info(local_dir)
    hf_dir = local_dir / HF_DIR
    target_dir = Path(target_dir) if target_dir is not None else hf_dir
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
    args = parser.parse_args(argv)
    target_dir = merge_checkpoint(args.local_dir, args.target_dir, args.dtype)
    files = sorted(path.name for path in target_dir.iterdir() if path.is_file())
    print(
        json.dumps({"merged": str(args.local_dir), "target_dir": str(target_dir), "files": files}, indent=2)
    )


if __name__ == "__main__":
    main()
