"""Padding-free training on the CPU: padding share and step time, padded against packed micro-batches.

    python bench/packing.py [--sizes tiny small] [--rows 16] [--min_response 4] [--max_response 256]
                            [--micro_batch_size 4] [--threads 2] [--repeats 5]

A mixed-length batch as the rollout hands it over: ``--rows`` responses whose lengths spread
geometrically from ``--min_response`` to ``--max_response`` tokens (many short, few long, in shuffled
order), half of the prompts with an image of one of four sizes, the others text only; prompts
left-padded, responses right-padded. For each tiny Qwen2.5-VL size the same actor update (PPO loss,
plain SGD, one optimizer step) and the same log-prob pass run three ways, in turn:

- ``padded``: micro-batches of ``--micro_batch_size`` rows at the batch's full width (what ran before);
- ``packed``: the same rows per micro-batch, packed into one sequence each (no padding computed);
- ``packed+budget``: packed micro-batches formed by a token budget of the same mean size (total valid
  tokens / number of count micro-batches, at least the longest row).

Reported: the share of computed tokens that are padding (the update's ``padding_ratio`` metric), the
update's wall time (forward + backward + step) and the log-prob pass's, each the median of
``--repeats`` rounds after a warm-up round (the modes alternate within a round). Prints a table and
writes ``bench/results/packing.json``; models are built under ``bench/results/models``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
KIND = "qwen2_5_vl"
IMAGE_SIZES = ((56, 56), (112, 84), (84, 112), (112, 112))  # (width, height) in pixels
TEMPERATURE = 1.0


def _encode_prompt(processor, image_size, seed: int) -> dict:
    import numpy as np
    from PIL import Image

    content = [{"type": "text", "text": "What colour is the shape? Think first, then answer."}]
    images = None
    if image_size is not None:
        content.insert(0, {"type": "image"})
        pixels = np.random.default_rng(seed).integers(
            0, 256, (image_size[1], image_size[0], 3), dtype=np.uint8
        )
        images = [Image.fromarray(pixels)]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return dict(processor(text=[prompt], images=images, return_tensors="pt"))


def response_lengths(rows: int, shortest: int, longest: int, seed: int = 0) -> list[int]:
    """``rows`` lengths spread geometrically over [shortest, longest], shuffled."""
    import numpy as np

    lengths = np.unique(np.geomspace(shortest, longest, rows).round().astype(int)).tolist()
    lengths += [longest] * (rows - len(lengths))  # rounding may merge a few short ones
    return np.random.default_rng(seed).permutation(lengths).tolist()


def build_batch(processor, lengths: list[int], seed: int = 0):
    """Left-padded prompts (every other one with an image), right-padded random responses and random
    advantages; the old log-probs are added by :func:`add_old_log_probs`."""
    import torch

    from mmrl.protocol import DataProto

    generator = torch.Generator().manual_seed(seed)
    sizes = [
        IMAGE_SIZES[row // 2 % len(IMAGE_SIZES)] if row % 2 == 0 else None for row in range(len(lengths))
    ]
    encoded = [_encode_prompt(processor, size, seed + row) for row, size in enumerate(sizes)]
    prompt_width, response_width = max(item["input_ids"].shape[1] for item in encoded), max(lengths)
    rows, pad_id = len(lengths), processor.tokenizer.pad_token_id
    prompts = torch.full((rows, prompt_width), pad_id)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    prompt_types = torch.zeros(rows, prompt_width, dtype=torch.long)
    for row, item in enumerate(encoded):
        width = item["input_ids"].shape[1]
        prompts[row, prompt_width - width :] = item["input_ids"][0]
        prompt_mask[row, prompt_width - width :] = 1
        prompt_types[row, prompt_width - width :] = item["mm_token_type_ids"][0]
    response_mask = (torch.arange(response_width) < torch.tensor(lengths)[:, None]).long()
    responses = torch.randint(50, 300, (rows, response_width), generator=generator)
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad_id))
    media = [{k: v for k, v in item.items() if k in ("pixel_values", "image_grid_thw")} for item in encoded]
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
        "response_mask": response_mask,
        "mm_token_type_ids": torch.cat([prompt_types, torch.zeros_like(responses)], dim=1),
        "advantages": torch.randn(rows, 1, generator=generator) * response_mask,
    }
    return DataProto.from_dict(
        tensors=tensors, non_tensors={"multi_modal_inputs": media, "uid": [str(row) for row in range(rows)]}
    )


def add_old_log_probs(model, batch):
    """The model's own log-probs as ``old_log_probs``: every ratio starts at 1, as in a real update."""
    from mmrl.config import ActorConfig
    from mmrl.protocol import DataProto
    from mmrl.workers.actor import PolicyActor

    actor = PolicyActor(model, ActorConfig(padding_free=True))
    log_probs, _ = actor.compute_log_probs(batch, len(batch), TEMPERATURE)
    return batch.union(DataProto.from_dict(tensors={"old_log_probs": log_probs}))


def bench_modes(model, batch, modes, micro_batch_size: int, repeats: int) -> dict[str, dict]:
    """Per mode ``(name, padding_free, budget)``: padding share, micro-batches, computed tokens and the
    median update / log-prob pass time. The modes' timed runs alternate, so a busy spell of the shared
    machine slows all of them rather than one."""
    import torch

    from mmrl.config import ActorConfig
    from mmrl.parallel.packing import padding_counts
    from mmrl.workers.actor import PolicyActor
    from mmrl.workers.fsdp_engine import micro_batch_rows

    actors, metrics, times = {}, {}, {}
    for name, padding_free, budget in modes:
        # lr 0: the weights stay as they are, so every repeat does the same work
        actors[name] = PolicyActor(
            model,
            ActorConfig(padding_free=padding_free, max_tokens_per_micro_batch=budget),
            optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
            max_response_length=batch.batch["responses"].shape[1],
        )
        times[name] = {"update_s": [], "log_prob_s": []}
    for repeat in range(repeats + 1):  # the first round warms up
        for name, actor in actors.items():
            start = time.perf_counter()
            metrics[name] = actor.update_policy(batch, len(batch), micro_batch_size, 1, TEMPERATURE).metrics
            middle = time.perf_counter()
            actor.compute_log_probs(batch, micro_batch_size, TEMPERATURE)
            update_s, log_prob_s = middle - start, time.perf_counter() - middle
            if repeat > 0:
                times[name]["update_s"].append(update_s)
                times[name]["log_prob_s"].append(log_prob_s)
    attention_mask = batch.batch["attention_mask"]
    results = {}
    for name, padding_free, budget in modes:
        groups = micro_batch_rows(attention_mask, micro_batch_size, budget)
        results[name] = {
            "micro_batches": len(groups),
            "computed_tokens": sum(padding_counts(attention_mask[rows], padding_free)[0] for rows in groups),
            "valid_tokens": int(attention_mask.sum()),
            "padding_ratio": metrics[name]["padding_ratio"],
            "update_s": statistics.median(times[name]["update_s"]),
            "log_prob_s": statistics.median(times[name]["log_prob_s"]),
            "update_s_runs": times[name]["update_s"],
            "log_prob_s_runs": times[name]["log_prob_s"],
        }
    return results


def _table(rows: list[dict]) -> str:
    header = (
        f"{'model':<16}{'mode':<15}{'micro':>6}{'computed':>10}{'padding':>9}"
        f"{'update s':>10}{'speed-up':>9}{'log-prob s':>11}{'speed-up':>9}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['size'] + ' (' + format(row['params'] / 1e6, '.2f') + 'M)':<16}{row['mode']:<15}"
            f"{row['micro_batches']:>6}{row['computed_tokens']:>10}{row['padding_ratio']:>8.1%} "
            f"{row['update_s']:>10.3f}{row['update_speedup']:>8.2f}x{row['log_prob_s']:>11.3f}"
            f"{row['log_prob_speedup']:>8.2f}x"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--min_response", type=int, default=4)
    parser.add_argument("--max_response", type=int, default=256)
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch
    from transformers import AutoProcessor

    from mmrl.demo.tiny import build_tiny_model, count_parameters, tiny_model_path
    from mmrl.models.loading import load_model
    from mmrl.models.prepare import prepare_for_training

    torch.set_num_threads(args.threads)
    lengths = response_lengths(args.rows, args.min_response, args.max_response)
    rows = []
    for size in args.sizes:
        path = build_tiny_model(KIND, tiny_model_path(KIND, size, RESULTS / "models"), size)
        batch = build_batch(AutoProcessor.from_pretrained(path), lengths)
        valid_per_row = batch.batch["attention_mask"].sum(-1)
        count_micro_batches = math.ceil(args.rows / args.micro_batch_size)
        budget = max(int(valid_per_row.max()), math.ceil(int(valid_per_row.sum()) / count_micro_batches))
        model = prepare_for_training(load_model(str(path)), packing=True, score_tokens=True)  # padded, packed
        batch = add_old_log_probs(model, batch)
        modes = (("padded", False, None), ("packed", True, None), ("packed+budget", True, budget))
        results = bench_modes(model, batch, modes, args.micro_batch_size, args.repeats)
        for mode, result in results.items():
            rows.append(
                {
                    "size": size,
                    "params": count_parameters(KIND, size),
                    "mode": mode,
                    "budget": budget if mode == "packed+budget" else None,
                    **result,
                    "update_speedup": results["padded"]["update_s"] / result["update_s"],
                    "log_prob_speedup": results["padded"]["log_prob_s"] / result["log_prob_s"],
                }
            )
    print(
        f"\n{args.rows} responses of {min(lengths)}..{max(lengths)} tokens (half the prompts with an image), "
        f"{args.micro_batch_size} rows per count micro-batch, fp32, CPU, {args.threads} threads; "
        f"median of {args.repeats}\n"
    )
    print(_table(rows))
    out = RESULTS / "packing.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"args": vars(args), "response_lengths": lengths, "rows": rows}, indent=2) + "\n"
    )
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
