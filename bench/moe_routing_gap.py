"""The rollout/trainer log-prob gap of a MoE model with and without routing replay.

    python bench/moe_routing_gap.py [--prompts 8] [--n 4] [--max-tokens 16] [--seeds 3]

On the tiny Qwen3-VL MoE (4 experts, top-2; weights spread by 0.2 * N(0, 1) so that it answers more
than one way), the transformers rollout samples responses to the colour task's images and records its
routing; the actor (fp32, packed) then scores the same tokens with free routing and with the recorded
routing replayed. Two rollout precisions: fp32 (the trainer's, only the order of sums differs: KV-cache
decode against one full forward) and bf16 (the rollout engine of a real run computes in bf16, the
trainer's masters are fp32). Per row: the gap |trainer - rollout| over the response tokens (max, mean),
and the share of (token, layer) pairs whose free trainer routing differs from the rollout's.
"""

from __future__ import annotations

import argparse
import copy
import tempfile

import torch

from mmrl.config import ActorConfig
from mmrl.data.collate import collate_prompts
from mmrl.data.config import DataConfig
from mmrl.data.dataset import PromptDataset
from mmrl.data.processing import attach_media, load_tokenizer_and_processor
from mmrl.demo.synthetic import generate_shapes_dataset
from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS, build_tiny_model, tiny_model_path
from mmrl.models.loading import load_model
from mmrl.models.moe import FREE, ROUTED_EXPERTS, forward_routing
from mmrl.models.prepare import prepare_for_training
from mmrl.workers.actor import PolicyActor
from mmrl.workers.rollout import SamplingParams
from mmrl.workers.rollout.hf import HFRollout

TEMPERATURE = 1.0


def measure(
    model, tokenizer, prompts, rollout_dtype: torch.dtype, n: int, max_tokens: int, seed: int
) -> dict:
    rollout_model = copy.deepcopy(model).to(rollout_dtype)
    rollout = HFRollout(rollout_model, tokenizer, return_log_probs=True, record_routing=True, prepack=False)
    batch = rollout.generate(
        prompts, SamplingParams(n=n, temperature=TEMPERATURE, max_tokens=max_tokens, seed=seed)
    )
    mask = batch.batch["response_mask"].bool()
    row = {}
    for replay in (False, True):
        actor = PolicyActor(model, ActorConfig(share_prompts=False), replay_routing=replay)
        log_probs, _ = actor.compute_log_probs(batch, len(batch), TEMPERATURE)
        gap = (log_probs - batch.batch["rollout_log_probs"]).abs()[mask]
        row[replay] = (gap.max().item(), gap.mean().item())
        if not replay:
            recorded = forward_routing(batch.batch[ROUTED_EXPERTS], batch.batch["attention_mask"], True)
            fed = (recorded != FREE).all(-1)  # [T, layers]
            free = actor.routers.layer_experts().sort(-1).values
            differs = (free != recorded.long().sort(-1).values).any(-1) & fed
            row["flips"] = differs.sum().item() / fed.sum().item()
    return {"tokens": int(mask.sum()), **row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    work = tempfile.mkdtemp(prefix="mmrl-moe-gap-")
    path = build_tiny_model("qwen3_vl_moe", tiny_model_path("qwen3_vl_moe", "tiny", work))
    data = generate_shapes_dataset("color", f"{work}/data", n_train=args.prompts, n_val=1, seed=0)
    tokenizer, processor = load_tokenizer_and_processor(str(path))
    dataset = PromptDataset(
        str(data / "train.jsonl"),
        tokenizer,
        processor,
        DataConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
    )
    prompts = attach_media(
        collate_prompts([dataset[i] for i in range(args.prompts)], tokenizer.pad_token_id), dataset.media
    )
    model = load_model(str(path))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    model = prepare_for_training(model, packing=True, score_tokens=True)
    print(
        "| rollout | tokens | routing flips (token, layer) | gap max free | gap mean free | gap max replay | gap mean replay |"
    )
    print("|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for seed in range(args.seeds):
            row = measure(model, tokenizer, prompts, dtype, args.n, args.max_tokens, seed)
            free, replay = row[False], row[True]
            print(
                f"| {str(dtype).removeprefix('torch.')} seed {seed} | {row['tokens']} | {row['flips']:.2%} | "
                f"{free[0]:.2e} | {free[1]:.2e} | {replay[0]:.2e} | {replay[1]:.2e} |"
            )


if __name__ == "__main__":
    main()
