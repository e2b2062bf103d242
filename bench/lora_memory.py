"""Memory of one actor update with a LoRA adapter against full fine-tuning, at Qwen2.5-VL-3B's widths.

    python bench/lora_memory.py [--layers 2] [--rank 64] [--alpha 128] [--length 256] [--threads 2]

Model: :mod:`mmrl.demo.tiny`'s ``3b-width`` Qwen2.5-VL (hidden 2048, intermediate 11008, 16 heads /
2 KV heads, 151,936-row tied vocabulary, 2 vision blocks of width 1280) with ``--layers`` decoder
layers, random fp32 weights on the CPU, built in memory as ``build_tiny_model`` builds it (its
tokenizer, ``build_config``, ``model_class``) and prepared as the trainer prepares the actor
(``prepare_for_training(..., score_tokens=True)``). ``lora``: ``mmrl.models.lora.apply_lora`` with
``--rank`` / ``--alpha`` on every linear layer but the head (``all-linear``, vision tower included), as
``worker.actor.model.lora`` does.

Each mode runs in a fresh process: build, then ONE ``PolicyActor.update_policy`` (forward, backward,
fused AdamW step: the step that creates the optimizer's moments) on one text row of ``--length``
random response tokens, packed. Reported per process (= per rank of a one-rank run: with N FSDP ranks
the weights, gradients and optimizer states below are divided by N, the activations are not):
``trainable``: parameters the optimizer updates; ``optimizer_mb``: bytes of its state tensors after the
step; ``grads_mb``: bytes of gradients a step holds (trainable fp32 parameters); ``start_mb``: RSS
before the update (model built); ``peak_mb``: highest RSS during it (sampled every 10 ms); ``added_mb``:
the difference, what the update costs on top of the weights. Prints a table and writes
``bench/results/lora_memory.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time

from cost_curves import RSSPeak
from harness import REPO, markdown_table, write_json

KIND, SIZE = "qwen2_5_vl", "3b-width"
TEMPERATURE = 0.7
MB = 1024**2


def build_model(layers: int):
    """The ``3b-width`` Qwen2.5-VL with ``layers`` decoder layers, random weights (seed 0), prepared."""
    import torch

    from mmrl.demo.tiny import SIZES, TINY_CORPUS, build_config, model_class, train_tokenizer
    from mmrl.models.prepare import prepare_for_training

    spec = dataclasses.replace(SIZES[SIZE], num_layers=layers)
    tokenizer = train_tokenizer(TINY_CORPUS, spec.vocab_size, KIND, tokenizer_size=spec.tokenizer_size)
    torch.manual_seed(0)
    model = model_class(KIND)(build_config(KIND, spec, tokenizer))
    return prepare_for_training(model.float(), packing=True, score_tokens=True)


def _batch(length: int):
    import torch

    from mmrl.protocol import DataProto

    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(300, 150_000, (1, 32), generator=generator)
    responses = torch.randint(300, 150_000, (1, length), generator=generator)
    tensors = {
        "prompts": prompt,
        "responses": responses,
        "input_ids": torch.cat([prompt, responses], dim=1),
        "attention_mask": torch.ones(1, 32 + length, dtype=torch.long),
        "response_mask": torch.ones(1, length, dtype=torch.long),
        "advantages": torch.ones(1, length),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": ["p0"]})


def run_point(point: dict) -> dict:
    import torch

    from mmrl.config import ActorConfig
    from mmrl.models.lora import apply_lora
    from mmrl.workers.actor import PolicyActor
    from mmrl.workers.fsdp_engine import build_optimizer

    torch.set_num_threads(point["threads"])
    module = build_model(point["layers"])
    if point["mode"] == "lora":
        apply_lora(module, point["rank"], point["alpha"], "all-linear", None)
    trainable = [param for param in module.parameters() if param.requires_grad]
    optimizer = build_optimizer(module.parameters(), lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
    config = ActorConfig(padding_free=True, max_grad_norm=1.0)
    actor = PolicyActor(module, config, optimizer=optimizer, max_response_length=point["length"])
    batch = _batch(point["length"])
    with RSSPeak() as memory:
        start = time.perf_counter()
        actor.update_policy(batch, 1, 1, 1, TEMPERATURE, on_policy=True)
        seconds = time.perf_counter() - start
    optimizer_bytes = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
    return {
        **point,
        "parameters": sum(param.numel() for param in module.parameters()),
        "trainable": sum(param.numel() for param in trainable),
        "optimizer_mb": optimizer_bytes / MB,
        "grads_mb": sum(param.numel() * param.element_size() for param in trainable) / MB,
        "start_mb": memory.start_bytes / MB,
        "peak_mb": memory.peak_bytes / MB,
        "added_mb": (memory.peak_bytes - memory.start_bytes) / MB,
        "seconds": seconds,
    }


def measure(point: dict) -> dict:
    """``point`` in a fresh process (its RSS starts from nothing)."""
    out = subprocess.run(
        [sys.executable, __file__, "--point", json.dumps(point)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        timeout=1800,
    )
    if out.returncode != 0:
        raise RuntimeError(f"point {point} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--alpha", type=int, default=128)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--point", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point is not None:
        print(json.dumps(run_point(json.loads(args.point))))
        return
    base = {"layers": args.layers, "rank": args.rank, "alpha": args.alpha, "length": args.length}
    results = [measure({**base, "threads": args.threads, "mode": mode}) for mode in ("full", "lora")]
    headers = ["mode", "params", "trainable", "optimizer MB", "grads MB", "RSS before MB", "peak RSS MB",
               "update adds MB", "update s"]  # fmt: skip
    rows = [
        [
            "full fine-tuning" if r["mode"] == "full" else f"LoRA r={r['rank']} (all-linear)",
            f"{r['parameters'] / 1e6:.1f} M",
            f"{r['trainable'] / 1e6:.2f} M",
            f"{r['optimizer_mb']:.0f}",
            f"{r['grads_mb']:.0f}",
            f"{r['start_mb']:.0f}",
            f"{r['peak_mb']:.0f}",
            f"{r['added_mb']:.0f}",
            f"{r['seconds']:.1f}",
        ]
        for r in results
    ]
    print(f"\none update, 3b-width Qwen2.5-VL with {args.layers} decoder layers, fp32 on CPU, one rank, "
          f"{args.length} response tokens")  # fmt: skip
    print(markdown_table(headers, rows))
    print(f"written to {write_json('lora_memory', {'args': vars(args), 'results': results})}")


if __name__ == "__main__":
    main()
