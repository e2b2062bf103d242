"""The ``data`` section of the config tree, and the ``path[@split]`` form of its dataset keys.

It lives with the data layer, which reads it (:class:`mmrl.data.dataset.PromptDataset` takes the
section whole); :mod:`mmrl.config` embeds it as ``PPOConfig.data``, so the keys stay ``data.*``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# The data files mmrl reads (mmrl.data.dataset.load_rows), by suffix; folders and hub ids besides.
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet", ".arrow")
DATA_FORMATS = (
    "a .jsonl, .json, .csv, .parquet or .arrow file, a `datasets` save_to_disk folder, a folder of such "
    "files, or a hub dataset id (owner/name); each may end in @split"
)


def unsupported_data_file(path: str) -> str | None:
    """Why the existing file ``path`` is no data file mmrl reads (its suffix), or None when it is one."""
    if not os.path.isfile(path) or path.endswith(DATA_FILE_SUFFIXES):
        return None
    suffix = os.path.splitext(path)[1] or "no suffix"
    return f"'{path}' ({suffix}) is not a data format mmrl reads: give {DATA_FORMATS}"


def split_dataset_spec(spec: str) -> tuple[str, str | None]:
    """``"data/train.parquet@train"`` → ``("data/train.parquet", "train")``; no ``@`` → split None."""
    path, sep, split = spec.rpartition("@")
    if not sep or not path:
        return spec, None
    return path, split


@dataclass(frozen=True)
class DataConfig:
    train_files: str = ""  # jsonl/json/csv/parquet/arrow file, `datasets` folder or hub id, optional `@split`; comma-separated
    val_files: str = ""  # same forms as train_files; empty = no validation
    prompt_key: str = "problem"  # column with the prompt text (may hold <image>/<video>/<audio> markers)
    answer_key: str = "answer"  # column with the ground truth handed to the reward function
    image_key: str = "images"  # column with a list of images (paths, bytes or {"bytes","path"} dicts)
    video_key: str = "videos"  # column with a list of videos (paths)
    audio_key: str = "audios"  # column with a list of audio files (paths)
    media_dir: str | None = None  # base folder of relative media paths; null = the data file's folder
    format_prompt: str | None = None  # Jinja template file applied to each prompt (gets `content` + columns)
    override_chat_template: str | None = None  # Jinja chat template file used instead of the tokenizer's
    system_prompt: str | None = None  # system message put before every prompt; null = the chat template's
    max_prompt_length: int = 512  # tokens, media placeholders included
    max_response_length: int = 512  # tokens generated per response
    filter_overlong_prompts: bool = True  # drop prompts over max_prompt_length at load (count is logged)
    preprocess_num_workers: int | None = None  # processes measuring prompts for the filter; null = auto
    prompt_length_cache: bool = True  # reuse the filter's lengths in later runs (in $MMRL_CACHE_DIR)
    rollout_batch_size: int = 512  # prompts per training step
    # algorithm.online_filtering: prompts generated per round while filling a step; null = rollout_batch_size
    mini_rollout_batch_size: int | None = None
    val_batch_size: int = -1  # prompts per validation batch; -1 = the whole validation set at once
    shuffle: bool = True  # reshuffle the training prompts every epoch
    seed: int = 1  # seed of the shuffling
    min_pixels: int | None = (
        262144  # images smaller than this many pixels are upscaled (aspect kept); null = never
    )
    max_pixels: int | None = (
        4194304  # images larger than this many pixels are downscaled (aspect kept); null = never
    )
    video_fps: float = 2.0  # video frames sampled per second of video (unless num_video_frames is set)
    num_video_frames: int | None = None  # frames evenly sampled per video (<= max_video_frames); null: fps
    max_video_frames: int = 64  # at most this many frames per video (counts are made even for Qwen)
    min_video_frames: int = 4  # at least this many frames per video sampled by video_fps (qwen-vl-utils' 4)
    video_min_pixels: int = 100352  # video frames smaller than this many pixels are upscaled (aspect kept)
    video_max_pixels: int = 602112  # video frames larger than this many pixels are downscaled (aspect kept)
    # a video's frames together at most this many pixels (counted per temporal patch of 2 frames, as
    # qwen-vl-utils' total_pixels): long videos get smaller frames, never under 1.05 × video_min_pixels;
    # null = qwen-vl-utils' default, 0.9 × 128000 tokens' worth (90316800 pixels at Qwen2.5-VL's 28×28)
    video_total_pixels: int | None = None
    max_audio_seconds: float = 30.0  # audio and video sound tracks are cut after this many seconds
    use_audio_in_video: bool = False  # Qwen-Omni: also feed each video's sound track, interleaved with frames
    skip_bad_samples: bool = False  # skip bad samples (unreadable media, marker mismatch) and count them
    dataloader_num_workers: int = 0  # worker processes decoding media for the driver's dataloader

    def check(self) -> list[str]:
        """Lengths, batch sizes, image and video bounds; the files are checked by mmrl.config.files."""
        positive = {
            "data.max_prompt_length": self.max_prompt_length,
            "data.max_response_length": self.max_response_length,
            "data.rollout_batch_size": self.rollout_batch_size,
        }
        errors = [f"{key}={value} must be > 0" for key, value in positive.items() if value <= 0]
        min_pixels, max_pixels = self.min_pixels, self.max_pixels
        for key, value in (("data.min_pixels", min_pixels), ("data.max_pixels", max_pixels)):
            if value is not None and value <= 0:
                errors.append(f"{key}={value} must be > 0 (or null for no bound)")
        if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
            errors.append(f"data.min_pixels={min_pixels} exceeds data.max_pixels={max_pixels}")
        _check_media(errors, self)
        return errors


def _check_media(errors: list[str], data: DataConfig) -> None:
    positive = {
        "data.video_fps": data.video_fps,
        "data.max_video_frames": data.max_video_frames,
        "data.min_video_frames": data.min_video_frames,
        "data.video_min_pixels": data.video_min_pixels,
        "data.max_audio_seconds": data.max_audio_seconds,
    }
    for key, value in positive.items():
        if value <= 0:
            errors.append(f"{key}={value} must be > 0")
    if data.num_video_frames is not None and data.num_video_frames <= 0:
        errors.append(
            f"data.num_video_frames={data.num_video_frames} must be > 0 (or null to sample by video_fps)"
        )
    if data.num_video_frames is not None and data.num_video_frames > data.max_video_frames > 0:
        # the sampling caps the count at max_video_frames: 1,024 frames asked with the default 64 would
        # silently give every video 64 frames
        errors.append(
            f"data.num_video_frames={data.num_video_frames} exceeds data.max_video_frames="
            f"{data.max_video_frames}, which caps every video's frames: raise data.max_video_frames to "
            f"{data.num_video_frames}"
        )
    if data.video_total_pixels is not None and data.video_total_pixels <= 0:
        errors.append(
            f"data.video_total_pixels={data.video_total_pixels} must be > 0 (or null for qwen-vl-utils' budget)"
        )
    if data.video_min_pixels > data.video_max_pixels:
        errors.append(
            f"data.video_min_pixels={data.video_min_pixels} exceeds data.video_max_pixels={data.video_max_pixels}"
        )
    if data.preprocess_num_workers is not None and data.preprocess_num_workers < 1:
        errors.append(
            f"data.preprocess_num_workers={data.preprocess_num_workers} must be >= 1 (or null for the driver's CPUs)"
        )
