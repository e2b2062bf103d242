"""bench/recipes.py: a run's metrics become a learning curve per generated response token; the study's
cells (task, learning-rate setting, recipe, seed) and its tables."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH_DIR))  # bench/ holds scripts, not a package

import recipes  # noqa: E402


def test_summary_counts_tokens_up_to_each_validation():
    rows = [
        {"step": 0, "val/reward/accuracy": 0.5},
        {"step": 1, "rollout/generated_response_tokens": 100, "rollout/generated_responses": 50,
         "rollout/zero_adv_group_frac": 0.5},
        {"step": 2, "rollout/generated_response_tokens": 300, "rollout/generated_responses": 150,
         "rollout/zero_adv_group_frac": 0.0, "val/reward/accuracy": 0.75},
        {"step": 3, "rollout/generated_response_tokens": 200, "rollout/generated_responses": 100,
         "rollout/zero_adv_group_frac": 0.25, "val/reward/accuracy": 0.95},
    ]  # fmt: skip
    summary = recipes.summarize(rows, threshold=0.9)
    assert [(p["step"], p["tokens"], p["accuracy"]) for p in summary["curve"]] == [
        (0, 0, 0.5),
        (2, 400, 0.75),
        (3, 600, 0.95),
    ]
    assert summary["learnt"] and summary["final_accuracy"] == 0.95
    assert summary["tokens_to_threshold"] == 600
    assert summary["zero_adv_group_frac"] == pytest.approx(0.25)
    assert (summary["generated_responses"], summary["generated_response_tokens"]) == (300, 600)
    assert summary["entropy_last10"] is None and summary["trained_steps"] == 0  # no update rows here


def _run(task, setting, recipe, seed, final, **extra):
    rows = [{"step": step, "actor/pg_loss": 0.0, "actor/entropy_rollout": 0.1 * step} for step in (1, 2, 3)]
    rows.append({"step": 3, "val/reward/accuracy": final, "rollout/steps_since_mixed_group": 2.0})
    cell = {"task": task, "setting": setting, "recipe": recipe, "seed": seed, "steps": 3, "returncode": 0}
    return {**cell, "wall_s": 10.0, **recipes.summarize(rows, threshold=0.8), **extra}


def test_table_counts_stopped_runs_apart_and_reports_the_entropy_at_the_end():
    done = _run("spatial", "cosine", "entropy", 1, 0.9)
    stopped = {**done, "seed": 2, "returncode": 1, "trained_steps": 2, "error": "gave up"}
    assert done["entropy_last10"] == pytest.approx(0.2) and done["trained_steps"] == 3
    assert done["max_steps_since_mixed"] == 2.0 and done["recovery_steps"] == 0
    assert not recipes.stopped_early(done) and recipes.stopped_early(stopped)
    summary_line = recipes.table([done, stopped], 0.8).splitlines()[2]
    assert summary_line.startswith("| spatial / cosine / entropy | 2 | 1/2 | 1/2 | 2/2 | 0.90 | 0.200 |")


def test_summary_table_puts_the_studied_recipes_worst_cell_first():
    results = [
        _run("spatial", "cosine", "entropy", 1, 1.0),
        _run("spatial", "cosine", "plain", 1, 0.5),
        _run("spatial", "constant", "entropy", 1, 0.5),
        _run("spatial", "constant", "entropy", 2, 1.0),
        _run("bigger", "cosine", "entropy", 1, 0.95),
    ]
    lines = recipes.summary_table(results, ["plain", "entropy"], "entropy").splitlines()
    assert lines[0] == "| task | lr setting | plain | entropy |"
    assert lines[2:] == [
        "| spatial | constant | - | 1/2 (mean 0.75) |",
        "| spatial | cosine | 0/1 (mean 0.50) | 1/1 (mean 1.00) |",
        "| bigger | cosine | - | 1/1 (mean 0.95) |",
    ]


def test_a_cell_sets_its_task_lr_setting_and_seed(tmp_path):
    args = recipes.build_parser().parse_args(["--seeds", "3", "--steps", "7"])
    assert (
        args.threshold == 0.9 and args.tasks == ["spatial", "bigger"] and args.recipes == ["plain", "entropy"]
    )
    overrides = recipes.run_overrides(recipes.Cell("bigger", "constant", "plain", 3), args, tmp_path)
    assert {"trainer.seed=3", "worker.rollout.seed=3", "data.seed=3", "trainer.max_steps=7"} <= set(overrides)
    assert "algorithm.online_filtering=false" in overrides
    assert "worker.actor.optim.lr_scheduler_type=constant" in overrides
    data, model = recipes.TASKS["bigger"]
    assert f"data.train_files={recipes.ASSETS / data / 'train.jsonl'}" in overrides
    assert f"worker.actor.model.model_path={recipes.ASSETS / model}" in overrides
    recipe = recipes.run_overrides(recipes.Cell("spatial", "cosine", "entropy", 3), args, tmp_path)
    assert recipe[3] == "trainer.seed=3"  # the yaml's recipe: only the task's three paths before the seed
    variant = recipes.build_parser().parse_args(
        ["--variant", "try", "--override", "worker.actor.entropy_top_k=4"]
    )
    tried = recipes.run_overrides(recipes.Cell("spatial", "cosine", "try", 3), variant, tmp_path)
    assert tried[3] == "worker.actor.entropy_top_k=4"
    assert recipes.Cell("spatial", "cosine", "try", 3).name == "spatial_cosine_try_seed3"
