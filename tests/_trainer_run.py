"""Run ``python -m mmrl.trainer.main`` for a few steps on the tiny VL model and read its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# dense (distinct characters of the response): GRPO advantages are non-zero from the first step
FINGERPRINT_REWARD = REPO_ROOT / "tests/trainer/assets/fingerprint_reward.py"


def small_run_overrides(model_path, data_dir, save_dir) -> list[str]:
    """A 2-step, 2-worker run on the colour images with the fingerprint reward; append to change it."""
    return [
        f"data.train_files={Path(data_dir) / 'train.jsonl'}",
        f"data.val_files={Path(data_dir) / 'val.jsonl'}",
        "data.max_prompt_length=64",
        "data.max_response_length=4",
        "data.rollout_batch_size=4",
        "data.min_pixels=3136",
        "data.max_pixels=50176",
        f"worker.actor.model.model_path={model_path}",
        "worker.actor.model.enable_gradient_checkpointing=false",
        "worker.actor.global_batch_size=4",
        "worker.actor.optim.lr=0.02",
        "worker.rollout.n=4",
        f"worker.reward.reward_function={FINGERPRINT_REWARD}:compute_score",
        "trainer.max_steps=2",
        "trainer.logger=[jsonl]",
        "trainer.n_gpus_per_node=2",
        "trainer.device=cpu",
        "trainer.save_freq=-1",
        f"trainer.save_checkpoint_path={save_dir}",
    ]


def run_main(overrides: list[str], save_dir, timeout_s: float = 300, env: dict | None = None) -> list[dict]:
    """Run the trainer to completion (it must exit 0), with ``env`` added to this process's
    environment; returns its metrics.jsonl rows."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", **(env or {})}
    run = subprocess.run(
        [sys.executable, "-m", "mmrl.trainer.main", *overrides],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    lines = (Path(save_dir) / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]
