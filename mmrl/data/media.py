"""Decoding of the media a sample refers to, into what the model's processor takes.

References: a path (absolute, or relative to a base folder), raw bytes or a ``{"bytes", "path"}`` dict
(Hugging Face ``datasets`` columns); images may also be PIL images, audio also a decoded
``{"array", "sampling_rate"}`` dict.

- Images (Pillow): RGB (transparency onto white), scaled (aspect kept) onto the model's patch grid
  (``factor``: 28 pixels for Qwen2/2.5-VL, 32 for Qwen3-VL) with their pixel count within
  ``[min_pixels, max_pixels]``.
- Videos (PyAV): frames sampled evenly at ``fps`` per second of video (at least ``min_frames``), or
  ``num_frames`` per video, at most ``max_frames``, their count a multiple of ``frame_multiple`` (the
  model's temporal patch: 2 for Qwen), sized like images with each frame's cap lowered to its share
  of the video's ``total_pixels`` budget. The sampling is kept (source fps and frame indices) so that
  the processor derives the seconds per frame that M-RoPE needs.

Sampling and sizing are those of qwen-vl-utils (Qwen's reference, the way its models saw frames in
training), written here without its torchvision readers; tests/data/test_media_reference.py proves
equality against it on many shapes and lengths. The processor is then told to leave the sizes as
they are (:mod:`mmrl.data.processing`).
- Audio (PyAV): resampled to the feature extractor's rate, mixed down to mono float32, cut after
  ``max_seconds``; a video's own audio track the same way.

Errors raise :class:`MediaError` naming the reference; the dataset adds the file and row.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from mmrl.errors import UserInputError

MAX_ASPECT_RATIO = 200  # Qwen-VL (qwen-vl-utils, transformers) refuses longer sides over 200 × the shorter

# the DataConfig fields that shape a media item's pixel rows (frames chosen, sizes, budgets)
MEDIA_SETTINGS = (
    "min_pixels",
    "max_pixels",
    "video_fps",
    "num_video_frames",
    "max_video_frames",
    "min_video_frames",
    "video_total_pixels",
    "video_min_pixels",
    "video_max_pixels",
)


class MediaError(UserInputError, ValueError):
    """A media reference that cannot be decoded; the message says which and why."""


def _describe(ref: Any) -> str:
    if isinstance(ref, (bytes, bytearray)):
        return f"<{len(ref)} bytes>"
    if isinstance(ref, dict):
        if "array" in ref:
            return f"<array of {np.asarray(ref['array']).shape} at {ref.get('sampling_rate')} Hz>"
        if ref.get("path"):  # the bytes were read from that file (the compact form names it)
            return repr(ref["path"])
        return f"<{len(ref.get('bytes') or b'')} bytes>"
    return repr(ref)[:200]


def _resolve_path(path: str, base_dir: str | None, kind: str) -> str:
    full = path if os.path.isabs(path) or base_dir is None else os.path.join(base_dir, path)
    if not os.path.isfile(full):
        raise MediaError(f"{kind} file '{full}' does not exist")
    return full


def _open_image(ref: Any, base_dir: str | None) -> Image.Image:
    if isinstance(ref, Image.Image):
        return ref
    if isinstance(ref, dict):
        if ref.get("bytes"):
            return Image.open(io.BytesIO(ref["bytes"]))
        if ref.get("path"):
            return _open_image(ref["path"], base_dir)
        raise MediaError("image dict has neither 'bytes' nor 'path'")
    if isinstance(ref, (bytes, bytearray)):
        return Image.open(io.BytesIO(ref))
    if isinstance(ref, str):
        return Image.open(_resolve_path(ref, base_dir, "image"))
    raise MediaError(
        f"an image must be a path, bytes, a {{'bytes','path'}} dict or a PIL image, found {type(ref).__name__}"
    )


def smart_size(
    width: int, height: int, factor: int, min_pixels: int | None, max_pixels: int | None
) -> tuple[int, int]:
    """``(width, height)`` on the model's patch grid: both sides multiples of ``factor`` (the merged
    patch: 28 pixels for Qwen2/2.5-VL, 32 for Qwen3-VL), their product within [min_pixels,
    max_pixels], the aspect kept as closely as the grid allows.

    Equal to qwen-vl-utils' ``smart_resize`` (the sizing Qwen's models were trained with; proved in
    tests/data/test_media_reference.py), except that a None bound is no bound (EasyR1's null) where
    the reference would put its defaults. ``factor=1`` is a plain scale into the pixel range.
    """
    if factor > 1 and max(width, height) / max(1, min(width, height)) > MAX_ASPECT_RATIO:
        raise MediaError(
            f"{width}×{height} has an aspect ratio over {MAX_ASPECT_RATIO}, which Qwen's models cannot encode"
        )
    grid_w = max(factor, round(width / factor) * factor)
    grid_h = max(factor, round(height / factor) * factor)
    if max_pixels is not None and grid_w * grid_h > max_pixels:
        beta = math.sqrt(width * height / max_pixels)  # shrink, then floor onto the grid: stays <= max
        grid_w = math.floor(width / beta / factor) * factor
        grid_h = math.floor(height / beta / factor) * factor
    elif min_pixels is not None and grid_w * grid_h < min_pixels:
        beta = math.sqrt(min_pixels / (width * height))  # grow, then ceil onto the grid: stays >= min
        grid_w = math.ceil(width * beta / factor) * factor
        grid_h = math.ceil(height * beta / factor) * factor
    return grid_w, grid_h


def scaled_size(width: int, height: int, min_pixels: int | None, max_pixels: int | None) -> tuple[int, int]:
    """``(width, height)`` scaled (aspect kept) so that width × height lies within [min_pixels, max_pixels];
    a None bound is no bound (EasyR1's null). :func:`smart_size` with no grid."""
    return smart_size(width, height, 1, min_pixels, max_pixels)


def resize_to_pixel_range(
    image: Image.Image, min_pixels: int | None, max_pixels: int | None, factor: int = 1
) -> Image.Image:
    """Scale ``image`` onto the ``factor`` grid, its pixel count within [min_pixels, max_pixels]
    (:func:`smart_size`)."""
    size = smart_size(image.width, image.height, factor, min_pixels, max_pixels)
    if size == image.size:
        return image
    return image.resize(size, Image.Resampling.BICUBIC)


def _check_patch_size(width: int, height: int, ref: Any, kind: str, min_pixels_key: str, factor: int) -> None:
    min_side = max(factor, 1)
    if min(width, height) < min_side:  # only a downscale of a very long, thin image gets here
        raise MediaError(
            f"{kind} {_describe(ref)} is {width}×{height} after resizing; both sides must be "
            f">= {min_side} pixels (raise {min_pixels_key} or pad the {kind})"
        )


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB; transparent pixels become white, as qwen-vl-utils' ``to_rgb`` makes them."""
    if image.mode == "RGBA":
        white = Image.new("RGB", image.size, (255, 255, 255))
        white.paste(image, mask=image.split()[3])
        return white
    return image.convert("RGB") if image.mode != "RGB" else image


def load_image(
    ref: Any, min_pixels: int | None, max_pixels: int | None, base_dir: str | None = None, factor: int = 1
) -> Image.Image:
    """Decode one image reference into an RGB PIL image on the ``factor`` grid within the pixel range
    (:func:`smart_size`)."""
    try:
        image = _open_image(ref, base_dir)
        image.load()  # decode now, so a truncated file fails here and not inside the processor
    except MediaError:
        raise
    except Exception as err:  # PIL raises many types for corrupt data
        raise MediaError(f"cannot decode image {_describe(ref)}: {err}") from err
    try:
        size = smart_size(image.width, image.height, factor, min_pixels, max_pixels)
    except MediaError as err:
        raise MediaError(f"image {_describe(ref)}: {err}") from None
    _check_patch_size(*size, ref, "image", "data.min_pixels", factor)
    image = _to_rgb(image)
    return image if size == image.size else image.resize(size, Image.Resampling.BICUBIC)


def image_size(
    ref: Any, min_pixels: int | None, max_pixels: int | None, base_dir: str | None = None, factor: int = 1
) -> tuple[int, int]:
    """``(width, height)`` that :func:`load_image` would return, read from the file's header alone (no
    pixels decoded): what a prompt's length needs. A truncated file passes here and fails at load."""
    try:
        image = _open_image(ref, base_dir)
        width, height = image.size
        if image is not ref:  # a PIL image of the caller's stays open
            image.close()
    except MediaError:
        raise
    except Exception as err:  # PIL raises many types for data that is no image
        raise MediaError(f"cannot decode image {_describe(ref)}: {err}") from err
    try:
        width, height = smart_size(width, height, factor, min_pixels, max_pixels)
    except MediaError as err:
        raise MediaError(f"image {_describe(ref)}: {err}") from None
    _check_patch_size(width, height, ref, "image", "data.min_pixels", factor)
    return width, height


# ---- audio and video (PyAV) ---------------------------------------------------------------------


def _av_source(ref: Any, base_dir: str | None, kind: str) -> str | bytes:
    """A path or the raw bytes of an audio/video reference (PyAV opens either)."""
    if isinstance(ref, dict):
        if ref.get("bytes"):
            return bytes(ref["bytes"])
        if ref.get("path"):
            return _av_source(ref["path"], base_dir, kind)
        raise MediaError(f"{kind} dict has neither 'bytes' nor 'path'")
    if isinstance(ref, (bytes, bytearray)):
        return bytes(ref)
    if isinstance(ref, str):
        return _resolve_path(ref, base_dir, kind)
    raise MediaError(
        f"a {kind} must be a path, bytes or a {{'bytes','path'}} dict, found {type(ref).__name__}"
    )


def _open_container(source: str | bytes):
    import av

    return av.open(io.BytesIO(source) if isinstance(source, bytes) else source)


def _resample_to_mono(frames: Iterable[Any], sampling_rate: int, max_samples: int) -> np.ndarray:
    """Audio frames → mono float32 ``[N]`` at ``sampling_rate``, N <= max_samples.

    Channels are resampled separately and then averaged (as librosa's ``mono=True`` does); FFmpeg's
    own stereo→mono downmix would sum them × 1/√2 instead.
    """
    import av

    resampler = av.AudioResampler(format="fltp", rate=sampling_rate)  # keeps the channel layout
    chunks, num_samples = [], 0
    for frame in frames:
        for out in resampler.resample(frame):
            chunks.append(out.to_ndarray())  # [channels, n]
            num_samples += chunks[-1].shape[-1]
        if num_samples >= max_samples:
            break
    else:
        chunks += [out.to_ndarray() for out in resampler.resample(None)]  # flush the resampler's tail
    if not chunks:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate(chunks, axis=-1).mean(axis=0)[:max_samples].astype(np.float32)


def _audio_from_array(ref: dict[str, Any], sampling_rate: int, max_samples: int) -> np.ndarray:
    import av

    array = np.asarray(ref["array"], dtype=np.float32)
    if array.ndim == 2:  # [channels, samples]
        array = array.mean(axis=0)
    if array.ndim != 1 or not ref.get("sampling_rate"):
        raise MediaError(
            f"audio {_describe(ref)}: expected a 1-D or [channels, samples] array and a sampling_rate"
        )
    if int(ref["sampling_rate"]) == sampling_rate or array.size == 0:
        return array[:max_samples]
    frame = av.AudioFrame.from_ndarray(array[None], format="fltp", layout="mono")
    frame.sample_rate = int(ref["sampling_rate"])
    return _resample_to_mono([frame], sampling_rate, max_samples)


def load_audio(ref: Any, sampling_rate: int, max_seconds: float, base_dir: str | None = None) -> np.ndarray:
    """Decode the first audio stream of an audio (or video) file: mono float32 ``[N]`` at
    ``sampling_rate`` Hz, the first ``max_seconds`` of it."""
    max_samples = max(1, int(round(max_seconds * sampling_rate)))
    try:
        if isinstance(ref, dict) and "array" in ref:
            waveform = _audio_from_array(ref, sampling_rate, max_samples)
        else:
            with _open_container(_av_source(ref, base_dir, "audio")) as container:
                if not container.streams.audio:
                    raise MediaError(f"{_describe(ref)} has no audio stream")
                waveform = _resample_to_mono(container.decode(audio=0), sampling_rate, max_samples)
    except MediaError:
        raise
    except Exception as err:  # PyAV raises its own error types (InvalidDataError, ...) for bad data
        raise MediaError(f"cannot decode audio {_describe(ref)}: {err}") from err
    if waveform.size == 0:
        raise MediaError(f"audio {_describe(ref)} is empty (zero samples)")
    return waveform


@dataclass(frozen=True)
class DecodedVideo:
    """Frames sampled from one video, with the sampling that produced them."""

    frames: np.ndarray  # [T, H, W, 3] uint8 RGB; T a multiple of the model's temporal patch
    source_fps: float  # frames per second of the file
    source_num_frames: int  # frames in the file
    frame_indices: tuple[int, ...]  # the file's frame shown by each sampled frame
    audio: np.ndarray | None = None  # [N] float32 mono: the video's audio track, when asked for

    @property
    def sampled_fps(self) -> float:
        """``T / source_num_frames × source_fps``: Qwen's convention (qwen-vl-utils, transformers'
        ``VideoMetadata.sampled_fps``); the processor makes it M-RoPE's ``temporal_patch / sampled_fps``
        seconds per temporal patch."""
        return len(self.frame_indices) / self.source_num_frames * self.source_fps

    @property
    def timestamps_s(self) -> list[float]:
        return [index / self.source_fps for index in self.frame_indices]

    def metadata(self) -> dict[str, Any]:
        """The fields of transformers' ``VideoMetadata`` (also what vLLM takes next to the frames)."""
        return {
            "total_num_frames": self.source_num_frames,
            "fps": self.source_fps,
            "width": int(self.frames.shape[2]),
            "height": int(self.frames.shape[1]),
            "duration": self.source_num_frames / self.source_fps,
            "video_backend": "pyav",
            "frames_indices": list(self.frame_indices),
        }


def video_frame_count(
    total_frames: int,
    source_fps: float,
    fps: float,
    num_frames: int | None,
    max_frames: int,
    frame_multiple: int,
    min_frames: int = 1,
) -> int:
    """How many frames to sample, as qwen-vl-utils' ``smart_nframes`` counts them (with the same
    arithmetic, so float edges fall the same way):

    - ``num_frames`` given: rounded to the nearest multiple of ``frame_multiple`` (the temporal patch);
    - else the duration × ``fps``, at least ``min_frames`` (rounded up to the multiple), at most
      ``max_frames`` and the video's frames (rounded down), then floored to the multiple.

    Where the reference refuses (more frames asked than the video has, a video shorter than one
    temporal patch), mmrl caps ``num_frames`` at the video's and ``max_frames``, and a too-short video
    repeats frames up to ``frame_multiple``.
    """
    multiple = max(1, frame_multiple)
    if num_frames is not None:
        count = round(num_frames / multiple) * multiple
        count = min(count, math.floor(min(max_frames, total_frames) / multiple) * multiple)
    else:
        low = math.ceil(min_frames / multiple) * multiple
        high = math.floor(min(max_frames, total_frames) / multiple) * multiple
        wanted = total_frames / source_fps * fps
        count = math.floor(min(max(wanted, low), high, total_frames) / multiple) * multiple
    return max(multiple, count)


def sample_frame_indices(
    total_frames: int,
    source_fps: float,
    fps: float,
    num_frames: int | None,
    max_frames: int,
    frame_multiple: int,
    min_frames: int = 1,
) -> list[int]:
    """Evenly spaced frame indices ``round(linspace(0, total_frames - 1, count))``, ``count`` from
    :func:`video_frame_count` (a video shorter than ``count`` repeats frames). The linspace is torch's
    in float32, as in qwen-vl-utils' readers: float64 picks a neighbouring frame in long videos."""
    import torch

    count = video_frame_count(
        total_frames, source_fps, fps, num_frames, max_frames, frame_multiple, min_frames
    )
    return torch.linspace(0, total_frames - 1, count, dtype=torch.float32).round().long().tolist()


def video_frame_max_pixels(
    num_frames: int, min_pixels: int, max_pixels: int, total_pixels: int | None, frame_multiple: int
) -> int:
    """The pixel cap of each of a video's ``num_frames`` frames: ``max_pixels`` (the per-frame cap),
    lowered to the video's even share of ``total_pixels`` (counted per temporal patch of
    ``frame_multiple`` frames, as qwen-vl-utils counts its ``total_pixels``) but never below
    1.05 × ``min_pixels``. ``total_pixels=None``: no total budget."""
    if total_pixels is None:
        return max_pixels
    share = total_pixels / num_frames * max(1, frame_multiple)
    return min(max_pixels, max(share, int(min_pixels * 1.05)))


def _decode_frames(source: str | bytes, wanted: set[int], size: tuple[int, int] | None) -> tuple[dict, int]:
    """RGB arrays ``[H, W, 3]`` of the ``wanted`` frame indices at ``size = (width, height)``, and
    the number of frames decoded (``size`` None: count only)."""
    frames, count = {}, 0
    with _open_container(source) as container:
        for count, frame in enumerate(container.decode(video=0), start=1):
            if count - 1 in wanted:
                resized = frame.reformat(
                    width=size[0], height=size[1], format="rgb24", interpolation="BICUBIC"
                )
                frames[count - 1] = resized.to_ndarray()
    return frames, count


def _stream_info(source: str | bytes, ref: Any) -> tuple[float, int, int, int]:
    """``(fps, frame count or 0 when unknown, width, height)`` of the first video stream."""
    with _open_container(source) as container:
        if not container.streams.video:
            raise MediaError(f"video {_describe(ref)} has no video stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        return (
            float(rate or 0),
            int(stream.frames or 0),
            stream.codec_context.width,
            stream.codec_context.height,
        )


def _decoded_frames(
    ref: dict, min_pixels: int, max_pixels: int, frame_multiple: int, total_pixels: int | None, factor: int
) -> DecodedVideo:
    """Frames already sampled (a tool's ``VideoFrames``), sized as :func:`load_video` sizes decoded
    ones; the last frame repeated up to a multiple of the model's temporal patch."""
    frames = np.asarray(ref["frames"], dtype=np.uint8)
    if frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
        raise MediaError(f"video frames must be [T, H, W, 3] with T > 0, found shape {frames.shape}")
    count = len(frames) + (-len(frames) % max(1, frame_multiple))
    frame_max = video_frame_max_pixels(count, min_pixels, max_pixels, total_pixels, frame_multiple)
    size = smart_size(frames.shape[2], frames.shape[1], factor, min_pixels, frame_max)
    if size != (frames.shape[2], frames.shape[1]):
        frames = np.stack(
            [np.asarray(Image.fromarray(frame).resize(size, Image.BICUBIC)) for frame in frames]
        )
    missing = -len(frames) % max(1, frame_multiple)
    if missing:
        frames = np.concatenate([frames, np.repeat(frames[-1:], missing, axis=0)])
    return DecodedVideo(frames, float(ref.get("fps", 2.0)), len(frames), tuple(range(len(frames))))


def load_video(
    ref: Any,
    min_pixels: int,
    max_pixels: int,
    fps: float = 2.0,
    num_frames: int | None = None,
    max_frames: int = 64,
    frame_multiple: int = 2,
    base_dir: str | None = None,
    audio_sampling_rate: int | None = None,
    max_audio_seconds: float = 30.0,
    min_frames: int = 1,
    total_pixels: int | None = None,
    factor: int = 1,
) -> DecodedVideo:
    """Sample frames of one video (see the module docstring) and size them on the ``factor`` grid:
    :func:`smart_size` within ``min_pixels`` and :func:`video_frame_max_pixels` (the per-frame cap
    ``max_pixels``, lowered to the frames' share of ``total_pixels``), as qwen-vl-utils' ``fetch_video``
    sizes them. With ``audio_sampling_rate``, also the audio track (mono float32 at that rate, the
    first ``max_audio_seconds``). A ``{"frames", "fps"}`` dict (frames a tool returned,
    ``[T, H, W, 3]`` uint8) is taken as already sampled and only sized."""
    if isinstance(ref, dict) and "frames" in ref:
        return _decoded_frames(ref, min_pixels, max_pixels, frame_multiple, total_pixels, factor)
    source = _av_source(ref, base_dir, "video")
    try:
        source_fps, total, width, height = _stream_info(source, ref)
        if total <= 0:  # containers such as mkv don't store a frame count: count by decoding
            total = _decode_frames(source, set(), None)[1]
        if source_fps <= 0:
            raise MediaError(f"video {_describe(ref)} has no frame rate in its header")
        indices, decoded = [], {}
        for _ in range(2):  # a second pass when the header's frame count was wrong
            if total == 0:
                raise MediaError(f"video {_describe(ref)} has no decodable frames")
            indices = sample_frame_indices(
                total, source_fps, fps, num_frames, max_frames, frame_multiple, min_frames
            )
            frame_max = video_frame_max_pixels(
                len(indices), min_pixels, max_pixels, total_pixels, frame_multiple
            )
            try:
                size = smart_size(width, height, factor, min_pixels, frame_max)
            except MediaError as err:
                raise MediaError(f"video {_describe(ref)}: {err}") from None
            _check_patch_size(*size, ref, "video frame", "data.video_min_pixels", factor)
            decoded, found = _decode_frames(source, set(indices), size)
            if found == total:
                break
            total = found
        if any(index not in decoded for index in indices):
            raise MediaError(f"video {_describe(ref)} gives a different number of frames on each decoding")
        frames = np.stack([decoded[index] for index in indices])  # [T, H, W, 3]
    except MediaError:
        raise
    except Exception as err:  # PyAV raises its own error types (InvalidDataError, ...) for bad data
        raise MediaError(f"cannot decode video {_describe(ref)}: {err}") from err
    audio = None
    if audio_sampling_rate is not None:
        try:
            audio = load_audio(source, audio_sampling_rate, max_audio_seconds)
        except MediaError as err:
            raise MediaError(
                f"the audio track of video {_describe(ref)} (data.use_audio_in_video): {err}"
            ) from None
    return DecodedVideo(frames, source_fps, total, tuple(indices), audio)
