"""Optimizer state memory of ``adamw`` versus ``adamw_bf16`` at Qwen2.5-VL-3B's widths.

    python bench/optimizer_memory.py [--layers 2] [--steps 2]

Builds the language model's tensors at real widths (hidden 2,048, intermediate 11,008, vocabulary
151,936 (tied head), 16 query / 2 key-value heads of 128) for ``--layers`` decoder layers, random fp32
weights and gradients on the CPU (the fp32 masters), and runs ``--steps`` optimizer steps of each
strategy in a fresh process (so the peaks do not mix). Prints one row per strategy: parameters,
optimizer state bytes (the tensors in ``optimizer.state``), RSS before the first step (weights and
gradients), the peak RSS over the steps, the peak's increase, seconds per step; then the saving, as
measured and extrapolated to the whole model (3.75 B parameters with the vision tower: state bytes per
parameter times that count). Writes ``bench/results/optimizer_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from harness import REPO, GiB, markdown_table, write_json

HIDDEN, INTERMEDIATE, VOCAB, HEAD_DIM, KV_HEADS = 2048, 11008, 151_936, 128, 2
FULL_MODEL_PARAMETERS = 3.75e9  # Qwen2.5-VL-3B-Instruct, vision tower included


def layer_shapes(layers: int) -> list[tuple[int, ...]]:
    """Tensor shapes of the embedding (tied with the head) and ``layers`` Qwen2 decoder layers."""
    kv = KV_HEADS * HEAD_DIM
    per_layer = [
        (HIDDEN, HIDDEN), (HIDDEN,), (kv, HIDDEN), (kv,), (kv, HIDDEN), (kv,), (HIDDEN, HIDDEN),  # attention
        (INTERMEDIATE, HIDDEN), (INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE),  # MLP
        (HIDDEN,), (HIDDEN,),  # norms
    ]  # fmt: skip
    return [(VOCAB, HIDDEN), *per_layer * layers, (HIDDEN,)]


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def measure(strategy: str, layers: int, steps: int) -> dict:
    """In this process: build the tensors, step ``steps`` times, report the memory."""
    import torch

    sys.path.insert(0, str(REPO))
    from mmrl.workers.fsdp_engine import build_optimizer

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape) * 0.02) for shape in layer_shapes(layers)]
    for param in params:
        param.grad = torch.randn_like(param) * 1e-3
    optimizer = build_optimizer(params, lr=1e-6, betas=(0.9, 0.999), weight_decay=0.01, strategy=strategy)
    before = current_rss_bytes()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        seconds.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    state_bytes = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )
    return {
        "strategy": strategy,
        "parameters": sum(param.numel() for param in params),
        "state_bytes": state_bytes,
        "rss_before_bytes": before,
        "peak_rss_bytes": peak,
        "seconds_per_step": min(seconds[1:] or seconds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)  # run one strategy and print its JSON
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.layers, args.steps)))
        return
    rows = []
    for strategy in ("adamw", "adamw_bf16"):
        command = [
            sys.executable,
            __file__,
            f"--child={strategy}",
            f"--layers={args.layers}",
            f"--steps={args.steps}",
        ]
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(output.strip().splitlines()[-1]))
    table = [
        [
            row["strategy"],
            f"{row['parameters'] / 1e6:.0f} M",
            f"{row['state_bytes'] / GiB:.2f}",
            f"{row['state_bytes'] / row['parameters']:.1f}",
            f"{row['rss_before_bytes'] / GiB:.2f}",
            f"{row['peak_rss_bytes'] / GiB:.2f}",
            f"{(row['peak_rss_bytes'] - row['rss_before_bytes']) / GiB:.2f}",
            f"{row['seconds_per_step']:.2f}",
        ]
        for row in rows
    ]
    headers = ["strategy", "params", "state GiB", "state B/param", "RSS before step GiB", "peak RSS GiB",
               "peak - before GiB", "s/step (CPU)"]  # fmt: skip
    print(f"{args.layers} decoder layers + embedding at Qwen2.5-VL-3B widths, fp32 masters on the CPU\n")
    print(markdown_table(headers, table))
    adamw, bf16 = rows
    saved = adamw["state_bytes"] - bf16["state_bytes"]
    per_param = saved / adamw["parameters"]
    summary = {
        "state_saving_percent": 100 * saved / adamw["state_bytes"],
        "peak_rss_saving_gib": (adamw["peak_rss_bytes"] - bf16["peak_rss_bytes"]) / GiB,
        "full_model_state_saving_gib": per_param * FULL_MODEL_PARAMETERS / GiB,
        "full_model_adamw_state_gib": adamw["state_bytes"]
        / adamw["parameters"]
        * FULL_MODEL_PARAMETERS
        / GiB,
    }
    print(
        f"\noptimizer state: -{summary['state_saving_percent']:.0f} % ({saved / GiB:.2f} GiB here); peak RSS "
        f"-{summary['peak_rss_saving_gib']:.2f} GiB; whole 3B model ({FULL_MODEL_PARAMETERS / 1e9:.2f} B "
        f"parameters): {summary['full_model_adamw_state_gib']:.1f} GiB of AdamW state, "
        f"-{summary['full_model_state_saving_gib']:.1f} GiB with adamw_bf16 (summed over all ranks)"
    )
    print(write_json("optimizer_memory.json", {"layers": args.layers, "rows": rows, **summary}))


if __name__ == "__main__":
    main()
