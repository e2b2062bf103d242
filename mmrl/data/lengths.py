"""Prompt lengths for the overlong-prompt filter at start-up: computed in parallel, cached on disk.

Knowing which prompts exceed ``data.max_prompt_length`` means rendering and encoding every prompt, its
media included (an image's placeholder count depends on its size). Done serially on the driver that
is hours for a 100k-row image dataset, so the rows are split over ``data.preprocess_num_workers``
processes, and the lengths are kept in the cache folder (:func:`cache_dir`, with ``data.prompt_length_cache``) under a key made of
everything a length depends on: the data files (path, size, modification time), the data settings
that shape a prompt, the tools' schemas the prompt shows (multi-turn), and the tokenizer and processor. A second run over the same files (a resume, a
new experiment on the same data) reads the lengths back in a second. A different
``max_prompt_length`` reuses the cache: lengths are stored, not the verdicts.

The worker processes are *spawned* (a fresh interpreter each): by the time the datasets load the
driver has started Ray, whose threads a ``fork`` would copy mid-flight.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from typing import TYPE_CHECKING, Any

from mmrl.data.media import MEDIA_SETTINGS

if TYPE_CHECKING:
    from mmrl.data.dataset import PromptDataset

logger = logging.getLogger(__name__)

# below this many rows per process, starting a process (importing torch and transformers, seconds)
# costs more than it saves
MIN_ROWS_PER_PROCESS = 256
MAX_AUTO_PROCESSES = 32
PROBE_S = 2.0  # auto: seconds of rows measured in this process before deciding to start processes
PROCESS_START_S = 10.0  # a spawned process importing torch and transformers, here and on most nodes
# the DataConfig fields a prompt's tokens depend on (paths of the files are part of the key anyway)
LENGTH_SETTINGS = (
    "prompt_key",
    "image_key",
    "video_key",
    "audio_key",
    "media_dir",
    "system_prompt",
    *MEDIA_SETTINGS,
    "max_audio_seconds",
    "use_audio_in_video",
)


@dataclass(frozen=True)
class Measured:
    """One row's prompt length in tokens, or why the row cannot be used (a ``DataError`` message)."""

    length: int | None
    error: str | None = None


def process_count(requested: int | None, num_rows: int) -> int:
    """Processes to use (1 means in this process): ``requested``, at most one per row; null = the
    machine's CPUs (at most 32), but no more than one per ``MIN_ROWS_PER_PROCESS`` rows."""
    if requested is not None:
        return max(1, min(requested, num_rows))
    return max(1, min(os.cpu_count() or 1, MAX_AUTO_PROCESSES, num_rows // MIN_ROWS_PER_PROCESS))


def spawn_pays_off(rows: int, seconds_per_row: float, processes: int) -> bool:
    """Whether ``processes`` spawned processes measure ``rows`` clearly sooner than this one would."""
    serial_s = rows * seconds_per_row
    return PROCESS_START_S + serial_s / processes < 0.8 * serial_s


def _file_identity(source: str) -> dict[str, Any]:
    from mmrl.data.config import split_dataset_spec

    path, split = split_dataset_spec(source)
    if os.path.isfile(path):
        stat = os.stat(path)
        return {
            "path": os.path.abspath(path),
            "split": split,
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
        }
    if os.path.isdir(path):  # a dataset folder: every file in it
        files = sorted(
            (os.path.relpath(os.path.join(root, name), path), os.stat(os.path.join(root, name)))
            for root, _, names in os.walk(path)
            for name in names
        )
        entries = [(name, stat.st_size, stat.st_mtime_ns) for name, stat in files]
        return {"path": os.path.abspath(path), "split": split, "files": entries}
    return {"hub": source}  # a hub dataset: its name and split (its revision is not pinned here)


def _text_digest(path: str | None) -> str | None:
    if not path:
        return None
    with open(path, "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def _tokenizer_digest(tokenizer: Any, processor: Any | None) -> str:
    """What the token counts depend on: the vocabulary and merges, the chat template, the processor's
    settings (patch and merge sizes, pixel ranges)."""
    digest = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update(
        backend.to_str().encode()
        if backend is not None
        else repr(sorted(tokenizer.get_vocab().items())).encode()
    )
    chat = processor if processor is not None else tokenizer
    digest.update(str(getattr(chat, "chat_template", None)).encode())
    for part in ("image_processor", "video_processor", "feature_extractor"):
        sub = getattr(processor, part, None)
        if sub is not None:
            digest.update(sub.to_json_string().encode())
    return digest.hexdigest()


def cache_key(dataset: PromptDataset) -> str:
    config = dataset.config
    described = {
        "files": [_file_identity(rows.source) for rows in dataset.files],
        "settings": {name: getattr(config, name) for name in LENGTH_SETTINGS},
        "format_prompt": _text_digest(config.format_prompt),
        "tools": dataset.tools,  # multi-turn tools' schemas, rendered into every prompt by the chat template
        "tokenizer": _tokenizer_digest(dataset.tokenizer, dataset.processor),
        "version": 2,  # 2: images and frames sized on the patch grid as qwen-vl-utils sizes them
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _read_cache(path: str, num_rows: int) -> list[Measured] | None:
    try:
        with open(path, encoding="utf-8") as handle:
            stored = json.load(handle)
    except (OSError, ValueError):
        return None
    if len(stored.get("lengths", [])) != num_rows:
        return None
    errors = stored.get("errors", {})
    return [Measured(length, errors.get(str(row))) for row, length in enumerate(stored["lengths"])]


def _write_cache(path: str, measured: list[Measured]) -> None:
    """Atomically: a run killed while writing leaves the previous cache file or none, never half of one."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    stored = {
        "lengths": [m.length for m in measured],
        "errors": {str(row): m.error for row, m in enumerate(measured) if m.error is not None},
    }
    handle, tmp_path = tempfile.mkstemp(dir=folder, prefix=".lengths-", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(stored, out)
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
        raise


# ---- measuring ---------------------------------------------------------------------------------

_WORKER_DATASET: PromptDataset | None = None


def _start_worker(dataset: PromptDataset) -> None:
    global _WORKER_DATASET
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    torch.set_num_threads(1)  # the processes share the machine's cores
    _WORKER_DATASET = dataset


def _measure_rows(positions: list[int]) -> list[Measured]:
    return _measure(_WORKER_DATASET, positions)


def _measure(dataset: PromptDataset, positions: list[int]) -> list[Measured]:
    from mmrl.data.dataset import DataError

    measured = []
    for position in positions:
        try:
            measured.append(Measured(dataset.prompt_length(position)))
        except DataError as err:
            measured.append(Measured(None, str(err)))
    return measured


def cache_dir() -> str:
    """Where lengths are kept: ``$MMRL_CACHE_DIR/prompt_lengths``, by default in ``$XDG_CACHE_HOME/mmrl``
    (``~/.cache/mmrl`` when that is unset)."""
    root = os.environ.get("MMRL_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "mmrl")
    return os.path.join(root, "prompt_lengths")


def measure_prompt_lengths(
    dataset: PromptDataset, num_processes: int | None, *, cache: bool
) -> list[Measured]:
    """The prompt length (or error) of every row of ``dataset``, in row order; see the module docstring."""
    num_rows = len(dataset)
    cache_path = None
    if cache:
        cache_path = os.path.join(cache_dir(), f"{cache_key(dataset)}.json")
        cached = _read_cache(cache_path, num_rows)
        if cached is not None:
            logger.info("prompt lengths of %d rows read from %s", num_rows, cache_path)
            return cached
    processes = process_count(num_processes, num_rows)
    measured: list[Measured] = []
    if num_processes is None and processes > 1:
        # auto: rows counted from image headers take ~0.2 ms, encoded ones (video, audio) tens of ms;
        # measure here for a moment and start processes only when the rest is worth their start-up
        started = time.perf_counter()
        while len(measured) < num_rows and time.perf_counter() - started < PROBE_S:
            measured += _measure(dataset, [len(measured)])
        seconds_per_row = (time.perf_counter() - started) / len(measured)
        if not spawn_pays_off(num_rows - len(measured), seconds_per_row, processes):
            processes = 1
    rest = list(range(len(measured), num_rows))
    if processes == 1 or not rest:
        measured += _measure(dataset, rest)
    else:
        logger.warning(
            "measuring %d prompts for data.filter_overlong_prompts in %d processes", len(rest), processes
        )
        # a few chunks per process keeps them all busy when some rows are slower (videos, big images)
        size = max(1, -(-len(rest) // (processes * 4)))
        chunks = [rest[start : start + size] for start in range(0, len(rest), size)]
        with ProcessPoolExecutor(
            processes, mp_context=get_context("spawn"), initializer=_start_worker, initargs=(dataset,)
        ) as pool:
            measured += [m for chunk in pool.map(_measure_rows, chunks) for m in chunk]
    if cache_path is not None:
        try:
            _write_cache(cache_path, measured)
        except OSError as err:  # a read-only home is no reason to stop a run
            logger.warning("could not cache prompt lengths in %s (%s)", cache_path, err)
    return measured
