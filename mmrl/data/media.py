"""Decoding of the media a sample refers to, into what the model's processor takes.

References: a path (absolute, or relative to a base folder), raw bytes or a ``{"bytes", "path"}`` dict
(Hugging Face ``datasets`` columns); images may also be PIL images, audio also a decoded
``{"array", "sampling_rate"}`` dict.

- Images (Pillow): RGB, scaled (aspect kept) so that their pixel count lies within
  ``[min_pixels, max_pixels]``.
- Videos (PyAV): frames sampled evenly at ``fps`` per second of video, or ``num_frames`` per video,
  at most ``max_frames``, their count a multiple of ``frame_multiple`` (the model's temporal patch:
  2 for Qwen), scaled into the pixel range like images. The sampling is kept (source fps and frame
  indices) so that the processor derives the seconds per frame that M-RoPE needs.
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

MIN_IMAGE_SIDE = 28  # Qwen-VL: one merged patch is 28×28 pixels; smaller images cannot be encoded


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


def scaled_size(width: int, height: int, min_pixels: int | None, max_pixels: int | None) -> tuple[int, int]:
    """``(width, height)`` scaled (aspect kept) so that width × height lies within [min_pixels, max_pixels];
    a None bound is no bound (EasyR1's null)."""
    pixels = width * height
    if max_pixels is not None and pixels > max_pixels:
        scale = math.sqrt(max_pixels / pixels)
    elif min_pixels is not None and pixels < min_pixels:
        scale = math.sqrt(min_pixels / pixels)
    else:
        return width, height
    # floor when shrinking and ceil when growing keeps the result inside the range
    rounding = math.floor if scale < 1 else math.ceil
    return max(1, rounding(width * scale)), max(1, rounding(height * scale))


def resize_to_pixel_range(image: Image.Image, min_pixels: int | None, max_pixels: int | None) -> Image.Image:
    """Scale ``image`` (aspect kept) so that width × height lies within [min_pixels, max_pixels]."""
    size = scaled_size(image.width, image.height, min_pixels, max_pixels)
    if size == image.size:
        return image
    return image.resize(size, Image.Resampling.BICUBIC)


def _check_patch_size(width: int, height: int, ref: Any, kind: str, min_pixels_key: str) -> None:
    if min(width, height) < MIN_IMAGE_SIDE:
        raise MediaError(
            f"{kind} {_describe(ref)} is {width}×{height} after resizing; both sides must be "
            f">= {MIN_IMAGE_SIDE} pixels (raise {min_pixels_key} or pad the {kind})"
        )


def load_image(
    ref: Any, min_pixels: int | None, max_pixels: int | None, base_dir: str | None = None
) -> Image.Image:
    """Decode one image reference into an RGB PIL image within the pixel range."""
    try:
        image = _open_image(ref, base_dir)
        image.load()  # decode now, so a truncated file fails here and not inside the processor
    except MediaError:
        raise
    except Exception as err:  # PIL raises many types for corrupt data
        raise MediaError(f"cannot decode image {_describe(ref)}: {err}") from err
    if image.mode != "RGB":
        image = image.convert("RGB")
    image = resize_to_pixel_range(image, min_pixels, max_pixels)
    _check_patch_size(image.width, image.height, ref, "image", "data.min_pixels")
    return image


def image_size(
    ref: Any, min_pixels: int | None, max_pixels: int | None, base_dir: str | None = None
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
    width, height = scaled_size(width, height, min_pixels, max_pixels)
    _check_patch_size(width, height, ref, "image", "data.min_pixels")
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


def sample_frame_indices(
    total_frames: int,
    source_fps: float,
    fps: float,
    num_frames: int | None,
    max_frames: int,
    frame_multiple: int,
) -> list[int]:
    """Evenly spaced frame indices ``round(linspace(0, total_frames - 1, count))``.

    ``count`` is ``num_frames`` when given, else the duration ``total_frames / source_fps`` × ``fps``;
    capped by ``max_frames`` and ``total_frames``, floored to a multiple of ``frame_multiple``, and at
    least ``frame_multiple`` (a shorter video repeats frames).
    """
    wanted = num_frames if num_frames is not None else total_frames / source_fps * fps
    count = min(wanted, max_frames, total_frames)
    count = max(frame_multiple, math.floor(count / frame_multiple + 1e-9) * frame_multiple)
    return np.linspace(0, total_frames - 1, count).round().astype(int).tolist()


def _decode_frames(source: str | bytes, wanted: set[int], size: tuple[int, int]) -> tuple[dict, int]:
    """RGB arrays ``[H, W, 3]`` of the ``wanted`` frame indices at ``size = (width, height)``, and
    the number of frames decoded."""
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


def _decoded_frames(ref: dict, min_pixels: int, max_pixels: int, frame_multiple: int) -> DecodedVideo:
    """Frames already sampled (a tool's ``VideoFrames``), scaled into the pixel range; the last frame
    repeated up to a multiple of the model's temporal patch."""
    frames = np.asarray(ref["frames"], dtype=np.uint8)
    if frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
        raise MediaError(f"video frames must be [T, H, W, 3] with T > 0, found shape {frames.shape}")
    size = scaled_size(frames.shape[2], frames.shape[1], min_pixels, max_pixels)
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
) -> DecodedVideo:
    """Sample frames of one video (see the module docstring); with ``audio_sampling_rate``, also its
    audio track (mono float32 at that rate, the first ``max_audio_seconds``). A ``{"frames", "fps"}``
    dict (frames a tool returned, ``[T, H, W, 3]`` uint8) is taken as already sampled."""
    if isinstance(ref, dict) and "frames" in ref:
        return _decoded_frames(ref, min_pixels, max_pixels, frame_multiple)
    source = _av_source(ref, base_dir, "video")
    try:
        source_fps, total, width, height = _stream_info(source, ref)
        size = scaled_size(width, height, min_pixels, max_pixels)
        _check_patch_size(*size, ref, "video frame", "data.video_min_pixels")
        if total <= 0:  # containers such as mkv don't store a frame count: count by decoding
            total = _decode_frames(source, set(), size)[1]
        if source_fps <= 0:
            raise MediaError(f"video {_describe(ref)} has no frame rate in its header")
        indices, decoded = [], {}
        for _ in range(2):  # a second pass when the header's frame count was wrong
            if total == 0:
                raise MediaError(f"video {_describe(ref)} has no decodable frames")
            indices = sample_frame_indices(total, source_fps, fps, num_frames, max_frames, frame_multiple)
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
