"""The checks that read the disk: the data files, model folders, reward files, templates and checkpoint a
run names exist (a model folder's config also gives its attention heads, which Ulysses must divide, and its
family, which may rule out sequence parallelism and shared prompts).
``load_config(..., check_paths=False)`` leaves them out."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING

from mmrl.config.reward import split_function_spec
from mmrl.data.config import DATA_FILE_SUFFIXES, DATA_FORMATS, split_dataset_spec, unsupported_data_file

if TYPE_CHECKING:
    from mmrl.config.schema import PPOConfig


HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")  # `owner/name`, as on the Hugging Face hub


def check_files(cfg: PPOConfig) -> list[str]:
    """One message per missing or unreadable file or folder of the run."""
    errors: list[str] = []
    data = cfg.data
    if not data.train_files:
        errors.append("data.train_files is required (e.g. data.train_files=data/train.jsonl)")
    _check_dataset(errors, "data.train_files", data.train_files)
    _check_dataset(errors, "data.val_files", data.val_files)
    if cfg.trainer.val_only and not data.val_files:
        errors.append(
            "trainer.val_only=true validates and exits, but data.val_files is not set: set "
            "data.val_files (e.g. data/val.jsonl) or trainer.val_only=false"
        )
    if data.format_prompt and not os.path.isfile(data.format_prompt):
        errors.append(f"data.format_prompt: template '{data.format_prompt}' does not exist")
    if data.override_chat_template and not os.path.isfile(data.override_chat_template):
        errors.append(f"data.override_chat_template: template '{data.override_chat_template}' does not exist")
    if data.media_dir and not os.path.isdir(data.media_dir):
        errors.append(f"data.media_dir: folder '{data.media_dir}' does not exist")
    actor_model = cfg.worker.actor.model
    actor_folder = _check_model_path(errors, "worker.actor.model.model_path", actor_model.model_path, True)
    _check_model_path(errors, "worker.actor.model.tokenizer_path", actor_model.tokenizer_path, False)
    if actor_folder is not None:
        _check_ulysses_heads(errors, cfg, "actor", actor_folder)
        _check_sequence_state(errors, cfg, "actor", "worker.actor.model.model_path", actor_folder)
    if cfg.use_critic:
        critic_key = "worker.critic.model.model_path"
        critic_path = cfg.worker.critic.model.model_path
        critic_folder = (
            _check_model_path(errors, critic_key, critic_path, False) if critic_path else actor_folder
        )
        if critic_folder is not None:
            _check_ulysses_heads(errors, cfg, "critic", critic_folder)
            folder_key = critic_key if critic_path else "worker.actor.model.model_path"
            _check_sequence_state(errors, cfg, "critic", folder_key, critic_folder)
    reward = cfg.worker.reward.reward_function
    judge, reward_model = cfg.worker.reward.judge, cfg.worker.reward.reward_model
    code = cfg.worker.reward.code
    if not reward and not judge.enable and not reward_model.model_path and not code.enable:
        errors.append(
            "worker.reward.reward_function is required (e.g. ./reward_functions/math.py:compute_score), "
            "unless worker.reward.judge.enable=true, worker.reward.reward_model.model_path is set or "
            "worker.reward.code.enable=true"
        )
    elif reward:
        path, _ = split_function_spec(reward)
        if not os.path.isfile(path):
            errors.append(f"worker.reward.reward_function: file '{path}' does not exist")
    for key, template in (
        ("worker.reward.judge.prompt_template", judge.prompt_template if judge.enable else None),
        ("worker.reward.reward_model.prompt_template", reward_model.prompt_template),
    ):
        if template and not os.path.isfile(template):
            errors.append(f"{key}: file '{template}' does not exist")
    if judge.enable and judge.serve.model_path:
        _check_model_path(errors, "worker.reward.judge.serve.model_path", judge.serve.model_path, False)
    if reward_model.model_path:
        _check_model_path(errors, "worker.reward.reward_model.model_path", reward_model.model_path, False)
    if cfg.trainer.load_checkpoint_path and not os.path.isdir(cfg.trainer.load_checkpoint_path):
        errors.append(
            f"trainer.load_checkpoint_path: folder '{cfg.trainer.load_checkpoint_path}' does not exist"
        )
    return errors


def _check_dataset(errors: list[str], key: str, value: str) -> None:
    for spec in filter(None, (s.strip() for s in value.split(","))):
        path, _ = split_dataset_spec(spec)
        if os.path.exists(path):
            problem = unsupported_data_file(path)
            if problem:
                errors.append(f"{key}: {problem}")
            continue
        if HUB_ID.match(path) and not path.endswith(DATA_FILE_SUFFIXES):
            continue  # a hub dataset id: only the loader can tell whether it is reachable
        errors.append(f"{key}: '{path}' does not exist ({DATA_FORMATS})")


def _check_model_path(errors: list[str], key: str, value: str | None, required: bool) -> str | None:
    """The folder holding ``value``'s config (a hub id is resolved through the Hugging Face cache,
    without its weights), or None after recording why there is none."""
    from mmrl.models.loading import ModelPathError, resolve_model_path

    if not value:
        if required:
            errors.append(f"{key} is required (a Hugging Face model folder or hub id)")
        return None
    try:
        return resolve_model_path(value, key, without_weights=True)
    except ModelPathError as error:
        errors.append(str(error))
        return None


def _check_ulysses_heads(errors: list[str], cfg: PPOConfig, role: str, folder: str) -> None:
    """Ulysses gives each rank ``heads / ulysses_size`` of the text decoder's attention heads: the size
    must divide the heads. Key/value heads it does not divide are repeated to one per query head
    (more memory, still exact), so they set no rule; ring attention splits tokens, not heads."""
    from mmrl.models.loading import attention_heads

    size = getattr(cfg.worker, role).ulysses_size
    if size <= 1:
        return
    try:
        heads, kv_heads = attention_heads(folder, cfg.worker.actor.model.trust_remote_code)
    except (OSError, ValueError) as error:
        errors.append(
            f"worker.{role}.ulysses_size={size} needs the model's attention heads, but its config in "
            f"{folder} cannot be read: {str(error).splitlines()[0]}"
        )
        return
    if heads % size == 0:
        return
    world = cfg.trainer.world_size
    fitting = [n for n in range(1, heads + 1) if heads % n == 0]
    usable = [n for n in fitting if world % n == 0]
    errors.append(
        f"worker.{role}.ulysses_size={size} does not divide the model's {heads} attention heads "
        f"({kv_heads} key/value heads) in {folder}: Ulysses gives each rank heads / ulysses_size of them. "
        f"Sizes that work: {', '.join(map(str, fitting))} (of those, {', '.join(map(str, usable))} also "
        f"divide the {world} processes); or split sequences with worker.{role}.ring_size instead"
    )


def _check_sequence_state(errors: list[str], cfg: PPOConfig, role: str, key: str, folder: str) -> None:
    """A model whose decoder carries a state along each sequence (the family's ``sequence_state``, e.g.
    Qwen3.5's linear attention) must run each packed sequence whole, from its first token: a sequence
    split over sequence-parallel ranks would need that state handed from rank to rank, which mmrl does
    not do. (Shared prompts, an optimisation, are simply not used for such a model:
    :func:`mmrl.workers.forward.prompts_shared`.)"""
    from mmrl.models.loading import folder_family

    if getattr(cfg.worker, role).sequence_parallel_size <= 1:
        return
    family = folder_family(folder)
    if family is None or family.sequence_state is None:
        return
    errors.append(
        f"{key}: '{folder}' is a {family.name} model, whose {family.sequence_state} carry a state along "
        f"each sequence, so worker.{role} must run every sequence whole: set worker.{role}.ulysses_size=1 "
        f"and worker.{role}.ring_size=1 (a sequence split over ranks would need its state handed from rank "
        "to rank)"
    )
