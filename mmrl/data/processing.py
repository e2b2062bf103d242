"""A prompt's media, from the compact form that travels to the model's inputs where the model runs.

The driver needs only a prompt's token ids (its length and the placeholders the processor expands);
the media tensors (``pixel_values`` are ~8x the decoded image and tens of times its JPEG) are needed
only where the model runs. So a dataset item carries its media in compact form, a
:class:`PromptMedia`: the original file bytes of each image, video and audio clip (or the decoded value
the data itself held: a PIL image, an ``{"array", "sampling_rate"}`` dict), the chat-templated prompt,
and the order of the markers. The trainer puts each one in Ray's object store once per step; the batch
carries the small references (column ``prompt_media``, :mod:`mmrl.columns`).

:class:`MediaProcessor` is the one processing path: the dataset runs it on the driver (for the token
ids) and :func:`attach_media` runs it on the workers (for ``multi_modal_inputs``, the processor's
media tensors, and ``multi_modal_data``, the decoded media a rollout engine takes), so both see the
same processor outputs. Media reach the Hugging Face processor as transformers v5 expects them:

- images: PIL images (``images=``), already on the patch grid (:func:`mmrl.data.media.smart_size`),
  with a ``size`` range holding them, so that the processor keeps their size;
- videos: ``[T, H, W, 3]`` uint8 frames (``videos=``), already sampled (``do_sample_frames=False``)
  and sized as qwen-vl-utils sizes them, with ``video_metadata`` (Qwen2.5-VL derives
  ``second_per_grid_ts`` from its sampled fps) and ``fps`` (Qwen2.5-Omni reads one fps per call; each
  video's own ``video_second_per_grid`` is set afterwards), a ``size`` range under which the frames
  keep their size (read per frame by Qwen2/2.5-VL and Omni, per video by Qwen3-VL) and
  ``cap_pixels_per_frame=False`` where the processor knows it (the reference's cap is applied);
- audio: mono float32 waveforms at the feature extractor's rate (``audio=``), in the order of their
  markers; with ``use_audio_in_video`` (Qwen2.5-Omni) each video's sound track joins the list at the
  video's place, as the processor interleaves them.

``multi_modal_data`` holds what a rollout engine takes: ``{"images": [PIL], "videos": [(frames,
metadata dict)], "audios": [(waveform, sampling_rate)]}`` (only the kinds present; vLLM's item forms).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mmrl.columns import TrajectoryInputs, concat_multi_modal_inputs
from mmrl.data.config import DataConfig
from mmrl.data.media import DecodedVideo, MediaError, load_audio, load_image, load_video
from mmrl.errors import UserInputError
from mmrl.protocol import DataProto
from mmrl.runtime.startup import collector_paused

__all__ = ["MODEL_MEDIA_COLUMNS", "PROMPT_MEDIA", "TOKEN_COLUMNS", "TRAJECTORY_MEDIA", "DataError", "MediaCache",
           "MediaProcessor", "PromptMedia", "SourceImages", "TrajectoryMedia", "attach_media", "compact_media_ref",
           "load_tokenizer_and_processor", "media_error", "without_model_media"]  # fmt: skip

# processor outputs of shape [1, prompt_length] are per-token columns; the rest are media features
TOKEN_COLUMNS = ("input_ids", "attention_mask", "mm_token_type_ids")
PROMPT_MEDIA = "prompt_media"  # the compact column: a PromptMedia, a Ray ref to one, or None
TRAJECTORY_MEDIA = "trajectory_media"  # multi-turn rollouts: a TrajectoryMedia, or None
# what attach_media adds on a worker; never sent back to the driver (without_model_media)
EMBEDS_COLUMN = "multi_modal_embeds"  # the actor's encodings a rollout engine takes (reuse_encodings)
MODEL_MEDIA_COLUMNS = ("multi_modal_inputs", "multi_modal_data", EMBEDS_COLUMN)


# a folder holding any of these has a tokenizer (fast, sentencepiece, BPE, WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


class DataError(UserInputError, ValueError):
    """A dataset row that cannot be used; the message names the file and row."""


def media_error(where: str, err: MediaError) -> DataError:
    """The row's error for media that cannot be used, with what the user can do about it."""
    return DataError(
        f"{where}: {err}; fix or replace the file, or set data.skip_bad_samples=true to leave such samples out"
    )


def load_tokenizer_and_processor(
    model_path: str,
    trust_remote_code: bool = False,
    key: str = "worker.actor.model.tokenizer_path",
    chat_template_file: str | None = None,
) -> tuple[Any, Any | None]:
    """The tokenizer of ``model_path`` (a folder or hub id, named by config ``key``), and its multimodal
    processor (None for text-only models). ``chat_template_file`` (``data.override_chat_template``)
    replaces the chat template of both, so that every prompt is rendered with it."""
    from transformers import AutoProcessor, AutoTokenizer, PreTrainedTokenizerBase

    from mmrl.models.loading import ModelPathError, resolve_model_path

    model_path = resolve_model_path(model_path, key, without_weights=True)
    if not any(name in TOKENIZER_FILES or name.endswith(".tiktoken") for name in os.listdir(model_path)):
        # transformers v5 would build an empty tokenizer (a vocabulary of 1) without a word
        raise ModelPathError(
            f"{key}: '{model_path}' has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); copy them "
            "from the base model, or set worker.actor.model.tokenizer_path to a folder that has them"
        )
    # The processor first: it holds the tokenizer (a text model's "processor" is its tokenizer), which is
    # then not parsed a second time; and a vocabulary's many objects load with the collector paused, which
    # would walk them again and again. Both: 5.1 -> 2.0 CPU-s for 151,936 tokens (bench/startup.py)
    with collector_paused():
        try:
            processor = AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            processor_error = None
        except (OSError, ValueError, TypeError, KeyError) as err:
            processor, processor_error = None, err
        if hasattr(processor, "image_processor"):
            tokenizer = getattr(processor, "tokenizer", None)
        else:
            tokenizer = processor if isinstance(processor, PreTrainedTokenizerBase) else None
            processor = None
        if tokenizer is None:
            try:
                tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            except (OSError, ValueError, TypeError, KeyError) as err:  # transformers' "no tokenizer"s
                raise ModelPathError(
                    f"{key}: no usable tokenizer in '{model_path}' ({type(err).__name__}: "
                    f"{str(err).splitlines()[0]}); copy the tokenizer files (tokenizer.json, tokenizer_config.json) "
                    "from the base model, or set worker.actor.model.tokenizer_path to a folder that has them"
                ) from None
    if isinstance(processor_error, (TypeError, KeyError)):
        raise processor_error  # the tokenizer loads: the processor itself is broken
    if chat_template_file is not None:
        with open(chat_template_file, encoding="utf-8") as file:
            template = file.read()
        for chat in (tokenizer, processor):
            if chat is not None:
                chat.chat_template = template
    return tokenizer, processor


@dataclass(frozen=True, eq=False)
class PromptMedia:
    """One prompt's media in compact form: everything a worker needs to reproduce its processor outputs."""

    prompt: str  # the chat-templated prompt text the processor is called with
    # each a compact_media_ref: {"bytes", "path"} or bytes (or a decoded value the data itself held)
    images: tuple[Any, ...] = ()
    videos: tuple[Any, ...] = ()
    audios: tuple[Any, ...] = ()
    order: tuple[str, ...] = ()  # the media kinds in the order of the prompt's markers
    where: str = ""  # "file row r", for error messages

    @property
    def encoded_bytes(self) -> int:
        """Bytes of the encoded files (decoded values the data held count as their array bytes)."""
        return sum(_value_bytes(value) for value in (*self.images, *self.videos, *self.audios))


@dataclass(frozen=True, eq=False)
class TrajectoryMedia:
    """The media the observations of one trajectory returned, in compact form (column
    ``trajectory_media``): for each observation turn that returned media, its turn and a
    :class:`PromptMedia` whose ``prompt`` is the observation's rendered text (what the processor
    expands), so that a worker reproduces the observation's processor outputs as the rollout saw them.
    ``key`` identifies it in a worker's :class:`MediaCache` (the object is copied by every dispatch)."""

    turns: tuple[int, ...]
    observations: tuple[PromptMedia, ...]
    key: str = ""

    @property
    def encoded_bytes(self) -> int:
        return sum(media.encoded_bytes for media in self.observations)


def _value_bytes(value: Any) -> int:
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, dict) and "bytes" in value:
        return len(value["bytes"])
    if isinstance(value, dict) and "array" in value:
        return int(np.asarray(value["array"]).nbytes)
    if hasattr(value, "tobytes"):  # a PIL image
        return len(value.tobytes())
    return 0


def compact_media_ref(ref: Any, base_dir: str | None, kind: str) -> Any:
    """The compact form of one media reference: ``{"bytes", "path"}`` with the file's own bytes (the
    path only names it in messages); bytes stay bytes; a value already decoded (PIL image, audio array
    dict) is kept as it is. :mod:`mmrl.data.media` decodes each of these forms."""
    if isinstance(ref, dict) and "array" not in ref:
        if ref.get("bytes"):
            data = ref["bytes"]  # left as given: a wrong type fails in decoding, naming the row
            return {"bytes": bytes(data) if isinstance(data, bytearray) else data, "path": ref.get("path")}
        if ref.get("path"):
            return compact_media_ref(ref["path"], base_dir, kind)
        raise MediaError(f"{kind} dict has neither 'bytes' nor 'path'")
    if isinstance(ref, str):
        path = ref if os.path.isabs(ref) or base_dir is None else os.path.join(base_dir, ref)
        if not os.path.isfile(path):
            raise MediaError(f"{kind} file '{path}' does not exist")
        with open(path, "rb") as handle:
            return {"bytes": handle.read(), "path": path}
    if isinstance(ref, bytearray):
        return bytes(ref)
    return ref


REFERENCE_VIDEO_TOKENS = 128000  # qwen-vl-utils' MODEL_SEQ_LEN: its default video budget is 90% of it


def _grid_factor(processor: Any | None) -> int:
    """Pixels per side of one merged patch (patch_size × merge_size: 28 for Qwen2/2.5-VL, 32 for
    Qwen3-VL); 1 for a processor without a patch grid."""
    if processor is None or not hasattr(processor, "patch_size"):
        return 1
    return int(processor.patch_size) * int(getattr(processor, "merge_size", 1) or 1)


def _unchanged_video_size(frames: list[np.ndarray]) -> dict[str, int]:
    """A processor ``size`` under which frames already on the grid keep their size: the range holds
    each video's per-frame pixels (Qwen2/2.5-VL read the range per frame) and its whole-video pixels
    (Qwen3-VL reads it for all of a video's frames together)."""
    per_frame = [int(video.shape[1] * video.shape[2]) for video in frames]  # [T, H, W, 3]
    whole = [pixels * int(video.shape[0]) for pixels, video in zip(per_frame, frames)]
    return {"shortest_edge": min(per_frame), "longest_edge": max(whole)}


class MediaProcessor:
    """Decodes a prompt's media and runs the model's processor on them, with the ``data`` section's
    settings (pixel ranges, video sampling, audio length); the same on the driver and on the workers.

    ``processor`` is the model's Hugging Face processor (None for text-only models, then the tokenizer
    encodes the prompt)."""

    def __init__(self, tokenizer: Any, processor: Any | None, config: DataConfig):
        self.tokenizer = tokenizer
        self.processor = processor
        self.config = config
        self.video_processor = getattr(processor, "video_processor", None)
        self.image_factor = _grid_factor(getattr(processor, "image_processor", None))
        self.video_factor = _grid_factor(self.video_processor)
        self.feature_extractor = getattr(processor, "feature_extractor", None)  # Qwen-Omni's audio features
        self.audio_seconds = self._audio_seconds(config.max_audio_seconds)
        if config.use_audio_in_video and self.feature_extractor is None:
            raise DataError(
                "data.use_audio_in_video=true, but the model's processor takes no audio (Qwen2.5-Omni's does)"
            )

    def _audio_seconds(self, max_audio_seconds: float) -> float:
        """``max_audio_seconds``, and no more than the feature extractor's window, beyond which it
        would cut the clip itself without a word (Qwen2.5-Omni pads every clip to that window)."""
        window_samples = getattr(self.feature_extractor, "n_samples", None)
        if window_samples is None:
            return max_audio_seconds
        return min(max_audio_seconds, window_samples / self.feature_extractor.sampling_rate)

    def takes(self, kind: str) -> bool:
        """Whether the model's processor takes media of ``kind``."""
        return {
            "image": self.processor is not None,
            "video": self.video_processor is not None,
            "audio": self.feature_extractor is not None,
        }[kind]

    # ---- compact media -> decoded media -> processor outputs ----------------------------------

    def _decode(self, media: PromptMedia) -> tuple[list[Any], list[DecodedVideo], list[Any]]:
        """``(images, videos, audios)`` of one prompt, decoded and scaled; errors name the row."""
        config = self.config
        sampling_rate = getattr(self.feature_extractor, "sampling_rate", None)
        try:
            images = [
                load_image(ref, config.min_pixels, config.max_pixels, factor=self.image_factor)
                for ref in media.images
            ]
            videos = [
                load_video(
                    ref,
                    config.video_min_pixels,
                    config.video_max_pixels,
                    fps=config.video_fps,
                    num_frames=config.num_video_frames,
                    max_frames=config.max_video_frames,
                    frame_multiple=getattr(self.video_processor, "temporal_patch_size", 1),
                    audio_sampling_rate=sampling_rate if config.use_audio_in_video else None,
                    max_audio_seconds=self.audio_seconds,
                    min_frames=config.min_video_frames,
                    total_pixels=self._video_total_pixels(),
                    factor=self.video_factor,
                )
                for ref in media.videos
            ]
            audios = [load_audio(ref, sampling_rate, self.audio_seconds) for ref in media.audios]
        except MediaError as err:
            raise media_error(media.where, err) from None
        return images, videos, audios

    def source_images(self, media: PromptMedia) -> list[Any]:
        """The prompt's images as RGB PIL images at the resolution the data holds them (no pixel
        budget): what a tool crops or zooms into. Errors name the row."""
        try:
            return [load_image(ref, None, None) for ref in media.images]
        except MediaError as err:
            raise media_error(media.where, err) from None

    def _video_total_pixels(self) -> int:
        """``data.video_total_pixels``, or qwen-vl-utils' default: 90% of 128,000 tokens' pixels."""
        if self.config.video_total_pixels is not None:
            return self.config.video_total_pixels
        return int(REFERENCE_VIDEO_TOKENS * 0.9 * self.video_factor**2)

    def _audio_inputs(self, order: Sequence[str], videos: list[DecodedVideo], audios: list[Any]) -> list[Any]:
        """The processor's audio list: clips, and with ``use_audio_in_video`` the videos' sound tracks,
        in the order of their markers, which is the order Qwen2.5-Omni's processor consumes them in."""
        next_video, next_audio = iter(videos), iter(audios)
        ordered = []
        for kind in order:
            if kind == "audio":
                ordered.append(next(next_audio))
            elif kind == "video":
                video = next(next_video)
                if self.config.use_audio_in_video:
                    ordered.append(video.audio)
        return ordered

    def _processor_media_kwargs(
        self, images: list[Any], videos: list[DecodedVideo], audio_inputs: list[Any], where: str
    ) -> dict[str, Any]:
        """Media keyword arguments of the processor call (see the module docstring)."""
        kwargs: dict[str, Any] = {}
        if images:
            kwargs["images"] = images
            # already on the grid (media.smart_size): a range holding every image leaves them as they are;
            # GLM-4.1V's resize counts an image as the 2 frames of its temporal patch, Qwen's as one
            pixels = [image.width * image.height for image in images]
            kwargs["images_kwargs"] = {
                "size": {"shortest_edge": min(pixels), "longest_edge": 2 * max(pixels)}
            }
        if videos:
            if self.config.use_audio_in_video and len({round(video.sampled_fps, 6) for video in videos}) > 1:
                raise DataError(
                    f"{where}: with data.use_audio_in_video the videos of one sample must be sampled at one fps "
                    f"(found {sorted({video.sampled_fps for video in videos})}): Qwen2.5-Omni's processor takes "
                    "one fps per call; use one video per sample, or videos of equal frame rate and length"
                )
            kwargs["videos"] = [video.frames for video in videos]
            videos_kwargs = {
                "do_sample_frames": False,
                "video_metadata": [video.metadata() for video in videos],
                "fps": videos[0].sampled_fps,
                "size": _unchanged_video_size([video.frames for video in videos]),
            }
            if hasattr(self.video_processor, "cap_pixels_per_frame"):
                # the reference's per-frame cap is applied when the frames are sized (media.load_video):
                # the processor must not cap them a second time (transformers >= 5.19 asks to choose)
                videos_kwargs["cap_pixels_per_frame"] = False
            if self.feature_extractor is not None:
                videos_kwargs["use_audio_in_video"] = self.config.use_audio_in_video
            kwargs["videos_kwargs"] = videos_kwargs
        if audio_inputs:
            kwargs["audio"] = audio_inputs
            kwargs["audio_kwargs"] = {"sampling_rate": self.feature_extractor.sampling_rate}
        return kwargs

    def _run_processor(
        self, prompt: str, images: list[Any], videos: list[DecodedVideo], audio_inputs: list[Any], where: str
    ) -> dict[str, Any]:
        if self.processor is None:
            return dict(self.tokenizer([prompt], add_special_tokens=False, return_tensors="pt"))
        kwargs = self._processor_media_kwargs(images, videos, audio_inputs, where)
        try:
            encoded = dict(self.processor(text=[prompt], return_tensors="pt", **kwargs))
        except (ValueError, RuntimeError) as err:
            raise DataError(f"{where}: the model's processor rejected the sample: {err}") from err
        if videos and "video_second_per_grid" in encoded:
            # Qwen2.5-Omni derives seconds per temporal patch from one fps per call: use each video's own
            patch = self.video_processor.temporal_patch_size
            encoded["video_second_per_grid"] = torch.tensor([patch / video.sampled_fps for video in videos])
        if videos and self.config.use_audio_in_video:
            encoded["use_audio_in_video"] = True  # read by the thinker's get_rope_index (mmrl.models.inputs)
        return encoded

    def encode(self, media: PromptMedia) -> tuple[dict[str, Any], dict[str, list[Any]]]:
        """The processor's outputs for the prompt and its media (token columns ``[1, L]`` included),
        and the decoded media a rollout engine takes (``multi_modal_data``)."""
        images, videos, audios = self._decode(media)
        audio_inputs = self._audio_inputs(media.order, videos, audios)
        rollout_media: dict[str, list[Any]] = {}
        if images:
            rollout_media["images"] = images
        if videos:
            # the frames are sampled already: vLLM's processors read that from the metadata (its GLM-4.1V
            # processor requires the key, and samples again where it is missing)
            rollout_media["videos"] = [
                (video.frames, {**video.metadata(), "do_sample_frames": False}) for video in videos
            ]
        if audio_inputs:
            rollout_media["audios"] = [
                (waveform, self.feature_extractor.sampling_rate) for waveform in audio_inputs
            ]
        encoded = self._run_processor(media.prompt, images, videos, audio_inputs, media.where)
        return encoded, rollout_media

    def model_media(self, media: PromptMedia | None) -> tuple[dict[str, Any], dict[str, list[Any]]]:
        """``(multi_modal_inputs, multi_modal_data)`` of one prompt: the processor's media tensors and
        the decoded media; ``({}, {})`` for a prompt without media."""
        if media is None:
            return {}, {}
        encoded, rollout_media = self.encode(media)
        return {key: value for key, value in encoded.items() if key not in TOKEN_COLUMNS}, rollout_media


# ---- on the workers -----------------------------------------------------------------------------


def _is_object_ref(value: Any) -> bool:
    # by name: the data layer imports Ray only when a batch holds refs
    return type(value).__name__ == "ObjectRef" and hasattr(value, "hex")


class MediaCache:
    """The processed media of the batch a worker last handled, kept for its next phase.

    After ``balance_batch`` a rank scores and trains the same rows in every phase of a step (log-probs,
    reference, values, update), so it keeps exactly the media of its last batch: an entry not in the
    new batch is dropped before the new ones are made. Memory is thus bounded by one batch share, as
    when the batch itself carried the tensors, and nothing needs to be told when a step begins.
    Entries are keyed by the Ray ref of the compact media (unique per object put), or by the identity
    of an in-process :class:`PromptMedia`, which the entry keeps alive."""

    def __init__(self) -> None:
        # key -> (the compact value, (multi_modal_inputs, multi_modal_data))
        self.entries: dict[Any, tuple[Any, tuple[dict[str, Any], dict[str, list[Any]]]]] = {}
        self.processed = 0  # prompts decoded and processed (misses)
        self.reused = 0  # prompts found in the cache (hits)
        self.fetched_bytes = 0  # encoded media bytes read from the object store

    def retain(self, keys: set[Any]) -> None:
        self.entries = {key: entry for key, entry in self.entries.items() if key in keys}


def _media_key(value: Any) -> Any:
    return value.hex() if _is_object_ref(value) else id(value)


def attach_media(
    batch: DataProto,
    processor: MediaProcessor,
    cache: MediaCache | None = None,
    rollout_media: bool = False,
) -> DataProto:
    """``batch`` with ``multi_modal_inputs`` (and with ``rollout_media`` also ``multi_modal_data``)
    made from its compact ``prompt_media`` column; unchanged when it has none.

    Values may be :class:`PromptMedia` (in-process use: the demo warm-up, tests) or Ray refs to them
    (what the trainer dispatches), resolved here in one ``ray.get``. Rows sharing a value (the n
    responses of a prompt) share one processed result, the same objects; ``cache`` keeps the results
    for the worker's next phase (see :class:`MediaCache`)."""
    if PROMPT_MEDIA not in batch.non_tensor_batch:
        return batch
    values = list(batch.non_tensor_batch[PROMPT_MEDIA])
    keys = [_media_key(value) for value in values]
    distinct = dict(zip(keys, values))
    if cache is not None:
        trajectories = batch.non_tensor_batch.get(TRAJECTORY_MEDIA, ())
        cache.retain(set(distinct) | {media.key for media in trajectories if media is not None and media.key})
    entries = cache.entries if cache is not None else {}
    refs = [key for key in distinct if isinstance(key, str) and key not in entries]
    resolved = {}
    if refs:
        import ray

        resolved = dict(zip(refs, ray.get([distinct[key] for key in refs])))
    results = {}
    for key, value in distinct.items():
        if key in entries:
            results[key] = entries[key][1]
            cache.reused += 1
            continue
        media = resolved.get(key, value)
        results[key] = processor.model_media(media)
        if cache is not None:
            entries[key] = (value, results[key])
            cache.processed += 1
            cache.fetched_bytes += media.encoded_bytes if key in resolved and media is not None else 0
    rows = [results[key] for key in keys]
    columns: dict[str, list[Any]] = {"multi_modal_inputs": [inputs for inputs, _ in rows]}
    if TRAJECTORY_MEDIA in batch.non_tensor_batch:  # trajectories: their observations' media join in
        columns["multi_modal_inputs"] = _with_trajectory_media(
            columns["multi_modal_inputs"], batch.non_tensor_batch[TRAJECTORY_MEDIA], processor, cache
        )
    if rollout_media:
        columns["multi_modal_data"] = [data for _, data in rows]
    added = DataProto.from_dict(non_tensors=columns).non_tensor_batch  # 1-D object arrays
    return DataProto(batch.batch, {**batch.non_tensor_batch, **added}, batch.meta_info)


class SourceImages(Sequence):
    """A prompt's images at the resolution the data holds them, decoded on first access (an item, a
    slice, iteration), once, under a lock (tools of one prompt's rows may run at once): a tool that
    never reads them costs no decoding. ``len()`` decodes nothing."""

    def __init__(self, media: PromptMedia | None, processor: MediaProcessor):
        self._media, self._processor = media, processor
        self._images: list[Any] | None = None if media is not None and media.images else []
        self._lock = threading.Lock()

    @property
    def decoded(self) -> bool:
        return self._images is not None

    def _decode(self) -> list[Any]:
        with self._lock:
            if self._images is None:
                self._images = self._processor.source_images(self._media)
        return self._images

    def __len__(self) -> int:
        return 0 if self._media is None else len(self._media.images)

    def __getitem__(self, index: Any) -> Any:
        return self._decode()[index]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._decode())

    def __reduce__(self):  # a copy or pickle (no lock) is the plain list
        return list, (list(self),)

    def __repr__(self) -> str:
        return f"SourceImages({len(self)} images, {'decoded' if self.decoded else 'not decoded yet'})"


def source_images(batch: DataProto, processor: MediaProcessor) -> list[SourceImages]:
    """Each row's images at the resolution the data holds them (:meth:`MediaProcessor.source_images`),
    from its compact ``prompt_media`` (Ray refs resolved in one ``ray.get``), decoded when first read
    (:class:`SourceImages`); empty for a row without media. A crop of the image the processor scaled to
    ``data.max_pixels`` would hold no more detail than the prompt showed, so tools get these. Rows
    sharing a value (the n responses of a prompt) share one :class:`SourceImages`, so one decoding."""
    values = list(batch.non_tensor_batch.get(PROMPT_MEDIA, [None] * len(batch)))
    keys = [_media_key(value) for value in values]
    distinct = dict(zip(keys, values))
    refs = [key for key in distinct if isinstance(key, str)]
    resolved = {}
    if refs:  # the bytes attach_media fetched already: the decoding is what waits for a reader
        import ray

        resolved = dict(zip(refs, ray.get([distinct[key] for key in refs])))
    images = {key: SourceImages(resolved.get(key, value), processor) for key, value in distinct.items()}
    return [images[key] for key in keys]


def trajectory_inputs(
    prompt: dict[str, Any], observations: Sequence[tuple[int, dict[str, Any]]]
) -> dict[str, Any]:
    """A trajectory row's ``multi_modal_inputs``: the prompt's processor outputs, or, when observations
    returned media (``(turn, outputs)`` in row order), a :class:`~mmrl.columns.TrajectoryInputs`."""
    observations = [(turn, inputs) for turn, inputs in observations if inputs]
    if not observations:
        return prompt
    response = concat_multi_modal_inputs([inputs for _, inputs in observations])
    return TrajectoryInputs(
        concat_multi_modal_inputs([prompt, response]), prompt, response, ((0, prompt), *observations)
    )


def _with_trajectory_media(
    prompts: list[dict[str, Any]],
    trajectories: Sequence[Any],
    processor: MediaProcessor,
    cache: MediaCache | None,
) -> list[dict[str, Any]]:
    """Each row's ``multi_modal_inputs`` with its observations' media (``trajectory_media``) joined in."""
    rows = []
    for prompt, media in zip(prompts, trajectories):
        if media is None:
            rows.append(prompt)
            continue
        entry = cache.entries.get(media.key) if cache is not None and media.key else None
        if entry is None:
            observations = [
                (turn, processor.model_media(observation)[0])
                for turn, observation in zip(media.turns, media.observations)
            ]
            entry = (media, observations)
            if cache is not None and media.key:
                cache.entries[media.key] = entry
                cache.processed += 1
        elif cache is not None:
            cache.reused += 1
        rows.append(trajectory_inputs(prompt, entry[1]))
    return rows


def without_model_media(batch: DataProto) -> DataProto:
    """``batch`` without the columns :func:`attach_media` made (what a worker returns to the driver)."""
    keep = [key for key in batch.non_tensor_batch if key not in MODEL_MEDIA_COLUMNS]
    return DataProto(batch.batch, {key: batch.non_tensor_batch[key] for key in keep}, batch.meta_info)
