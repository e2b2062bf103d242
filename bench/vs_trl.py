"""mmrl against TRL's GRPOTrainer on the same work: seconds per step, tokens/s and peak memory on the CPU.

    python bench/vs_trl.py [--sizes tiny small] [--prompts 8] [--n 8] [--response_length 64]
                           [--micro_batch 16] [--lr 1e-4] [--steps 8] [--warmup 1] [--rounds 1]
                           [--backends hf vllm] [--ray_worker_niceness 0]

For each tiny Qwen2.5-VL size (``tiny`` ≈ 0.4M, ``small`` ≈ 13M parameters, random weights, built
under ``bench/results/models``) and the synthetic colour task (``bench/results/data``), three jobs run
one after the other: mmrl with the transformers rollout, TRL, mmrl with the vLLM rollout (eager). Every
job does the same work per step: one rollout of ``--prompts`` image prompts × ``--n`` responses of
exactly ``--response_length`` tokens (mmrl ``ignore_eos``, TRL ``min_new_tokens``), rewards from
``reward_functions/shapes.py``, GRPO advantages, and one optimizer step (AdamW, constant lr, no KL,
micro-batches of ``--micro_batch`` responses, fp32, no gradient checkpointing); with one optimizer
step per rollout neither runs a separate old-log-prob pass.
``bench/trl_grpo.py`` lists the settings key by key.

- mmrl runs the real trainer (``python -m mmrl.trainer.main``, Ray driver + one FSDP2 worker process +
  one reward worker), its step time read from ``timing_s/step`` of its jsonl log; TRL runs in one
  process (``bench/trl_grpo.py``), its step timed by a callback from ``on_step_begin`` to
  ``on_step_end``. Neither includes start-up. Both use as many torch threads as the machine has cores
  (mmrl's worker sets cores / processes per node; TRL gets ``--threads``).
- Ray starts worker processes at niceness 15; on a machine shared with other jobs that alone slows
  mmrl several-fold against a TRL process at niceness 0, so ``--ray_worker_niceness 0`` (the default
  here) puts both at the same priority (``RAY_worker_niceness``).
- Reported per model size and backend: median seconds per step over the steps after ``--warmup``
  (of every round), rollout tokens/s (response tokens / generation s), training tokens/s (prompt +
  response tokens / the rest of the step), peak RSS of the job's whole process tree (see
  ``bench/harness.py``), the job's wall time with start-up, the CPU load other jobs put on the
  machine meanwhile, and mmrl / TRL seconds per step. ``--rounds r`` repeats the three jobs r times,
  alternating their order, so a busy spell of the shared machine hits all of them.

Prints a table and writes ``bench/results/vs_trl.json`` (one row per size and backend with
``mmrl_s_per_step``, ``trl_s_per_step``, tokens/s and peak RSS; the raw runs under ``runs``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from harness import (
    RESULTS,
    GiB,
    JobSettings,
    markdown_table,
    mmrl_command,
    mmrl_step_records,
    run_monitored,
    summarize_steps,
    trl_command,
    trl_step_records,
    write_json,
)
from harness import build_models_and_data as build_assets

RUN_TIMEOUT_S = 3600  # a safety net for hangs: a shared machine can slow a job many times over


def run_job(job: JobSettings, runner: str, run_dir: Path, args: argparse.Namespace) -> dict:
    """One job (``mmrl-hf``, ``mmrl-vllm`` or ``trl``); its step records and resource use."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if runner == "trl":
        log_file = run_dir / "trl.jsonl"
        result = run_monitored(
            trl_command(job, log_file, args.threads), log_file, run_dir / "output.txt", RUN_TIMEOUT_S
        )
        steps = trl_step_records(result.records)
    else:
        command, log_file = mmrl_command(job, runner.removeprefix("mmrl-"), run_dir)
        result = run_monitored(
            command,
            log_file,
            run_dir / "output.txt",
            RUN_TIMEOUT_S,
            # the last step's line is all we need: skip the final checkpoint and the shutdown
            stop_when=lambda record: record.get("step", 0) >= job.steps and "timing_s/step" in record,
            env={"RAY_worker_niceness": str(args.ray_worker_niceness)},
        )
        steps = mmrl_step_records(result.records, job.prompts * job.n)
    if len(steps) < job.steps:
        raise RuntimeError(f"{runner}: {len(steps)} of {job.steps} steps logged; see {result.output_file}")
    return {
        "steps": steps,
        "peak_rss_bytes": result.peak_rss_bytes,
        "wall_s": result.wall_s,
        "other_load_cores": result.other_load_cores,
        "by_process": result.by_process,
    }


def runner_order(backends: list[str], round_index: int) -> list[str]:
    """mmrl backends around TRL (``mmrl-hf, trl, mmrl-vllm``), reversed every other round."""
    mmrl = [f"mmrl-{backend}" for backend in backends]
    order = mmrl[:1] + ["trl"] + mmrl[1:]
    return order if round_index % 2 == 0 else order[::-1]


def combine_runs(runs: list[dict], warmup: int) -> dict:
    """One runner's rounds: medians over every round's steps after its warm-up, worst peak memory."""
    steps = [step for run in runs for step in run["steps"][warmup:]]
    return {
        **summarize_steps(steps, warmup=0),
        "peak_rss_gib": max(run["peak_rss_bytes"] for run in runs) / GiB,
        "wall_s": sum(run["wall_s"] for run in runs) / len(runs),
        "other_load_cores": sum(run["other_load_cores"] for run in runs) / len(runs),
    }


def build_rows(
    summaries: dict[str, dict[str, dict]], params: dict[str, int], backends: list[str]
) -> list[dict]:
    """One row per size and mmrl backend, next to TRL's numbers for the same size."""
    rows = []
    for size, by_runner in summaries.items():
        trl = by_runner["trl"]
        for backend in backends:
            mmrl = by_runner[f"mmrl-{backend}"]
            rows.append(
                {
                    "size": size,
                    "params": params[size],
                    "backend": backend,
                    "mmrl_s_per_step": mmrl["s_per_step"],
                    "trl_s_per_step": trl["s_per_step"],
                    "ratio_mmrl_over_trl": mmrl["s_per_step"] / trl["s_per_step"],
                    "mmrl_rollout_tokens_per_s": mmrl["rollout_tokens_per_s"],
                    "trl_rollout_tokens_per_s": trl["rollout_tokens_per_s"],
                    "mmrl_train_tokens_per_s": mmrl["train_tokens_per_s"],
                    "trl_train_tokens_per_s": trl["train_tokens_per_s"],
                    "mmrl_tokens_per_s": mmrl["tokens_per_s"],
                    "trl_tokens_per_s": trl["tokens_per_s"],
                    "mmrl_peak_rss_gib": mmrl["peak_rss_gib"],
                    "trl_peak_rss_gib": trl["peak_rss_gib"],
                    "mmrl_wall_s": mmrl["wall_s"],
                    "trl_wall_s": trl["wall_s"],
                    "mmrl_other_load_cores": mmrl["other_load_cores"],
                    "trl_other_load_cores": trl["other_load_cores"],
                    "prompt_tokens_per_step": {
                        "mmrl": mmrl["prompt_tokens_per_step"],
                        "trl": trl["prompt_tokens_per_step"],
                    },
                }
            )
    return rows


def format_table(rows: list[dict]) -> str:
    headers = [
        "model", "backend", "mmrl s/step", "TRL s/step", "mmrl/TRL", "rollout tok/s (mmrl, TRL)",
        "train tok/s (mmrl, TRL)", "peak RSS GiB (mmrl, TRL)", "wall s (mmrl, TRL)", "other load (mmrl, TRL)",
    ]  # fmt: skip
    cells = [
        [
            f"{row['size']} ({row['params'] / 1e6:.2f}M)",
            row["backend"],
            f"{row['mmrl_s_per_step']:.2f}",
            f"{row['trl_s_per_step']:.2f}",
            f"{row['ratio_mmrl_over_trl']:.2f}",
            f"{row['mmrl_rollout_tokens_per_s']:.0f}, {row['trl_rollout_tokens_per_s']:.0f}",
            f"{row['mmrl_train_tokens_per_s']:.0f}, {row['trl_train_tokens_per_s']:.0f}",
            f"{row['mmrl_peak_rss_gib']:.2f}, {row['trl_peak_rss_gib']:.2f}",
            f"{row['mmrl_wall_s']:.0f}, {row['trl_wall_s']:.0f}",
            f"{row['mmrl_other_load_cores']:.1f}, {row['trl_other_load_cores']:.1f}",
        ]
        for row in rows
    ]
    return markdown_table(headers, cells)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--backends", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response_length", type=int, default=64)
    parser.add_argument("--micro_batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=8, help="steps per job, warm-up included")
    parser.add_argument("--warmup", type=int, default=1, help="first steps of each job left out")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="TRL's torch threads")
    parser.add_argument("--ray_worker_niceness", type=int, default=0, help="Ray's default is 15")
    args = parser.parse_args()
    if args.steps - args.warmup < 5:
        parser.error("--steps - --warmup must leave at least 5 timed steps")

    assets = build_assets(args.sizes)
    summaries: dict[str, dict[str, dict]] = {}
    raw: dict[str, dict[str, list]] = {}
    for size in args.sizes:
        job = JobSettings(
            model=assets["models"][size],
            data_dir=assets["data_dir"],
            prompts=args.prompts,
            n=args.n,
            response_length=args.response_length,
            force_length=True,
            micro_batch=args.micro_batch,
            lr=args.lr,
            steps=args.steps,
        )
        raw[size] = {}
        for round_index in range(args.rounds):
            for runner in runner_order(args.backends, round_index):
                run_dir = RESULTS / "runs" / "vs_trl" / f"{size}-{runner}-{round_index}"
                print(f"[vs_trl] {size} {runner} (round {round_index + 1}/{args.rounds})", flush=True)
                raw[size].setdefault(runner, []).append(run_job(job, runner, run_dir, args))
        summaries[size] = {runner: combine_runs(runs, args.warmup) for runner, runs in raw[size].items()}
    rows = build_rows(summaries, assets["params"], args.backends)
    print(
        f"\n{args.prompts} prompts x {args.n} responses x {args.response_length} tokens per step, one optimizer "
        f"step per rollout, micro-batch {args.micro_batch}, fp32, CPU ({os.cpu_count()} cores); median of "
        f"{args.steps - args.warmup} steps x {args.rounds} round(s) after {args.warmup} warm-up step(s)\n"
    )
    print(format_table(rows))
    out = write_json("vs_trl.json", {"args": vars(args), "rows": rows, "summaries": summaries, "runs": raw})
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
