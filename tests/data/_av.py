"""Small audio/video files for the media and dataset tests, written with PyAV and the ``wave`` module."""

from __future__ import annotations

import wave
from pathlib import Path

import av
import numpy as np


def grey_frames(num_frames: int, width: int = 56, height: int = 56) -> np.ndarray:
    """``[T, H, W, 3]`` uint8 frames, frame ``t`` uniformly grey at level ``20 + 20 t``: a decoded
    frame's mean tells which source frame it is (H.264 at quantiser 0 keeps grey levels exactly)."""
    levels = 20 + 20 * np.arange(num_frames, dtype=np.uint8)
    return np.broadcast_to(levels[:, None, None, None], (num_frames, height, width, 3)).copy()


def tone(seconds: float, sampling_rate: int = 16000, hz: float = 440.0, amplitude: float = 0.5) -> np.ndarray:
    time_s = np.arange(int(round(seconds * sampling_rate))) / sampling_rate
    return (amplitude * np.sin(2 * np.pi * hz * time_s)).astype(np.float32)


def write_video(
    path: Path,
    frames: np.ndarray | None,
    fps: int,
    audio: np.ndarray | None = None,
    sampling_rate: int = 16000,
) -> Path:
    """An H.264 video (quantiser 0) in the container of ``path``'s suffix (.mp4, .mov, .mkv), with a
    16-bit PCM mono sound track when ``audio`` is given (.mov/.mkv: PCM keeps the sample count exact).
    ``frames=None`` declares a video stream but writes no frame into it."""
    with av.open(str(path), "w") as container:
        video = container.add_stream("libx264", rate=fps)
        video.width, video.height = (56, 56) if frames is None else (frames.shape[2], frames.shape[1])
        video.pix_fmt = "yuv420p"
        video.options = {"qp": "0", "preset": "ultrafast"}
        sound = None
        if audio is not None:
            sound = container.add_stream("pcm_s16le", rate=sampling_rate)
            sound.layout = "mono"
            pcm = np.round(np.clip(audio, -1, 1) * 32767).astype(np.int16)
            for start in range(0, len(pcm), 1024):
                chunk = av.AudioFrame.from_ndarray(
                    pcm[None, start : start + 1024], format="s16", layout="mono"
                )
                chunk.sample_rate, chunk.pts = sampling_rate, start
                container.mux(sound.encode(chunk))
            container.mux(sound.encode(None))
        for frame in frames if frames is not None else []:
            container.mux(
                video.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24"))
            )
        if frames is not None:
            container.mux(video.encode(None))
    return path


def write_wav(path: Path, channels: list[np.ndarray], sampling_rate: int) -> Path:
    """16-bit PCM wav with one row of float samples in [-1, 1] per channel (none: an empty file)."""
    pcm = np.round(np.clip(np.stack(channels, axis=1), -1, 1) * 32767).astype("<i2") if channels else b""
    with wave.open(str(path), "wb") as file:
        file.setnchannels(max(1, len(channels)))
        file.setsampwidth(2)
        file.setframerate(sampling_rate)
        file.writeframes(pcm.tobytes() if channels else pcm)
    return path
