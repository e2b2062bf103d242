"""Checks of a run's inputs before Ray starts: a broken input fails in seconds, with one message.

:func:`preflight` runs the library's own loaders on what the run will read, in the order of their cost,
and raises the first :class:`~mmrl.errors.UserInputError` found (the command line prints it and exits
with code 2). It is the same code the trainer and the workers run later, so a problem that slips past
(a bad image in row 9,000 with ``filter_overlong_prompts=false``) fails there with the same message.

- packages: torch, transformers, ray, vLLM (with the vllm rollout) and flash-attn are not older than
  the releases mmrl calls (:mod:`mmrl.versions`; newer ones get a warning);
- output: ``trainer.save_checkpoint_path`` is a folder or can be made one, and is writable;
  ``trainer.load_checkpoint_path`` is a complete ``global_step_N`` checkpoint whose files hold only
  tensors and plain data;
- model: the actor's (and critic's) folder has a readable ``config.json`` of a model family mmrl
  knows, and a tokenizer (config, tokenizer and processor files only, never the weights);
- reward: the reward file imports, defines the function, and the function takes the reward inputs and
  ``reward_function_kwargs``; with ``worker.reward.code.enable`` the code sandbox runs a trivial program;
- data: every data file parses (file and line named), every row has ``data.prompt_key`` and
  ``data.answer_key``, the first :data:`SAMPLE_ROWS` rows of each file go through the format prompt,
  the chat template, media decoding and the processor exactly as in training, and enough prompts fit
  ``data.max_prompt_length``.

Not errors: audio at another sampling rate (resampled to the model's), silent audio, stereo (mixed to
mono), images of any size (scaled into ``data.min_pixels``..``data.max_pixels``). Empty audio (zero
samples) and videos without a decodable frame are errors. Imports no Ray.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from mmrl.checkpoint.safe_load import check_role_folder
from mmrl.checkpoint.state import missing_state_files
from mmrl.checkpoint.tracker import TRAINER_STATE_FILE, find_last_checkpoint
from mmrl.config import PPOConfig
from mmrl.errors import UserInputError
from mmrl.versions import check_versions, packages_of_run

SAMPLE_ROWS = 4  # rows per data file rendered and processed in full (media decoded) before the run


class PreflightError(UserInputError):
    """An input of the run (output folder, checkpoint, data) that cannot work; the message says why."""


def preflight(config: PPOConfig) -> None:
    """Raise the first user error among the run's inputs (see the module docstring); None when fine."""
    from mmrl.trainer.ray_trainer import prompts_per_round  # imports no Ray

    for warning in check_versions(packages_of_run(config.worker.rollout.name)):  # too old: VersionError
        print(f"mmrl: warning: {warning}", file=sys.stderr, flush=True)
    check_output_paths(config)
    tokenizer, processor = check_models(config)
    check_reward(config)
    data = config.data
    step = (prompts_per_round(config), "the prompts a step draws (data.rollout_batch_size)")
    check_dataset("data.train_files", data.train_files, tokenizer, processor, config, step)
    if data.val_files:
        check_dataset(
            "data.val_files", data.val_files, tokenizer, processor, config, (1, "one to validate on")
        )


# ---- output and checkpoint folders --------------------------------------------------------------


def check_output_paths(config: PPOConfig) -> None:
    trainer = config.trainer
    _check_writable_folder("trainer.save_checkpoint_path", trainer.checkpoint_dir)
    if trainer.load_checkpoint_path:
        _check_checkpoint("trainer.load_checkpoint_path", trainer.load_checkpoint_path)


def _check_writable_folder(key: str, path: str) -> None:
    """``path`` is a writable folder, or the folders up to it can be made (nothing is created here)."""
    path = os.path.abspath(path)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == path else f"would be made inside '{existing}', which is a file"
        raise PreflightError(
            f"{key}: '{path}' cannot be a checkpoint folder: it {where}; choose another path, or move the file away"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PreflightError(
            f"{key}: '{existing}' is not writable by this user, so checkpoints and logs under '{path}' "
            "cannot be written; choose a writable folder"
        )


def _check_checkpoint(key: str, path: str) -> None:
    """``path`` is a ``global_step_N`` folder that :meth:`RayPPOTrainer.resume` can load."""
    if not os.path.isfile(os.path.join(path, TRAINER_STATE_FILE)):
        latest = find_last_checkpoint(path) if os.path.isdir(path) else None
        hint = (
            f"it holds checkpoints: point at one step folder, e.g. {key}={latest}"
            if latest is not None
            else "point at a global_step_N folder that a run saved, or leave it null"
        )
        raise PreflightError(f"{key}: '{path}' is no mmrl checkpoint (no {TRAINER_STATE_FILE}); {hint}")
    missing = missing_state_files(os.path.join(path, "actor"))
    if missing:
        raise PreflightError(
            f"{key}: checkpoint '{path}' is incomplete (actor/ lacks {', '.join(missing)}; a save that was "
            "cut off?); point at an earlier global_step_N folder"
        )
    for role in ("actor", "critic"):
        if os.path.isdir(os.path.join(path, role)):
            check_role_folder(os.path.join(path, role))  # nothing that would run code on unpickling


# ---- model folders, tokenizer, reward file ------------------------------------------------------


def check_models(config: PPOConfig) -> tuple[Any, Any | None]:
    """Check the model folders; the tokenizer and processor the data checks use."""
    from mmrl.data.processing import load_tokenizer_and_processor
    from mmrl.models.loading import check_model_folder, resolve_model_path

    model = config.worker.actor.model
    folders = [("worker.actor.model.model_path", model.model_path)]
    if config.use_critic and config.worker.critic.model.model_path:
        folders.append(("worker.critic.model.model_path", config.worker.critic.model.model_path))
    for key, path in folders:
        check_model_folder(resolve_model_path(path, key, without_weights=True), key, model.trust_remote_code)
    return load_tokenizer_and_processor(
        model.tokenizer_or_model_path,
        model.trust_remote_code,
        key=model.tokenizer_key,
        chat_template_file=config.data.override_chat_template,
    )


def check_reward(config: PPOConfig) -> None:
    """Import the reward file and check the function, as each reward worker does at start."""
    from mmrl.rewards.rule import load_reward_function

    reward = config.worker.reward
    if reward.reward_function:  # optional when a judge or a reward model scores
        load_reward_function(reward.reward_function, reward.reward_function_kwargs)
    if reward.code.enable:  # the sandbox runs a trivial program here, or says why it cannot
        from mmrl.rewards.code import build_sandbox

        build_sandbox(reward.code.sandbox)


# ---- data -----------------------------------------------------------------------------------------


def check_dataset(
    key: str, files: str, tokenizer: Any, processor: Any | None, config: PPOConfig, needed: tuple[int, str]
) -> None:
    """Build the dataset as the trainer does, check its rows' keys, process the first rows of each
    file in full, and check that ``needed = (count, what for)`` prompts are left to use."""
    from mmrl.data.dataset import PromptDataset

    data = config.data
    from mmrl.agent.loop import tool_schemas

    tools = tool_schemas(config.worker.rollout.multi_turn)
    dataset = PromptDataset(files, tokenizer, processor, data, tools=tools)  # parses; measures lengths
    for rows in dataset.files:
        _check_columns(
            key, rows, (("data.prompt_key", data.prompt_key), ("data.answer_key", data.answer_key))
        )
    if not data.filter_overlong_prompts:
        _check_no_overlong(key, dataset)  # before the sample, whose first overlong row would say less
    first_positions: dict[int, list[int]] = {}
    for position, (file_index, _) in enumerate(dataset.index):
        first_positions.setdefault(file_index, []).append(position)
    for positions in first_positions.values():
        for position in positions[:SAMPLE_ROWS]:
            dataset[position]  # template, chat template, media, processor, length: DataError naming the row
    if len(dataset) < needed[0]:
        raise PreflightError(_too_few(key, dataset, needed))


def _too_few(key: str, dataset: Any, needed: tuple[int, str]) -> str:
    count = f"{key}: {len(dataset)} usable prompts, fewer than {needed[0]}, {needed[1]}"
    if dataset.num_filtered == 0:
        return f"{count}; add data, or lower data.rollout_batch_size"
    lengths = [length for length, _ in _lengths(dataset)]
    limit = dataset.config.max_prompt_length
    return (
        f"{count}: data.filter_overlong_prompts dropped {dataset.num_filtered} of {len(lengths)} as longer than "
        f"data.max_prompt_length={limit} tokens (prompts have {min(lengths)} to {max(lengths)} tokens, media "
        f"placeholders included); raise data.max_prompt_length ({max(lengths)} keeps every prompt), or add data"
    )


def _check_columns(key: str, rows: Any, required: tuple[tuple[str, str], ...]) -> None:
    """Every row of ``rows`` (a :class:`~mmrl.data.dataset.Rows`) has each required column."""
    table = rows.table
    if len(table) == 0:
        raise PreflightError(f"{key}: '{rows.source}' has no rows; give a file with at least one prompt")
    column_names = getattr(table, "column_names", None)  # a `datasets.Dataset`: its schema says it all
    for config_key, column in required:
        if column_names is not None:
            missing_at = None if column in column_names else 0
        else:
            missing_at = next((index for index, row in enumerate(table) if column not in row), None)
        if missing_at is not None:
            found = sorted(column_names if column_names is not None else table[missing_at])
            raise PreflightError(
                f"{key}: {rows.source} row {missing_at}: no column '{column}' ({config_key}); its columns are "
                f"{found}: set {config_key} to the right one, or add the column to every row"
            )


def _lengths(dataset: Any) -> list[tuple[int, str]]:
    """``(prompt length, "file row r")`` of every row of the dataset's files, filtered ones included
    (measured as the overlong filter does, so usually read back from its cache)."""
    from mmrl.data.lengths import measure_prompt_lengths

    kept = dataset.index
    dataset.index = [(f, r) for f, rows in enumerate(dataset.files) for r in range(len(rows.table))]
    try:
        config = dataset.config
        measured = measure_prompt_lengths(
            dataset, config.preprocess_num_workers, cache=config.prompt_length_cache
        )
        failed = next((row.error for row in measured if row.error is not None), None)
        if failed is not None and not config.skip_bad_samples:
            raise PreflightError(failed)  # already names the file and row
        return [(row.length, dataset.where(p)) for p, row in enumerate(measured) if row.error is None]
    finally:
        dataset.index = kept


def _check_no_overlong(key: str, dataset: Any) -> None:
    """With ``filter_overlong_prompts=false`` every prompt must fit, or training stops at the first."""
    limit = dataset.config.max_prompt_length
    lengths = _lengths(dataset)
    over = [(length, where) for length, where in lengths if length > limit]
    if over:
        longest, where = max(over)
        raise PreflightError(
            f"{key}: {len(over)} of {len(lengths)} prompts are longer than data.max_prompt_length={limit} "
            f"tokens (the longest, {longest} tokens, at {where}); raise data.max_prompt_length to {longest}, "
            "or set data.filter_overlong_prompts=true to drop them"
        )
