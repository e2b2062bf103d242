"""Peak memory per phase of GRPO steps at Qwen's real vocabulary with a small VL model, as a new user's
first job would run it: every phase should be bounded by the head's token chunk, as the update is.

    python bench/scale_phases.py [--before_src DIR] [--responses 1024] [--steps 2]

Model: ``mmrl.demo.tiny``'s ``small-151k`` Qwen2.5-VL (the 13M ``small`` widths with the 151,936-row
vocabulary, 52M parameters, tied head), built under ``bench/results/models/``. Job: 8 prompts (112-pixel
JPEGs of the colour task) x 4 responses of ``--responses`` tokens (``ignore_eos``: every response full
length), 2 CPU ranks, transformers rollout, KL loss against the reference (so the reference pass runs;
the update computes the old log-probs itself), the default micro-batches (16 responses per log-prob
micro-batch, 4 per update micro-batch) and head chunk (1,024 tokens). Reported per phase: the largest
peak resident set over the ranks in the last step (``memory/<phase>_peak_gib``,
:mod:`mmrl.workers.memory`; on a CPU the whole process: model copies, optimizer state and what the
phase adds) and the seconds of that step.

``--before_src DIR``: also run the job with the ``mmrl`` package found in ``DIR`` (e.g. ``git archive
main mmrl | tar -x -C DIR``: the code before a change) and print both. Prints the table and writes
``bench/results/scale_phases.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import REPO, RESULTS, markdown_table, write_json  # noqa: E402

FINGERPRINT_REWARD = REPO / "tests/trainer/assets/fingerprint_reward.py"
PHASES = ("gen", "ref_log_prob", "update_actor", "sync")


def overrides(model: Path, data_dir: Path, save_dir: Path, responses: int, steps: int) -> list[str]:
    return [
        f"data.train_files={data_dir / 'train.jsonl'}",
        "data.max_prompt_length=128",
        f"data.max_response_length={responses}",
        "data.rollout_batch_size=8",
        f"worker.actor.model.model_path={model}",
        "worker.actor.global_batch_size=8",  # one update per rollout: the update gives the old log-probs
        "worker.rollout.name=hf",
        "worker.rollout.n=4",
        "worker.rollout.ignore_eos=true",
        "algorithm.disable_kl=false",
        "algorithm.use_kl_loss=true",
        f"worker.reward.reward_function={FINGERPRINT_REWARD}:compute_score",
        f"trainer.max_steps={steps}",
        "trainer.logger=[jsonl]",
        "trainer.n_gpus_per_node=2",
        "trainer.device=cpu",
        "trainer.save_freq=-1",
        "trainer.val_before_train=false",
        f"trainer.save_checkpoint_path={save_dir}",
    ]


def run(label: str, source: Path, model: Path, data_dir: Path, responses: int, steps: int) -> dict:
    save_dir = RESULTS / f"scale_phases_run_{label}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(source)}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "mmrl.trainer.main", *overrides(model, data_dir, save_dir, responses, steps)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    wall_s = time.perf_counter() - start
    if done.returncode != 0:
        return {"label": label, "failed": f"exit {done.returncode}: {(done.stdout + done.stderr)[-3000:]}"}
    lines = [json.loads(line) for line in (save_dir / "logs" / "metrics.jsonl").read_text().splitlines()]
    last = [line for line in lines if "actor/pg_loss" in line][-1]
    peaks = {phase: last.get(f"memory/{phase}_peak_gib") for phase in PHASES}
    seconds = {phase: last.get(f"timing_s/{phase}") for phase in (*PHASES, "step")}
    return {"label": label, "peak_gib": peaks, "seconds": seconds, "wall_s": wall_s}


def format_table(rows: list[dict]) -> str:
    headers = ["code", *(f"{phase} peak GiB" for phase in PHASES), *(f"{p} s" for p in (*PHASES, "step"))]
    table = []
    for row in rows:
        if "failed" in row:
            table.append([row["label"], f"failed: {row['failed'][-200:]!r}"])
            continue
        peaks = [f"{row['peak_gib'][p]:.2f}" if row["peak_gib"][p] else "-" for p in PHASES]
        seconds = [f"{row['seconds'][p]:.0f}" if row["seconds"][p] else "-" for p in (*PHASES, "step")]
        table.append([row["label"], *peaks, *seconds])
    return markdown_table(headers, table)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before_src", type=Path, default=None, help="a folder holding another mmrl")
    parser.add_argument("--responses", type=int, default=1024, help="tokens per response")
    parser.add_argument("--steps", type=int, default=2, help="the last step is reported")
    args = parser.parse_args(argv)
    from mmrl.demo.synthetic import write_photo_dataset
    from mmrl.demo.tiny import ensure_tiny_model

    model = ensure_tiny_model("qwen2_5_vl", "small-151k", root=RESULTS / "models")
    data_dir = write_photo_dataset(RESULTS / "data" / "photos-8", n=8, size=112)
    sources = ([("before", args.before_src)] if args.before_src else []) + [("after", REPO)]
    rows = []
    for label, source in sources:
        rows.append(run(label, source.resolve(), model, data_dir, args.responses, args.steps))
        print(f"[scale_phases] {label}: {rows[-1].get('peak_gib', rows[-1].get('failed'))}", flush=True)
    print(
        f"\npeak memory per phase, step {args.steps} (small-151k Qwen2.5-VL, 2 CPU ranks, 8 prompts x 4 "
        f"responses x {args.responses} tokens, transformers rollout, KL loss)"
    )
    print(format_table(rows))
    write_json(
        "scale_phases.json", {"args": {**vars(args), "before_src": str(args.before_src)}, "rows": rows}
    )
    return rows


if __name__ == "__main__":
    main()
