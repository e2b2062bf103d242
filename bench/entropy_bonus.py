"""Where an entropy bonus sends a tiny model's probability: the whole vocabulary against the top-k.

    python bench/entropy_bonus.py [--model assets/models/tiny-qwen2.5-vl-spatial-warm]
        [--data assets/data/shapes-spatial/train.jsonl] [--prompts 16] [--steps 8] [--coef 0.01]

The spatial warm-up model answers "left" or "right" (then EOS) whatever the image. This takes its
distribution over the first response token for ``--prompts`` training prompts and runs ``--steps``
AdamW steps (the small-model recipe's learning rate, 1e-3) on the entropy bonus alone,
``-coef * mean H``, with H over the whole vocabulary or over the top-k logits
(``core_algos.entropy_from_logits``), and prints per variant, before and after: the whole-vocabulary
entropy, the probability on the two answer words, the probability left for everything else (non-words
here), and how many tokens hold more than 1 % each. No policy gradient is involved: it isolates where
the bonus's own gradient goes. A bonus that moves mass off the answer words breaks the answer format
(stop 20: seed 1's entropy went 0.45 -> 1.1 in two steps at coefficient 0.001, and no round could fill
a step).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from mmrl.core_algos import entropy_from_logits
from mmrl.data.collate import collate_prompts
from mmrl.data.processing import attach_media, load_tokenizer_and_processor
from mmrl.demo.warmup import _dataset
from mmrl.models.inputs import response_head_outputs
from mmrl.models.loading import load_model

REPO = Path(__file__).resolve().parent.parent
ANSWERS = ("left", "right")


def first_token_logits(model, dataset, items, tokenizer) -> torch.Tensor:
    """Logits [N, V] of the first response token after each prompt of ``items``."""
    prompts = attach_media(collate_prompts(items, tokenizer.pad_token_id), dataset.media)
    batch = prompts.batch
    response = torch.full((len(items), 1), tokenizer.eos_token_id)
    input_ids = torch.cat([batch["input_ids"], response], dim=-1)
    attention_mask = torch.cat([batch["attention_mask"], torch.ones_like(response)], dim=-1)
    mm_types = torch.cat([batch["mm_token_type_ids"], torch.zeros_like(response)], dim=-1)
    media = list(prompts.non_tensor_batch["multi_modal_inputs"])
    return response_head_outputs(model, input_ids, attention_mask, 1, media, mm_types)[:, 0]


def summary(logits: torch.Tensor, answer_ids: list[int]) -> dict[str, float]:
    probs = torch.softmax(logits.float(), dim=-1)  # [N, V]
    on_answers = probs[:, answer_ids].sum(-1)
    return {
        "entropy": float(entropy_from_logits(logits.float()).mean()),
        "p(answer words)": float(on_answers.mean()),
        "p(other tokens)": float((1 - on_answers).mean()),
        "tokens > 1 %": float((probs > 0.01).sum(-1).float().mean()),
    }


def run_variant(args, top_k: int, tokenizer, dataset, items, answer_ids) -> dict[str, float]:
    torch.manual_seed(0)
    model = load_model(args.model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    for _ in range(args.steps):
        logits = first_token_logits(model, dataset, items, tokenizer)
        loss = -args.coef * entropy_from_logits(logits.float(), top_k).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return summary(first_token_logits(model.eval(), dataset, items, tokenizer), answer_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "assets/models/tiny-qwen2.5-vl-spatial-warm"))
    parser.add_argument("--data", default=str(REPO / "assets/data/shapes-spatial/train.jsonl"))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps (the recipe: 2 per RL step)")
    parser.add_argument("--coef", type=float, default=0.01)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--top_k", type=int, nargs="+", default=[0, 2, 8, 64])
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer, processor = load_tokenizer_and_processor(args.model)
    dataset = _dataset(args.data, tokenizer, processor)
    items = [dataset[i] for i in range(args.prompts)]
    answer_ids = [tokenizer.encode(word, add_special_tokens=False)[0] for word in ANSWERS]
    with torch.no_grad():
        before = summary(
            first_token_logits(load_model(args.model).eval(), dataset, items, tokenizer), answer_ids
        )
    rows = {"before": before}
    for top_k in args.top_k:
        name = "whole vocabulary" if top_k == 0 else f"top-{top_k}"
        rows[f"{name}, {args.steps} steps"] = run_variant(args, top_k, tokenizer, dataset, items, answer_ids)
    keys = list(before)
    print(f"vocabulary {len(tokenizer)} tokens; bonus coefficient {args.coef}, lr {args.lr}")
    print("| bonus | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, row in rows.items():
        print(f"| {name} | " + " | ".join(f"{row[key]:.3f}" for key in keys) + " |")
    out = REPO / "bench" / "results" / "entropy_bonus.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
