"""Prompt datasets for RL: rows from local files, rendered into model-ready prompts.

A row holds a prompt (with ``<image>``/``<video>``/``<audio>`` markers placing its media), a ground
truth and any other columns. One item is the tokenized prompt and its media, encoded by the model's
own processor, plus the unexpanded prompt ids and decoded media that a rollout engine takes, plus the
row's other columns for the reward function. Every error names the file and row.
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
from jinja2 import StrictUndefined, Template, TemplateError

from mmrl.data.media import MediaError, load_image

logger = logging.getLogger(__name__)

MEDIA_MARKERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}
_MARKER_PATTERN = re.compile("(" + "|".join(re.escape(m) for m in MEDIA_MARKERS.values()) + ")")
# processor outputs of shape [1, prompt_length] are per-token columns; the rest are media features
TOKEN_COLUMNS = ("input_ids", "attention_mask", "mm_token_type_ids")


class DataError(ValueError):
    """A dataset row that cannot be used; the message names the file and row."""


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
                raise DataError(f"{path} line {line_number}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DataError(
                    f"{path} line {line_number}: expected a JSON object, found {type(row).__name__}"
                )
            rows.append(row)
    return rows


def load_rows(spec: str, media_dir: str | None = None) -> Rows:
    """Read ``path[@split]``: a .jsonl/.json/.parquet file, a ``datasets.save_to_disk`` folder, or a
    folder of data files; anything else that looks like ``owner/name`` goes to ``datasets.load_dataset``."""
    from mmrl.trainer.config import split_dataset_spec

    path, split = split_dataset_spec(spec)
    base_dir = media_dir or (os.path.dirname(os.path.abspath(path)) if os.path.isfile(path) else path)
    if path.endswith(".jsonl"):
        return Rows(spec, base_dir, _read_json_lines(path))
    if path.endswith(".json"):
        with open(path, encoding="utf-8") as handle:
            table = json.load(handle)
        if not isinstance(table, list):
            raise DataError(f"{path}: expected a JSON list of objects, found {type(table).__name__}")
        return Rows(spec, base_dir, table)
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return Rows(spec, base_dir, pq.read_table(path).to_pylist())
    import datasets

    if os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_dict.json")):
        table = datasets.load_from_disk(path)[split or "train"]
    elif os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
        table = datasets.load_from_disk(path)
    else:
        table = datasets.load_dataset(path, split=split or "train")
    return Rows(spec, base_dir, table)


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

    ``processor`` is the model's Hugging Face processor (None for text-only models, then the
    tokenizer's chat template is used). Overlong prompts are dropped at construction when
    ``filter_overlong_prompts`` (their count is logged and kept in ``num_filtered``), else they raise.
    """

    def __init__(
        self,
        data_files: str,
        tokenizer: Any,
        processor: Any | None,
        prompt_key: str = "problem",
        answer_key: str = "answer",
        image_key: str = "images",
        video_key: str = "videos",
        audio_key: str = "audios",
        media_dir: str | None = None,
        format_prompt: str | None = None,
        system_prompt: str | None = None,
        max_prompt_length: int = 512,
        min_pixels: int = 262144,
        max_pixels: int = 4194304,
        filter_overlong_prompts: bool = True,
    ):
        self.tokenizer = tokenizer
        self.processor = processor
        self.prompt_key, self.answer_key = prompt_key, answer_key
        self.media_keys = {"image": image_key, "video": video_key, "audio": audio_key}
        self.system_prompt = system_prompt
        self.max_prompt_length = max_prompt_length
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.template = self._load_template(format_prompt)
        self.files = [load_rows(spec.strip(), media_dir) for spec in data_files.split(",") if spec.strip()]
        self.index = [(f, r) for f, rows in enumerate(self.files) for r in range(len(rows.table))]
        self.num_filtered = 0
        if filter_overlong_prompts:
            self._filter_overlong()

    @staticmethod
    def _load_template(path: str | None) -> Template | None:
        if not path:
            return None
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
        try:
            return Template(source, undefined=StrictUndefined, keep_trailing_newline=False)
        except TemplateError as err:
            raise DataError(f"format prompt '{path}': invalid Jinja template ({err})") from None

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
        if self.prompt_key not in row:
            raise DataError(
                f"{where}: no column '{self.prompt_key}' (data.prompt_key); columns: {sorted(row)}"
            )
        content = row[self.prompt_key]
        if not isinstance(content, str):
            raise DataError(
                f"{where}: column '{self.prompt_key}' must be a string, found {type(content).__name__}"
            )
        if self.template is None:
            return content
        try:
            return self.template.render(**{**row, "content": content}).strip()
        except TemplateError as err:
            raise DataError(f"{where}: format prompt failed: {err}") from None

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
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        if all(part["type"] == "text" for part in parts):
            messages.append({"role": "user", "content": text})
        else:
            messages.append({"role": "user", "content": parts})
        return messages

    def _encode(self, position: int) -> dict[str, Any]:
        row, base_dir = self._row(position)
        where = self.where(position)
        text = self._prompt_text(row, where)
        images_refs = self._media_list(row, "image", where)
        for kind in ("video", "audio"):
            if self._media_list(row, kind, where):
                raise DataError(
                    f"{where}: {kind} inputs are not supported yet (issue 'Video, audio and packed sequences')"
                )
        messages = self._messages(text, {"image": len(images_refs)}, where)
        try:
            images = [load_image(ref, self.min_pixels, self.max_pixels, base_dir) for ref in images_refs]
        except MediaError as err:
            raise DataError(f"{where}: {err}") from None
        chat = self.processor if self.processor is not None else self.tokenizer
        prompt = chat.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        if images and self.processor is None:
            raise DataError(f"{where}: the sample has images but the model has no processor")
        if self.processor is not None:
            encoded = self.processor(text=[prompt], images=images or None, return_tensors="pt")
        else:
            encoded = self.tokenizer([prompt], add_special_tokens=False, return_tensors="pt")
        return {"row": row, "prompt": prompt, "images": images, "encoded": dict(encoded)}

    def _filter_overlong(self) -> None:
        kept = [pos for pos in range(len(self.index)) if self._prompt_length(pos) <= self.max_prompt_length]
        self.num_filtered = len(self.index) - len(kept)
        if self.num_filtered:
            logger.warning(
                "dropped %d of %d prompts longer than data.max_prompt_length=%d tokens",
                self.num_filtered,
                len(self.index),
                self.max_prompt_length,
            )
        self.index = [self.index[pos] for pos in kept]

    def _prompt_length(self, position: int) -> int:
        return int(self._encode(position)["encoded"]["input_ids"].shape[-1])

    def __getitem__(self, position: int) -> dict[str, Any]:
        item = self._encode(position)
        encoded, row = item["encoded"], item["row"]
        length = encoded["input_ids"].shape[-1]
        if length > self.max_prompt_length:
            raise DataError(
                f"{self.where(position)}: prompt is {length} tokens, over data.max_prompt_length="
                f"{self.max_prompt_length} (raise it, or set data.filter_overlong_prompts=true)"
            )
        tokens = {key: encoded[key][0] for key in TOKEN_COLUMNS if key in encoded}  # [L] each
        media_inputs = {key: value for key, value in encoded.items() if key not in TOKEN_COLUMNS}
        media_keys = set(self.media_keys.values())
        columns = {k: v for k, v in row.items() if k not in media_keys and k != self.answer_key}
        return {
            **tokens,
            "raw_prompt_ids": self.tokenizer.encode(item["prompt"], add_special_tokens=False),
            "multi_modal_data": {"images": item["images"]} if item["images"] else {},
            "multi_modal_inputs": media_inputs,
            "ground_truth": row.get(self.answer_key),
            "uid": uuid.uuid4().hex,  # groups the n responses of this prompt; its value affects nothing
            "sample_index": position,
            **columns,
        }
