"""A Qwen3-VL-30B-A3B-width MoE layer on the CPU: host memory at load and each phase's seconds and peak.

    python bench/moe_scale.py [--rows 2] [--responses 512] [--threads 2] [--force]

Model: ``mmrl.demo.tiny``'s ``30b-a3b-width`` Qwen3-VL MoE (Qwen3-VL-30B-A3B-Instruct's widths: a
2,048-wide stream, 32 query heads and 4 key/value heads of 128, 128 experts of 768 per sparse block,
top-8, the 151,936-row vocabulary; one decoder layer and one 1,152-wide vision block; the head tied to
the embedding), random fp32 weights, built under ``bench/results/models/`` on first use.

One process, the phases of an actor step in order, as a training process runs them (so each phase's
peak includes what the earlier ones left, the AdamW moments above all):

- ``load``: ``load_model`` and ``prepare_for_training`` (packed, chunked token scoring);
- ``log_prob``: the old-log-prob pass with entropy over ``--rows`` text rows of ``--responses`` random
  response tokens (one micro-batch, packed);
- ``update 1``: forward, backward and the fused AdamW step with the routers' load-balancing loss
  (``worker.actor.moe.aux_loss_coef=0.001``) and router metrics: the first step, which creates the
  AdamW moments;
- ``update 2``: the same again, what every later step costs.

``peak GiB``: the process's highest RSS during the phase (sampled every 10 ms); ``adds GiB``: that
peak minus the RSS before it. Whole steps with FSDP2 over several ranks shard the parameters, gradients
and moments ``world_size`` ways; this one process holds them all, as one rank of a job would hold
1/N of them. Prints the table and writes ``bench/results/moe_scale.json``. It needs about 16 bytes of
memory per parameter (weights, gradients, two moments) plus the passes' activations, ~15 GiB in all:
it refuses to start with less available unless ``--force``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cost_curves import RSSPeak  # noqa: E402
from harness import RESULTS, markdown_table, write_json  # noqa: E402

KIND, SIZE = "qwen3_vl_moe", "30b-a3b-width"
TEMPERATURE = 1.0
GIB = 1024**3
BYTES_PER_PARAMETER = 16  # fp32 weight, gradient and the two AdamW moments
ACTIVATION_MARGIN_GIB = 3.0


def model_dir() -> Path:
    from mmrl.demo.tiny import ensure_tiny_model

    return ensure_tiny_model(KIND, SIZE, root=RESULTS / "models")


def text_batch(rows: int, response_length: int):
    """``rows`` rows of a short prompt and ``response_length`` random ordinary tokens, all scored."""
    import torch

    from mmrl.protocol import DataProto

    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(300, 150_000, (rows, 32), generator=generator)
    responses = torch.randint(300, 150_000, (rows, response_length), generator=generator)
    input_ids = torch.cat([prompts, responses], dim=1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "response_mask": torch.ones_like(responses),
        "advantages": torch.randn(rows, 1, generator=generator).sign().expand(rows, response_length),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": [f"p{row}" for row in range(rows)]})


def parameters_of(path: Path) -> int:
    from mmrl.demo.tiny import _read_marker

    return int(_read_marker(path)["num_parameters"])


def measure(rows: int, responses: int, threads: int) -> dict:
    import psutil
    import torch

    from mmrl.config import ActorConfig
    from mmrl.config.actor import MoEConfig
    from mmrl.models.loading import load_model
    from mmrl.models.prepare import prepare_for_training
    from mmrl.workers.actor import PolicyActor
    from mmrl.workers.fsdp_engine import build_optimizer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    path = model_dir()
    phases = []

    def phase(name: str, work) -> None:
        with RSSPeak() as memory:
            start = time.perf_counter()
            result = work()
            seconds = time.perf_counter() - start
        phases.append(
            {
                "phase": name,
                "seconds": seconds,
                "peak_gib": memory.peak_bytes / GIB,
                "adds_gib": (memory.peak_bytes - memory.start_bytes) / GIB,
                "after_gib": psutil.Process().memory_info().rss / GIB,
            }
        )
        print(f"[moe_scale] {name}: {seconds:.1f} s, peak {memory.peak_bytes / GIB:.2f} GiB", flush=True)
        return result

    holder = {}
    phase(
        "load",
        lambda: holder.update(
            module=prepare_for_training(load_model(str(path)), packing=True, score_tokens=True)
        ),
    )
    module = holder["module"]
    config = ActorConfig(padding_free=True, max_grad_norm=1.0, moe=MoEConfig(aux_loss_coef=0.001))
    optimizer = build_optimizer(module.parameters(), lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
    actor = PolicyActor(module, config, optimizer=optimizer, max_response_length=responses)
    batch = text_batch(rows, responses)
    phase("log_prob", lambda: actor.compute_log_probs(batch, rows, TEMPERATURE, with_entropy=True))
    for step in (1, 2):
        update = phase(
            f"update {step}", lambda: actor.update_policy(batch, rows, rows, 1, TEMPERATURE, on_policy=True)
        )
    moe = {key: value for key, value in update.metrics.items() if "moe" in key}
    return {
        "parameters": parameters_of(path),
        "rows": rows,
        "responses": responses,
        "phases": phases,
        "moe": moe,
    }


def format_table(result: dict) -> str:
    tokens = result["rows"] * result["responses"]
    body = [
        [row["phase"], f"{row['seconds']:.1f}", f"{row['peak_gib']:.2f}", f"{row['adds_gib']:.2f}"]
        + [f"{tokens / row['seconds']:.0f}" if row["phase"] != "load" else "-"]
        for row in result["phases"]
    ]
    headers = ["phase", "seconds", "peak GiB", "adds GiB", "response tokens/s"]
    return markdown_table(headers, body)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--responses", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--force", action="store_true", help="run even with less memory available")
    args = parser.parse_args(argv)

    import psutil

    path = model_dir()
    need_gib = parameters_of(path) * BYTES_PER_PARAMETER / GIB + ACTIVATION_MARGIN_GIB
    available_gib = psutil.virtual_memory().available / GIB
    if available_gib < need_gib and not args.force:
        sys.exit(
            f"moe_scale: needs ~{need_gib:.1f} GiB ({parameters_of(path):,} parameters x "
            f"{BYTES_PER_PARAMETER} bytes, plus activations), {available_gib:.1f} GiB available; stop "
            "other jobs, or pass --force"
        )
    result = measure(args.rows, args.responses, args.threads)
    print(
        f"\n{KIND} at {SIZE}: {result['parameters'] / 1e9:.2f} B parameters, {args.rows} rows x "
        f"{args.responses} response tokens, {args.threads} threads\n"
    )
    print(format_table(result))
    print("\nrouter metrics of the last update:", result["moe"])
    write_json("moe_scale", result)
    return result


if __name__ == "__main__":
    main()
