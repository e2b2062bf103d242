"""The real-shape smoke run: peak memory per worker and per phase, and time per phase, of two GRPO steps
at Qwen2.5-VL-3B's widths and real vocabulary on this CPU machine.

    python bench/scale_smoke.py [--chunks 0 256]

The model is ``mmrl.demo.tiny``'s ``3b-width`` Qwen2.5-VL (2 decoder layers, 2 vision blocks, random
weights, 151,936-token vocabulary, 0.55B parameters), the data two 448-pixel photo-like JPEGs, the job
the one ``tests/trainer/test_real_shape.py`` runs (:func:`real_shape_overrides`): a prompt × 2
responses of 1,024 tokens, one FSDP2 worker, bf16 compute, the transformers rollout in bf16. Each
``--chunks`` value is a run with ``worker.actor.log_prob_chunk_tokens`` set to it (0 = the whole
``[tokens, vocab]`` logits, what mmrl did before). Reported per phase: the largest peak resident set
over the workers (``memory/<phase>_peak_gib``, :mod:`mmrl.workers.memory`) and the seconds of step 2.
Prints a table and writes ``bench/results/scale_smoke.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results"
FINGERPRINT_REWARD = REPO / "tests/trainer/assets/fingerprint_reward.py"
RESPONSE_TOKENS = 1024
IMAGE_PIXELS = 448 * 448  # kept as is: 16 × 16 merged patches, 256 placeholder tokens
PHASES = ("gen", "update_actor", "sync")


def native_bf16() -> bool:
    """Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX). Without it torch emulates bf16
    matmuls: the real-shape job's two steps took over 14 minutes on a 2-core AVX2 machine (81 s with
    AVX512-BF16), so there it computes in fp32, the dtype such a CPU runs fastest."""
    import torch

    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def real_shape_overrides(
    model_path,
    data_dir,
    save_dir,
    chunk_tokens: int = 256,
    response_tokens: int = RESPONSE_TOKENS,
    dtype: str | None = None,
    steps: int = 2,
) -> list[str]:
    """The real-shape job (the test and this bench run the same): one worker, one prompt × 2 responses,
    no reference (so the update computes the old log-probs itself). One worker holds the fp32 weights,
    gradients and AdamW moments (8.8 GB), the gathered bf16 weights and gradients in the update (2.2
    GB) and a bf16 rollout copy (1.1 GB): it fits this 24 GB machine with bf16 gradient reduction (an
    fp32 one first casts the gathered gradients to a full fp32 copy) and 256-token chunks (each
    [256, 151,936] fp32 buffer of the head is 0.16 GB). Two ranks would halve the sharded state but
    double the processes; the 2-rank FSDP2 paths are tested at small widths. ``dtype`` is the compute
    dtype (None: bf16 where the CPU has it natively, else fp32: :func:`native_bf16`); ``steps``: training
    steps (the first already has every phase: generation, update with the AdamW moments made, sync)."""
    dtype = dtype or ("bf16" if native_bf16() else "fp32")
    return [
        f"data.train_files={Path(data_dir) / 'train.jsonl'}",
        "data.max_prompt_length=320",
        f"data.max_response_length={response_tokens}",
        "data.rollout_batch_size=1",
        f"data.min_pixels={IMAGE_PIXELS}",
        f"data.max_pixels={IMAGE_PIXELS}",
        f"worker.actor.model.model_path={model_path}",
        "worker.actor.global_batch_size=1",  # one optimizer step per rollout: no separate old-log-prob pass
        "worker.actor.micro_batch_size_per_device_for_update=1",
        f"worker.actor.fsdp.mp_param_dtype={dtype}",
        f"worker.actor.fsdp.mp_reduce_dtype={dtype}",
        f"worker.actor.log_prob_chunk_tokens={chunk_tokens}",
        "worker.rollout.name=hf",
        f"worker.rollout.dtype={dtype}",
        "worker.rollout.prepack_cpu_linears=false",  # a second copy of the large weights: 0.9 GB
        "worker.rollout.n=2",
        "worker.rollout.ignore_eos=true",  # a random model seldom samples EOS anyway: full-length responses
        f"worker.reward.reward_function={FINGERPRINT_REWARD}:compute_score",
        "algorithm.disable_kl=true",
        f"trainer.max_steps={steps}",
        "trainer.logger=[jsonl]",
        "trainer.n_gpus_per_node=1",
        "trainer.device=cpu",
        "trainer.save_freq=0",  # no checkpoint: the end's would write 7.3 GB (fp32 weights, AdamW moments)
        f"trainer.save_checkpoint_path={save_dir}",
    ]


def run(chunk_tokens: int, model: Path, data_dir: Path) -> dict:
    save_dir = RESULTS / f"scale_smoke_run_{chunk_tokens}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmrl.trainer.main",
            *real_shape_overrides(model, data_dir, save_dir, chunk_tokens),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    wall_s = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        return {"chunk_tokens": chunk_tokens, "failed": f"exit {done.returncode}: {tail}", "wall_s": wall_s}
    lines = [json.loads(line) for line in (save_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "actor/pg_loss" in line]
    peaks = {phase: max(step[f"memory/{phase}_peak_gib"] for step in steps) for phase in PHASES}
    seconds = {phase: steps[-1].get(f"timing_s/{phase}") for phase in (*PHASES, "step")}
    return {"chunk_tokens": chunk_tokens, "peak_gib": peaks, "seconds": seconds, "wall_s": wall_s}


def format_table(rows: list[dict]) -> str:
    lines = [
        "| log_prob_chunk_tokens | " + " | ".join(f"{p} peak GiB" for p in PHASES) + " | "
        + " | ".join(f"{p} s" for p in (*PHASES, "step")) + " | run s |",
        "|---" * (2 * len(PHASES) + 3) + "|",
    ]  # fmt: skip
    for row in rows:
        if "failed" in row:
            lines.append(f"| {row['chunk_tokens']} | failed: {row['failed'][-200:]!r} |")
            continue
        peaks = " | ".join(f"{row['peak_gib'][p]:.2f}" for p in PHASES)
        secs = " | ".join(f"{row['seconds'][p]:.1f}" for p in (*PHASES, "step"))
        lines.append(f"| {row['chunk_tokens']} | {peaks} | {secs} | {row['wall_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 256])
    args = parser.parse_args(argv)
    from mmrl.demo.synthetic import write_photo_dataset
    from mmrl.demo.tiny import ensure_tiny_model

    model = ensure_tiny_model("qwen2_5_vl", "3b-width", root=REPO / "assets" / "models")
    data_dir = write_photo_dataset(REPO / "assets" / "bench" / "photos-2", n=2, size=448)
    rows = []
    for chunk in args.chunks:
        rows.append(run(chunk, model, data_dir))
        print(f"[scale_smoke] chunk {chunk}: {rows[-1].get('peak_gib', rows[-1].get('failed'))}", flush=True)
    print(
        "\nreal-shape GRPO steps (3b-width Qwen2.5-VL, 2 workers, bf16 compute, 2 × 2 responses of 1,024 tokens)"
    )
    print(format_table(rows))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "scale_smoke.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
