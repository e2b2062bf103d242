"""Prompt datasets for RL: rows from local files, rendered into model-ready prompts.

A row holds a prompt (with ``<image>``/``<video>``/``<audio>`` markers placing its media), a ground
truth and any other columns. One item is the tokenized prompt (the model's processor expands the media
placeholders, so the driver knows every prompt's length), the unexpanded prompt ids a rollout engine
takes, the prompt's media in compact form (``prompt_media``: a
:class:`~mmrl.data.processing.PromptMedia` holding the original file bytes, None without media) and
the row's other columns for the reward function. Every error names the file and row.

The item carries no media tensors and no decoded media: the workers make ``multi_modal_inputs`` and
``multi_modal_data`` from ``prompt_media`` with the same :class:`~mmrl.data.processing.MediaProcessor`
the dataset tokenizes with (:func:`~mmrl.data.processing.attach_media`; its module docstring says how
media reach the processor), so media cross process boundaries as their encoded bytes.

Bad samples (unreadable media, marker/media count mismatch, media the model cannot take) raise
:class:`DataError` naming the file and row; with ``skip_bad_samples`` they are logged, counted in
``num_skipped`` (``skipped`` maps each to its reason) and left out: at load when the overlong-prompt
filter measures every prompt anyway (a truncated image whose header is whole passes that count and is
found later), else at ``__getitem__``, which then returns the next good sample
(wrapping around), so the same position always gives the same stand-in. Skips found inside dataloader
worker processes are logged and counted there, not in the main process.
"""

from __future__ import annotations

import json
import logging
import os
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jinja2 import StrictUndefined, Template, TemplateError, TemplateSyntaxError

from mmrl.data.config import (
    DATA_FILE_SUFFIXES,
    DATA_FORMATS,
    DataConfig,
    split_dataset_spec,
    unsupported_data_file,
)
from mmrl.data.media import MediaError, image_size
from mmrl.data.processing import (
    TOKEN_COLUMNS,
    DataError,
    MediaProcessor,
    PromptMedia,
    compact_media_ref,
    media_error,
)

logger = logging.getLogger(__name__)

MEDIA_MARKERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}
_MARKER_PATTERN = re.compile("(" + "|".join(re.escape(m) for m in MEDIA_MARKERS.values()) + ")")
JSONL_FORM = (
    'each line of a .jsonl file holds one row as a JSON object, e.g. {"problem": "...", "answer": "..."}'
)
__all__ = ["TOKEN_COLUMNS", "DataError", "PromptDataset", "Rows", "load_rows", "split_by_markers"]


@dataclass(frozen=True)
class Rows:
    """Rows of one data file (or dataset folder), with where they came from for error messages."""

    source: str  # the path (and split) the rows came from
    base_dir: str | None  # folder that relative media paths are resolved against
    table: Sequence[dict[str, Any]]  # list of dicts or a `datasets.Dataset`


def _read_json_lines(path: str) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"{path} line {line_number}: not valid JSON ({err.msg}); {JSONL_FORM}"
                ) from None
            if not isinstance(row, dict):
                raise DataError(
                    f"{path} line {line_number}: expected a JSON object, found {type(row).__name__}; {JSONL_FORM}"
                )
            rows.append(row)
    return rows


def _read_json_list(path: str) -> list[dict[str, Any]]:
    """A .json file: one JSON list of row objects, or JSON lines (which ``datasets`` reads from .json)."""
    with open(path, encoding="utf-8") as handle:
        try:
            table = json.load(handle)
        except json.JSONDecodeError as err:
            if err.msg == "Extra data":  # a second value after the first: one object per line
                return _read_json_lines(path)
            raise DataError(
                f"{path} line {err.lineno} column {err.colno}: not valid JSON ({err.msg}); a .json data file "
                "holds one JSON list of row objects (use .jsonl for one object per line)"
            ) from None
    if not isinstance(table, list):
        raise DataError(f"{path}: expected a JSON list of objects, found {type(table).__name__}")
    for index, row in enumerate(table):
        if not isinstance(row, dict):
            raise DataError(f"{path} row {index}: expected a JSON object, found {type(row).__name__}")
    return table


def _read_parquet(path: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ... for a damaged file
        raise DataError(
            f"{path}: not a readable parquet file ({type(err).__name__}: {str(err).splitlines()[0]}); "
            "rewrite it (e.g. pandas.DataFrame.to_parquet) or give a .jsonl file"
        ) from None


def _read_csv(path: str) -> list[dict[str, Any]]:
    import pyarrow.csv

    try:
        return pyarrow.csv.read_csv(path).to_pylist()
    except Exception as err:  # pyarrow raises ArrowInvalid for a ragged or undecodable file
        raise DataError(
            f"{path}: not a readable CSV file ({type(err).__name__}: {str(err).splitlines()[0]}); every "
            "line needs the header's number of comma-separated fields"
        ) from None


def _read_arrow(path: str) -> list[dict[str, Any]]:
    """An Arrow IPC file: the stream format ``datasets`` writes (``data-*.arrow``) or the file format
    (Feather v2, ``pyarrow.feather.write_feather``)."""
    import pyarrow as pa

    try:
        with pa.memory_map(path) as source:
            try:
                table = pa.ipc.open_stream(source).read_all()
            except pa.ArrowInvalid:
                source.seek(0)
                table = pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid as err:
        raise DataError(
            f"{path}: not a readable Arrow file ({str(err).splitlines()[0]}); write it with "
            "datasets.Dataset.save_to_disk or pyarrow.feather.write_feather, or give a .jsonl file"
        ) from None
    return table.to_pylist()


FILE_READERS = {
    ".jsonl": _read_json_lines,
    ".json": _read_json_list,
    ".csv": _read_csv,
    ".parquet": _read_parquet,
    ".arrow": _read_arrow,
}
assert tuple(FILE_READERS) == DATA_FILE_SUFFIXES, "mmrl.data.config lists the formats read here"


def load_rows(spec: str, media_dir: str | None = None) -> Rows:
    """Read ``path[@split]``: a file of one of the :data:`FILE_READERS` formats, a
    ``datasets.save_to_disk`` folder, or a folder of data files; an ``owner/name`` that is no local
    path goes to ``datasets.load_dataset`` (the hub). A file that cannot be read or parsed, or whose
    format mmrl does not read, raises :class:`DataError` naming it (and the line)."""
    path, split = split_dataset_spec(spec)
    base_dir = media_dir or (os.path.dirname(os.path.abspath(path)) if os.path.isfile(path) else path)
    reader = next((read for suffix, read in FILE_READERS.items() if path.endswith(suffix)), None)
    if reader is not None:
        try:
            return Rows(spec, base_dir, reader(path))
        except UnicodeDecodeError as err:
            raise DataError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
        except OSError as err:  # missing, a folder, no permission
            raise DataError(f"{path}: cannot read the data file ({err.strerror or err})") from None
    problem = unsupported_data_file(path)
    if problem:
        raise DataError(problem)
    return Rows(spec, base_dir, _load_with_datasets(path, split))


def _load_with_datasets(path: str, split: str | None) -> Any:
    """A ``save_to_disk`` folder, a folder of data files or a hub id, through the ``datasets`` library."""
    import datasets

    split_name = split or "train"
    try:
        if os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_dict.json")):
            folders = datasets.load_from_disk(path)
            if split_name not in folders:
                raise DataError(f"{path}: no split '{split_name}' in this dataset; it has {sorted(folders)}")
            return folders[split_name]
        if os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
            return datasets.load_from_disk(path)
        return datasets.load_dataset(path, split=split_name)
    except DataError:
        raise
    except Exception as err:  # FileNotFoundError, DatasetNotFoundError, ValueError (unknown split), ...
        first_line = str(err).splitlines()[0] if str(err) else ""
        raise DataError(
            f"{path}{'@' + split if split else ''}: the datasets library could not load it "
            f"({type(err).__name__}: {first_line}); give {DATA_FORMATS}"
        ) from None


def split_by_markers(text: str) -> list[dict[str, str]]:
    """``"<image>What is it?"`` → ``[{"type": "image"}, {"type": "text", "text": "What is it?"}]``."""
    parts = []
    for piece in _MARKER_PATTERN.split(text):
        if not piece:
            continue
        kind = next((k for k, marker in MEDIA_MARKERS.items() if marker == piece), None)
        parts.append({"type": kind} if kind else {"type": "text", "text": piece})
    return parts


class PromptDataset(torch.utils.data.Dataset):
    """Prompts of one or more data files, encoded for the model; see the module docstring.

    ``data_files``: ``data.train_files`` or ``data.val_files``; ``config``: the ``data`` section, whose
    columns, prompt, image, video and audio keys mean what their comments in :mod:`mmrl.data.config` say.
    ``processor`` is the model's Hugging Face processor (None for text-only models, then the
    tokenizer's chat template is used). Overlong prompts are dropped at construction when
    ``filter_overlong_prompts`` (their count is logged and kept in ``num_filtered``), else they raise.
    """

    def __init__(self, data_files: str, tokenizer: Any, processor: Any | None, config: DataConfig):
        self.tokenizer = tokenizer
        self.processor = processor
        self.config = config
        self.media_keys = {"image": config.image_key, "video": config.video_key, "audio": config.audio_key}
        self.media = MediaProcessor(tokenizer, processor, config)  # the workers run the same
        self.skipped: dict[str, str] = {}  # "file row r" -> why it was skipped
        self.template = self._load_template(config.format_prompt)
        self.files = [
            load_rows(spec.strip(), config.media_dir) for spec in data_files.split(",") if spec.strip()
        ]
        self.index = [(f, r) for f, rows in enumerate(self.files) for r in range(len(rows.table))]
        self.num_filtered = 0
        image_processor = getattr(processor, "image_processor", None)
        self._count_images_by_size = hasattr(image_processor, "get_number_of_image_patches") and hasattr(
            image_processor, "merge_size"
        )
        self._image_counting_checked = False  # see prompt_length
        if config.filter_overlong_prompts:
            self._filter_at_load()

    @property
    def num_skipped(self) -> int:
        """Bad samples left out so far (data.skip_bad_samples=true)."""
        return len(self.skipped)

    @staticmethod
    def _load_template(path: str | None) -> Template | None:
        if not path:
            return None
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
        try:
            return Template(source, undefined=StrictUndefined, keep_trailing_newline=False)
        except TemplateSyntaxError as err:
            raise DataError(
                f"data.format_prompt: template '{path}' line {err.lineno}: invalid Jinja ({err.message}); "
                "fix the template (it gets `content` and the row's columns)"
            ) from None
        except TemplateError as err:
            raise DataError(f"data.format_prompt: template '{path}': invalid Jinja ({err})") from None

    def __len__(self) -> int:
        return len(self.index)

    def where(self, position: int) -> str:
        file_index, row = self.index[position]
        return f"{self.files[file_index].source} row {row}"

    def _row(self, position: int) -> tuple[dict[str, Any], str | None]:
        file_index, row = self.index[position]
        rows = self.files[file_index]
        return dict(rows.table[row]), rows.base_dir

    # ---- building one prompt ------------------------------------------------------------------

    def _prompt_text(self, row: dict[str, Any], where: str) -> str:
        if self.config.prompt_key not in row:
            raise DataError(
                f"{where}: no column '{self.config.prompt_key}' (data.prompt_key); its columns are {sorted(row)}: "
                "set data.prompt_key to the right one, or add the column to every row"
            )
        content = row[self.config.prompt_key]
        if not isinstance(content, str):
            raise DataError(
                f"{where}: column '{self.config.prompt_key}' must be a string, found {type(content).__name__}"
            )
        if self.template is None:
            return content
        try:
            return self.template.render(**{**row, "content": content}).strip()
        except TemplateError as err:
            raise DataError(
                f"{where}: data.format_prompt '{self.config.format_prompt}' failed: {err}; the template gets "
                f"`content` and the row's columns {sorted(row)}"
            ) from None

    def _media_list(self, row: dict[str, Any], kind: str, where: str) -> list[Any]:
        value = row.get(self.media_keys[kind])
        if value is None:
            return []
        if not isinstance(value, (list, tuple)):
            value = [value]
        return list(value)

    def _messages(self, text: str, num_media: dict[str, int], where: str) -> list[dict[str, Any]]:
        parts = split_by_markers(text)
        for kind, count in num_media.items():
            markers = sum(part["type"] == kind for part in parts)
            if markers != count:
                raise DataError(
                    f"{where}: the prompt has {markers} {MEDIA_MARKERS[kind]} marker(s) but the sample has "
                    f"{count} {kind}(s) in column '{self.media_keys[kind]}'; put one marker where each goes"
                )
        messages = (
            [{"role": "system", "content": self.config.system_prompt}] if self.config.system_prompt else []
        )
        if all(part["type"] == "text" for part in parts):
            messages.append({"role": "user", "content": text})
        else:
            messages.append({"role": "user", "content": parts})
        return messages

    def _check_model_takes(self, refs: dict[str, list[Any]], where: str) -> None:
        for kind, items in refs.items():
            if items and not self.media.takes(kind):
                raise DataError(
                    f"{where}: the sample has {len(items)} {kind}(s) in column '{self.media_keys[kind]}', but the "
                    f"model's processor takes no {kind}s; use a model that does, or check that its folder has "
                    "its processor files (preprocessor_config.json, processor_config.json)"
                )

    def _compact_media(
        self, prompt: str, text: str, refs: dict[str, list[Any]], base_dir: str | None, where: str
    ) -> PromptMedia:
        """The row's media in compact form (file bytes) with the prompt they are processed with."""
        try:
            compact = {
                kind: tuple(compact_media_ref(ref, base_dir, kind) for ref in items)
                for kind, items in refs.items()
            }
        except MediaError as err:
            raise media_error(where, err) from None
        order = tuple(part["type"] for part in split_by_markers(text) if part["type"] != "text")
        return PromptMedia(
            prompt, compact["image"], compact["video"], compact["audio"], order=order, where=where
        )

    def _render(
        self, position: int
    ) -> tuple[dict[str, Any], str | None, str, str, dict[str, list[Any]], str]:
        """``(row, base_dir, where, text, media refs, chat-templated prompt)`` of the row at ``position``."""
        row, base_dir = self._row(position)
        where = self.where(position)
        text = self._prompt_text(row, where)
        refs = {kind: self._media_list(row, kind, where) for kind in MEDIA_MARKERS}
        messages = self._messages(text, {kind: len(items) for kind, items in refs.items()}, where)
        self._check_model_takes(refs, where)
        chat = self.processor if self.processor is not None else self.tokenizer
        try:
            prompt = chat.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except TemplateError as err:  # a broken data.override_chat_template surfaces here
            source = self.config.override_chat_template or "the tokenizer's chat template"
            line = f" line {err.lineno}" if getattr(err, "lineno", None) else ""
            raise DataError(
                f"{where}: chat template {source}{line} failed: {err} (data.override_chat_template)"
            ) from None
        return row, base_dir, where, text, refs, prompt

    def _encode(self, position: int) -> dict[str, Any]:
        row, base_dir, where, text, refs, prompt = self._render(position)
        media = self._compact_media(prompt, text, refs, base_dir, where)
        encoded, _ = self.media.encode(media)
        return {"row": row, "prompt": prompt, "media": media, "encoded": encoded}

    # ---- load-time filtering and bad samples --------------------------------------------------

    def _skip(self, position: int, err: DataError) -> None:
        self.skipped[self.where(position)] = str(err)
        logger.warning("data.skip_bad_samples: skipping a bad sample (%d so far): %s", self.num_skipped, err)

    def _filter_at_load(self) -> None:
        """Drops overlong prompts (counted in ``num_filtered``) and, with ``skip_bad_samples``, bad ones.
        The lengths come from :func:`mmrl.data.lengths.measure_prompt_lengths` (parallel, cached)."""
        from mmrl.data.lengths import measure_prompt_lengths

        measured = measure_prompt_lengths(
            self, self.config.preprocess_num_workers, cache=self.config.prompt_length_cache
        )
        kept, overlong = [], 0
        for position, row in enumerate(measured):
            if row.error is not None:
                if not self.config.skip_bad_samples:
                    raise DataError(row.error)
                self._skip(position, DataError(row.error))
            elif row.length <= self.config.max_prompt_length:
                kept.append(position)
            else:
                overlong += 1
        self.num_filtered = overlong
        if self.num_filtered:
            logger.warning(
                "dropped %d of %d prompts longer than data.max_prompt_length=%d tokens",
                self.num_filtered,
                len(self.index),
                self.config.max_prompt_length,
            )
        self.index = [self.index[position] for position in kept]

    def prompt_length(self, position: int) -> int:
        """Tokens of the prompt at ``position``, media placeholders included; DataError for a bad row.

        Rows whose media are images only are counted from the images' sizes (file headers) when the
        image processor can say how many patches a size gives (Qwen-VL's can: vLLM relies on it),
        ~20× faster than encoding the pixels; the first such row of a process is also encoded, and a
        disagreement turns the shortcut off."""
        if self._count_images_by_size:
            counted = self._length_from_image_sizes(position)
            if counted is not None and (self._image_counting_checked or not counted[1]):
                return counted[0]
            if counted is not None:
                encoded = int(self._encode(position)["encoded"]["input_ids"].shape[-1])
                self._image_counting_checked = encoded == counted[0]
                if encoded != counted[0]:
                    self._count_images_by_size = False
                    logger.warning(
                        "prompt lengths from image sizes disagree with the processor (%d vs %d tokens at %s); "
                        "encoding every prompt instead",
                        counted[0],
                        encoded,
                        self.where(position),
                    )
                return encoded
        return int(self._encode(position)["encoded"]["input_ids"].shape[-1])

    def _length_from_image_sizes(self, position: int) -> tuple[int, int] | None:
        """``(length, images)``: the prompt's length from its text and image sizes, and its number of
        images; None for rows with other media."""
        row, base_dir, where, _, refs, prompt = self._render(position)
        if refs["video"] or refs["audio"]:
            return None
        image_processor = self.processor.image_processor if refs["image"] else None
        factor = image_processor.patch_size * image_processor.merge_size if image_processor else 1
        try:
            sizes = [
                image_size(ref, self.config.min_pixels, self.config.max_pixels, base_dir, factor=factor)
                for ref in refs["image"]
            ]
        except MediaError as err:
            raise media_error(where, err) from None
        length = len(self.tokenizer.encode(prompt, add_special_tokens=False))
        for width, height in sizes:  # each image's one placeholder becomes one token per merged patch block
            # on the grid already (media.smart_size), and the processor is told to keep the size
            size = {"min_pixels": width * height, "max_pixels": width * height}
            patches = image_processor.get_number_of_image_patches(height, width, size)
            length += patches // image_processor.merge_size**2 - 1
        return length, len(sizes)

    def __getstate__(self) -> dict[str, Any]:
        # a compiled Jinja template does not pickle (spawned length workers get the dataset): rebuilt
        state = dict(self.__dict__)
        state["template"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.template = self._load_template(self.config.format_prompt)

    def __getitem__(self, position: int) -> dict[str, Any]:
        if self.where(position) not in self.skipped:
            try:
                return self._item(position)
            except DataError as err:
                if not self.config.skip_bad_samples:
                    raise
                self._skip(position, err)
        return self._replacement(position)

    def _replacement(self, position: int) -> dict[str, Any]:
        """The first good sample after ``position`` (wrapping around): a stand-in for a bad one."""
        for offset in range(1, len(self)):
            candidate = (position + offset) % len(self)
            if self.where(candidate) in self.skipped:
                continue
            try:
                return self._item(candidate)
            except DataError as err:
                self._skip(candidate, err)
        raise DataError(
            f"every sample of the dataset is bad ({self.num_skipped} skipped); the first: "
            f"{next(iter(self.skipped.values()))}"
        )

    def _item(self, position: int) -> dict[str, Any]:
        item = self._encode(position)
        encoded, row = item["encoded"], item["row"]
        length = encoded["input_ids"].shape[-1]
        if length > self.config.max_prompt_length:
            raise DataError(
                f"{self.where(position)}: prompt is {length} tokens, over data.max_prompt_length="
                f"{self.config.max_prompt_length} (raise it, or set data.filter_overlong_prompts=true)"
            )
        tokens = {key: encoded[key][0] for key in TOKEN_COLUMNS if key in encoded}  # [L] each
        media = item["media"]
        has_media = media.images or media.videos or media.audios
        has_media = has_media or any(key not in TOKEN_COLUMNS for key in encoded)
        media_keys = set(self.media_keys.values())
        columns = {k: v for k, v in row.items() if k not in media_keys and k != self.config.answer_key}
        return {
            **tokens,
            "raw_prompt_ids": self.tokenizer.encode(item["prompt"], add_special_tokens=False),
            "prompt_media": media if has_media else None,  # processed where the model runs
            "ground_truth": row.get(self.config.answer_key),
            "uid": uuid.uuid4().hex,  # groups the n responses of this prompt; its value affects nothing
            "sample_index": position,
            **columns,
        }
