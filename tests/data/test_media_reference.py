"""Frames and images as Qwen's models were trained on them: mmrl's sampling and sizing equal
qwen-vl-utils' (the reference, imported here and nowhere in mmrl) on images and videos of many shapes
and lengths, and the processor leaves what mmrl sized as it is (no second resize, no cap warning)."""

from __future__ import annotations

import logging

import av
import numpy as np
import pytest
import torch
from _av import grey_frames, write_video
from PIL import Image

from mmrl.data.media import load_image, load_video, sample_frame_indices, smart_size, video_frame_count

vision_process = pytest.importorskip("qwen_vl_utils.vision_process")

SIDES = (1, 13, 27, 28, 29, 55, 57, 100, 224, 333, 480, 719, 1080, 1920, 4000)
PIXEL_RANGES = (
    (None, None),
    (3136, 12845056),
    (262144, 4194304),
    (100352, 602112),
    (50176, 50176),
    (1, 3136),
)


@pytest.mark.parametrize("factor", [28, 32])
def test_image_sizes_equal_smart_resize(factor):
    checked = 0
    for width in SIDES:
        for height in SIDES:
            if max(width, height) / min(width, height) > 200:
                continue
            for min_pixels, max_pixels in PIXEL_RANGES:
                # the reference puts its defaults where mmrl's bound is None (EasyR1's null: no bound)
                ref_min = min_pixels if min_pixels is not None else 0
                ref_max = max_pixels if max_pixels is not None else 10**12
                ref_h, ref_w = vision_process.smart_resize(height, width, factor, ref_min, ref_max)
                assert smart_size(width, height, factor, min_pixels, max_pixels) == (ref_w, ref_h), (
                    width, height, min_pixels, max_pixels,
                )  # fmt: skip
                checked += 1
    assert checked > 1000


@pytest.mark.parametrize(
    ("size", "mode", "pixels"),
    [
        ((640, 480), "RGB", (3136, 12845056)),
        ((333, 1000), "RGBA", (262144, 4194304)),
        ((50, 20), "L", (1, 10**6)),
    ],
)
def test_images_equal_fetch_image(size, mode, pixels):
    rng = np.random.default_rng(0)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = rng.integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    image = Image.fromarray(array.squeeze(-1) if channels == 1 else array, mode)
    min_pixels, max_pixels = pixels
    reference = vision_process.fetch_image(
        {"image": image, "min_pixels": min_pixels, "max_pixels": max_pixels}
    )
    ours = load_image(image, min_pixels, max_pixels, factor=28)
    assert ours.size == reference.size and ours.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(reference))  # RGBA onto white, bicubic


TOTALS = (1, 2, 3, 4, 5, 7, 8, 30, 61, 100, 299, 1001, 3600, 18000, 108000)


def test_frame_counts_and_indices_equal_smart_nframes():
    checked = 0
    for total in TOTALS:
        for source_fps in (1.0, 23.976, 25.0, 29.97, 30.0, 60.0):
            for max_frames in (4, 7, 64, 768, 1024):
                for fps in (0.1, 0.5, 1.0, 2.0, 3.3):
                    options = {"fps": fps, "min_frames": 4, "max_frames": max_frames}
                    try:
                        expected = vision_process.smart_nframes(options, total, source_fps)
                    except ValueError:  # a video shorter than one temporal patch: mmrl repeats frames
                        assert video_frame_count(total, source_fps, fps, None, max_frames, 2, 4) == 2
                        continue
                    assert video_frame_count(total, source_fps, fps, None, max_frames, 2, 4) == expected
                    checked += 1
                for asked in (1, 2, 3, 5, 7, 16, 33, 64, 101):
                    try:
                        expected = vision_process.smart_nframes({"nframes": asked}, total, source_fps)
                    except ValueError:  # more frames asked than the video has: mmrl caps them
                        continue
                    if expected <= max_frames:  # mmrl also caps num_video_frames at max_video_frames
                        assert video_frame_count(total, source_fps, 2.0, asked, max_frames, 2) == expected
                        checked += 1
            for count in {video_frame_count(total, source_fps, 2.0, None, 768, 2, 4), 4, 64}:
                if 2 <= count <= total:  # the reference readers' indices: linspace in float32, rounded
                    indices = sample_frame_indices(total, source_fps, 2.0, count, 768, 2)
                    assert indices == torch.linspace(0, total - 1, count).round().long().tolist()
    assert checked > 2000


def _pyav_reader(options):
    """A reference video reader over PyAV (qwen-vl-utils' own need torchvision.io.read_video, decord or
    torchcodec, none installed): decodes every frame, then samples as its decord reader does."""
    with av.open(options["video"]) as container:
        stream = container.streams.video[0]
        fps = float(stream.average_rate)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    video = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)  # [T, C, H, W]
    count = vision_process.smart_nframes(options, total_frames=len(frames), video_fps=fps)
    indices = torch.linspace(0, len(frames) - 1, count).round().long().tolist()
    metadata = {"fps": fps, "frames_indices": indices, "total_num_frames": len(frames)}
    return video[indices], metadata, count / len(frames) * fps


@pytest.mark.parametrize(
    ("frames", "width", "height", "source_fps", "options"),
    [
        (40, 120, 90, 10, {"fps": 2.0, "min_pixels": 3136, "max_pixels": 50176}),
        (9, 64, 200, 3, {"fps": 2.0, "min_pixels": 3136, "max_pixels": 50176}),  # 3 s: at least 4 frames
        (30, 100, 60, 5, {"nframes": 7, "min_pixels": 1000, "max_pixels": 20000}),
        # a total budget under the per-frame cap: 24 frames share 60000 pixels per temporal patch
        (48, 160, 120, 8, {"fps": 4.0, "min_pixels": 784, "max_pixels": 50176, "total_pixels": 60000}),
        # the budget's share below 1.05 × min_pixels: the floor wins
        (48, 160, 120, 8, {"fps": 4.0, "min_pixels": 3136, "max_pixels": 50176, "total_pixels": 20000}),
    ],
)
def test_videos_equal_fetch_video(tmp_path, monkeypatch, frames, width, height, source_fps, options):
    path = write_video(tmp_path / "clip.mp4", grey_frames(frames, width=width, height=height), fps=source_fps)
    monkeypatch.setitem(vision_process.VIDEO_READER_BACKENDS, "torchvision", _pyav_reader)
    monkeypatch.setattr(vision_process, "get_video_reader_backend", lambda: "torchvision")
    reference, metadata = vision_process.fetch_video(
        {"video": str(path), "min_frames": 4, "max_frames": 768, **options}, return_video_metadata=True
    )
    ours = load_video(
        str(path),
        options["min_pixels"],
        options["max_pixels"],
        fps=options.get("fps", 2.0),
        num_frames=options.get("nframes"),
        max_frames=768,
        min_frames=4,
        total_pixels=options.get("total_pixels", 10**12),
        factor=28,
    )
    assert list(ours.frame_indices) == metadata["frames_indices"]
    assert ours.frames.shape[:3] == (reference.shape[0], reference.shape[2], reference.shape[3])
    assert ours.frames.shape[1] % 28 == 0 and ours.frames.shape[2] % 28 == 0
    # the grey level of each frame (20 + 20 t) survives both decoders: the same source frames
    ref_levels = reference.mean(dim=(1, 2, 3)).numpy()
    np.testing.assert_allclose(ours.frames.reshape(len(ours.frames), -1).mean(axis=1), ref_levels, atol=2)


def test_processor_keeps_the_sizes_and_is_told_the_cap(tmp_path, tiny_vl_path, tiny_qwen3_vl_path, caplog):
    """Qwen2.5-VL reads the size range per frame, Qwen3-VL for all of a video's frames together: either
    way the frames mmrl sized keep their size, and the processors' per-frame cap question is answered
    (no warning)."""
    from transformers.utils import logging as hf_logging

    from mmrl.data.config import DataConfig
    from mmrl.data.processing import MediaProcessor, PromptMedia, load_tokenizer_and_processor

    write_video(tmp_path / "clip.mp4", grey_frames(24, width=160, height=120), fps=4)  # 6 s
    Image.new("RGB", (300, 200), (10, 200, 30)).save(tmp_path / "image.png")
    config = DataConfig(min_pixels=3136, max_pixels=50176, video_min_pixels=3136, video_max_pixels=50176)
    hf_logging.enable_propagation()
    for path in (tiny_vl_path, tiny_qwen3_vl_path):
        tokenizer, processor = load_tokenizer_and_processor(str(path))
        media_processor = MediaProcessor(tokenizer, processor, config)
        image_processor = processor.image_processor
        patch, factor = image_processor.patch_size, image_processor.patch_size * image_processor.merge_size
        prompt = processor.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "x"}],
                }
            ],
            add_generation_prompt=True,
        )
        media = PromptMedia(
            prompt=prompt,
            images=(str(tmp_path / "image.png"),),
            videos=(str(tmp_path / "clip.mp4"),),
            audios=(),
            order=("image", "video"),
            where="row 0",
        )
        with caplog.at_level(logging.WARNING):
            encoded, decoded = media_processor.encode(media)
        assert "per-frame pixel cap" not in caplog.text
        (image,) = decoded["images"]
        ((frames, _),) = decoded["videos"]
        expected_w, expected_h = smart_size(300, 200, factor, 3136, 50176)
        assert image.size == (expected_w, expected_h)
        assert frames.shape == (12, *smart_size(160, 120, factor, 3136, 50176)[::-1], 3)  # 6 s × 2 fps
        assert encoded["image_grid_thw"].tolist() == [[1, expected_h // patch, expected_w // patch]]
        assert encoded["video_grid_thw"].tolist() == [[6, frames.shape[1] // patch, frames.shape[2] // patch]]
