"""Memory at the real vocabulary: the policy's log-prob pass and one update against response length,
scoring tokens from the whole logits (before) and in chunks inside the head (after).

    python bench/scale_memory.py [--lengths 512 1024 2048 4096] [--update_lengths 512 1024 2048]
        [--chunk_tokens 1024] [--threads 2]

Model: the ``3b-width`` Qwen2.5-VL of :mod:`mmrl.demo.tiny` (Qwen2.5-VL-3B's widths and 151,936-row
tied vocabulary, 2 decoder layers, 2 vision blocks; 0.54B random fp32 parameters on the CPU), built
under ``bench/results/models/`` on first use. One text prompt (the chat template around a short
question, 26 tokens) and one response of exactly each length, random ordinary token ids; one response
per micro-batch, packed (``padding_free``), temperature 0.7.

Each point is a fresh process that loads the model prepared as the trainer prepares the actor's
(``prepare_for_training(..., score_tokens=True)``) and runs mmrl's ``PolicyActor`` (no FSDP: one rank
needs none, and FSDP2 at world size 1 only adds its own buffers):

- ``log_prob``: ``compute_log_probs(with_entropy=True)``, the old-log-prob pass of a step;
- ``update``: ``update_policy(on_policy=True)``: forward, backward, fused AdamW step (its moments are
  created by this first step, 2 x 2.2 GB; they are part of any step's peak).

``before``: ``worker.actor.log_prob_chunk_tokens=0``, the whole ``[K, vocab]`` logits through
``log_probs_from_logits`` / ``entropy_from_logits`` (main's code path); ``after``: the chunk size of
``--chunk_tokens``. ``peak_mb``: the process's highest RSS during the pass, sampled every 10 ms (model,
optimizer state and the pass); ``added_mb``: that peak minus the RSS just before the pass, what the
pass itself costs. (Loading can peak higher than a pass; ``process_peak_mb``, the ``ru_maxrss``, is in
the JSON.)
``tokens_s``: response tokens per second of the pass (one run, after a 16-token warm-up pass; the
machine is shared, so read it as a rough figure). Prints the table and writes
``bench/results/scale_memory.json``.

The update stops at 2,048 tokens by default: on a 2-core CPU one 4,096-token update of this model
takes minutes (pass ``--update_lengths`` to add it). The whole default run took 21 min on the shared
2-core machine while other jobs kept its load at 8-12 (the two 2,048-token updates about a third of
it); ``--update_lengths 512 1024`` is the quick variant.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from cost_curves import RSSPeak
from harness import REPO, RESULTS, markdown_table, write_json

KIND, SIZE = "qwen2_5_vl", "3b-width"
TEMPERATURE = 0.7
POINT_TIMEOUT_S = 1800
MB = 1024**2


def model_dir() -> Path:
    from mmrl.demo.tiny import ensure_tiny_model

    return ensure_tiny_model(KIND, SIZE, root=RESULTS / "models")


# ---- one point, in its own process --------------------------------------------------------------


def _batch(model_path: Path, response_length: int):
    """One row: the chat-templated prompt, then ``response_length`` random ordinary tokens."""
    import torch
    from transformers import AutoTokenizer

    from mmrl.protocol import DataProto

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What colour is the shape? Answer with one word."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]  # [1, P]
    generator = torch.Generator().manual_seed(response_length)
    responses = torch.randint(300, 150_000, (1, response_length), generator=generator)
    response_mask = torch.ones_like(responses)
    tensors = {
        "prompts": prompt,
        "responses": responses,
        "input_ids": torch.cat([prompt, responses], dim=1),
        "attention_mask": torch.cat([torch.ones_like(prompt), response_mask], dim=1),
        "response_mask": response_mask,
        "advantages": torch.ones(1, response_length),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": ["p0"]})


def run_point(point: dict) -> dict:
    """Load the model, warm up on 16 tokens, then run the point's pass once: seconds and memory."""
    import torch

    from mmrl.config import ActorConfig
    from mmrl.models.loading import load_model
    from mmrl.models.prepare import prepare_for_training
    from mmrl.workers.actor import PolicyActor
    from mmrl.workers.fsdp_engine import build_optimizer

    torch.set_num_threads(point["threads"])
    torch.manual_seed(0)
    model_path = Path(point["model"])
    module = prepare_for_training(load_model(str(model_path)), packing=True, score_tokens=True)
    config = ActorConfig(log_prob_chunk_tokens=point["chunk_tokens"], padding_free=True, max_grad_norm=1.0)
    optimizer = None
    if point["phase"] == "update":
        optimizer = build_optimizer(module.parameters(), lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
    actor = PolicyActor(module, config, optimizer=optimizer, max_response_length=point["length"])

    def run(batch) -> None:
        if point["phase"] == "log_prob":
            actor.compute_log_probs(batch, 1, TEMPERATURE, with_entropy=True)
        else:
            actor.update_policy(batch, 1, 1, 1, TEMPERATURE, on_policy=True)

    run(_batch(model_path, 16))  # warm-up: one-time allocations, and the AdamW moments of an update
    batch = _batch(model_path, point["length"])
    with RSSPeak() as memory:
        start = time.perf_counter()
        run(batch)
        seconds = time.perf_counter() - start
    return {
        **point,
        "seconds": seconds,
        "tokens_s": point["length"] / seconds,
        "peak_mb": memory.peak_bytes / MB,
        "added_mb": (memory.peak_bytes - memory.start_bytes) / MB,
        "start_mb": memory.start_bytes / MB,
        "process_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


# ---- the sweep, one process per point -----------------------------------------------------------


def measure(point: dict) -> dict:
    out = RESULTS / "runs" / "scale_memory" / "point.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, __file__, "--point", json.dumps(point), "--point_out", str(out)]
    # this checkout's mmrl, whichever one the environment has installed
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(command, capture_output=True, text=True, timeout=POINT_TIMEOUT_S, env=env)
    if done.returncode != 0:
        raise RuntimeError(
            f"point {point} failed (exit {done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )
    return json.loads(out.read_text())


def measure_rows(
    lengths: list[int] = (512, 1024, 2048, 4096),
    update_lengths: list[int] = (512, 1024, 2048),
    chunk_tokens: int = 1024,
    threads: int = 2,
    progress: bool = True,
) -> list[dict]:
    """One row per (phase, length): before (unchunked) and after (chunked) seconds and memory."""
    model = str(model_dir())
    rows = []
    plan = [("log_prob", length) for length in lengths] + [("update", length) for length in update_lengths]
    for phase, length in plan:
        row = {"phase": phase, "length": length, "chunk_tokens": chunk_tokens}
        for label, chunk in (("before", 0), ("after", chunk_tokens)):
            point = {
                "phase": phase,
                "length": length,
                "chunk_tokens": chunk,
                "model": model,
                "threads": threads,
            }
            result = measure(point)
            keys = ("seconds", "tokens_s", "peak_mb", "added_mb", "start_mb", "process_peak_mb")
            row[label] = {key: result[key] for key in keys}
            if progress:
                print(
                    f"[scale_memory] {phase} {length} tokens, {label}: peak {result['peak_mb']:.0f} MB, "
                    f"+{result['added_mb']:.0f} MB, {result['tokens_s']:.0f} tokens/s",
                    flush=True,
                )
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    headers = [
        "pass",
        "response tokens",
        "peak MB before",
        "peak MB after",
        "pass adds MB before",
        "pass adds MB after",
        "tokens/s before",
        "tokens/s after",
    ]
    table = [
        [
            row["phase"],
            row["length"],
            f"{row['before']['peak_mb']:.0f}",
            f"{row['after']['peak_mb']:.0f}",
            f"{row['before']['added_mb']:.0f}",
            f"{row['after']['added_mb']:.0f}",
            f"{row['before']['tokens_s']:.0f}",
            f"{row['after']['tokens_s']:.0f}",
        ]
        for row in rows
    ]
    return markdown_table(headers, table)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--update_lengths", type=int, nargs="*", default=[512, 1024, 2048])
    parser.add_argument("--chunk_tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--point", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--point_out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.point is not None:
        Path(args.point_out).write_text(json.dumps(run_point(json.loads(args.point))))
        return {}
    start = time.perf_counter()
    rows = measure_rows(args.lengths, args.update_lengths, args.chunk_tokens, args.threads)
    payload = {"args": vars(args), "rows": rows, "wall_s": time.perf_counter() - start}
    path = write_json("scale_memory.json", payload)
    print(f"\nmemory at the real vocabulary ({SIZE} Qwen2.5-VL, fp32, CPU; chunk {args.chunk_tokens})")
    print(format_table(rows))
    print(f"-> {path} ({payload['wall_s']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()
