"""Sequence parallelism on the CPU: memory per rank and step time vs sequence length, SP 1 and 2.

    python bench/sequence_parallel.py [--lengths 1024 2048 4096 8192] [--layouts 1x1 2x1 1x2]
                                      [--budget_mb 400] [--repeats 2]

Model: the ``small`` Qwen2 text model of ``mmrl.demo.tiny`` (hidden 256, 4 layers, 4 query / 2
key-value heads, 7.2M parameters, fp32), built under ``bench/results/``. Work: one packed row of
``L`` tokens (``L - 32`` prompt, 32 response) and one actor update through ``PolicyActor.update_policy``
(forward, backward, AdamW step) under FSDP2, padding-free, no gradient checkpointing. Layouts
``UxR``: Ulysses size x ring size; ``1x1`` is one rank. Every rank runs one torch thread (two threads
per rank oversubscribe a shared 2-core machine and time mostly the contention), so SP 2 uses twice the
cores of SP 1: its step time shows what splitting a row costs or gains per core pair.

Memory per rank: the process's peak RSS over the timed updates minus its RSS just before them (after
the model, the optimizer states and a 64-token warm-up update), i.e. what the step needs on top of the
model; the largest over the ranks. Time: median wall time of ``--repeats`` updates after one warm-up
update at the same length. The longest row that fits ``--budget_mb`` comes from a line through the
measured (length, memory) points of each layout. Prints a table; writes
``bench/results/sequence_parallel.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mmrl.demo.ranks import run_on_ranks  # noqa: E402

RESULTS = ROOT / "bench" / "results"
RESPONSE_TOKENS = 32


def _row(length: int, vocab_size: int):
    from mmrl.protocol import DataProto

    generator = torch.Generator().manual_seed(length)
    input_ids = torch.randint(10, vocab_size - 10, (1, length), generator=generator)
    response_mask = torch.ones(1, RESPONSE_TOKENS, dtype=torch.long)
    return DataProto.from_dict(
        tensors={
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "responses": input_ids[:, -RESPONSE_TOKENS:],
            "response_mask": response_mask,
            "old_log_probs": torch.full((1, RESPONSE_TOKENS), -6.0),
            "advantages": torch.ones(1, RESPONSE_TOKENS),
        }
    )


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def _rank_job(
    rank: int, world_size: int, model_path: str, length: int, layout: tuple[int, int], repeats: int
):
    from torch.distributed.device_mesh import init_device_mesh

    from mmrl.models.loading import load_model
    from mmrl.models.prepare import prepare_for_training
    from mmrl.parallel.sequence import init_sequence_parallel
    from mmrl.workers.actor import PolicyActor
    from mmrl.workers.fsdp_engine import apply_fsdp2, build_optimizer

    ulysses_size, ring_size = layout
    groups = init_sequence_parallel(ulysses_size, ring_size) if world_size > 1 else None
    model = prepare_for_training(
        load_model(model_path), packing=True, sequence_parallel=groups is not None, score_tokens=True
    )
    vocab_size = model.config.vocab_size
    module = apply_fsdp2(model, init_device_mesh("cpu", (world_size,)), torch.float32, torch.float32)
    optimizer = build_optimizer(module.parameters(), lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0)
    sp_args = {} if groups is None else {"dp_group": groups.dp_group, "sequence_parallel": groups}
    actor = PolicyActor(module, optimizer=optimizer, max_response_length=RESPONSE_TOKENS, **sp_args)

    def update(row) -> float:
        start = time.perf_counter()
        actor.update_policy(row, 1, 1, 1, temperature=1.0)
        return time.perf_counter() - start

    update(_row(64, vocab_size))  # optimizer states exist from here on
    baseline = _rss_mb()
    row = _row(length, vocab_size)
    update(row)  # warm-up at this length
    seconds = [update(row) for _ in range(repeats)]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB
    return {"step_s": statistics.median(seconds), "peak_mb": peak - baseline}


def measure(model_path: str, length: int, layout: tuple[int, int], repeats: int) -> dict:
    world_size = layout[0] * layout[1]
    results = run_on_ranks(_rank_job, world_size, model_path, length, layout, repeats, timeout_s=1200)
    return {
        "step_s": max(r["step_s"] for r in results),
        "peak_mb_per_rank": max(r["peak_mb"] for r in results),
        "tokens_per_s": length / max(r["step_s"] for r in results),
    }


def longest_in_budget(points: list[tuple[int, float]], budget_mb: float) -> float:
    """Length where the line through (length, memory) points reaches ``budget_mb``."""
    lengths, memory = np.array(points, dtype=float).T
    slope, intercept = np.polyfit(lengths, memory, 1)
    return float((budget_mb - intercept) / slope)


def format_table(rows: list[dict], budget: dict[str, float], budget_mb: float) -> str:
    """Seconds per step and peak MB per rank of every (layout, length), the longest row that fits
    ``budget_mb`` per layout, and that length relative to one rank's."""
    lengths = sorted({row["length"] for row in rows})
    layouts = list(dict.fromkeys(row["layout"] for row in rows))
    lines = [
        f"Sequence parallelism, small Qwen2 (7.2M), one row, fp32, 1 thread per rank: {budget_mb:.0f} MB budget",
        f"{'layout':>8} " + " ".join(f"{'L=' + str(n):>16}" for n in lengths) + f" {'longest in budget':>18}",
    ]
    for name in layouts:
        cells = []
        for length in lengths:
            row = next(r for r in rows if r["layout"] == name and r["length"] == length)
            cells.append(f"{row['step_s']:6.2f}s {row['peak_mb_per_rank']:6.0f}MB")
        lines.append(
            f"{name:>8} " + " ".join(f"{cell:>16}" for cell in cells) + f" {budget[name]:>15.0f} tok"
        )
    base = budget.get("1x1")
    if base:
        lines += [f"  {name}: longest row {budget[name] / base:.2f}x that of one rank" for name in layouts]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "1x2"])
    parser.add_argument("--budget_mb", type=float, default=400.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)

    from mmrl.demo.tiny import ensure_tiny_model

    model_path = str(ensure_tiny_model("qwen2", "small", root=RESULTS / "models"))
    layouts = {name: tuple(int(x) for x in name.split("x")) for name in args.layouts}
    rows = []
    for length in args.lengths:
        for name, layout in layouts.items():
            result = {"layout": name, "length": length, **measure(model_path, length, layout, args.repeats)}
            rows.append(result)
            print(
                f"  L={length:>6}  {name} (ulysses x ring)  {result['step_s']:7.2f} s/step  "
                f"{result['peak_mb_per_rank']:8.1f} MB/rank  {result['tokens_per_s']:8.0f} tok/s",
                flush=True,
            )
    budget = {
        name: longest_in_budget(
            [(row["length"], row["peak_mb_per_rank"]) for row in rows if row["layout"] == name],
            args.budget_mb,
        )
        for name in layouts
    }
    print("\n" + format_table(rows, budget, args.budget_mb))
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = {"budget_mb": args.budget_mb, "rows": rows, "longest_in_budget": budget}
    (RESULTS / "sequence_parallel.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS / 'sequence_parallel.json'}")


if __name__ == "__main__":
    main()
