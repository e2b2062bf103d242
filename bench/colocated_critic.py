"""What a GAE run costs the machine: training processes, peak memory and time per step.

    python bench/colocated_critic.py [--steps 6] [--checkout DIR]

One job, 2 CPU training ranks, the tiny Qwen2.5-VL and the colour task with the dense test reward
(``tests/trainer/assets/fingerprint_reward.py``), ``algorithm.adv_estimator=gae``. Prints one table row:
``ray::_WorkerHost`` processes (training ranks: the critic's role lives in the actor's processes, so
2, where a critic worker group of its own made 4), the peak RSS of the job's process tree
(``harness.run_monitored``), the median seconds per step after the first, and the last step's reward.
``--checkout DIR`` runs another mmrl checkout's trainer (its own code in every process) with the same
settings, e.g. the commit before a change, to compare.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from harness import REPO, RESULTS, GiB, build_models_and_data, markdown_table, run_monitored, write_json

FINGERPRINT_REWARD = REPO / "tests" / "trainer" / "assets" / "fingerprint_reward.py"


def gae_command(model: str, data_dir: str, out_dir: Path, steps: int) -> list[str]:
    data = Path(data_dir)
    overrides = {
        "data.train_files": data / "train.jsonl",
        "data.max_prompt_length": 64,
        "data.max_response_length": 4,
        "data.rollout_batch_size": 4,
        "data.min_pixels": 3136,
        "data.max_pixels": 50176,
        "algorithm.adv_estimator": "gae",
        "algorithm.disable_kl": "true",
        "worker.actor.model.model_path": model,
        "worker.actor.model.enable_gradient_checkpointing": "false",
        "worker.actor.global_batch_size": 4,
        "worker.actor.optim.lr": 0.02,
        "worker.critic.global_batch_size": 4,
        "worker.critic.model.enable_gradient_checkpointing": "false",
        "worker.rollout.name": "hf",
        "worker.rollout.n": 4,
        "worker.reward.reward_function": f"{FINGERPRINT_REWARD}:compute_score",
        "trainer.max_steps": steps,
        "trainer.logger": "[jsonl]",
        "trainer.n_gpus_per_node": 2,
        "trainer.device": "cpu",
        "trainer.val_before_train": "false",
        "trainer.save_freq": -1,
        "trainer.save_checkpoint_path": out_dir,
        "trainer.find_last_checkpoint": "false",
    }
    return [sys.executable, "-m", "mmrl.trainer.main", *(f"{k}={v}" for k, v in overrides.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--checkout", type=Path, default=REPO, help="the mmrl checkout whose trainer runs")
    args = parser.parse_args()
    assets = build_models_and_data(["tiny"], n_train=32, n_val=8)
    checkout = args.checkout.resolve()
    out_dir = RESULTS / "colocated_critic" / checkout.name
    command = gae_command(assets["models"]["tiny"], assets["data_dir"], out_dir, args.steps)
    result = run_monitored(
        command,
        out_dir / "logs" / "metrics.jsonl",
        RESULTS / f"colocated_critic_{checkout.name}.log",
        timeout_s=1200,
        env={"PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"},
        cwd=checkout,
    )
    steps = [record for record in result.records if "timing_s/step" in record]
    row = {
        "checkout": str(checkout),
        "training_processes": result.process_counts.get("ray::_WorkerHost", 0),
        "peak_rss_gib": result.peak_rss_bytes / GiB,
        "s_per_step": statistics.median(step["timing_s/step"] for step in steps[1:]),
        "wall_s": result.wall_s,
        "last_reward": steps[-1]["critic/score/mean"],
        "other_load_cores": result.other_load_cores,
    }
    # one row per checkout: a run of another checkout (before a change) is kept next to this one's
    path = RESULTS / "colocated_critic.json"
    rows = json.loads(path.read_text())["rows"] if path.is_file() else []
    rows = [other for other in rows if other["checkout"] != row["checkout"]] + [row]
    write_json("colocated_critic.json", {"rows": rows})
    print(format_table(rows))


def format_table(rows: list[dict]) -> str:
    headers = [
        "checkout",
        "training processes",
        "peak RSS GiB",
        "s/step",
        "wall s",
        "last reward",
        "other load",
    ]
    cells = [
        [
            row["checkout"],
            row["training_processes"],
            f"{row['peak_rss_gib']:.2f}",
            f"{row['s_per_step']:.2f}",
            f"{row['wall_s']:.0f}",
            f"{row['last_reward']:.3f}",
            f"{row['other_load_cores']:.2f}",
        ]
        for row in rows
    ]
    return markdown_table(headers, cells)


if __name__ == "__main__":
    main()
