"""Prompt datasets with videos and audio: processor inputs that match the model (placeholder counts,
grids, feature lengths, M-RoPE timing), the decoded media a rollout engine takes, and bad samples named
or skipped and counted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from _av import grey_frames, tone, write_video, write_wav
from PIL import Image

from mmrl.config.loading import ConfigError, load_config
from mmrl.data.collate import collate_prompts
from mmrl.data.config import DataConfig
from mmrl.data.dataset import DataError, PromptDataset
from mmrl.data.processing import attach_media, load_tokenizer_and_processor
from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS
from mmrl.models.inputs import build_forward_inputs, compute_position_ids, concat_multi_modal_inputs
from mmrl.models.loading import load_model

MEDIA_RANGE = {
    "min_pixels": MIN_PIXELS,
    "max_pixels": MAX_PIXELS,
    "video_min_pixels": MIN_PIXELS,
    "video_max_pixels": MAX_PIXELS,
}


@pytest.fixture(scope="module")
def vl(tiny_vl_path):
    return load_tokenizer_and_processor(str(tiny_vl_path))


@pytest.fixture(scope="module")
def omni(tiny_omni_path):
    return load_tokenizer_and_processor(str(tiny_omni_path))


def make_dataset(path: Path, rows: list[dict], model, **kwargs) -> PromptDataset:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tokenizer, processor = model
    return PromptDataset(
        str(path), tokenizer, processor, DataConfig(max_prompt_length=512, **{**MEDIA_RANGE, **kwargs})
    )


def with_model_media(dataset: PromptDataset, position: int = 0) -> dict:
    """Item ``position`` with the ``multi_modal_inputs``/``multi_modal_data`` a worker makes for it."""
    item = dataset[position]
    batch = attach_media(collate_prompts([item], 0), dataset.media, rollout_media=True)
    return {**item, **{key: values[0] for key, values in batch.non_tensor_batch.items()}}


def count(item, tokenizer, token: str) -> int:
    return int((item["input_ids"] == tokenizer.convert_tokens_to_ids(token)).sum())


def audio_tokens(feature_frames: int) -> int:
    """Qwen2.5-Omni's audio tower: a stride-2 convolution, then 2× pooling."""
    return ((feature_frames - 1) // 2 + 1 - 2) // 2 + 1


def test_video_item_for_qwen2_5_vl(tmp_path, vl, tiny_vl_path):
    tokenizer, _ = vl
    write_video(tmp_path / "clip.mp4", grey_frames(8), fps=2)  # 4 s
    rows = [{"problem": "<video>Which way?", "answer": "left", "videos": ["clip.mp4"]}]
    # 4 of the 8 frames: sampled at 4 / 8 × 2 = 1 fps, so a temporal patch of 2 frames spans 2 s
    dataset = make_dataset(tmp_path / "d.jsonl", rows, vl, num_video_frames=4)
    item = with_model_media(dataset)
    inputs = item["multi_modal_inputs"]
    assert inputs["video_grid_thw"].tolist() == [[2, 4, 4]]  # 4 frames / 2, 56 px / 14
    assert inputs["pixel_values_videos"].shape == (2 * 4 * 4, 3 * 2 * 14 * 14)
    assert inputs["second_per_grid_ts"].tolist() == [2.0]
    video_pad = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert count(item, tokenizer, "<|video_pad|>") == 2 * 4 * 4 // 4  # one per merged 2×2 block
    assert item["mm_token_type_ids"].tolist() == ((item["input_ids"] == video_pad).long() * 2).tolist()
    assert item["raw_prompt_ids"].count(video_pad) == 1
    ((frames, metadata),) = item["multi_modal_data"]["videos"]
    assert frames.shape == (4, 56, 56, 3) and metadata["frames_indices"] == [0, 2, 5, 7]
    assert metadata["fps"] == 2.0 and metadata["total_num_frames"] == 8
    assert metadata["do_sample_frames"] is False  # sampled already: vLLM must not sample again

    # M-RoPE from the model's own get_rope_index: temporal ids step by seconds per patch (2) ×
    # tokens_per_second (2) = 4 between the two temporal patches; height/width ids span 2 merged rows
    model = load_model(str(tiny_vl_path))
    input_ids, mask = item["input_ids"][None], item["attention_mask"][None]
    media = concat_multi_modal_inputs([inputs])
    positions = compute_position_ids(model, input_ids, mask, media, item["mm_token_type_ids"][None])
    video = positions[:, 0, item["input_ids"] == video_pad]  # [3, 8]
    start = int(video[0, 0])
    assert video[0].tolist() == [start] * 4 + [start + 4] * 4
    assert video[1].tolist() == [start, start, start + 1, start + 1] * 2
    assert video[2].tolist() == [start, start + 1] * 4

    # the n samples of a prompt share its decoded frames
    repeated = collate_prompts([dataset[0]], tokenizer.pad_token_id).repeat(3)
    shared = attach_media(repeated, dataset.media, rollout_media=True).non_tensor_batch["multi_modal_data"]
    assert shared[0]["videos"][0][0] is shared[2]["videos"][0][0]


def test_image_and_two_videos_follow_their_markers(tmp_path, vl):
    tokenizer, _ = vl
    write_video(tmp_path / "long.mp4", grey_frames(8), fps=2)
    write_video(tmp_path / "short.mp4", grey_frames(4), fps=2)
    Image.new("RGB", (56, 56), (255, 0, 0)).save(tmp_path / "red.png")
    row = {
        "problem": "<video>a<image>b<video>c",
        "answer": "x",
        "videos": ["long.mp4", "short.mp4"],
        "images": ["red.png"],
    }
    item = with_model_media(make_dataset(tmp_path / "d.jsonl", [row], vl))
    inputs = item["multi_modal_inputs"]
    assert inputs["video_grid_thw"].tolist() == [[4, 4, 4], [2, 4, 4]]
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert inputs["second_per_grid_ts"].tolist() == [1.0, 1.0]
    assert count(item, tokenizer, "<|video_pad|>") == 16 + 8 and count(item, tokenizer, "<|image_pad|>") == 4
    ids = item["input_ids"]
    video_at = torch.nonzero(ids == tokenizer.convert_tokens_to_ids("<|video_pad|>")).flatten()
    image_at = torch.nonzero(ids == tokenizer.convert_tokens_to_ids("<|image_pad|>")).flatten()
    assert (
        video_at[15] < image_at.min() and image_at.max() < video_at[16]
    )  # 8-frame video, image, 4-frame video
    assert [len(frames) for frames, _ in item["multi_modal_data"]["videos"]] == [8, 4]
    assert len(item["multi_modal_data"]["images"]) == 1


def test_audio_item_for_qwen2_5_omni(tmp_path, omni):
    tokenizer, _ = omni
    write_wav(tmp_path / "beeps.wav", [tone(1.5)], 16000)
    rows = [{"problem": "<audio>How many beeps?", "answer": "2", "audios": ["beeps.wav"]}]
    dataset = make_dataset(tmp_path / "d.jsonl", rows, omni)
    assert dataset.media.audio_seconds == 10.0  # max_audio_seconds=30 is cut to the extractor's 10 s window
    item = with_model_media(dataset)
    inputs = item["multi_modal_inputs"]
    assert inputs["input_features"].shape == (1, 32, 1000)  # mel bins × the 10 s window at 100 frames/s
    assert int(inputs["feature_attention_mask"].sum()) == 150  # 1.5 s
    assert count(item, tokenizer, "<|AUDIO|>") == audio_tokens(150) == 37
    ((waveform, sampling_rate),) = item["multi_modal_data"]["audios"]
    assert waveform.shape == (24000,) and waveform.dtype == np.float32 and sampling_rate == 16000
    cut = with_model_media(make_dataset(tmp_path / "d.jsonl", rows, omni, max_audio_seconds=1.0))
    assert int(cut["multi_modal_inputs"]["feature_attention_mask"].sum()) == 100
    assert count(cut, tokenizer, "<|AUDIO|>") == audio_tokens(100) == 25


def test_video_with_its_sound_for_omni(tmp_path, omni, tiny_omni_path):
    tokenizer, _ = omni
    write_video(tmp_path / "talk.mov", grey_frames(8), fps=4, audio=tone(2.0))  # 2 s of both
    rows = [{"problem": "<video>What happens?", "answer": "x", "videos": ["talk.mov"]}]
    item = with_model_media(
        make_dataset(tmp_path / "d.jsonl", rows, omni, video_fps=4.0, use_audio_in_video=True)
    )
    inputs = item["multi_modal_inputs"]
    # frames kept at 56×56: without size= the Omni processor would scale them to its own 100k-pixel floor
    assert inputs["video_grid_thw"].tolist() == [[4, 4, 4]]
    assert inputs["video_second_per_grid"].tolist() == [0.5]  # 2 frames per patch at 4 fps
    assert inputs["use_audio_in_video"] is True
    assert int(inputs["feature_attention_mask"].sum()) == 200
    video_pad, audio_pad = (tokenizer.convert_tokens_to_ids(t) for t in ("<|VIDEO|>", "<|AUDIO|>"))
    assert count(item, tokenizer, "<|VIDEO|>") == 16 and count(item, tokenizer, "<|AUDIO|>") == audio_tokens(
        200
    )
    ((waveform, _),) = item["multi_modal_data"]["audios"]  # the video's own track, for the rollout engine
    assert waveform.shape == (32000,)

    # the thinker's own get_rope_index: 25 temporal ids per second for both streams, so the 4 temporal
    # patches (0.5 s apart) sit at 0, 12.5, 25, 37.5 and the 50 audio tokens (40 ms each) at 0 .. 49
    model = load_model(str(tiny_omni_path))
    ids = item["input_ids"]
    inputs = build_forward_inputs(model, ids[None], item["attention_mask"][None], [inputs])
    temporal = inputs["position_ids"][0, 0]  # [L]
    start = int(temporal[ids == audio_pad][0])
    assert temporal[ids == video_pad].unique().tolist() == [start, start + 12, start + 25, start + 37]
    assert temporal[ids == audio_pad].tolist() == list(range(start, start + 50))
    with torch.no_grad():  # features and placeholders agree, or the thinker raises
        logits = model(**inputs).logits
    assert logits.shape[:2] == (1, len(ids))


def _media_row(tmp_path: Path, kind: str) -> dict:
    Image.new("RGB", (84, 56), (255, 0, 0)).save(tmp_path / "red.png")
    write_video(tmp_path / "clip.mp4", grey_frames(8), fps=2)
    write_wav(tmp_path / "beeps.wav", [tone(1.5)], 16000)
    write_video(tmp_path / "talk.mov", grey_frames(8), fps=4, audio=tone(2.0))
    return {
        "image": {"problem": "<image>x", "images": ["red.png"]},
        "image_and_video": {"problem": "<video>a<image>b", "videos": ["clip.mp4"], "images": ["red.png"]},
        "audio": {"problem": "<audio>x", "audios": ["beeps.wav"]},
        "video_with_sound": {"problem": "<audio>a<video>b", "videos": ["talk.mov"], "audios": ["beeps.wav"]},
    }[kind]


def _old_driver_inputs(dataset: PromptDataset, row: dict, base_dir: Path) -> dict:
    """What the dataset item carried before media moved to the workers: the processor's outputs for
    media decoded from the row's own paths on the driver, without the token columns."""
    from mmrl.data.media import load_audio, load_image, load_video

    media, config = dataset.media, dataset.config
    rate = media.feature_extractor.sampling_rate if media.feature_extractor is not None else None
    images = [
        load_image(p, config.min_pixels, config.max_pixels, str(base_dir)) for p in row.get("images", [])
    ]
    videos = [
        load_video(
            p, config.video_min_pixels, config.video_max_pixels, fps=config.video_fps,
            frame_multiple=2, base_dir=str(base_dir),
            audio_sampling_rate=rate if config.use_audio_in_video else None, max_audio_seconds=media.audio_seconds,
        )
        for p in row.get("videos", [])
    ]  # fmt: skip
    audios = [load_audio(p, rate, media.audio_seconds, str(base_dir)) for p in row.get("audios", [])]
    prompt = dataset[0]["prompt_media"].prompt
    order = [part for part in ("audio", "video") if f"<{part}>" in row["problem"]]
    order.sort(key=lambda kind: row["problem"].index(f"<{kind}>"))
    audio_inputs = media._audio_inputs(order, videos, audios)
    encoded = media._run_processor(prompt, images, videos, audio_inputs, "row 0")
    return {
        key: value
        for key, value in encoded.items()
        if key not in ("input_ids", "attention_mask", "mm_token_type_ids")
    }


@pytest.mark.parametrize(
    ("kind", "model_name", "options"),
    [
        ("image", "vl", {}),
        ("image_and_video", "vl", {}),
        ("audio", "omni", {}),
        ("video_with_sound", "omni", {"video_fps": 4.0, "use_audio_in_video": True}),
    ],
)
def test_worker_media_equal_the_old_driver_side_inputs(tmp_path, request, kind, model_name, options):
    """The inputs a worker makes from the compact file bytes are exactly those the driver made from the
    paths before (same decoding, same processor call)."""
    row = {**_media_row(tmp_path, kind), "answer": "a"}
    dataset = make_dataset(tmp_path / "d.jsonl", [row], request.getfixturevalue(model_name), **options)
    made = with_model_media(dataset)["multi_modal_inputs"]
    expected = _old_driver_inputs(dataset, row, tmp_path)
    assert made.keys() == expected.keys() and made
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert made[key].dtype == value.dtype and torch.equal(made[key], value), key
        else:
            assert made[key] == value, key


def _bad_row(tmp_path: Path, case: str) -> dict:
    if case == "corrupt_video":
        (tmp_path / "broken.mp4").write_bytes(b"\x00 not a video " * 64)
        return {"problem": "<video>x", "videos": ["broken.mp4"]}
    if case == "frameless_video":
        write_video(tmp_path / "empty.mkv", None, fps=4, audio=tone(0.2))
        return {"problem": "<video>x", "videos": ["empty.mkv"]}
    if case == "missing_audio":
        return {"problem": "<audio>x", "audios": ["gone.wav"]}
    if case == "zero_length_audio":
        write_wav(tmp_path / "silent.wav", [], 16000)
        return {"problem": "<audio>x", "audios": ["silent.wav"]}
    if case == "videos_over_markers":
        return {"problem": "<video>x", "videos": ["good.mp4", "good.mp4"]}
    if case == "audios_over_markers":
        return {"problem": "<audio>x", "audios": ["good.wav", "good.wav"]}
    if case == "image_too_small":
        Image.new("RGB", (2010, 10)).save(tmp_path / "small.png")  # longer than 200 × its height
        return {"problem": "<image>x", "images": ["small.png"]}
    return {"problem": "<audio>x", "audios": ["good.wav"]}  # audio for a model without an audio tower


BAD_CASES = [
    ("corrupt_video", "vl", r"cannot decode video '.*broken\.mp4'"),
    ("frameless_video", "vl", r"video '.*empty\.mkv' has no decodable frames"),
    ("missing_audio", "omni", r"audio file '.*gone\.wav' does not exist"),
    ("zero_length_audio", "omni", r"audio '.*silent\.wav' is empty \(zero samples\)"),
    ("videos_over_markers", "vl", r"the prompt has 1 <video> marker\(s\) but the sample has 2 video\(s\)"),
    ("audios_over_markers", "omni", r"the prompt has 1 <audio> marker\(s\) but the sample has 2 audio\(s\)"),
    ("image_too_small", "vl", r"image '.*small\.png': 2010×10 has an aspect ratio over 200"),
    (
        "audio_for_a_vision_model",
        "vl",
        r"the sample has 1 audio\(s\) in column 'audios', but the model's processor takes no audios",
    ),
]


@pytest.mark.parametrize(("case", "model_name", "message"), BAD_CASES)
def test_bad_samples_named_or_skipped_and_counted(tmp_path, request, case, model_name, message):
    model = request.getfixturevalue(model_name)
    write_video(tmp_path / "good.mp4", grey_frames(2), fps=2)
    write_wav(tmp_path / "good.wav", [tone(0.3)], 16000)
    good = (
        {"problem": "<video>ok", "videos": ["good.mp4"]}
        if model_name == "vl"
        else {"problem": "<audio>ok", "audios": ["good.wav"]}
    )
    rows = [{**_bad_row(tmp_path, case), "answer": "a"}, {**good, "answer": "b"}]
    strict = make_dataset(tmp_path / "bad.jsonl", rows, model, filter_overlong_prompts=False, min_pixels=1)
    with pytest.raises(DataError, match=r"bad\.jsonl row 0: " + message):
        strict[0]
    with pytest.raises(DataError, match=r"bad\.jsonl row 0: "):  # the load-time pass stops at it too
        make_dataset(tmp_path / "bad.jsonl", rows, model, min_pixels=1)
    lenient = make_dataset(tmp_path / "bad.jsonl", rows, model, min_pixels=1, skip_bad_samples=True)
    assert len(lenient) == 1 and lenient.num_skipped == 1 and lenient.num_filtered == 0
    ((where, reason),) = lenient.skipped.items()
    assert where.endswith("bad.jsonl row 0") and reason.startswith(where)
    assert lenient[0]["ground_truth"] == "b"


def test_skipped_at_getitem_for_the_next_good_sample_counted_once(tmp_path, vl):
    write_video(tmp_path / "good.mp4", grey_frames(2), fps=2)
    good = {"problem": "<video>ok", "videos": ["good.mp4"], "answer": "good"}
    bad = {"problem": "<video>ok", "videos": ["gone.mp4"], "answer": "bad"}
    dataset = make_dataset(
        tmp_path / "d.jsonl", [good, bad, good, bad], vl, filter_overlong_prompts=False, skip_bad_samples=True
    )
    assert len(dataset) == 4 and dataset.num_skipped == 0  # nothing decoded yet
    assert dataset[1]["sample_index"] == 2 and dataset.num_skipped == 1
    assert dataset[1]["sample_index"] == 2 and dataset.num_skipped == 1  # the same stand-in, counted once
    assert dataset[3]["sample_index"] == 0 and dataset.num_skipped == 2  # wraps around
    all_bad = make_dataset(
        tmp_path / "b.jsonl", [bad, bad], vl, filter_overlong_prompts=False, skip_bad_samples=True
    )
    with pytest.raises(
        DataError, match=r"every sample of the dataset is bad \(2 skipped\); the first: .*row 0"
    ):
        all_bad[0]


def test_use_audio_in_video_needs_a_model_that_hears(tmp_path, vl):
    with pytest.raises(
        DataError, match="data.use_audio_in_video=true, but the model's processor takes no audio"
    ):
        make_dataset(tmp_path / "d.jsonl", [{"problem": "x", "answer": "a"}], vl, use_audio_in_video=True)


def test_media_keys_are_validated_at_config_load():
    args = [
        "data.video_fps=0",
        "data.num_video_frames=0",
        "data.video_min_pixels=10",
        "data.video_max_pixels=5",
    ]
    with pytest.raises(ConfigError) as raised:
        load_config([*args, "data.max_audio_seconds=-1"], check_paths=False)
    errors = "\n".join(raised.value.errors)
    assert "data.video_fps=0.0 must be > 0" in errors
    assert "data.num_video_frames=0 must be > 0" in errors
    assert "data.video_min_pixels=10 exceeds data.video_max_pixels=5" in errors
    assert "data.max_audio_seconds=-1.0 must be > 0" in errors


def test_num_video_frames_over_max_video_frames_is_refused_at_config_load():
    """The sampling caps num_video_frames at max_video_frames: 1,024 frames asked next to the default
    cap of 64 would train on 64 frames without a word."""
    with pytest.raises(ConfigError) as raised:
        load_config(["data.num_video_frames=1024"], check_paths=False)
    assert (
        "data.num_video_frames=1024 exceeds data.max_video_frames=64, which caps every video's frames: "
        "raise data.max_video_frames to 1024" in "\n".join(raised.value.errors)
    )
    load_config(["data.num_video_frames=1024", "data.max_video_frames=1024"], check_paths=False)
