"""Synthetic shapes tasks: the drawn pixels agree with the answer, splits are balanced, files readable."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmrl.demo import synthetic
from mmrl.demo.synthetic import BACKGROUND_RGB, COLORS, draw_sample, generate_shapes_dataset


def _foreground(image: Image.Image) -> np.ndarray:
    """[H, W] bool: pixels that differ from the background."""
    pixels = np.asarray(image.convert("RGB"))
    return (pixels != np.array(BACKGROUND_RGB)).any(axis=-1)


def _count_components(mask: np.ndarray) -> int:
    """4-connected components of a [H, W] bool mask (flood fill; no scipy on the test machine)."""
    seen = np.zeros_like(mask)
    components = 0
    for start in zip(*np.nonzero(mask)):
        if seen[start]:
            continue
        components += 1
        stack = [start]
        seen[start] = True
        while stack:
            row, col = stack.pop()
            for next_row, next_col in ((row + 1, col), (row - 1, col), (row, col + 1), (row, col - 1)):
                inside = 0 <= next_row < mask.shape[0] and 0 <= next_col < mask.shape[1]
                if inside and mask[next_row, next_col] and not seen[next_row, next_col]:
                    seen[next_row, next_col] = True
                    stack.append((next_row, next_col))
    return components


def test_draw_sample_is_deterministic_per_seed():
    first = draw_sample("color", np.random.default_rng(7))
    second = draw_sample("color", np.random.default_rng(7))
    assert first[1:] == second[1:]
    assert np.array_equal(np.asarray(first[0]), np.asarray(second[0]))
    assert first[0].size == (56, 56) and first[0].mode == "RGB"


def test_color_pixels_match_the_answer():
    rng = np.random.default_rng(0)
    for _ in range(40):
        image, question, answer = draw_sample("color", rng)
        assert question == "<image>What colour is the shape? Answer with one word."
        pixels = np.asarray(image)
        foreground = _foreground(image)
        assert foreground.sum() >= 200  # the smallest shape, a triangle of side 22 px, covers ~242 px
        # No anti-aliasing: the mean non-background colour is exactly the answer's colour.
        assert pixels[foreground].mean(axis=0).tolist() == list(COLORS[answer])


def test_spatial_shape_lies_in_the_answer_half_and_the_question_names_it():
    rng = np.random.default_rng(0)
    seen = Counter()
    for _ in range(60):
        image, question, answer = draw_sample("spatial", rng)
        pixels = np.asarray(image)
        foreground = _foreground(image) & (pixels != synthetic.LANDMARK_RGB).any(axis=-1)
        landmark = (pixels == synthetic.LANDMARK_RGB).all(axis=-1)
        assert (landmark | foreground)[:, :28].all() and not landmark[:, 28:].any()  # the black left half
        columns = np.flatnonzero(foreground.any(axis=0))
        assert foreground.sum() >= 200  # the smallest shape, a triangle of side 20 px, covers ~200 px
        assert (columns.max() < 28) if answer == "left" else (columns.min() >= 28)
        assert len({tuple(rgb) for rgb in pixels[foreground]}) == 1  # one colour, no anti-aliasing
        shape = question.split("Is the ")[1].split(" on the")[0]
        assert question == f"<image>Is the {shape} on the left or the right? Answer left or right."
        assert shape in synthetic.SHAPES
        assert _count_components(foreground) == 1
        seen[shape, answer] += 1
    assert len(seen) == 6  # every shape on both sides


def test_spatial_dataset_is_balanced_and_scored_by_the_shapes_reward(tmp_path):
    from mmrl.rewards.rule import load_reward_function

    shapes_reward = Path(__file__).resolve().parents[2] / "reward_functions" / "shapes.py"
    compute_score = load_reward_function(f"{shapes_reward}:compute_score")
    out_dir = generate_shapes_dataset("spatial", tmp_path / "spatial", n_train=8, n_val=4, seed=0)
    rows = _read_jsonl(out_dir / "train.jsonl")
    assert Counter(row["answer"] for row in rows) == {"left": 4, "right": 4}
    assert {row["data_source"] for row in rows} == {"shapes_spatial"}
    responses = ["Left.", "right", "left<|im_end|>", "on the left"]
    scores = compute_score([{"response": r, "ground_truth": "left"} for r in responses])
    assert [score["overall"] for score in scores] == [1.0, 0.0, 1.0, 0.0]


def test_small_mark_is_a_decoy_tint_at_the_budget_and_whole_in_the_zoom_tool():
    from mmrl.agent.tools import load_tools

    shapes_reward = Path(__file__).resolve().parents[2] / "reward_functions" / "shapes.py"
    zoom_file = Path(__file__).resolve().parents[2] / "examples" / "tools" / "zoom_center.py"
    zoom = load_tools([str(zoom_file)])["zoom"]
    assert zoom.schema["function"]["parameters"]["properties"] == {}  # a call without arguments
    rng = np.random.default_rng(0)
    for _ in range(4):
        image, question, answer = draw_sample("small_mark", rng)
        assert image.size == (1120, 1120) and "small mark at the centre" in question
        zoomed = np.asarray(zoom.function(row={"images": [image]}))
        assert zoomed.shape == (56, 56, 3)
        mark = _foreground(Image.fromarray(zoomed))
        assert 0.5 <= mark.mean() <= 1.0  # the 5-6 px mark fills the view (its bounding box)
        assert {tuple(rgb) for rgb in zoomed[mark]} == {COLORS[answer]}
        # at the 56 x 56 budget the centre is tinted no more than the decoy blocks around it
        small = np.abs(np.asarray(image.resize((56, 56), Image.BICUBIC)).astype(int) - 255).max(-1)
        assert small[26:30, 26:30].max() <= small.max() and small.max() <= 0.12 * 255 + 2
    compute_score = load_reward_function_from(shapes_reward)
    from mmrl.agent.trajectory import TrajectoryRecord

    record = TrajectoryRecord(
        model_turns=2, turn_texts=['<tool_call>{"name": "zoom"}</tool_call>', "x", "red"]
    )
    scores = compute_score([{"response": "junk red", "ground_truth": "red", "trajectory": record},
                            {"response": "red", "ground_truth": "red"}])  # fmt: skip
    assert [score["overall"] for score in scores] == [1.0, 1.0]  # a trajectory's last model turn


def load_reward_function_from(path: Path):
    from mmrl.rewards.rule import load_reward_function

    return load_reward_function(f"{path}:compute_score")


def test_circle_count_matches_connected_components_and_area():
    one_circle = Image.new("RGB", (56, 56), BACKGROUND_RGB)
    synthetic.draw_shape(one_circle, "circle", (10, 10, 24, 24), synthetic.COUNT_RGB)  # radius 7
    circle_area = _foreground(one_circle).sum()
    rng = np.random.default_rng(1)
    answers = []
    for _ in range(40):
        image, question, answer = draw_sample("count", rng)
        assert question == "<image>How many circles are there? Answer with a number."
        assert _count_components(_foreground(image)) == int(answer)
        # Equal circles, no overlap, no anti-aliasing: the coloured area is count x one circle.
        assert _foreground(image).sum() == int(answer) * circle_area
        answers.append(answer)
    assert set(answers) == {"1", "2", "3", "4"}


def test_placed_circles_keep_their_gap():
    circles = synthetic.place_circles(4, np.random.default_rng(3), size=56, radius=7, gap=2)
    for index, (x, y, r) in enumerate(circles):
        assert r == 7 and r <= x <= 56 - r and r <= y <= 56 - r
        for other_x, other_y, other_r in circles[index + 1 :]:
            assert (x - other_x) ** 2 + (y - other_y) ** 2 > (r + other_r + 2) ** 2


def test_balanced_answers_differ_by_at_most_one():
    answers = synthetic.balanced_answers(("a", "b", "c", "d"), 10, np.random.default_rng(0))
    assert sorted(Counter(answers).values()) == [2, 2, 3, 3]


def test_unknown_task_names_the_choices():
    with pytest.raises(ValueError, match="color"):
        draw_sample("colour", np.random.default_rng(0))


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_dataset_rows_counts_balance_and_relative_paths(shapes_data_dir):
    train, val = _read_jsonl(shapes_data_dir / "train.jsonl"), _read_jsonl(shapes_data_dir / "val.jsonl")
    assert (len(train), len(val)) == (32, 8)
    assert Counter(row["answer"] for row in train) == dict.fromkeys(COLORS, 8)
    assert Counter(row["answer"] for row in val) == dict.fromkeys(COLORS, 2)
    for row in train + val:
        assert set(row) == {"problem", "answer", "images", "data_source"}
        assert row["problem"].startswith("<image>") and row["data_source"] == "shapes_color"
        (relative,) = row["images"]
        assert not Path(relative).is_absolute()
        image = Image.open(shapes_data_dir / relative)
        pixels = np.asarray(image.convert("RGB"))
        assert pixels[_foreground(image)].mean(axis=0).tolist() == list(COLORS[row["answer"]])


def test_parquet_embeds_the_same_images_as_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl_dir = generate_shapes_dataset("count", tmp_path / "jsonl", n_train=12, n_val=4, seed=5, fmt="jsonl")
    parquet_dir = generate_shapes_dataset(
        "count", tmp_path / "pq", n_train=12, n_val=4, seed=5, fmt="parquet"
    )

    table = pq.read_table(parquet_dir / "train.parquet")
    assert table.num_rows == 12
    image_type = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    assert table.schema.field("images").type == image_type
    features = json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]
    assert features["images"] == {"feature": {"_type": "Image"}, "_type": "Sequence"}

    jsonl_rows = _read_jsonl(jsonl_dir / "train.jsonl")
    for parquet_row, jsonl_row in zip(table.to_pylist(), jsonl_rows):
        assert parquet_row["answer"] == jsonl_row["answer"] and parquet_row["problem"] == jsonl_row["problem"]
        (embedded,) = parquet_row["images"]
        assert embedded["bytes"] == (jsonl_dir / jsonl_row["images"][0]).read_bytes()
        image = Image.open(io.BytesIO(embedded["bytes"]))
        assert _count_components(_foreground(image)) == int(parquet_row["answer"])
    assert Counter(row["answer"] for row in jsonl_rows) == {"1": 3, "2": 3, "3": 3, "4": 3}


def test_second_call_skips_changed_arguments_rebuild_and_foreign_folders_are_refused(tmp_path):
    out_dir = generate_shapes_dataset("color", tmp_path / "data", n_train=4, n_val=4, seed=0)
    stamp = (out_dir / "train.jsonl").stat().st_mtime_ns
    generate_shapes_dataset("color", out_dir, n_train=4, n_val=4, seed=0)
    assert (out_dir / "train.jsonl").stat().st_mtime_ns == stamp

    generate_shapes_dataset("color", out_dir, n_train=8, n_val=4, seed=0)
    assert len(_read_jsonl(out_dir / "train.jsonl")) == 8

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="force"):
        generate_shapes_dataset("color", foreign, n_train=4, n_val=4)


def test_cli_writes_then_reports_up_to_date(tmp_path, capsys):
    args = [
        "--task",
        "count",
        "--out",
        str(tmp_path / "cli"),
        "--n_train",
        "8",
        "--n_val",
        "4",
        "--format",
        "parquet",
    ]
    synthetic.main(args)
    synthetic.main(args)
    first, second = capsys.readouterr().out.strip().splitlines()
    assert first.startswith("[mmrl.demo.synthetic] built: task=count train=8 val=4 format=parquet")
    assert second.startswith("[mmrl.demo.synthetic] up to date")
    assert (tmp_path / "cli" / "val.parquet").is_file()


def _dot_centers_x(frames: np.ndarray) -> np.ndarray:
    """[T] mean column of the dark (dot) pixels of each frame; the background is white."""
    dark = frames.astype(int).sum(axis=-1) < 600  # [T, H, W]
    return np.array([np.nonzero(mask)[1].mean() for mask in dark])


def test_dot_moves_the_answered_way_also_after_mp4_round_trip():
    from mmrl.data.media import load_video

    rng = np.random.default_rng(4)
    answers = []
    for _ in range(12):
        frames, question, answer = draw_sample("video_direction", rng)
        assert question == "<video>Which way does the dot move? Answer left or right."
        assert frames.shape == (8, 56, 56, 3) and frames.dtype == np.uint8
        steps = np.diff(_dot_centers_x(frames))
        # one constant speed of 3-5 px per frame, positive exactly when the answer is "right"
        assert len(set(steps.tolist())) == 1 and abs(steps[0]) in synthetic.DOT_SPEEDS
        assert (steps[0] > 0) == (answer == "right")
        # the whole dot is inside every frame: equal dark areas
        assert len({int(area) for area in (frames.astype(int).sum(-1) < 600).sum(axis=(1, 2))}) == 1
        decoded = load_video(synthetic.mp4_bytes(frames), 3136, 3136, fps=synthetic.VIDEO_FPS).frames
        np.testing.assert_allclose(_dot_centers_x(decoded), _dot_centers_x(frames), atol=0.5)
        answers.append(answer)
    assert set(answers) == {"left", "right"}


def _lit_slots(frames: np.ndarray) -> list[int]:
    """2-frame slots whose frames are mostly not white (the light is on)."""
    lit = (frames.astype(int).sum(-1) < 700).mean(axis=(1, 2)) > 0.5  # [T]
    return [slot for slot in range(len(frames) // 2) if lit[2 * slot] and lit[2 * slot + 1]]


def test_flash_count_matches_the_lit_slots_also_after_mp4_round_trip():
    from mmrl.data.media import load_video

    rng = np.random.default_rng(5)
    answers = []
    for _ in range(12):
        frames, question, answer = draw_sample("video_flashes", rng)
        assert question == "<video>How many times does the light flash? Answer with a number."
        assert frames.shape == (12, 56, 56, 3) and frames.dtype == np.uint8
        slots = _lit_slots(frames)
        assert len(slots) == int(answer) and all(b - a > 1 for a, b in zip(slots, slots[1:]))  # separate
        # a frame is either lit (both frames of its slot) or white
        lit_frames = {2 * slot + i for slot in slots for i in (0, 1)}
        for index, frame in enumerate(frames):
            assert (frame == 255).all() == (index not in lit_frames)
        decoded = load_video(synthetic.mp4_bytes(frames), 3136, 3136, fps=synthetic.VIDEO_FPS).frames
        assert _lit_slots(decoded) == slots
        answers.append(answer)
    assert set(answers) == {"1", "2", "3"}
    # three flashes among six slots can only be every other slot
    assert synthetic.flash_slots(3, np.random.default_rng(0)) in ([0, 2, 4], [0, 2, 5], [0, 3, 5], [1, 3, 5])


def test_clip_flashes_prompt_holds_a_still_and_the_tool_plays_the_row_s_clip(tmp_path):
    from mmrl.agent.tools import ToolCall, ToolRunner, load_tools

    play_file = Path(__file__).resolve().parents[2] / "examples" / "tools" / "play_clip.py"
    tools = load_tools([str(play_file)])
    assert tools["play"].schema["function"]["parameters"]["properties"] == {}  # a call without arguments
    out_dir = generate_shapes_dataset("clip_flashes", tmp_path / "jsonl", n_train=6, n_val=3, seed=2)
    train = _read_jsonl(out_dir / "train.jsonl")
    assert Counter(row["answer"] for row in train) == {"1": 2, "2": 2, "3": 2}
    outputs = ToolRunner(tools).run([(ToolCall("play", {}), row) for row in train])
    for row, output in zip(train, outputs):
        assert set(row) == {"problem", "answer", "images", "data_source", "clip"}
        assert row["problem"] == "<image>How many times does the light flash? Answer with a number."
        still = np.asarray(Image.open(out_dir / row["images"][0]))
        assert still.shape == (56, 56, 3) and (still == 255).all()  # the same white still for every answer
        # what the tool returns is the clip: 12 frames at 2 fps, lit in `answer` separate slots
        assert output.error is None and output.describe_media() == ("video 12 frames",)
        assert output.videos[0].fps == synthetic.VIDEO_FPS
        assert len(_lit_slots(output.videos[0].array())) == int(row["answer"])
    parquet_dir = generate_shapes_dataset(
        "clip_flashes", tmp_path / "pq", n_train=6, n_val=3, seed=2, fmt="parquet"
    )
    import pyarrow.parquet as pq

    assert [row["clip"] for row in pq.read_table(parquet_dir / "train.parquet").to_pylist()] == [
        row["clip"] for row in train
    ]


def test_long_flashes_keep_their_count_through_mp4_and_1024_frame_sampling():
    from mmrl.data.media import load_video

    rng = np.random.default_rng(3)
    for answer in ("1", "3"):
        frames, question = synthetic.get_task("video_long_flashes").sample(answer, rng)
        assert question == "<video>How many times does the light flash? Answer with a number."
        assert frames.shape == (1024, 56, 56, 3) and frames.dtype == np.uint8
        slots = _lit_slots(frames)
        assert len(slots) == int(answer) and all(b - a > 1 for a, b in zip(slots, slots[1:]))
        assert (frames.reshape(1024, -1) == 255).all(axis=1).sum() == 1024 - 2 * int(answer)
        decoded = load_video(synthetic.mp4_bytes(frames), 3136, 3136, num_frames=1024, max_frames=1024)
        assert decoded.frames.shape[0] == 1024 and _lit_slots(decoded.frames) == slots
    # the densest case has one answer: every other slot
    assert synthetic.spaced_slots(3, 5, np.random.default_rng(0)) == [0, 2, 4]
    draws = [synthetic.spaced_slots(2, 4, np.random.default_rng(seed)) for seed in range(60)]
    assert {tuple(d) for d in draws} == {(0, 2), (0, 3), (1, 3)}


def _count_beeps(waveform: np.ndarray, sampling_rate: int = 16000) -> tuple[int, list[float]]:
    """Beeps by energy envelope: runs of 10 ms windows whose RMS exceeds 0.1; returns (count, lengths s)."""
    window = sampling_rate // 100
    usable = len(waveform) // window * window
    rms = np.sqrt((waveform[:usable].reshape(-1, window) ** 2).mean(axis=1))  # [windows]
    loud = np.concatenate([[False], rms > 0.1, [False]])
    starts, ends = np.nonzero(~loud[:-1] & loud[1:])[0], np.nonzero(loud[:-1] & ~loud[1:])[0]
    return len(starts), [(end - start) / 100 for start, end in zip(starts, ends)]


def test_beep_count_matches_the_energy_envelope_after_wav_round_trip(tmp_path):
    from mmrl.data.media import load_audio

    rng = np.random.default_rng(2)
    answers = []
    for index in range(12):
        waveform, question, answer = draw_sample("audio_beeps", rng)
        assert question == "<audio>How many beeps are there? Answer with a number."
        assert waveform.shape == (24000,) and waveform.dtype == np.float32  # 1.5 s at 16 kHz
        path = tmp_path / f"{index}.wav"
        path.write_bytes(synthetic.wav_bytes(waveform))
        decoded = load_audio(str(path), 16000, 30.0)
        beeps, lengths = _count_beeps(decoded)
        assert beeps == int(answer)
        assert all(abs(length - synthetic.BEEP_SECONDS) <= 0.02 for length in lengths)
        answers.append(answer)
    assert set(answers) == {"1", "2", "3"}
    starts = synthetic.place_beeps(3, np.random.default_rng(0))
    gaps = np.diff(starts) - synthetic.BEEP_SECONDS
    assert gaps.min() >= synthetic.MIN_BEEP_GAP_SECONDS and starts[-1] + synthetic.BEEP_SECONDS <= 1.5 - 0.1


@pytest.mark.parametrize(
    ("task", "column", "suffix"),
    [
        ("video_flashes", "videos", ".mp4"),
        ("video_direction", "videos", ".mp4"),
        ("audio_beeps", "audios", ".wav"),
    ],
)
def test_video_and_audio_datasets_layout(tmp_path, task, column, suffix):
    spec = synthetic.get_task(task)
    out_dir = generate_shapes_dataset(task, tmp_path / task, n_train=6, n_val=2, seed=1)
    train = _read_jsonl(out_dir / "train.jsonl")
    assert Counter(row["answer"] for row in train) == dict.fromkeys(spec.answers, 6 // len(spec.answers))
    for row in train:
        assert set(row) == {"problem", "answer", column, "data_source"}
        assert row["data_source"] == f"synthetic_{task}" and row["problem"] == spec.question
        (relative,) = row[column]
        assert relative.startswith(f"{column}/") and relative.endswith(suffix)
        assert (out_dir / relative).is_file()
    parquet_dir = generate_shapes_dataset(task, tmp_path / "pq", n_train=6, n_val=2, seed=1, fmt="parquet")
    import pyarrow.parquet as pq

    embedded = pq.read_table(parquet_dir / "train.parquet").to_pylist()
    assert [row[column][0]["bytes"] for row in embedded] == [
        (out_dir / row[column][0]).read_bytes() for row in train
    ]


def test_new_answer_words_are_single_tiny_tokens():
    from mmrl.demo import tiny

    tokenizer = tiny.train_tokenizer(tiny.TINY_CORPUS, tiny.SIZES["tiny"].vocab_size, "qwen2_5_omni")
    tiny.check_single_token_answers(tokenizer, ["left", "right", "1", "2", "3"])


def test_bigger_task_draws_the_answer_colour_larger_in_its_own_half():
    """Both colours in every image, the answer's shape 2.5-7 times the other's area, each in one half."""
    rng = np.random.default_rng(0)
    for _ in range(40):
        image, question, answer = draw_sample("bigger", rng)
        pixels = np.asarray(image)
        other = "blue" if answer == "red" else "red"
        big, small = ((pixels == COLORS[colour]).all(-1) for colour in (answer, other))
        assert question == "<image>Which shape is bigger, the red one or the blue one? Answer red or blue."
        assert 2 * small.sum() < big.sum() and small.sum() > 0
        half = pixels.shape[1] // 2
        columns = [np.nonzero(mask.any(0))[0] for mask in (big, small)]
        sides = [0 if c.max() < half else 1 if c.min() >= half else None for c in columns]
        assert sorted(sides) == [0, 1]  # each wholly inside a half, one per half
