"""Rollout throughput on the CPU: the vLLM backend against the transformers one, tiny Qwen2.5-VL models.

    python bench/rollout_speed.py [--sizes tiny small] [--prompts 16] [--max_tokens 64] [--threads 2]
                                  [--repeats 3] [--compile]

For every model size and prompt kind (one image per prompt, or text only) both backends sample one
response of exactly ``--max_tokens`` tokens (``ignore_eos``) per prompt at temperature 1, through the
same ``Rollout.generate`` call the trainer makes. tokens/s = generated tokens / wall time of that call,
the best of ``--repeats`` calls after one short warm-up call. Also reported: the vLLM engine's start
time and the time to push the weights into it (``update_weights``). Prints a table and writes
``bench/results/rollout_speed.json``; models and data are built under ``bench/results/``.

Both backends run in this process, in a one-rank gloo group (the engine's external launcher needs
one), with ``--threads`` torch threads, set before the first engine is built (building one replaces
``torch.set_num_threads`` with a no-op). Their timed calls alternate: a busy spell of the shared
machine slows both.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
KIND = "qwen2_5_vl"
TEXT_PROMPTS = (
    "What colour is the sky on a clear day? Answer with one word.",
    "How many corners does a triangle have? Answer with a number.",
    "Name a shape that has no corners. Answer with one word.",
    "Is a square a circle? Think, then answer yes or no.",
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _join_one_rank_group() -> None:
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    dist.init_process_group("gloo", rank=0, world_size=1)


def _prompt_files(num_prompts: int) -> dict[str, str]:
    from mmrl.demo.synthetic import generate_shapes_dataset

    data_dir = generate_shapes_dataset(
        "color", RESULTS / "data" / "shapes-color", n_train=num_prompts, n_val=1
    )
    text_file = RESULTS / "data" / "text.jsonl"
    rows = [{"problem": TEXT_PROMPTS[i % len(TEXT_PROMPTS)], "answer": "x"} for i in range(num_prompts)]
    text_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return {"image": str(data_dir / "train.jsonl"), "text": str(text_file)}


def _prompts(model_path: str, data_file: str, num_prompts: int):
    from mmrl.data.collate import collate_prompts
    from mmrl.data.config import DataConfig
    from mmrl.data.dataset import PromptDataset
    from mmrl.data.processing import attach_media, load_tokenizer_and_processor
    from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS

    tokenizer, processor = load_tokenizer_and_processor(model_path)
    dataset = PromptDataset(
        data_file, tokenizer, processor, DataConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    )
    prompts = collate_prompts([dataset[row] for row in range(num_prompts)], tokenizer.pad_token_id)
    return attach_media(prompts, dataset.media, rollout_media=True)  # as the worker does before generating


def _timed_tokens_per_s(rollout, prompts, sampling) -> float:
    start = time.perf_counter()
    batch = rollout.generate(prompts, sampling)
    return float(batch.batch["response_mask"].sum()) / (time.perf_counter() - start)


def _bench_size(model_path: str, prompts: dict, args: argparse.Namespace) -> dict[str, dict]:
    """Both backends on one model; their timed calls alternate, so a busy spell of the (shared)
    machine slows both, and the best of ``--repeats`` calls counts."""
    from transformers import AutoTokenizer

    from mmrl.config import RolloutConfig
    from mmrl.models.loading import load_model
    from mmrl.models.prepare import prepare_for_training
    from mmrl.workers.rollout import SamplingParams
    from mmrl.workers.rollout.hf import HFRollout
    from mmrl.workers.rollout.vllm_spmd import VLLMRollout
    from mmrl.workers.weight_sync import iter_full_state_dict

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = prepare_for_training(load_model(model_path), packing=False)
    backends = {"transformers": HFRollout(model, tokenizer)}
    start = time.perf_counter()
    engine = RolloutConfig(
        name="vllm", max_model_len=1024, cpu_kv_cache_gib=0.5, enforce_eager=not args.compile
    )
    backends["vllm"] = VLLMRollout(model_path, tokenizer, engine)
    results: dict[str, dict] = {"transformers": {}, "vllm": {"engine_start_s": time.perf_counter() - start}}
    push_s = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        backends["vllm"].update_weights(iter_full_state_dict(model, checkpoint_format=True))
        push_s.append(time.perf_counter() - start)
    results["vllm"]["sync_s"] = min(push_s)
    sampling = SamplingParams(n=1, temperature=1.0, max_tokens=args.max_tokens, seed=0, ignore_eos=True)
    for kind, batch in prompts.items():
        for rollout in backends.values():
            rollout.generate(batch[:2], sampling.override(max_tokens=4))  # warm-up
        for _ in range(args.repeats):
            for name, rollout in backends.items():
                key = f"{kind}_tokens_per_s"
                results[name][key] = max(
                    results[name].get(key, 0.0), _timed_tokens_per_s(rollout, batch, sampling)
                )
    return results


def _table(rows: list[dict]) -> str:
    header = "| model | params | backend | image tok/s | text tok/s | engine start s | weight push s |"
    lines = [header, "|" + "---|" * 7]
    for row in rows:
        start = f"{row['engine_start_s']:.1f}" if "engine_start_s" in row else "-"
        sync = f"{row['sync_s']:.3f}" if "sync_s" in row else "-"
        lines.append(
            f"| {row['size']} | {row['params'] / 1e6:.2f}M | {row['backend']} "
            f"| {row['image_tokens_per_s']:.0f} | {row['text_tokens_per_s']:.0f} | {start} | {sync} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per cell; the best counts")
    parser.add_argument("--compile", action="store_true", help="vLLM with torch.compile (no enforce_eager)")
    args = parser.parse_args()

    import torch

    from mmrl.demo.tiny import build_tiny_model, count_parameters, tiny_model_path

    torch.set_num_threads(args.threads)
    _join_one_rank_group()
    files = _prompt_files(args.prompts)
    models = {
        size: str(build_tiny_model(KIND, tiny_model_path(KIND, size, RESULTS / "models"), size))
        for size in args.sizes
    }
    prompts = {
        size: {kind: _prompts(path, data_file, args.prompts) for kind, data_file in files.items()}
        for size, path in models.items()
    }
    rows = []
    for size, path in models.items():
        for backend, result in _bench_size(path, prompts[size], args).items():
            rows.append({"size": size, "params": count_parameters(KIND, size), "backend": backend, **result})
    rows.sort(key=lambda row: row["backend"] == "vllm")  # transformers rows first
    mode = "torch.compile" if args.compile else "eager"
    print(
        f"\n{args.prompts} prompts x {args.max_tokens} tokens, {args.threads} threads, fp32, CPU, "
        f"vLLM {mode}\n"
    )
    print(_table(rows))
    out = RESULTS / "rollout_speed.json"
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    print(f"\nwritten to {out}")
    os._exit(0)  # skip the engines' teardown (it would destroy the process group mid-exit)


if __name__ == "__main__":
    main()
