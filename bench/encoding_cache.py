"""Seconds of a frozen vision tower per GRPO step on a long video: every pass encoding (before), the
step's passes sharing one encoding (:class:`mmrl.models.encoding_cache.EncodingCache`), and a later
epoch reading the encodings from disk (:class:`mmrl.models.encoding_store.EncodingStore`).

    python bench/encoding_cache.py [--frames 32 64] [--frame_size 112] [--depth 2] [--n 4] [--micro 2]
    python bench/encoding_cache.py --device cuda --depth 32 --frames 64 256 1024 --frame_size 448

On ``--device cuda`` the tower and the pixel rows are bf16 on the GPU (as an FSDP2 step computes),
seconds are taken between CUDA synchronisations and each case's peak allocated GPU memory is a column.

The tower is Qwen2.5-VL-3B's (``Qwen2_5_VisionTransformerPretrainedModel`` at its config's widths:
hidden 1280, 16 heads, MLP 3420, output 2048, 14-pixel patches, 2x2 merge, 112-pixel windows), random
weights, with its depth cut to ``--depth`` blocks (32 in the real model: the tower's seconds scale
about linearly with the depth, the reuse ratios do not change). One prompt holds a video of
``--frames`` frames of ``--frame_size``² pixels; the step scores its ``--n`` responses in micro-batches
of ``--micro`` rows in three passes that each run the tower: old log-probs and reference log-probs
(no grad) and the update (grad on, tower frozen). The rollout is not counted (vLLM encodes there, once
per prompt through its own encoder cache).

Rows: tower calls, items encoded, seconds per step of the passes' tower calls (joining the rows on
the device, the pixel digests taken once per step where the forward announces its items, disk reads
included; the last row keys each call by hashing its rows, as before announcing), the embeddings'
file size; the one-off digest of the tower's weights (per GB
of weights, to scale to the 0.67B-parameter tower); and writing and reading the embeddings of a
``--disk_frames`` video at ``--disk_frame_size`` pixels (1,024 frames at 448 px: 131k tokens). Prints the table; writes
``bench/results/encoding_cache.json``.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from harness import markdown_table, write_json

from mmrl.columns import concat_multi_modal_inputs
from mmrl.models.encoding_cache import (
    EncodingCache,
    announce_media,
    enable_encoding_cache,
    label_weights,
    media_key,
    weights_digest,
)
from mmrl.models.encoding_store import EncodingStore

PATCH, TEMPORAL, MERGE = 14, 2, 2
CPU = torch.device("cpu")


def compute_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_tower(depth: int, device: torch.device = CPU) -> torch.nn.Module:
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLVisionConfig(  # Qwen2.5-VL-3B-Instruct's vision_config, depth cut
        depth=depth,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=2048,
        patch_size=PATCH,
        spatial_merge_size=MERGE,
        temporal_patch_size=TEMPORAL,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        hidden_act="silu",
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(config).eval()
    tower.requires_grad_(False)  # freeze_vision_tower
    return tower.to(device=device, dtype=compute_dtype(device))


def video(frames: int, frame_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A video's pixel rows [t*h*w, 3*2*14*14] (fp32, on the CPU) and grid [1, 3], as the processor
    hands them over."""
    side = frame_size // PATCH
    grid = torch.tensor([[frames // TEMPORAL, side, side]])
    rows = torch.randn(
        int(grid.prod()), 3 * TEMPORAL * PATCH * PATCH, generator=torch.Generator().manual_seed(1)
    )
    return rows, grid


def step(
    tower, rows, grid, n: int, micro: int, device: torch.device, announce: bool = True
) -> tuple[int, float]:
    """The step's three passes over n responses of one video prompt: tower calls and seconds. Each
    call is timed as a forward pass makes it: the micro-batch's rows joined on the device (and
    announced to the tower's cache, if any: :func:`mmrl.models.inputs.joined_media`), cast to the
    tower's dtype, encoded."""
    calls, seconds = 0, 0.0
    prompt = {"pixel_values_videos": rows, "video_grid_thw": grid}  # the worker's processed prompt
    for no_grad in (True, True, False):  # old log-probs, reference, update (tower frozen)
        for _ in range(0, n, micro):
            with torch.set_grad_enabled(not no_grad):
                synchronize(device)
                start = time.perf_counter()
                media = concat_multi_modal_inputs([prompt] * micro, device=device)
                if announce:
                    announce_media([tower], media, [prompt] * micro)
                tower(media["pixel_values_videos"].to(compute_dtype(device)), media["video_grid_thw"])
                synchronize(device)
                seconds += time.perf_counter() - start
            calls += 1
    return calls, seconds


def measure(frames: int, args) -> list[dict]:
    device = torch.device(args.device)
    rows, grid = video(frames, args.frame_size)
    patches = int(grid.prod())
    tokens = patches // MERGE**2
    results = []
    tower = build_tower(args.depth, device)
    encoded = []
    with torch.no_grad():
        tower(rows.to(device, compute_dtype(device)), grid.to(device))  # warm-up: one-off costs
    tower.blocks[0].register_forward_hook(lambda m, a, out: encoded.append(a[0].shape[0]))

    def run_case(case: str, announce: bool = True) -> None:
        """One step of passes; its row: tower calls, items encoded, seconds."""
        encoded.clear()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # a step's prompt is processed anew (its pixel digests are taken once per step, not per call)
        calls, seconds = step(tower, rows.clone(), grid, args.n, args.micro, device, announce)
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        results.append(
            {"case": case, "calls": calls, "encoded": sum(encoded) // patches, "s": seconds, "peak_gib": peak}
        )
        print(f"{frames} frames, {case}: {seconds:.2f} s", flush=True)  # a long run shows its progress

    run_case("every pass encodes (before)")

    label_weights(tower, weights_digest(tower, compute_dtype(device)))
    with tempfile.TemporaryDirectory() as folder:
        store = EncodingStore(folder, max_bytes=1 << 34)
        cache = EncodingCache(store=store)
        enable_encoding_cache([tower], cache)
        run_case("encoded once per step (+ disk write)")
        file_mb = sum(path.stat().st_size for path in store.directory.glob("*.pt")) / 1e6
        cache.clear()  # the next epoch: memory empty, the disk holds the video
        run_case("later epoch: read from disk")
        cache.clear()  # keyed by hashing the call's rows (on a GPU: of their bf16 cast, another key)
        step(tower, rows.clone(), grid, args.n, args.micro, device, announce=False)
        cache.clear()
        run_case("later epoch, each call hashing its pixels (before announcing)", announce=False)
        assert store.reads >= 2
    for result in results:
        result.update(frames=frames, tokens=tokens, file_mb=round(file_mb, 1))
    return results


def disk_row(frames: int, frame_size: int) -> dict:
    """Writing and reading one video's embeddings (bf16, the GPU's compute dtype) at a size no CPU
    tower here encodes in reasonable time: what a later epoch pays instead of the tower."""
    side = frame_size // PATCH
    tokens = frames // TEMPORAL * side * side // MERGE**2
    pooled = torch.randn(tokens, 2048).to(torch.bfloat16)
    with tempfile.TemporaryDirectory() as folder:
        store = EncodingStore(folder, max_bytes=1 << 36)
        start = time.perf_counter()
        store.save(("w", frames), pooled, None)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        assert store.load(("w", frames), tokens, torch.device("cpu")) is not None
        read_s = time.perf_counter() - start
        file_mb = store.path(("w", frames)).stat().st_size / 1e6
    # a step digests its items' pixel rows once (fp32, 1176 per patch): timed on a quarter of them
    quarter = torch.randn(frames // TEMPORAL * side * side // 4, 3 * TEMPORAL * PATCH * PATCH)
    start = time.perf_counter()
    media_key([1, 1, 1], quarter)
    pixel_digest_s = 4 * (time.perf_counter() - start)
    return {
        "frames": frames,
        "frame_size": frame_size,
        "tokens": tokens,
        "write_s": write_s,
        "read_s": read_s,
        "file_mb": file_mb,
        "pixel_mb": 4 * quarter.numel() * 4 / 1e6,
        "pixel_digest_s": pixel_digest_s,
    }


def digest_seconds_per_gb(tower: torch.nn.Module) -> float:
    weight_bytes = sum(p.numel() * p.element_size() for p in tower.parameters())
    start = time.perf_counter()
    weights_digest(tower, torch.bfloat16)  # the GPU case: fp32 masters cast to the bf16 compute dtype
    return (time.perf_counter() - start) / (weight_bytes / 2 / 1e9)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--frames", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--frame_size", type=int, default=112)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--disk_frames", type=int, default=1024)
    parser.add_argument("--disk_frame_size", type=int, default=448)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (bf16 tower on the GPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [result for frames in args.frames for result in measure(frames, args)]
    digest_s = digest_seconds_per_gb(build_tower(args.depth, torch.device(args.device)))
    disk = disk_row(args.disk_frames, args.disk_frame_size)
    where = (
        torch.cuda.get_device_name() + ", bf16" if args.device == "cuda" else f"CPU ({args.threads} threads)"
    )
    print(
        f"Qwen2.5-VL-3B vision widths, {args.depth} of 32 blocks, {where}, one video "
        f"prompt of {args.frame_size}x{args.frame_size} frames, n={args.n}, micro-batch {args.micro}, passes: "
        "old log-probs, reference, update"
    )
    print(
        markdown_table(
            [
                "frames",
                "video tokens",
                "case",
                "tower calls",
                "items encoded",
                "tower s/step",
                "peak GiB",
                "file MB",
            ],
            [
                [
                    r["frames"],
                    r["tokens"],
                    r["case"],
                    r["calls"],
                    r["encoded"],
                    f"{r['s']:.2f}",
                    "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}",
                    r["file_mb"],
                ]
                for r in rows
            ],  # fmt: skip
        )
    )
    print(f"weights digest (once per run and model): {digest_s:.2f} s per GB of bf16 weights")
    print(
        f"disk cache, one video of {disk['frames']} frames at {disk['frame_size']}px ({disk['tokens']} tokens, "
        f"bf16): {disk['file_mb']:.0f} MB, written in {disk['write_s']:.2f} s, read in {disk['read_s']:.2f} s; "
        f"digesting its {disk['pixel_mb']:.0f} MB of pixel rows (once per step): {disk['pixel_digest_s']:.2f} s"
    )
    write_json(
        "encoding_cache.json", {"args": vars(args), "rows": rows, "digest_s_per_gb": digest_s, "disk": disk}
    )


if __name__ == "__main__":
    main()
