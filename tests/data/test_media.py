"""Video and audio decoding: which frames are sampled, their size and timing; audio rate, mono mix and
length; a video's own sound track; every unreadable input named."""

from __future__ import annotations

import numpy as np
import pytest
from _av import grey_frames, tone, write_video, write_wav

from mmrl.data.media import MediaError, load_audio, load_video, sample_frame_indices, scaled_size


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((8, 2.0, 2.0, None, 64, 2), list(range(8))),  # 4 s at 2 fps: every frame
        ((30, 30.0, 2.0, None, 64, 2), [0, 29]),  # 1 s at 2 fps: first and last
        ((100, 25.0, 2.0, None, 64, 2), [0, 14, 28, 42, 57, 71, 85, 99]),  # 4 s: round(k · 99/7)
        ((100, 25.0, 2.0, 7, 64, 2), [0, 14, 28, 42, 57, 71, 85, 99]),  # 7 asked: round(3.5) = 4 pairs
        ((100, 25.0, 2.0, 5, 64, 2), [0, 33, 66, 99]),  # 5 asked: round(2.5) = 2 pairs (to even)
        ((30, 30.0, 2.0, None, 64, 2, 4), [0, 10, 19, 29]),  # 1 s at 2 fps, at least 4 frames
        ((100, 25.0, 2.0, None, 4, 2), [0, 33, 66, 99]),  # capped by max_frames
        ((1, 25.0, 2.0, None, 64, 2), [0, 0]),  # one frame: repeated up to the temporal patch
        ((10, 5.0, 2.0, 5, 64, 1), [0, 2, 4, 7, 9]),  # no temporal patch: odd counts allowed
    ],
)
def test_sample_frame_indices(args, expected):
    assert sample_frame_indices(*args) == expected


def test_frames_sampled_at_fps_resized_and_timed(tmp_path):
    path = write_video(tmp_path / "grey.mp4", grey_frames(10, width=84, height=56), fps=5)  # 2 s
    video = load_video(str(path), min_pixels=3136, max_pixels=3136, fps=2.0)
    # 2 s × 2 fps = 4 frames: round(linspace(0, 9, 4)); 84×56 = 4704 px scaled by √(3136/4704) → 68×45
    assert video.frame_indices == (0, 3, 6, 9)
    assert video.frames.shape == (4, 45, 68, 3) and video.frames.dtype == np.uint8
    levels = video.frames.reshape(4, -1).mean(axis=1)
    np.testing.assert_allclose(levels, [20, 80, 140, 200], atol=2)  # frame t is grey 20 + 20 t
    assert video.sampled_fps == pytest.approx(2.0)  # 4 frames / 10 frames × 5 fps
    assert video.timestamps_s == pytest.approx([0.0, 0.6, 1.2, 1.8])
    assert video.metadata() == {
        "total_num_frames": 10,
        "fps": 5.0,
        "width": 68,
        "height": 45,
        "duration": 2.0,
        "video_backend": "pyav",
        "frames_indices": [0, 3, 6, 9],
    }
    fixed = load_video(str(path), min_pixels=10_000, max_pixels=10**6, num_frames=6)
    assert fixed.frame_indices == (0, 2, 4, 5, 7, 9) and fixed.sampled_fps == pytest.approx(3.0)
    assert fixed.frames.shape[1:3] == (82, 123)  # upscaled by √(10000/4704): ceil(81.6), ceil(122.5)
    assert scaled_size(84, 56, 10_000, 10**6) == (123, 82)
    # EasyR1's null bounds: no upscaling / no downscaling
    assert scaled_size(84, 56, None, 10**6) == (84, 56)
    assert scaled_size(2000, 1000, 10_000, None) == (2000, 1000)
    assert scaled_size(2000, 1000, None, 500_000) == (1000, 500)
    assert load_video(str(path), 3136, 3136, fps=5.0, max_frames=2).frame_indices == (0, 9)


def test_container_without_frame_count_decodes_the_same(tmp_path):
    frames = grey_frames(6)
    from_mp4 = load_video(str(write_video(tmp_path / "a.mp4", frames, fps=3)), 3136, 3136, fps=3.0)
    from_mkv = load_video(str(write_video(tmp_path / "a.mkv", frames, fps=3)), 3136, 3136, fps=3.0)
    assert from_mkv.source_num_frames == 6 and from_mkv.frame_indices == tuple(range(6))
    np.testing.assert_array_equal(from_mkv.frames, from_mp4.frames)
    from_bytes = load_video((tmp_path / "a.mp4").read_bytes(), 3136, 3136, fps=3.0)
    np.testing.assert_array_equal(from_bytes.frames, from_mp4.frames)


def test_audio_resampled_mixed_to_mono_and_cut(tmp_path):
    left = tone(0.5, sampling_rate=22050, hz=440.0, amplitude=0.5)
    path = write_wav(tmp_path / "stereo.wav", [left, np.zeros_like(left)], sampling_rate=22050)
    waveform = load_audio(str(path), sampling_rate=16000, max_seconds=30.0)
    assert waveform.dtype == np.float32 and waveform.shape == (8000,)  # 0.5 s at 16 kHz
    # channels averaged: a 0.5 sine in one channel and silence in the other give a 0.25 sine
    assert np.sqrt(np.mean(waveform[1000:-1000] ** 2)) == pytest.approx(0.25 / np.sqrt(2), rel=0.01)
    spectrum = np.abs(np.fft.rfft(waveform))
    assert np.argmax(spectrum) == pytest.approx(440 * 8000 / 16000, abs=1)  # the tone stays at 440 Hz
    assert load_audio(str(path), 16000, max_seconds=0.25).shape == (4000,)
    from_dict = load_audio({"bytes": path.read_bytes(), "path": "x.wav"}, 16000, 30.0)
    np.testing.assert_array_equal(from_dict, waveform)
    decoded = load_audio({"array": tone(0.5, 8000), "sampling_rate": 8000}, 16000, 30.0)
    assert decoded.shape == (8000,) and np.abs(decoded).max() == pytest.approx(0.5, abs=0.02)


def test_video_sound_track_for_use_audio_in_video(tmp_path):
    path = write_video(tmp_path / "talk.mov", grey_frames(8), fps=4, audio=tone(2.0))  # 2 s of both
    video = load_video(str(path), 3136, 3136, fps=4.0, audio_sampling_rate=16000, max_audio_seconds=30.0)
    assert video.frame_indices == tuple(range(8)) and video.audio.shape == (32000,)
    np.testing.assert_allclose(video.audio, tone(2.0), atol=1e-4)  # 16-bit PCM round trip
    assert load_video(str(path), 3136, 3136, audio_sampling_rate=8000, max_audio_seconds=1.0).audio.shape == (
        8000,
    )
    assert load_video(str(path), 3136, 3136).audio is None


def _write_case(tmp_path, case: str):
    if case == "garbage":
        (tmp_path / "broken.mp4").write_bytes(b"\x00\x01 not a video " * 64)
        return "broken.mp4"
    if case == "frameless":
        return write_video(tmp_path / "empty.mkv", None, fps=4, audio=tone(0.2)).name
    if case == "no_video_stream":
        return write_wav(tmp_path / "sound.wav", [tone(0.2)], 16000).name
    if case == "silent_video":
        return write_video(tmp_path / "silent.mp4", grey_frames(2), fps=2).name
    if case == "thin":
        return write_video(tmp_path / "thin.mp4", grey_frames(2, width=1000, height=20), fps=2).name
    return "nowhere.mp4"


@pytest.mark.parametrize(
    ("case", "options", "message"),
    [
        ("missing", {}, r"video file '.*nowhere\.mp4' does not exist"),
        ("garbage", {}, r"cannot decode video '.*broken\.mp4'"),
        ("frameless", {}, r"video '.*empty\.mkv' has no decodable frames"),
        ("no_video_stream", {}, r"video '.*sound\.wav' has no video stream"),
        (
            "silent_video",
            {"audio_sampling_rate": 16000},
            r"the audio track of video '.*silent\.mp4' \(data.use_audio_in_video\): .* has no audio stream",
        ),
        (
            "thin",
            {"min_pixels": 1, "max_pixels": 3136, "factor": 28},  # shrunk: the short side floors to 0
            r"is 392×0 after resizing; both sides must be >= 28 .*data.video_min_pixels",
        ),
    ],
)
def test_unreadable_videos_are_named(tmp_path, case, options, message):
    name = _write_case(tmp_path, case)
    kwargs = {"min_pixels": 3136, "max_pixels": 50176, **options}
    with pytest.raises(MediaError, match=message):
        load_video(name, base_dir=str(tmp_path), **kwargs)


def test_unreadable_audio_is_named(tmp_path):
    empty = write_wav(tmp_path / "empty.wav", [], 16000)
    with pytest.raises(MediaError, match=r"audio '.*empty\.wav' is empty \(zero samples\)"):
        load_audio(str(empty), 16000, 30.0)
    with pytest.raises(MediaError, match=r"audio file '.*gone\.wav' does not exist"):
        load_audio("gone.wav", 16000, 30.0, base_dir=str(tmp_path))
    (tmp_path / "noise.wav").write_bytes(b"RIFF but not really" * 8)
    with pytest.raises(MediaError, match=r"cannot decode audio '.*noise\.wav'"):
        load_audio(str(tmp_path / "noise.wav"), 16000, 30.0)
    with pytest.raises(MediaError, match="neither 'bytes' nor 'path'"):
        load_audio({"path": None}, 16000, 30.0)
