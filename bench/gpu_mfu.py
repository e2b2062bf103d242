"""Actor update on one GPU: tokens/s and model FLOPs utilisation (MFU) of a real-size Qwen2.5-VL, random weights.

    python bench/gpu_mfu.py [--model 3b|7b] [--rows 16] [--prompt_length 512] [--response_length 512]
                            [--micro_batch 4] [--repeats 3] [--gradient_checkpointing]
                            [--peak_tflops 989]
    python bench/gpu_mfu.py --smoke      # the same code path on the CPU with a tiny config (a check, not a bench)

Needs CUDA; without it the script says so and exits with status 0 (nothing measured). The model is
built from a config dict written here (the published Qwen2.5-VL-3B/7B-Instruct sizes; nothing is
downloaded), with random fp32 weights on the GPU, sharded by mmrl's ``apply_fsdp2`` on a one-rank
group with bf16 compute and fp32 reduction (what the trainer does on GPU), AdamW from mmrl's
``build_optimizer``. Work: ``--rows`` text-only rows of ``--prompt_length`` random prompt tokens and
``--response_length`` random response tokens, one ``PolicyActor.update_policy`` (PPO loss, one optimizer
step over micro-batches of ``--micro_batch`` rows, padding-free), timed ``--repeats`` times after a
warm-up update (median, ``torch.cuda.synchronize`` around each).

FLOPs (:func:`update_flops`): matmul FLOPs of the forward pass (2 per multiply-add) times 3 for
forward + backward: per layer and token, the q/k/v/o projections and the SwiGLU MLP; per sequence, the
causal attention scores and weighted sum (2 · 2 · d_model · S(S+1)/2 per layer); the LM head only for
the response tokens (mmrl computes logits there only). Recomputation under gradient checkpointing is
not counted (model FLOPs, not hardware FLOPs); norms, rotary and softmax are left out. MFU = FLOPs /
(seconds × peak dense bf16 FLOP/s of the GPU: H100/H200 989 TFLOP/s, A100 312; ``--peak_tflops``
for others). Prints a table and writes ``bench/results/gpu_mfu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

# Published sizes of Qwen2.5-VL-{3B,7B}-Instruct (text decoder and vision tower); vocabulary as released.
TEXT_CONFIGS = {
    "3b": {
        "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
        "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    },
    "7b": {
        "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
    },
    # --smoke: the same architecture, small enough for a CPU check
    "smoke": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 512, "tie_word_embeddings": True,
    },
}  # fmt: skip
VISION_CONFIGS = {
    "3b": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16},
    "7b": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16},
    "smoke": {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2},
}
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0}


def build_config(name: str):
    """A ``Qwen2_5_VLConfig`` of the named size (transformers v5 layout: text and vision sub-configs)."""
    from transformers import Qwen2_5_VLConfig

    text = dict(TEXT_CONFIGS[name])
    tie = text.pop("tie_word_embeddings")
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    pairs = head_dim // 2  # M-RoPE sections (temporal, height, width): 1/4, 3/8, 3/8 of the rotary pairs
    temporal = pairs // 4
    height = (pairs - temporal) // 2
    text.update(
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1_000_000.0,
            "mrope_section": [temporal, height, pairs - temporal - height],
        },
        tie_word_embeddings=tie,
    )
    vision = dict(
        VISION_CONFIGS[name],
        out_hidden_size=text["hidden_size"],
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31] if name != "smoke" else [0],
        tokens_per_second=2,
    )
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie)


def forward_flops(text: dict, sequence_lengths: list[int], response_tokens: int) -> float:
    """Matmul FLOPs of one forward over packed sequences of ``sequence_lengths`` tokens, with the LM head
    applied to ``response_tokens`` positions (see module docstring)."""
    hidden, inter, layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    head_dim = hidden // text["num_attention_heads"]
    kv = text["num_key_value_heads"] * head_dim
    tokens = sum(sequence_lengths)
    projections = 2 * (hidden * hidden * 2 + hidden * kv * 2)  # q, o: h x h; k, v: h x kv
    mlp = 2 * 3 * hidden * inter  # gate, up, down
    attention = sum(2 * 2 * hidden * s * (s + 1) // 2 for s in sequence_lengths)  # QK^T and AV, causal
    head = 2 * hidden * text["vocab_size"] * response_tokens
    return layers * (tokens * (projections + mlp) + attention) + head


def update_flops(text: dict, sequence_lengths: list[int], response_tokens: int) -> float:
    """Forward + backward: 3 × forward (backward computes gradients of inputs and of weights)."""
    return 3 * forward_flops(text, sequence_lengths, response_tokens)


def peak_tflops(device_name: str, override: float | None) -> float | None:
    if override:
        return override
    return next((tflops for key, tflops in PEAK_BF16_TFLOPS.items() if key in device_name), None)


def random_batch(rows: int, prompt_length: int, response_length: int, vocab: int, seed: int = 0):
    """Text-only rows, every token valid; advantages random, old log-probs filled in later."""
    import torch

    from mmrl.protocol import DataProto

    generator = torch.Generator().manual_seed(seed)
    low = 16  # stay clear of the special tokens at the bottom of the vocabulary
    prompts = torch.randint(low, vocab, (rows, prompt_length), generator=generator)
    responses = torch.randint(low, vocab, (rows, response_length), generator=generator)
    response_mask = torch.ones(rows, response_length, dtype=torch.long)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.ones(rows, prompt_length + response_length, dtype=torch.long),
        "response_mask": response_mask,
        "advantages": torch.randn(rows, 1, generator=generator).expand(rows, response_length).contiguous(),
    }
    return DataProto.from_dict(tensors=tensors)


def _init_one_rank_group(backend: str) -> None:
    import torch.distributed as dist

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    dist.init_process_group(backend, rank=0, world_size=1)


def run(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mmrl.config import ActorConfig
    from mmrl.models.prepare import prepare_for_training
    from mmrl.protocol import DataProto
    from mmrl.workers.actor import PolicyActor
    from mmrl.workers.fsdp_engine import apply_fsdp2, build_optimizer, enable_gradient_checkpointing

    device = torch.device("cpu" if args.smoke else "cuda")
    if not dist.is_initialized():  # bench/gpu_check.py runs this in its own one-rank group
        _init_one_rank_group("gloo" if args.smoke else "nccl")
    config = build_config(args.model)
    if getattr(args, "layers", None):  # fewer decoder layers at the same widths (bench/gpu_check.py --layers)
        config.text_config.num_hidden_layers = args.layers
    start = time.perf_counter()
    with device:
        model = Qwen2_5_VLForConditionalGeneration._from_config(
            config, dtype=torch.float32, attn_implementation="sdpa"
        )  # random fp32 master weights, built on the device
    build_s = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    prepare_for_training(model, packing=True, score_tokens=True)  # as the trainer prepares the actor
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    mesh = dist.device_mesh.init_device_mesh(device.type, (1,))
    compute_dtype = torch.float32 if args.smoke else torch.bfloat16
    model = apply_fsdp2(model, mesh, param_dtype=compute_dtype, reduce_dtype=torch.float32)
    optimizer = build_optimizer(model.parameters(), lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
    actor = PolicyActor(
        model,
        ActorConfig(padding_free=True),
        optimizer=optimizer,
        device=device,
        max_response_length=args.response_length,
    )

    text = dict(TEXT_CONFIGS[args.model], num_hidden_layers=config.text_config.num_hidden_layers)
    batch = random_batch(args.rows, args.prompt_length, args.response_length, text["vocab_size"])
    log_probs, _ = actor.compute_log_probs(batch, args.micro_batch, temperature=1.0)
    batch = batch.union(DataProto.from_dict(tensors={"old_log_probs": log_probs}))

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    update_metrics: dict[str, float] = {}

    def timed_update() -> float:
        synchronize()
        begin = time.perf_counter()
        update = actor.update_policy(batch, args.rows, args.micro_batch, ppo_epochs=1, temperature=1.0)
        synchronize()
        update_metrics.update(update.metrics)
        return time.perf_counter() - begin

    timed_update()  # warm-up: allocator, kernels, optimizer states
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    update_s = [timed_update() for _ in range(args.repeats)]
    seconds = statistics.median(update_s)
    tokens = args.rows * (args.prompt_length + args.response_length)
    flops = update_flops(
        text, [args.prompt_length + args.response_length] * args.rows, args.rows * args.response_length
    )
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)"
    peak = peak_tflops(device_name, args.peak_tflops)
    return {
        "model": args.model,
        "device": device_name,
        "params": params,
        "build_s": build_s,
        "tokens_per_update": tokens,
        "update_s": seconds,
        "update_s_runs": update_s,
        "tokens_per_s": tokens / seconds,
        "tflops_per_update": flops / 1e12,
        "achieved_tflops": flops / seconds / 1e12,
        "peak_tflops": peak,
        "mfu": flops / seconds / (peak * 1e12) if peak else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 1024**3 if device.type == "cuda" else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 1024**3 if device.type == "cuda" else None,
        "device_free_gib": torch.cuda.mem_get_info()[0] / 1024**3 if device.type == "cuda" else None,
        "metrics": update_metrics,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="3b", choices=["3b", "7b"])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt_length", type=int, default=512)
    parser.add_argument("--response_length", type=int, default=512)
    parser.add_argument("--micro_batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--peak_tflops", type=float, default=None, help="peak dense bf16 TFLOP/s of the GPU")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny config on the CPU: checks the code path only"
    )
    args = parser.parse_args()

    import torch

    if args.smoke:
        args.model, args.rows, args.prompt_length, args.response_length, args.repeats = "smoke", 4, 16, 16, 1
    elif not torch.cuda.is_available():
        print(
            f"bench/gpu_mfu.py needs a CUDA GPU, and this machine has none (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda}). Nothing measured; run it on a GPU machine "
            "(`python bench/gpu_mfu.py --smoke` checks the code path on the CPU)."
        )
        sys.exit(0)
    result = run(args)
    mfu = "-" if result["mfu"] is None else f"{result['mfu']:.1%}"
    memory = "-" if result["peak_memory_gib"] is None else f"{result['peak_memory_gib']:.1f}"
    setting = (
        "fp32 on the CPU (smoke check)"
        if args.smoke
        else "bf16 compute / fp32 master weights, FSDP2 on 1 GPU"
    )
    print(
        f"\nactor update, {args.rows} rows x ({args.prompt_length} prompt + {args.response_length} response) "
        f"tokens, micro-batch {args.micro_batch}, {setting}, gradient checkpointing "
        f"{'on' if args.gradient_checkpointing else 'off'}; median of {args.repeats}\n"
    )
    print("| model | params | device | update s | tokens/s | TFLOP/update | TFLOP/s | MFU | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        f"| Qwen2.5-VL-{result['model']} | {result['params'] / 1e9:.2f}B | {result['device']} "
        f"| {result['update_s']:.3f} | {result['tokens_per_s']:.0f} | {result['tflops_per_update']:.1f} "
        f"| {result['achieved_tflops']:.1f} | {mfu} | {memory} |"
    )
    name = "gpu_mfu_smoke.json" if args.smoke else "gpu_mfu.json"
    out = RESULTS / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "result": result}, indent=2) + "\n")
    print(f"\nwritten to {out}")
    os._exit(0)  # skip the process group's teardown


if __name__ == "__main__":
    main()
