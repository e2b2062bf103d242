"""Host memory of building the sharded model on 2 ranks at Qwen2.5-VL-3B's widths: every rank reading
the whole model (before) against rank 0 reading it and broadcasting each tensor to ranks built on the
meta device (after).

    python bench/scale_load.py [--ranks 2] [--roles actor ref] [--checkpoint_dtype bf16]

Model: the ``3b-width`` Qwen2.5-VL of :mod:`mmrl.demo.tiny` (Qwen2.5-VL-3B's widths and 151,936-row
tied vocabulary, 2 decoder layers, 2 vision blocks; 0.55B fp32 parameters, 2.2 GB), built under
``bench/results/models/`` on first use. Each mode is a fresh set of gloo ranks (one thread each) that
run the worker's own builder, ``mmrl.workers.fsdp_workers.build_fsdp_model``, with
``rank0_init=False`` (before: what every rank did) and ``True`` (after), for the actor (trained, fp32)
and, with ``--roles actor ref``, the frozen reference too (fp32 on a CPU).

Per rank: ``rss_before_mb`` (after imports and the process group), ``peak_mb`` (the resident-set
high-water mark while building: ``VmHWM`` reset first) and ``rss_after_mb`` (what stays: the shards).
The machine's peak is bounded by the sum of the ranks' peaks. ``--checkpoint_dtype bf16`` (the
default) reads a bf16 copy of the weights, as hub checkpoints are stored: loading them into fp32
masters allocates a converted copy on every rank that reads them, where an fp32 file is memory-mapped
and its pages, shared between ranks and reclaimable, are resident only where touched. At 7B (33 GB of fp32 weights) the same
ratio gives 8 x 33 GB before and 33 GB + 7 x a shard after on one 8-GPU node. Prints the table and
writes ``bench/results/scale_load.json``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS, markdown_table, write_json  # noqa: E402

MB = 1024**2


def _rss_bytes() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _build_job(rank: int, world_size: int, model_path: str, rank0_init: bool, roles: list[str]) -> dict:
    """One rank: build each role as the worker does; its memory before, at the peak and after."""
    import gc

    import torch

    from mmrl.config import FSDPConfig, ModelConfig
    from mmrl.workers.fsdp_workers import build_fsdp_model
    from mmrl.workers.memory import _reset_resident_peak, resident_peak_bytes

    torch.set_num_threads(1)
    gc.collect()
    before = _rss_bytes()
    _reset_resident_peak()
    models = [
        build_fsdp_model(
            model_path,
            ModelConfig(enable_gradient_checkpointing=False),
            FSDPConfig(),
            "actor",
            torch.device("cpu"),
            trainable=role == "actor",
            trust_remote_code=False,
            padding_free=True,
            sequence_parallel=False,
            rank0_init=rank0_init,
        )
        for role in roles
    ]
    peak = resident_peak_bytes()
    gc.collect()
    after = _rss_bytes()
    parameters = sum(parameter.numel() for model in models for parameter in model.parameters())
    return {
        "rank": rank,
        "rss_before_mb": before / MB,
        "peak_mb": peak / MB,
        "rss_after_mb": after / MB,
        "parameters": parameters,
    }


def measure(model_path: Path, ranks: int, roles: list[str], timeout_s: float) -> list[dict]:
    from mmrl.demo.ranks import run_on_ranks

    rows = []
    for mode, rank0_init in (("before: every rank reads", False), ("after: rank 0 broadcasts", True)):
        for result in run_on_ranks(
            _build_job, ranks, str(model_path), rank0_init, roles, timeout_s=timeout_s
        ):
            rows.append({"mode": mode, **result})
            print(f"[scale_load] {mode}: {result}", flush=True)
    return rows


def format_table(rows: list[dict]) -> str:
    table = [
        [row["mode"], row["rank"], f"{row['rss_before_mb']:.0f}", f"{row['peak_mb']:.0f}", f"{row['rss_after_mb']:.0f}"]
        for row in rows
    ]  # fmt: skip
    for mode in dict.fromkeys(row["mode"] for row in rows):
        peaks = [row["peak_mb"] for row in rows if row["mode"] == mode]
        table.append([mode, "all (sum)", "", f"{sum(peaks):.0f}", ""])
    return markdown_table(["mode", "rank", "RSS before MB", "peak while building MB", "RSS after MB"], table)


def _bf16_copy(model_path: Path) -> Path:
    """The model at ``model_path`` saved in bf16 beside it (once), with its processor files."""
    import shutil

    out = model_path.with_name(model_path.name + "-bf16")
    if (out / "config.json").exists():
        return out
    import torch

    from mmrl.models.loading import load_model

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    load_model(str(model_path), torch_dtype=torch.bfloat16).save_pretrained(tmp)
    for path in model_path.iterdir():
        if path.is_file() and "safetensors" not in path.name and not (tmp / path.name).exists():
            shutil.copy(path, tmp / path.name)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--roles", nargs="+", default=["actor"], choices=["actor", "ref"])
    parser.add_argument("--checkpoint_dtype", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--timeout_s", type=float, default=900.0, help="per mode (a loaded machine is slow)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from mmrl.demo.tiny import ensure_tiny_model

    model = ensure_tiny_model("qwen2_5_vl", "3b-width", root=RESULTS / "models")
    if args.checkpoint_dtype == "bf16":
        model = _bf16_copy(model)
    rows = measure(model, args.ranks, args.roles, args.timeout_s)
    print(f"\nhost memory of building {'+'.join(args.roles)} at 3B widths on {args.ranks} ranks")
    print(format_table(rows))
    write_json("scale_load.json", {"args": vars(args), "rows": rows})
    return rows


if __name__ == "__main__":
    main()
