"""Synthetic image tasks that a tiny model can learn by RL, written as ready-to-train datasets.

Tasks (one image per sample, one-word answers, answers balanced over each split):

- ``color``: one filled circle, square or triangle of one colour on a white background.
  "What colour is the shape? Answer with one word." -> ``red`` | ``green`` | ``blue`` | ``yellow``.
- ``count``: 1-4 non-overlapping blue circles of radius 7 px. "How many circles are there? Answer with
  a number." -> ``1`` .. ``4``.

Shapes are drawn without anti-aliasing, so every pixel is either the background or the answer colour.
A task is a ``SyntheticTask``: its question, its answers and a function that draws a sample for a given
answer. Video and audio tasks plug in as more entries of ``TASKS`` with a media kind of their own.

Output folder (``generate_shapes_dataset``), rows with columns ``problem`` (the question with an
``<image>`` marker), ``answer``, ``images`` and ``data_source``:

- ``jsonl``: ``train.jsonl``, ``val.jsonl`` and ``images/{split}_{index:05d}.png``; ``images`` holds
  paths relative to the jsonl file's folder.
- ``parquet``: ``train.parquet``, ``val.parquet``; ``images`` holds ``{"bytes": png, "path": name}``
  structs like a Hugging Face ``datasets`` image column (the schema carries the ``datasets`` features,
  so ``load_dataset("parquet", ...)`` decodes them to PIL images).

The folder is complete when ``BUILD_MARKER`` exists (written last); a second call with the same
arguments returns at once.

CLI: ``python -m mmrl.data.synthetic --task color --out assets/data/shapes-color --n_train 512
--n_val 128 --seed 0 [--format jsonl|parquet] [--force]``
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

BUILD_MARKER = "mmrl_dataset.json"
# Bumped when the drawing or the file layout changes, so stale folders are rebuilt.
BUILD_VERSION = 2

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
SPLITS = ("train", "val")


@dataclass(frozen=True)
class SyntheticTask:
    """A generated task: ``draw(answer, rng)`` returns an image whose correct answer is ``answer``."""

    name: str
    question: str  # with the media marker, e.g. "<image>What colour ..."
    answers: tuple[str, ...]
    draw: Callable[[str, np.random.Generator], Image.Image]
    media: str = "image"  # column kind: "image" now; "video" / "audio" tasks come later

    @property
    def data_source(self) -> str:
        return f"shapes_{self.name}"


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
    """One shape of colour ``answer``, side 40-70 % of the image, anywhere fully inside it."""
    side = int(rng.integers(int(0.4 * size), int(0.7 * size) + 1))
    left, top = (int(v) for v in rng.integers(0, size - side + 1, size=2))
    image = _blank_image(size)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    draw_shape(image, shape, (left, top, left + side - 1, top + side - 1), COLORS[answer])
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
}


def get_task(task: str) -> SyntheticTask:
    if task not in TASKS:
        raise ValueError(f"unknown synthetic task {task!r}; expected one of {sorted(TASKS)}")
    return TASKS[task]


def draw_sample(task: str, rng: np.random.Generator) -> tuple[Image.Image, str, str]:
    """A random sample of ``task``: ``(image, question, answer)``; the answer is drawn uniformly."""
    spec = get_task(task)
    answer = spec.answers[int(rng.integers(len(spec.answers)))]
    return spec.draw(answer, rng), spec.question, answer


def balanced_answers(answers: tuple[str, ...], n: int, rng: np.random.Generator) -> list[str]:
    """``n`` answers in random order, each answer ``n // len(answers)`` or one more times."""
    cycled = [answers[i % len(answers)] for i in range(n)]
    return [cycled[i] for i in rng.permutation(n)]


def _png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def generate_split(spec: SyntheticTask, split: str, n: int, rng: np.random.Generator) -> list[dict[str, Any]]:
    """Rows ``{"problem", "answer", "image_name", "png"}`` of one split, answers balanced."""
    rows = []
    for index, answer in enumerate(balanced_answers(spec.answers, n, rng)):
        image = spec.draw(answer, rng)
        rows.append(
            {"problem": spec.question, "answer": answer, "image_name": f"{split}_{index:05d}.png",
             "png": _png_bytes(image)}
        )  # fmt: skip
    return rows


def write_jsonl_split(rows: list[dict[str, Any]], out_dir: Path, split: str, data_source: str) -> Path:
    """``{split}.jsonl`` with image paths relative to ``out_dir``, PNGs under ``out_dir/images``."""
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{split}.jsonl"
    with path.open("w", encoding="utf-8") as file:
        for row in rows:
            (out_dir / "images" / row["image_name"]).write_bytes(row["png"])
            record = {
                "problem": row["problem"],
                "answer": row["answer"],
                "images": [f"images/{row['image_name']}"],
                "data_source": data_source,
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


def write_parquet_split(rows: list[dict[str, Any]], out_dir: Path, split: str, data_source: str) -> Path:
    """``{split}.parquet`` with images embedded as ``list<struct<bytes, path>>``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema(
        [
            ("problem", pa.string()),
            ("answer", pa.string()),
            ("images", pa.list_(image_type)),
            ("data_source", pa.string()),
        ],
        metadata={"huggingface": json.dumps({"info": {"features": _DATASETS_FEATURES}})},
    )
    columns = {
        "problem": [row["problem"] for row in rows],
        "answer": [row["answer"] for row in rows],
        "images": [[{"bytes": row["png"], "path": row["image_name"]}] for row in rows],
        "data_source": [data_source] * len(rows),
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
            f"{out_dir} exists, is not empty and was not written by mmrl.data.synthetic "
            f"(no {BUILD_MARKER}); pass force=True (--force) to replace it or choose another folder"
        )

    tmp_dir = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    write_split = write_jsonl_split if fmt == "jsonl" else write_parquet_split
    for split, n in zip(SPLITS, (n_train, n_val)):
        write_split(generate_split(spec, split, n, rng), tmp_dir, split, spec.data_source)
    (tmp_dir / BUILD_MARKER).write_text(json.dumps(request, indent=2) + "\n")
    if _read_marker(out_dir) == request:  # another process finished the same build meanwhile
        shutil.rmtree(tmp_dir)
        return out_dir
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp_dir.rename(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write a synthetic shapes dataset (see module docstring).")
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
        f"[mmrl.data.synthetic] {state}: task={args.task} train={args.n_train} val={args.n_val} "
        f"format={args.format} -> {out_dir}"
    )


if __name__ == "__main__":
    main()
