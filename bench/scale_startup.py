"""Start-up at dataset scale: seconds from "load the dataset" to the first batch of prompts.

    python bench/scale_startup.py [--rows 10000] [--image_size 448] [--batch 64] [--processes 2]

``--rows`` synthetic image rows (one ``--image_size``-pixel JPEG each, a question with an ``<image>``
marker; built once under ``assets/bench/startup-<rows>``) are loaded as the trainer loads them: a
``PromptDataset`` with ``data.filter_overlong_prompts`` (every prompt rendered and encoded, its image
included, to know its length in tokens), then the first batch of ``--batch`` prompts is drawn and
collated. The processor is the tiny Qwen2.5-VL's, whose image processor is the real Qwen2.5-VL one
(EasyR1's pixel defaults: images upscaled to at least 512×512), so the work per image is real.

Four ways, in this order:

- before: one process encodes every prompt, pixels included (what mmrl's filter did);
- after, the defaults: image rows counted from their headers (``PromptDataset.prompt_length``), in
  this process or in spawned ones when the rows are slow enough to be worth their start
  (``data.preprocess_num_workers=null``), empty cache;
- the same again: the lengths come from the cache of the previous run;
- ``--processes`` spawned processes asked for explicitly (their start-up costs ~10 s here).

Prints a table and writes ``bench/results/scale_startup.json``. A 100k-row dataset costs ten times
the first three figures; processes divide them by the driver's cores (this machine has 2).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def build_rows(out_dir: Path, rows: int, image_size: int) -> Path:
    """``rows`` rows of the colour task with JPEG images; kept for later runs (a marker says when done)."""
    import numpy as np

    from mmrl.demo.synthetic import draw_color_image, get_task

    data = out_dir / "train.jsonl"
    marker = out_dir / "done.json"
    request = {"rows": rows, "image_size": image_size}
    if marker.exists() and json.loads(marker.read_text()) == request:
        return data
    shutil.rmtree(out_dir, ignore_errors=True)
    (out_dir / "images").mkdir(parents=True)
    rng = np.random.default_rng(0)
    answers = get_task("color").answers
    with open(data, "w", encoding="utf-8") as handle:
        for row in range(rows):
            answer = answers[row % len(answers)]
            draw_color_image(answer, rng, size=image_size).save(out_dir / "images" / f"{row}.jpg", quality=90)
            question = "<image>What colour is the shape? Think first, then answer."
            handle.write(
                json.dumps({"problem": question, "answer": answer, "images": [f"images/{row}.jpg"]}) + "\n"
            )
    marker.write_text(json.dumps(request))
    return data


def encode_every_prompt(dataset_class: type) -> type:
    """The dataset as mmrl measured prompts before: every prompt encoded, pixels included."""

    class EncodeEveryPrompt(dataset_class):
        def prompt_length(self, position: int) -> int:
            return int(self._encode(position)["encoded"]["input_ids"].shape[-1])

    return EncodeEveryPrompt


def time_to_first_batch(
    data: Path, model: Path, batch: int, processes: int, cache: bool, encode_all: bool
) -> dict:
    from mmrl.data.collate import collate_prompts
    from mmrl.data.config import DataConfig
    from mmrl.data.dataset import PromptDataset
    from mmrl.data.loader import PromptLoader
    from mmrl.data.processing import load_tokenizer_and_processor

    dataset_class = encode_every_prompt(PromptDataset) if encode_all else PromptDataset

    tokenizer, processor = load_tokenizer_and_processor(str(model))
    config = DataConfig(
        max_prompt_length=1024,
        preprocess_num_workers=processes,
        prompt_length_cache=cache,
        rollout_batch_size=batch,
    )
    start = time.perf_counter()
    dataset = dataset_class(str(data), tokenizer, processor, config)
    loaded = time.perf_counter()
    loader = PromptLoader(dataset, batch, lambda items: collate_prompts(items, tokenizer.pad_token_id))
    first = next(iter(loader))
    done = time.perf_counter()
    return {
        "load_s": loaded - start,
        "first_batch_s": done - loaded,
        "total_s": done - start,
        "rows": len(first),
    }


def run(rows: int = 10_000, image_size: int = 448, batch: int = 64, processes: int = 2) -> list[dict]:
    from mmrl.demo.tiny import ensure_tiny_model

    model = ensure_tiny_model("qwen2_5_vl", root=REPO / "assets" / "models")
    data = build_rows(REPO / "assets" / "bench" / f"startup-{rows}", rows, image_size)
    cache_root = tempfile.mkdtemp(prefix="mmrl-bench-cache-")
    os.environ["MMRL_CACHE_DIR"] = cache_root
    try:
        table = []
        for name, procs, cache, encode_all in (
            ("before: every prompt encoded, serial", 1, False, True),
            ("after: the defaults (auto processes), cold cache", None, True, False),
            ("after: the same again, cached lengths", None, True, False),
            (f"image sizes counted in {processes} spawned processes, no cache", processes, False, False),
        ):
            result = time_to_first_batch(data, model, batch, procs, cache, encode_all)
            table.append({"mode": name, "processes": "auto" if procs is None else procs, **result})
            print(f"  {name}: {result['total_s']:.1f} s", flush=True)
    finally:
        shutil.rmtree(cache_root, ignore_errors=True)
    return table


def format_table(table: list[dict], rows: int) -> str:
    lines = [
        f"{rows} image rows (load = the overlong-prompt filter over every row)",
        "| mode | processes | load s | first batch s | total s |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in table:
        lines.append(
            f"| {r['mode']} | {r['processes']} | {r['load_s']:.1f} | {r['first_batch_s']:.2f} | {r['total_s']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--image_size", type=int, default=448)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    table = run(args.rows, args.image_size, args.batch, args.processes)
    print("\nTime to the first batch\n" + format_table(table, args.rows))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scale_startup.json").write_text(json.dumps({"args": vars(args), "table": table}, indent=2))
    return table


if __name__ == "__main__":
    main()
