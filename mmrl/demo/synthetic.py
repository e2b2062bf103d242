"""Synthetic image, video and audio tasks that a tiny model can learn by RL, as ready-to-train datasets.

Tasks (one image, video or audio clip per sample, one-word answers, answers balanced over each split):

- ``color``: one filled circle, square or triangle of one colour on a white background.
  "What colour is the shape? Answer with one word." -> ``red`` | ``green`` | ``blue`` | ``yellow``.
- ``count``: 1-4 non-overlapping blue circles of radius 7 px. "How many circles are there? Answer with
  a number." -> ``1`` .. ``4``.
- ``video_flashes``: a 56×56 white video of 12 frames at 2 fps (6 s) that turns yellow 1-3 times, each
  time for 2 frames (one temporal patch of Qwen-VL), with white gaps between.
  "How many times does the light flash? Answer with a number." -> ``1`` .. ``3``. No single frame
  answers it: the model must take in the whole clip.
- ``video_long_flashes``: the same question over a long clip: 1,024 frames of 56×56 at 2 fps (8.5 min),
  1-3 flashes of 2 frames each among 512 slots (none adjacent). A needle count for long-video runs
  (``bench/long_video.py``): 2,048 video tokens per clip at 56×56 with every frame kept.
- ``video_direction``: a blue dot of radius 5 px crossing a 56×56 white video (8 frames at 2 fps) at
  3-5 px per frame. "Which way does the dot move? Answer left or right." -> ``left`` | ``right``.
  Harder: the tiny Qwen2.5-VL stays at chance on it even trained supervised (300 steps of 16 clips).
- ``spatial``: one filled circle, square or triangle (any of the 4 colours, side 20-28 px) fully inside
  the left or the right half of the image; the left half is black, the right half white (the landmark).
  "Is the <shape> on the left or the right? Answer left or right." -> ``left`` | ``right``. Chance is 1/2, and a small policy easily settles on one word before
  it uses the image: every group then scores alike and plain GRPO stops learning (the dynamic-sampling
  demo, ``examples/tiny_cpu_spatial.yaml``).
- ``bigger``: two shapes of one kind (random), a red one and a blue one, one in each half of the image
  (which half at random): the answer's of side 22-27 px, the other's 10-14 px. "Which shape is bigger,
  the red one or the blue one? Answer red or blue." -> ``red`` | ``blue``. Both colours are in every
  image, so the colour does not answer, its share of the image does: a comparison that a policy settled
  on one word scores 1/2 on (the second task of ``bench/recipes.py``, on which the small-model recipe
  was not tuned).
- ``small_mark``: a 1120×1120 image of faintly tinted 20-px blocks (decoys: each block white mixed
  with up to 12 % of one of the 4 colours) with one small filled shape (side 5-6 px, one of the 4
  colours, drawn as ``color`` draws it) inside the white 7×7 square at its centre. "What colour is the
  small mark at the centre of the image? Answer with one word." -> the colour. At a pixel budget of
  56×56 (``data.max_pixels=3136``) the processor shrinks the image 20 times: the mark is a tint of at
  most 9 % on the centre pixel(s), among blocks tinted as much. The tool
  ``examples/tools/zoom_center.py`` returns the object in the centre 7×7 square at full resolution,
  enlarged to 56×56 pixels, which it fills as the ``color`` task's shapes do (the multi-turn demo,
  ``examples/tiny_cpu_agent.yaml``).
- ``clip_flashes``: the ``video_flashes`` question about a clip the prompt does not hold: the prompt
  shows a still (a white 56×56 frame, the light off, the same for every answer) and the row's ``clip``
  column holds the ``video_flashes`` clip, an mp4 as base64 text. The tool ``examples/tools/play_clip.py``
  returns the clip's 12 frames (the video-tool demo, ``examples/tiny_cpu_agent_video.yaml``). The clip
  travels in the row because a tool runs in a rollout worker, away from the data file's folder.
- ``audio_beeps``: 1-3 beeps (0.2 s of an 880 Hz sine) at random places in 1.5 s of 16 kHz silence.
  "How many beeps are there? Answer with a number." -> ``1`` .. ``3``.

Shapes are drawn without anti-aliasing, so every pixel is either the background or the answer colour.
Beeps have one length and loudness, so (as with the circles) the sound's energy grows in steps with the
count. A task is a ``SyntheticTask``: its question, its answers, its media kind and a function that
draws a sample (a PIL image, ``[T, H, W, 3]`` uint8 frames, or a float32 waveform) for a given answer;
a question that names what was drawn (``{shape}``) is filled in from a ``Drawn``'s fields, and a
``Drawn``'s columns (text) join the sample's row.

Output folder (``generate_shapes_dataset``), rows with columns ``problem`` (the question with an
``<image>``, ``<video>`` or ``<audio>`` marker), ``answer``, the media column (``images``, ``videos``
or ``audios``), ``data_source`` and the task's extra columns (``clip``):

- ``jsonl``: ``train.jsonl``, ``val.jsonl`` and ``images/{split}_{index:05d}.png`` (``videos/...mp4``:
  H.264 with lossless luma, written with PyAV; ``audios/...wav``: 16-bit PCM); the media column holds
  paths relative to the jsonl file's folder.
- ``parquet``: ``train.parquet``, ``val.parquet``; the media column holds ``{"bytes", "path": name}``
  structs like a Hugging Face ``datasets`` image column (for images the schema carries the ``datasets``
  features, so ``load_dataset("parquet", ...)`` decodes them to PIL images).

The folder is complete when ``BUILD_MARKER`` exists (written last); a second call with the same
arguments returns at once.

CLI: ``python -m mmrl.demo.synthetic --task color --out assets/data/shapes-color --n_train 512
--n_val 128 --seed 0 [--format jsonl|parquet] [--force]`` (``--task video_flashes`` /
``video_long_flashes`` / ``audio_beeps`` for the video and audio tasks, ``clip_flashes`` for the
video-tool demo)
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import json
import os
import shutil
import wave
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

BUILD_MARKER = "mmrl_dataset.json"
# Bumped when the drawing or the file layout changes, so stale folders are rebuilt.
BUILD_VERSION = 5  # 5: the spatial task's left half is black (was a 4-px black bar)

IMAGE_SIZE = 56  # px; a multiple of 28 (patch 14 x merge 2), so Qwen's resize keeps it as drawn
BACKGROUND_RGB = (255, 255, 255)
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 60),
    "blue": (30, 70, 220),
    "yellow": (235, 200, 20),
}
SHAPES = ("circle", "square", "triangle")
MAX_CIRCLES = 4
CIRCLE_RADIUS = 7  # px, every circle of the count task
COUNT_RGB = COLORS["blue"]
BIGGER_SIDES, SMALLER_SIDES = (22, 27), (10, 14)  # px, the bigger task's two shapes
SPLITS = ("train", "val")

VIDEO_FRAMES = 8  # video_direction
FLASH_SLOTS = 6  # video_flashes: 6 slots of 2 frames (one Qwen-VL temporal patch each) = 12 frames
MAX_FLASHES = 3  # the most non-adjacent slots among 6
FLASH_RGB = COLORS["yellow"]
LONG_VIDEO_FRAMES = 1024  # video_long_flashes: 512 slots of 2 frames
VIDEO_FPS = 2  # frames per second of the written file: data.video_fps=2 (the default) samples every frame
DOT_RADIUS = 5  # px
DOT_SPEEDS = (3, 4, 5)  # px per frame; at most 35 px over the 7 steps of an 8-frame video
DOT_RGB = COLORS["blue"]
AUDIO_SAMPLING_RATE = 16000  # Hz, Whisper's and Qwen2.5-Omni's feature extractor rate
AUDIO_SECONDS = 1.5  # every clip has this length, so only the beeps tell the count
BEEP_SECONDS = 0.2
BEEP_HZ = 880.0
BEEP_AMPLITUDE = 0.5
BEEP_FADE_SECONDS = 0.005  # linear fade in/out, no clicks
MIN_BEEP_GAP_SECONDS = 0.15  # silence between two beeps
AUDIO_MARGIN_SECONDS = 0.1  # silence before the first and after the last beep
MAX_BEEPS = 3
LANDMARK_RGB = (0, 0, 0)  # spatial: the left half's background (see draw_spatial_image)
SPATIAL_MIN_SIDE = 20  # px; the largest shape fills its 28-px half
MARK_IMAGE_SIZE = 1120  # px, small_mark: 20 times the 56-px pixel budget of the agent demo
MARK_WINDOW = 7  # px, small_mark: the white centre square the mark lies in (what zoom_center enlarges)
MARK_BLOCK = 20  # px, small_mark: side of the decoy blocks (one pixel at the 56-px budget)
MARK_MAX_TINT = 0.12  # small_mark: the strongest decoy tint (the mark's own at the budget is <= 9 %)
CLIP_COLUMN = "clip"  # clip_flashes: the row's clip (what examples/tools/play_clip.py plays), mp4 as base64


@dataclass(frozen=True)
class Drawn:
    """What a ``draw`` returns when the question names part of the sample or the row has more columns:
    the media, the fields that fill the question's ``{placeholders}``, and extra text columns of the row."""

    media: Any
    fields: dict[str, str] = field(default_factory=dict)
    columns: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SyntheticTask:
    """A generated task: ``draw(answer, rng)`` returns media whose correct answer is ``answer``: a PIL
    image, ``[T, H, W, 3]`` uint8 video frames or a ``[N]`` float32 waveform, by ``media``."""

    name: str
    question: str  # with the media marker, e.g. "<image>What colour ..."
    answers: tuple[str, ...]
    draw: Callable[[str, np.random.Generator], Any]
    media: str = "image"  # image | video | audio

    def sample(self, answer: str, rng: np.random.Generator) -> tuple[Any, str]:
        """``(media, question)`` of a new sample whose correct answer is ``answer``."""
        media, question, _ = self.sample_row(answer, rng)
        return media, question

    def sample_row(self, answer: str, rng: np.random.Generator) -> tuple[Any, str, dict[str, str]]:
        """``(media, question, extra columns)`` of a new sample whose correct answer is ``answer``."""
        drawn = self.draw(answer, rng)
        if isinstance(drawn, Drawn):
            return drawn.media, self.question.format(**drawn.fields), dict(drawn.columns)
        return drawn, self.question, {}

    @property
    def data_source(self) -> str:
        return f"shapes_{self.name}" if self.media == "image" else f"synthetic_{self.name}"

    @property
    def column(self) -> str:
        """The dataset column (and jsonl media folder) of this task's media: images, videos or audios."""
        return f"{self.media}s"


def _blank_image(size: int) -> Image.Image:
    return Image.new("RGB", (size, size), BACKGROUND_RGB)


def draw_shape(
    image: Image.Image, shape: str, box: tuple[int, int, int, int], rgb: tuple[int, int, int]
) -> None:
    """Fills ``shape`` inside ``box = (left, top, right, bottom)`` (inclusive pixels), no anti-aliasing."""
    draw = ImageDraw.Draw(image)
    left, top, right, bottom = box
    if shape == "circle":
        draw.ellipse(box, fill=rgb)
    elif shape == "square":
        draw.rectangle(box, fill=rgb)
    elif shape == "triangle":
        draw.polygon([((left + right) / 2, top), (left, bottom), (right, bottom)], fill=rgb)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


def draw_color_image(answer: str, rng: np.random.Generator, size: int = IMAGE_SIZE) -> Image.Image:
    """One shape of colour ``answer``, side 70-95 % of the image, anywhere fully inside it.

    Large shapes put the colour into every one of the tiny model's few image tokens (a 56-pixel image
    is 2x2 merged patches); with smaller ones RL on the random tiny vision tower stalls at 2 of 4 colours.
    """
    side = int(rng.integers(int(0.7 * size), int(0.95 * size) + 1))
    left, top = (int(v) for v in rng.integers(0, size - side + 1, size=2))
    image = _blank_image(size)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    draw_shape(image, shape, (left, top, left + side - 1, top + side - 1), COLORS[answer])
    return image


def draw_bigger_image(answer: str, rng: np.random.Generator, size: int = IMAGE_SIZE) -> Image.Image:
    """Two shapes of one kind, a red one and a blue one, each inside its own half (left or right at
    random): the ``answer`` colour's of side 22-27 px, the other's 10-14 px (2.5-7 times less area).

    Comparing two shapes: the colour itself does not answer (both are in every image), its share of the
    image does; a policy that names one colour whatever the image is right half the time.
    """
    if answer not in ("red", "blue"):
        raise ValueError(f"the bigger shape is 'red' or 'blue', found {answer!r}")
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    half = size // 2
    big_half = int(rng.integers(2))  # 0: the bigger shape in the left half
    image = _blank_image(size)
    for colour, (low, high), column in (
        (answer, BIGGER_SIDES, big_half),
        ("blue" if answer == "red" else "red", SMALLER_SIDES, 1 - big_half),
    ):
        side = int(rng.integers(low, high + 1))
        left = column * half + int(rng.integers(0, half - side + 1))
        top = int(rng.integers(0, size - side + 1))
        draw_shape(image, shape, (left, top, left + side - 1, top + side - 1), COLORS[colour])
    return image


def draw_spatial_image(answer: str, rng: np.random.Generator, size: int = IMAGE_SIZE) -> Drawn:
    """A shape of side 20-28 px (random kind and colour) fully inside the ``answer`` (left | right) half;
    the left half's background is black, the right half's white.

    Each half is 28 px, one column of the tiny model's 2x2 merged 28-px patches. The black half is a
    landmark whose cue survives averaging over the image tokens: the shape hides black (left) or white
    (right), 13-25 % of the pixels. A 4-px black bar at the left edge did not: the bar is in the image
    either way, so the summed content of the tokens is the same for both answers; and a patch of bar
    and white normalises (RMSNorm, no patch bias) to nearly a white patch. The tiny model learnt the
    bar supervised (~120 steps of 16 images) but RL, from a warm-up that answers at random, stayed at
    chance for 200 steps. Black, not grey: a uniform grey patch is a scaled white one after the
    processor's normalisation, and RMSNorm removes the scale.
    """
    if answer not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', found {answer!r}")
    half = size // 2
    side = int(rng.integers(SPATIAL_MIN_SIDE, half + 1))
    lowest, highest = (0, half - side) if answer == "left" else (half, size - side)
    left = int(rng.integers(lowest, highest + 1))
    top = int(rng.integers(0, size - side + 1))
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    rgb = list(COLORS.values())[int(rng.integers(len(COLORS)))]
    image = _blank_image(size)
    ImageDraw.Draw(image).rectangle((0, 0, half - 1, size - 1), fill=LANDMARK_RGB)
    draw_shape(image, shape, (left, top, left + side - 1, top + side - 1), rgb)
    return Drawn(image, {"shape": shape})


def draw_mark_image(answer: str, rng: np.random.Generator, size: int = MARK_IMAGE_SIZE) -> Image.Image:
    """small_mark: decoy blocks with one shape of colour ``answer`` in the white ``MARK_WINDOW``-px
    square at the centre (see the module docstring)."""
    blocks = size // MARK_BLOCK
    palette = np.array(list(COLORS.values()), dtype=np.float32)  # [4, 3]
    tints = rng.uniform(0, MARK_MAX_TINT, size=(blocks, blocks, 1)).astype(np.float32)
    colours = palette[rng.integers(len(palette), size=(blocks, blocks))]  # [b, b, 3]
    mixed = (1 - tints) * np.array(BACKGROUND_RGB, dtype=np.float32) + tints * colours
    pixels = np.repeat(np.repeat(np.round(mixed).astype(np.uint8), MARK_BLOCK, 0), MARK_BLOCK, 1)
    image = Image.fromarray(pixels)
    side = int(rng.integers(5, MARK_WINDOW))  # 5 or 6 px
    window = _blank_image(MARK_WINDOW)
    left, top = (int(v) for v in rng.integers(0, MARK_WINDOW - side + 1, size=2))
    draw_shape(window, SHAPES[int(rng.integers(len(SHAPES)))], (left, top, left + side - 1, top + side - 1),
               COLORS[answer])  # fmt: skip
    image.paste(window, ((size - MARK_WINDOW) // 2,) * 2)
    return image


def place_circles(
    count: int,
    rng: np.random.Generator,
    size: int = IMAGE_SIZE,
    radius: int = CIRCLE_RADIUS,
    gap: int = 2,
    max_tries: int = 1000,
) -> list[tuple[int, int, int]]:
    """``count`` circles ``(center_x, center_y, radius)`` inside the image, at least ``gap`` px apart.

    Rejection sampling; 4 circles of radius 7 fill ~20 % of a 56 px image, so they always fit.
    """
    circles: list[tuple[int, int, int]] = []
    for _ in range(max_tries):
        if len(circles) == count:
            return circles
        center_x, center_y = (int(v) for v in rng.integers(radius, size - radius, size=2))
        if all((center_x - x) ** 2 + (center_y - y) ** 2 > (radius + r + gap) ** 2 for x, y, r in circles):
            circles.append((center_x, center_y, radius))
    raise RuntimeError(f"could not place {count} circles in a {size} px image after {max_tries} tries")


def draw_count_image(answer: str, rng: np.random.Generator, size: int = IMAGE_SIZE) -> Image.Image:
    """``int(answer)`` separate blue circles of radius ``CIRCLE_RADIUS``.

    One size and one colour on purpose: the coloured area then grows in steps with the count, a cue
    that a 0.4M-parameter model picks up (with random radii and colours it stayed at chance).
    """
    image = _blank_image(size)
    for center_x, center_y, radius in place_circles(int(answer), rng, size):
        box = (center_x - radius, center_y - radius, center_x + radius, center_y + radius)
        draw_shape(image, "circle", box, COUNT_RGB)
    return image


def draw_direction_video(answer: str, rng: np.random.Generator, size: int = IMAGE_SIZE) -> np.ndarray:
    """``[VIDEO_FRAMES, size, size, 3]`` uint8: a blue dot moving ``answer`` (left | right) in a straight
    horizontal line at a constant 3-5 px per frame, fully inside every frame, at a random height."""
    if answer not in ("left", "right"):
        raise ValueError(f"direction must be 'left' or 'right', found {answer!r}")
    speed = int(rng.choice(DOT_SPEEDS))
    travel = speed * (VIDEO_FRAMES - 1)
    start = int(rng.integers(DOT_RADIUS, size - DOT_RADIUS - travel))  # leftmost centre of the path
    step = speed if answer == "right" else -speed
    if answer == "left":
        start += travel
    center_y = int(rng.integers(DOT_RADIUS, size - DOT_RADIUS))
    frames = []
    for index in range(VIDEO_FRAMES):
        image = _blank_image(size)
        center_x = start + index * step
        box = (center_x - DOT_RADIUS, center_y - DOT_RADIUS, center_x + DOT_RADIUS, center_y + DOT_RADIUS)
        draw_shape(image, "circle", box, DOT_RGB)
        frames.append(np.asarray(image))
    return np.stack(frames)


def flash_slots(count: int, rng: np.random.Generator) -> list[int]:
    """Which of the ``FLASH_SLOTS`` 2-frame slots light up: ``count`` of them, none adjacent (so every
    flash is a separate one), chosen uniformly among such sets."""
    choices = [
        slots
        for slots in itertools.combinations(range(FLASH_SLOTS), count)
        if all(b - a > 1 for a, b in zip(slots, slots[1:]))
    ]
    return list(choices[int(rng.integers(len(choices)))])


def draw_flashes_video(answer: str, rng: np.random.Generator, size: int = IMAGE_SIZE) -> np.ndarray:
    """``[2 * FLASH_SLOTS, size, size, 3]`` uint8: white frames, all yellow in the two frames of each of
    ``int(answer)`` slots (see ``flash_slots``): the whole screen lights up."""
    count = int(answer)
    if not 1 <= count <= MAX_FLASHES:
        raise ValueError(f"flash count must be 1..{MAX_FLASHES}, found {answer!r}")
    frames = np.full((2 * FLASH_SLOTS, size, size, 3), BACKGROUND_RGB, dtype=np.uint8)
    for slot in flash_slots(count, rng):
        frames[2 * slot : 2 * slot + 2] = FLASH_RGB
    return frames


def draw_flashes_still(answer: str, rng: np.random.Generator, size: int = IMAGE_SIZE) -> Drawn:
    """clip_flashes: the still the prompt shows (white: the light off, alike for every answer) and, in
    the row's ``CLIP_COLUMN``, the ``video_flashes`` clip of ``answer`` flashes as base64 mp4 text."""
    clip = mp4_bytes(draw_flashes_video(answer, rng, size))
    return Drawn(_blank_image(size), columns={CLIP_COLUMN: base64.b64encode(clip).decode("ascii")})


def spaced_slots(count: int, slots: int, rng: np.random.Generator) -> list[int]:
    """``count`` of ``slots`` slots, none adjacent, uniformly among such sets: ``count`` sorted draws
    from ``slots - count + 1`` places, the i-th moved i places on (which makes every gap >= 1)."""
    places = np.sort(rng.choice(slots - count + 1, size=count, replace=False))
    return [int(place) + i for i, place in enumerate(places)]


def draw_long_flashes_video(
    answer: str, rng: np.random.Generator, size: int = IMAGE_SIZE, frames: int = LONG_VIDEO_FRAMES
) -> np.ndarray:
    """``[frames, size, size, 3]`` uint8: white frames, all yellow in both frames of ``int(answer)``
    of the ``frames // 2`` two-frame slots (see ``spaced_slots``)."""
    count = int(answer)
    if not 1 <= count <= MAX_FLASHES:
        raise ValueError(f"flash count must be 1..{MAX_FLASHES}, found {answer!r}")
    video = np.full((frames, size, size, 3), BACKGROUND_RGB, dtype=np.uint8)
    for slot in spaced_slots(count, frames // 2, rng):
        video[2 * slot : 2 * slot + 2] = FLASH_RGB
    return video


def place_beeps(count: int, rng: np.random.Generator) -> list[float]:
    """Start times (s) of ``count`` beeps in an ``AUDIO_SECONDS`` clip: in order, ``MIN_BEEP_GAP_SECONDS``
    or more apart, ``AUDIO_MARGIN_SECONDS`` from the ends; the spare time is spread at random."""
    busy = count * BEEP_SECONDS + (count - 1) * MIN_BEEP_GAP_SECONDS + 2 * AUDIO_MARGIN_SECONDS
    slack = AUDIO_SECONDS - busy
    if slack < 0:
        raise ValueError(f"{count} beeps do not fit in {AUDIO_SECONDS} s")
    offsets = np.sort(rng.uniform(0.0, slack, size=count))
    return [
        AUDIO_MARGIN_SECONDS + float(offsets[i]) + i * (BEEP_SECONDS + MIN_BEEP_GAP_SECONDS)
        for i in range(count)
    ]


def draw_beeps_audio(answer: str, rng: np.random.Generator) -> np.ndarray:
    """``[AUDIO_SECONDS × 16000]`` float32: ``int(answer)`` equal beeps in silence (see ``place_beeps``)."""
    waveform = np.zeros(int(AUDIO_SECONDS * AUDIO_SAMPLING_RATE), dtype=np.float32)
    beep_samples = int(BEEP_SECONDS * AUDIO_SAMPLING_RATE)
    fade = int(BEEP_FADE_SECONDS * AUDIO_SAMPLING_RATE)
    time_s = np.arange(beep_samples) / AUDIO_SAMPLING_RATE
    envelope = np.minimum(
        1.0, np.minimum(np.arange(beep_samples) + 1, beep_samples - np.arange(beep_samples)) / fade
    )
    beep = (BEEP_AMPLITUDE * envelope * np.sin(2 * np.pi * BEEP_HZ * time_s)).astype(np.float32)
    for start_s in place_beeps(int(answer), rng):
        start = int(round(start_s * AUDIO_SAMPLING_RATE))
        waveform[start : start + beep_samples] = beep
    return waveform


TASKS: dict[str, SyntheticTask] = {
    "color": SyntheticTask(
        name="color",
        question="<image>What colour is the shape? Answer with one word.",
        answers=tuple(COLORS),
        draw=draw_color_image,
    ),
    "count": SyntheticTask(
        name="count",
        question="<image>How many circles are there? Answer with a number.",
        answers=tuple(str(n) for n in range(1, MAX_CIRCLES + 1)),
        draw=draw_count_image,
    ),
    "bigger": SyntheticTask(
        name="bigger",
        question="<image>Which shape is bigger, the red one or the blue one? Answer red or blue.",
        answers=("red", "blue"),
        draw=draw_bigger_image,
    ),
    "spatial": SyntheticTask(
        name="spatial",
        question="<image>Is the {shape} on the left or the right? Answer left or right.",
        answers=("left", "right"),
        draw=draw_spatial_image,
    ),
    "small_mark": SyntheticTask(
        name="small_mark",
        question="<image>What colour is the small mark at the centre of the image? Answer with one word.",
        answers=tuple(COLORS),
        draw=draw_mark_image,
    ),
    **{
        name: SyntheticTask(
            name=name,
            question="<video>How many times does the light flash? Answer with a number.",
            answers=tuple(str(n) for n in range(1, MAX_FLASHES + 1)),
            draw=draw,
            media="video",
        )
        for name, draw in (
            ("video_flashes", draw_flashes_video),
            ("video_long_flashes", draw_long_flashes_video),
        )
    },
    "clip_flashes": SyntheticTask(
        name="clip_flashes",
        question="<image>How many times does the light flash? Answer with a number.",
        answers=tuple(str(n) for n in range(1, MAX_FLASHES + 1)),
        draw=draw_flashes_still,
    ),
    "video_direction": SyntheticTask(
        name="video_direction",
        question="<video>Which way does the dot move? Answer left or right.",
        answers=("left", "right"),
        draw=draw_direction_video,
        media="video",
    ),
    "audio_beeps": SyntheticTask(
        name="audio_beeps",
        question="<audio>How many beeps are there? Answer with a number.",
        answers=tuple(str(n) for n in range(1, MAX_BEEPS + 1)),
        draw=draw_beeps_audio,
        media="audio",
    ),
}


def get_task(task: str) -> SyntheticTask:
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; expected one of {sorted(TASKS)}")
    return TASKS[task]


def draw_sample(task: str, rng: np.random.Generator) -> tuple[Any, str, str]:
    """A random sample of ``task``: ``(media, question, answer)``; the answer is drawn uniformly."""
    spec = get_task(task)
    answer = spec.answers[int(rng.integers(len(spec.answers)))]
    media, question = spec.sample(answer, rng)
    return media, question, answer


def balanced_answers(answers: tuple[str, ...], n: int, rng: np.random.Generator) -> list[str]:
    """``n`` answers in random order, each answer ``n // len(answers)`` or one more times."""
    cycled = [answers[i % len(answers)] for i in range(n)]
    return [cycled[i] for i in rng.permutation(n)]


def _png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def mp4_bytes(frames: np.ndarray, fps: int = VIDEO_FPS) -> bytes:
    """``[T, H, W, 3]`` uint8 frames (H, W even) as an H.264 mp4; quantiser 0 keeps luma lossless
    (colour is subsampled 2×2, so edges of coloured shapes blur slightly). Same frames, same bytes."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = "yuv420p"
        stream.options = {"qp": "0", "preset": "ultrafast"}
        for frame in frames:
            container.mux(
                stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24"))
            )
        container.mux(stream.encode(None))  # flush the encoder's delayed frames
    return buffer.getvalue()


def wav_bytes(waveform: np.ndarray, sampling_rate: int = AUDIO_SAMPLING_RATE) -> bytes:
    """A mono float waveform in [-1, 1] as 16-bit PCM wav (standard library ``wave``)."""
    pcm = np.round(np.clip(waveform, -1.0, 1.0) * 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as file:
        file.setnchannels(1)
        file.setsampwidth(2)
        file.setframerate(sampling_rate)
        file.writeframes(pcm.tobytes())
    return buffer.getvalue()


# media kind -> (file suffix, encoder of what the task's draw returns)
MEDIA_FILES: dict[str, tuple[str, Callable[[Any], bytes]]] = {
    "image": (".png", _png_bytes),
    "video": (".mp4", mp4_bytes),
    "audio": (".wav", wav_bytes),
}


def generate_split(spec: SyntheticTask, split: str, n: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Rows ``{"problem", "answer", "file_name", "file_bytes", "columns"}`` of one split, answers
    balanced (``columns``: the task's extra text columns)."""
    suffix, encode = MEDIA_FILES[spec.media]
    rows = []
    for index, answer in enumerate(balanced_answers(spec.answers, n, rng)):
        media, question, columns = spec.sample_row(answer, rng)
        rows.append(
            {"problem": question, "answer": answer, "file_name": f"{split}_{index:05d}{suffix}",
             "file_bytes": encode(media), "columns": columns}
        )  # fmt: skip
    return rows


def write_jsonl_split(rows: list[dict[str, Any]], out_dir: Path, split: str, spec: SyntheticTask) -> Path:
    """``{split}.jsonl`` with media paths relative to ``out_dir``, files under ``out_dir/<column>``."""
    (out_dir / spec.column).mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{split}.jsonl"
    with path.open("w", encoding="utf-8") as file:
        for row in rows:
            (out_dir / spec.column / row["file_name"]).write_bytes(row["file_bytes"])
            record = {
                "problem": row["problem"],
                "answer": row["answer"],
                spec.column: [f"{spec.column}/{row['file_name']}"],
                "data_source": spec.data_source,
                **row["columns"],
            }
            file.write(json.dumps(record) + "\n")
    return path


# Hugging Face `datasets` features of the parquet files; "Sequence" (not datasets>=4's "List") is
# read by datasets 3.x as well as 4/5.
_DATASETS_FEATURES = {
    "problem": {"dtype": "string", "_type": "Value"},
    "answer": {"dtype": "string", "_type": "Value"},
    "images": {"feature": {"_type": "Image"}, "_type": "Sequence"},
    "data_source": {"dtype": "string", "_type": "Value"},
}


def write_parquet_split(rows: list[dict[str, Any]], out_dir: Path, split: str, spec: SyntheticTask) -> Path:
    """``{split}.parquet`` with the media embedded as ``list<struct<bytes, path>>``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    file_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    # only images carry `datasets` features: its Video/Audio features would decode with torchcodec
    metadata = (
        {"huggingface": json.dumps({"info": {"features": _DATASETS_FEATURES}})}
        if spec.media == "image"
        else None
    )
    schema = pa.schema(
        [
            ("problem", pa.string()),
            ("answer", pa.string()),
            (spec.column, pa.list_(file_type)),
            ("data_source", pa.string()),
            *[(name, pa.string()) for name in (rows[0]["columns"] if rows else {})],
        ],
        metadata=metadata,
    )
    columns = {
        "problem": [row["problem"] for row in rows],
        "answer": [row["answer"] for row in rows],
        spec.column: [[{"bytes": row["file_bytes"], "path": row["file_name"]}] for row in rows],
        "data_source": [spec.data_source] * len(rows),
        **{name: [row["columns"][name] for row in rows] for name in (rows[0]["columns"] if rows else {})},
    }
    path = out_dir / f"{split}.parquet"
    pq.write_table(pa.table(columns, schema=schema), path)
    return path


def _read_marker(out_dir: Path) -> dict[str, Any] | None:
    marker = out_dir / BUILD_MARKER
    return json.loads(marker.read_text()) if marker.is_file() else None


def _build_request(task: str, n_train: int, n_val: int, seed: int, fmt: str) -> dict[str, Any]:
    """What a build is made from; stored in ``BUILD_MARKER`` and compared on the next call."""
    return {"task": task, "n_train": n_train, "n_val": n_val, "seed": seed, "format": fmt,
            "version": BUILD_VERSION}  # fmt: skip


def is_complete(out_dir: str | Path, task: str, n_train: int, n_val: int, seed: int, fmt: str) -> bool:
    """True when ``out_dir`` holds a finished build made from exactly these arguments."""
    return _read_marker(Path(out_dir)) == _build_request(task, n_train, n_val, seed, fmt)


def generate_shapes_dataset(
    task: str,
    out_dir: str | Path,
    n_train: int = 512,
    n_val: int = 128,
    seed: int = 0,
    fmt: str = "jsonl",
    force: bool = False,
) -> Path:
    """Writes the train/val splits of ``task`` into ``out_dir`` (see the module docstring).

    Returns at once when ``out_dir`` already holds a complete build with the same arguments. The build
    goes to a temporary sibling folder that is renamed when complete, so a killed run leaves no
    half-written dataset behind. A folder without the marker is never overwritten unless ``force``.
    """
    spec = get_task(task)
    if fmt not in ("jsonl", "parquet"):
        raise ValueError(f"unknown dataset format {fmt!r}; expected 'jsonl' or 'parquet'")
    out_dir = Path(out_dir)
    request = _build_request(task, n_train, n_val, seed, fmt)
    existing = _read_marker(out_dir)
    if existing == request and not force:
        return out_dir
    if out_dir.exists() and existing is None and any(out_dir.iterdir()) and not force:
        raise FileExistsError(
            f"{out_dir} exists, is not empty and was not written by mmrl.demo.synthetic "
            f"(no {BUILD_MARKER}); pass force=True (--force) to replace it or choose another folder"
        )

    tmp_dir = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    write_split = write_jsonl_split if fmt == "jsonl" else write_parquet_split
    for split, n in zip(SPLITS, (n_train, n_val)):
        write_split(generate_split(spec, split, n, rng), tmp_dir, split, spec)
    (tmp_dir / BUILD_MARKER).write_text(json.dumps(request, indent=2) + "\n")
    if _read_marker(out_dir) == request:  # another process finished the same build meanwhile
        shutil.rmtree(tmp_dir)
        return out_dir
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp_dir.rename(out_dir)
    return out_dir


def write_photo_dataset(
    out_dir: str | Path, n: int, size: int = 448, seed: int = 0, quality: int = 90
) -> Path:
    """``train.jsonl`` and ``val.jsonl`` (the same ``n`` rows) of the ``color`` task drawn at ``size``
    pixels over per-pixel noise and saved as JPEG (``images/*.jpg``): files of a photo's size
    (~100 kB at 448 px), for measuring what media weigh in transit. Rewritten on every call."""
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    spec = get_task("color")
    lines = []
    for index, answer in enumerate(balanced_answers(spec.answers, n, rng)):
        image = np.asarray(draw_color_image(answer, rng, size), dtype=np.int16)
        noisy = np.clip(image + rng.integers(-40, 41, size=image.shape), 0, 255).astype(np.uint8)
        name = f"images/photo_{index:05d}.jpg"
        Image.fromarray(noisy).save(out_dir / name, format="JPEG", quality=quality)
        row = {"problem": spec.question, "answer": answer, "images": [name], "data_source": "photo_color"}
        lines.append(json.dumps(row) + "\n")
    for split in SPLITS:
        (out_dir / f"{split}.jsonl").write_text("".join(lines))
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a synthetic dataset (see module docstring).")
    parser.add_argument("--task", choices=sorted(TASKS), default="color")
    parser.add_argument("--out", required=True, help="output folder, e.g. assets/data/shapes-color")
    parser.add_argument("--n_train", type=int, default=512)
    parser.add_argument("--n_val", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    args = parser.parse_args(argv)
    up_to_date = not args.force and is_complete(
        args.out, args.task, args.n_train, args.n_val, args.seed, args.format
    )
    out_dir = generate_shapes_dataset(
        args.task, args.out, args.n_train, args.n_val, args.seed, args.format, force=args.force
    )
    state = "up to date" if up_to_date else "built"
    print(
        f"[mmrl.demo.synthetic] {state}: task={args.task} train={args.n_train} val={args.n_val} "
        f"format={args.format} -> {out_dir}"
    )


if __name__ == "__main__":
    main()
