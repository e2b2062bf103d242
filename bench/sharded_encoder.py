"""The vision tower of a long video split over sequence-parallel ranks (``mmrl.parallel.encoders``):
seconds and memory per rank of one encoding, SP 1 and 2, frozen (no grad) and training (forward and
backward), on the CPU.

    python bench/sharded_encoder.py [--frames 64 256] [--frame_size 112] [--depth 2] [--sp 1 2]
                                    [--images 4 16] [--image_size 448]

The tower is Qwen2.5-VL-3B's (``bench/encoding_cache.py``'s ``build_tower``: hidden 1280, 16 heads,
MLP 3420, output 2048, 14-pixel patches, 2x2 merge, 112-pixel windows), random weights, depth cut to
``--depth`` of 32 blocks (seconds and activation memory scale about linearly with it). One call per
case: a video of ``--frames`` frames of ``--frame_size``² pixels, or ``--images`` images of
``--image_size``² pixels (an image is one temporal patch: SP ranks split a call by whole images). Each SP rank is a process with one torch thread, so
SP 2 uses twice the cores of SP 1 (as in ``bench/sequence_parallel.py``). Every rank encodes its
share of the temporal patches and the embeddings are all-gathered; the gathered output is compared
with one rank's encoding of the whole video (``max |diff|``).

Memory per rank: the process's peak RSS during the pass minus its RSS just before it (the tower, the
pixel rows and, for the training pass, the weights' gradient buffers already there), the largest over
the ranks; the frozen pass is measured first, then the training pass. Prints a table; writes ``bench/results/sharded_encoder.json``.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import torch
from encoding_cache import MERGE, build_tower, video
from harness import markdown_table, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmrl.demo.ranks import run_on_ranks  # noqa: E402


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def media(kind: str, count: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixel rows and grid of one video of ``count`` frames, or of ``count`` images, of ``size``² px."""
    if kind == "video":
        return video(count, size)
    rows, grid = video(2, size)  # an image: one temporal patch (its frame twice)
    return rows.repeat(count, 1), grid.repeat(count, 1)


def _encode_job(rank: int, world_size: int, kind: str, count: int, size: int, depth: int) -> dict:
    from mmrl.models.attention import PackedSequences
    from mmrl.parallel.encoders import enable_sharded_encoders
    from mmrl.parallel.sequence import ShardedSequences, ShardLayout, init_sequence_parallel

    tower = build_tower(depth)
    rows, grid = media(kind, count, size)
    tokens = int(grid.prod(-1).sum()) // MERGE**2
    kwargs = {}
    if world_size > 1:
        enable_sharded_encoders([tower])
        layout = ShardLayout([tokens], 1, world_size)
        groups = init_sequence_parallel(world_size, 1)
        kwargs["packed_sequences"] = ShardedSequences(
            PackedSequences.from_lengths([tokens], "cpu"), layout, groups
        )
    with torch.no_grad():  # warm-up on one temporal patch: one-off costs are no pass's
        tower(rows[: int(grid[0, 1:].prod())], torch.tensor([[1, *grid[0, 1:].tolist()]]))
    result = {}
    for name, grad in (("frozen", False), ("training", True)):
        tower.requires_grad_(grad)
        for parameter in tower.parameters() if grad else ():
            parameter.grad = torch.zeros_like(parameter)  # the same on every layout: not the pass's memory
        before = _rss_mb()
        start = time.perf_counter()
        with torch.set_grad_enabled(grad):
            output = tower(rows, grid, **kwargs).pooler_output
            if grad:
                output.float().square().mean().backward()
        result[f"{name}_s"] = time.perf_counter() - start
        result[f"{name}_mb"] = _peak_mb() - before
        result["output"] = output.detach()
    result["tokens"] = tokens
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--frames", type=int, nargs="*", default=[64, 256], help="video lengths")
    parser.add_argument("--frame_size", type=int, default=112)
    parser.add_argument("--images", type=int, nargs="*", default=[], help="images per call")
    parser.add_argument("--image_size", type=int, default=448)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--sp", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    rows = []
    cases = [("video", n, args.frame_size) for n in args.frames]
    cases += [("images", n, args.image_size) for n in args.images]
    for kind, count, size in cases:
        whole = None
        for sp in args.sp:
            ranks = run_on_ranks(_encode_job, sp, kind, count, size, args.depth, timeout_s=3600)
            output = ranks[0]["output"]
            whole = output if whole is None else whole
            rows.append(
                {
                    "media": f"{count} {'frames' if kind == 'video' else 'images'} of {size} px",
                    "tokens": ranks[0]["tokens"],
                    "sp": sp,
                    "frozen_s": max(r["frozen_s"] for r in ranks),
                    "frozen_mb": max(r["frozen_mb"] for r in ranks),
                    "training_s": max(r["training_s"] for r in ranks),
                    "training_mb": max(r["training_mb"] for r in ranks),
                    "max_diff": max(float((r["output"] - whole).abs().max()) for r in ranks),
                }
            )
            print(rows[-1], flush=True)
    print(
        f"Qwen2.5-VL-3B vision widths, {args.depth} of 32 blocks, CPU, one thread per rank, one call of "
        "the tower; seconds and MB: the slowest / largest rank"
    )
    print(
        markdown_table(
            ["media", "tokens", "SP", "frozen s", "frozen MB/rank", "training s", "training MB/rank", "max |diff| vs SP 1"],
            [
                [r["media"], r["tokens"], r["sp"], f"{r['frozen_s']:.2f}", f"{r['frozen_mb']:.0f}",
                 f"{r['training_s']:.2f}", f"{r['training_mb']:.0f}", f"{r['max_diff']:.1e}"]
                for r in rows
            ],
        )
    )  # fmt: skip
    write_json("sharded_encoder.json", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
