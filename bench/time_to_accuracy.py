"""Time to accuracy on the CPU: wall time for mmrl and TRL to reach 0.8 validation accuracy on the colour task.

    python bench/time_to_accuracy.py [--model assets/models/tiny-qwen2.5-vl-warm]
        [--data_dir assets/data/shapes-color] [--target 0.8] [--prompts 16] [--n 8]
        [--response_length 4] [--micro_batch 16] [--updates_per_rollout 1] [--lr 5e-4]
        [--val_every 5] [--max_steps 60] [--runners mmrl-hf trl]

Both trainers start from the same answer-format warm-up model that ``make assets`` builds (chance
accuracy, 1/4) and train GRPO on the synthetic "What colour is the shape?" task with the same
settings (see ``bench/trl_grpo.py`` for the key-by-key mapping), the recipe of the demo
(``examples/tiny_cpu.yaml``) with a constant lr: ``--prompts`` prompts × ``--n`` responses per step
sampled at temperature 1 up to ``--response_length`` tokens (stopping at EOS), ``--updates_per_rollout``
optimizer steps per rollout, a k3 KL loss (``--kl_coef``) to the warm-up model, which keeps the policy
exploring the colours it gets wrong (without it, runs tend to stall at 3 of 4 colours, 0.75). Both
validate before training
and every ``--val_every`` steps: greedy answers to the whole validation split (``val.jsonl``, 64
images), scored by ``reward_functions/shapes.py``. A job stops at the first validation at or above
``--target``, or after ``--max_steps``.

Reported per trainer: the step at which it first reached the target; ``train_s``, the summed step
times up to that step (start-up and validation excluded); ``wall_s``, from launch to the moment that
validation was logged (start-up, every validation and all steps included); seconds per step; peak RSS
of the job's process tree; the other jobs' CPU load meanwhile (``bench/harness.py``). RL on a tiny
model is noisy: the step count, not only the speed, differs between runs and seeds.

Prints a table and writes ``bench/results/time_to_accuracy.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from harness import (
    REPO,
    RESULTS,
    GiB,
    JobSettings,
    first_reaching,
    markdown_table,
    mmrl_command,
    mmrl_step_records,
    run_monitored,
    training_seconds_until,
    trl_command,
    trl_step_records,
    validation_records,
    write_json,
)

MMRL_VAL_KEY = "val/reward/accuracy"
TRL_VAL_KEY = "val_accuracy"
RUN_TIMEOUT_S = 3600  # a safety net for hangs: a shared machine can slow a job many times over


def run_to_target(job: JobSettings, runner: str, target: float, args: argparse.Namespace) -> dict:
    run_dir = RESULTS / "runs" / "time_to_accuracy" / runner
    run_dir.mkdir(parents=True, exist_ok=True)
    if runner == "trl":
        log_file, key = run_dir / "trl.jsonl", TRL_VAL_KEY
        command, env = trl_command(job, log_file, args.threads) + [f"--val_target={target}"], {}
    else:
        command, log_file = mmrl_command(job, runner.removeprefix("mmrl-"), run_dir)
        key, env = MMRL_VAL_KEY, {"RAY_worker_niceness": str(args.ray_worker_niceness)}

    def reached(record: dict) -> bool:
        return record.get(key) is not None and record[key] >= target - 1e-9

    result = run_monitored(command, log_file, run_dir / "output.txt", RUN_TIMEOUT_S, reached, env)
    if runner == "trl":
        steps = trl_step_records(result.records)
    else:
        steps = mmrl_step_records(result.records, job.prompts * job.n)
    validations = validation_records(result.records, key)
    hit = first_reaching(validations, target)
    return {
        "runner": runner,
        "reached": hit is not None,
        "step": hit["step"] if hit else None,
        "train_s": training_seconds_until(steps, hit["step"]) if hit else None,
        "wall_s": hit["time_s"] if hit else None,
        "s_per_step": statistics.median(s["step_s"] for s in steps) if steps else None,
        "steps_run": len(steps),
        "best_accuracy": max((v["accuracy"] for v in validations), default=None),
        "validations": validations,
        "peak_rss_gib": result.peak_rss_bytes / GiB,
        "other_load_cores": result.other_load_cores,
        "by_process": result.by_process,
        "step_s_runs": [s["step_s"] for s in steps],
    }


def format_table(rows: list[dict], target: float) -> str:
    headers = [
        "trainer",
        f"step to {target}",
        "train s",
        "wall s",
        "s/step",
        "best acc",
        "peak RSS GiB",
        "other load",
    ]

    def number(value, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    cells = [
        [
            row["runner"],
            number(row["step"], "d") if row["reached"] else f"not in {row['steps_run']}",
            number(row["train_s"], ".1f"),
            number(row["wall_s"], ".1f"),
            number(row["s_per_step"], ".2f"),
            number(row["best_accuracy"], ".3f"),
            f"{row['peak_rss_gib']:.2f}",
            f"{row['other_load_cores']:.1f}",
        ]
        for row in rows
    ]
    return markdown_table(headers, cells)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(REPO / "assets" / "models" / "tiny-qwen2.5-vl-warm"))
    parser.add_argument("--data_dir", default=str(REPO / "assets" / "data" / "shapes-color"))
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response_length", type=int, default=4)
    parser.add_argument("--micro_batch", type=int, default=16)
    parser.add_argument("--updates_per_rollout", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument(
        "--kl_coef", type=float, default=0.02, help="k3 KL loss to the warm-up model; 0 = off"
    )
    parser.add_argument("--val_every", type=int, default=5)
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--runners", nargs="+", default=["mmrl-hf", "trl"], choices=["mmrl-hf", "mmrl-vllm", "trl"]
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="TRL's torch threads")
    parser.add_argument("--ray_worker_niceness", type=int, default=0, help="Ray's default is 15")
    args = parser.parse_args()
    for path in (args.model, args.data_dir):
        if not Path(path).exists():
            parser.error(f"{path} does not exist: run `make assets` first")

    job = JobSettings(
        model=str(Path(args.model).resolve()),
        data_dir=str(Path(args.data_dir).resolve()),
        prompts=args.prompts,
        n=args.n,
        response_length=args.response_length,
        force_length=False,
        micro_batch=args.micro_batch,
        lr=args.lr,
        steps=args.max_steps,
        updates_per_rollout=args.updates_per_rollout,
        val_every=args.val_every,
        kl_coef=args.kl_coef,
        seed=args.seed,
    )
    rows = []
    for runner in args.runners:
        print(f"[time_to_accuracy] {runner}", flush=True)
        rows.append(run_to_target(job, runner, args.target, args))
    print(
        f"\n{args.prompts} prompts x {args.n} responses (<= {args.response_length} tokens) per step, "
        f"{args.updates_per_rollout} optimizer step(s) per rollout, lr {args.lr}, KL {args.kl_coef}, greedy validation on "
        f"{Path(args.data_dir).name}/val.jsonl every {args.val_every} steps, CPU ({os.cpu_count()} cores)\n"
    )
    print(format_table(rows, args.target))
    out = write_json("time_to_accuracy.json", {"args": vars(args), "rows": rows})
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
