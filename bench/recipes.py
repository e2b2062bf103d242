"""Plain GRPO, stop 20's recipe (DAPO) and the small-model recipe over seeds, on two image tasks and two
learning-rate settings (issue 39: a recipe must survive a collapse on tasks it was not tuned on).

    python bench/recipes.py [--seeds 1 2 3] [--steps 60] [--recipes plain entropy]
        [--tasks spatial bigger] [--settings cosine constant] [--threshold 0.9] [--val_every 10]
        [--jobs 1] [--ranks 1] [--force]
    python bench/recipes.py --report   # the tables of every run there is a results file of
    python bench/recipes.py --variant NAME --override key=value ... [--seeds ...]   # a variant to try

Tasks (``make assets-recipes`` builds both, each with its warm-up: a tiny random Qwen2.5-VL taught to
answer the task's two words uniformly whatever the image, with the colour task trained on the side,
which opens its image path):

- ``spatial``: "Is the <shape> on the left or the right?" (``examples/tiny_cpu_spatial.yaml``'s task:
  the recipe was tuned on it);
- ``bigger``: "Which shape is bigger, the red one or the blue one?", two shapes of one kind in the two
  halves (``mmrl.demo.synthetic``'s ``bigger``): a comparison the recipe was never tuned on.

Settings: ``cosine`` (the recipe's learning-rate decay to 0.1 x over the run) and ``constant`` (the
same peak rate throughout). Recipes, each on top of ``examples/tiny_cpu_spatial.yaml`` (its k3 KL
loss 0.02 to the warm-up model, peak learning rate, batch sizes):

- ``plain``: GRPO as the colour demo runs it: no filtering, symmetric clip 0.2, no entropy bonus,
  Adam's default betas, no step-size control;
- ``dapo``: stop 20's recipe: online filtering that ends the run when ``trainer.max_try_make_batch``
  rounds cannot fill a step, clip_ratio_high 0.28, no entropy bonus;
- ``entropy``: the example config as it stands (the recommended recipe): the same filtering, but a
  step that cannot be filled trains on the groups it dropped (``algorithm.unfilled_step: train``),
  adaptive entropy control over the top-8 entropy and clip-higher, and steps that cannot knock a solved
  policy off (Adam's beta2 0.95, ``worker.actor.kl_step_control``).

The setting's learning-rate schedule applies to every recipe. A seed sets ``trainer.seed`` (torch RNGs
of the workers), ``worker.rollout.seed`` (the sampling streams) and ``data.seed`` (the prompt order);
the warm-up model is the same for every seed. Each run's summary goes to
``bench/results/recipes/<task>_<setting>_<recipe>_seed<seed>.json``; a run whose file exists (with the
same overrides and the same example config) is not run again (``--force`` reruns), so an interrupted
study resumes where it stopped. ``--jobs`` runs that many at once (one thread each; on a 2-core
machine two at a time take 1.7-3 x longer each, so one at a time finishes the study sooner).

Per run: validation accuracy (greedy, the 64 validation images) after every ``--val_every`` steps
against the response tokens generated so far (filtered rounds included), the mean fraction of
zero-advantage groups in the updates, the entropy of the last 10 steps, whether the run stopped before
its last step, and the wall time. A seed counts when its final accuracy is at least ``--threshold``
(default 0.9, issue 39's bar; a policy that ignores the image scores 0.5 on the balanced validation
set however it answers) and it did not stop early. The first table has one row per task and setting
and a column per recipe, the worst cell of the last recipe first; then per recipe and cell the
details, then every seed's curve.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results" / "recipes"
CONFIG = REPO / "examples" / "tiny_cpu_spatial.yaml"
ASSETS = REPO / "assets"
# task -> (data folder, warm-up model) as `make assets-recipes` builds them
TASKS = {
    "spatial": ("data/shapes-spatial", "models/tiny-qwen2.5-vl-spatial-warm"),
    "bigger": ("data/shapes-bigger", "models/tiny-qwen2.5-vl-bigger-warm"),
}
SETTINGS = {"cosine": [], "constant": ["worker.actor.optim.lr_scheduler_type=constant"]}
VAL_KEY = "val/reward/accuracy"
RUN_TIMEOUT_S = 3600  # a hang's safety net; a busy shared machine slows runs several times over

# Every recipe spells out the keys the recipes differ in, so none depends on the example's defaults;
# the rest (KL loss 0.02 to the warm-up model, learning rate, batch sizes) is the example's, the
# learning-rate schedule the setting's. (worker.actor.entropy_top_k stays the example's: without a bonus
# it is only the measure logged, so every recipe's entropy is measured alike)
NO_ENTROPY_CONTROL = ["worker.actor.entropy_coeff=0.0", "worker.actor.adaptive_entropy.enabled=false"]
# Adam's default betas and no step-size control: the recipe's steady steps are its own (stop 46)
PLAIN_STEPS = ["worker.actor.optim.betas=[0.9,0.999]", "worker.actor.kl_step_control.enabled=false"]
RECIPES: dict[str, list[str]] = {
    "plain": [  # GRPO as the colour demo runs it
        "algorithm.online_filtering=false",
        "worker.actor.clip_ratio_low=0.2",
        "worker.actor.clip_ratio_high=0.2",
        *NO_ENTROPY_CONTROL,
        *PLAIN_STEPS,
    ],
    "dapo": [  # stop 20's recipe: dynamic sampling (stops when a step cannot be filled), clip-higher
        "algorithm.online_filtering=true",
        "algorithm.unfilled_step=stop",
        "worker.actor.clip_ratio_low=0.2",
        "worker.actor.clip_ratio_high=0.28",
        *NO_ENTROPY_CONTROL,
        *PLAIN_STEPS,
    ],
    "entropy": [],  # examples/tiny_cpu_spatial.yaml as it stands: the recommended recipe
}


@dataclass(frozen=True)
class Cell:
    """One run of the study: a recipe (or ``--variant``) on a task, in a learning-rate setting, a seed."""

    task: str
    setting: str
    recipe: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.task}_{self.setting}_{self.recipe}_seed{self.seed}"


def config_sha() -> str:
    """The example config's hash: a result of another version of it is run again."""
    return hashlib.sha256(CONFIG.read_bytes()).hexdigest()[:16]


def recipe_overrides(recipe: str, args: argparse.Namespace) -> list[str]:
    """A recipe's keys; ``--variant NAME`` is the example's recipe with ``--override`` on top."""
    return RECIPES[recipe] if recipe in RECIPES else list(args.override)


def run_overrides(cell: Cell, args: argparse.Namespace, out_dir: Path) -> list[str]:
    data, model = TASKS[cell.task]
    return [
        f"data.train_files={ASSETS / data / 'train.jsonl'}",
        f"data.val_files={ASSETS / data / 'val.jsonl'}",
        f"worker.actor.model.model_path={ASSETS / model}",
        *SETTINGS[cell.setting],
        *recipe_overrides(cell.recipe, args),
        f"trainer.seed={cell.seed}",
        f"worker.rollout.seed={cell.seed}",
        f"data.seed={cell.seed}",
        f"trainer.max_steps={args.steps}",
        f"trainer.val_freq={args.val_every}",
        "trainer.val_before_train=true",
        "trainer.save_freq=-1",
        "trainer.logger=[jsonl]",
        f"trainer.n_gpus_per_node={args.ranks}",
        f"trainer.save_checkpoint_path={out_dir}",
        f"trainer.experiment_name=recipes_{cell.name}",
        *(args.override if cell.recipe in RECIPES else []),
    ]


def summarize(rows: list[dict], threshold: float) -> dict:
    """A run's metrics.jsonl rows → its learning curve per generated response token and summary."""
    tokens, curve, zero_adv, responses, entropy = 0, [], [], 0, []
    for row in sorted(rows, key=lambda r: r["step"]):
        if "actor/entropy_rollout" in row:
            entropy.append(row["actor/entropy_rollout"])
        tokens += int(row.get("rollout/generated_response_tokens", 0))
        responses += int(row.get("rollout/generated_responses", 0))
        if "rollout/zero_adv_group_frac" in row:
            zero_adv.append(row["rollout/zero_adv_group_frac"])
        if VAL_KEY in row:
            curve.append({"step": row["step"], "tokens": tokens, "accuracy": row[VAL_KEY]})
    final = curve[-1]["accuracy"] if curve else float("nan")
    reached = next((point for point in curve if point["accuracy"] >= threshold), None)
    return {
        "final_accuracy": final,
        "learnt": final >= threshold,
        "tokens_to_threshold": reached["tokens"] if reached else None,
        "zero_adv_group_frac": statistics.fmean(zero_adv) if zero_adv else None,
        "zero_adv_group_frac_last10": statistics.fmean(zero_adv[-10:]) if zero_adv else None,
        "generated_responses": responses,
        "generated_response_tokens": tokens,
        # the whole-vocabulary entropy of the sampled tokens' distributions, mean of the last 10 steps
        "entropy_last10": statistics.fmean(entropy[-10:]) if entropy else None,
        "trained_steps": max((row["step"] for row in rows if "actor/pg_loss" in row), default=0),
        # the longest run of steps without a group of mixed scores, and the steps the recovery term acted on
        "max_steps_since_mixed": max(
            (row.get("rollout/steps_since_mixed_group", 0) for row in rows), default=0
        ),
        "recovery_steps": sum(row.get("actor/collapse_coeff", 0) > 0 for row in rows),
        "curve": curve,
    }


def run_one(cell: Cell, args: argparse.Namespace) -> dict:
    result_file = RESULTS / f"{cell.name}.json"
    out_dir = RESULTS / "runs" / cell.name
    overrides = run_overrides(cell, args, out_dir)
    if result_file.is_file() and not args.force:
        done = json.loads(result_file.read_text())
        same = done["overrides"] == overrides  # same steps, same settings
        if same and done.get("config_sha") == config_sha():  # ... and the example config as it was
            return done
    log = out_dir / "logs" / "metrics.jsonl"
    log.unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "mmrl.trainer.main", f"config={CONFIG}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    with open(out_dir / "output.log", "w") as output:
        process = subprocess.run(
            command, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S
        )
    wall_s = time.perf_counter() - start
    rows = [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []
    summary = {
        **asdict(cell),
        "steps": args.steps,
        "returncode": process.returncode,
        "wall_s": wall_s,
        "overrides": overrides,
        "config_sha": config_sha(),
        **summarize(rows, args.threshold),
    }
    if process.returncode != 0:
        tail = (out_dir / "output.log").read_text(errors="replace")[-1500:]
        summary["error"] = tail.strip().splitlines()[-1] if tail.strip() else "no output"
        print(f"[recipes] {cell.name} failed ({process.returncode}): {summary['error']}")
    result_file.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def stopped_early(run: dict) -> bool:
    """The run ended before its last step (dynamic sampling gave up, or it failed)."""
    return run["returncode"] != 0 or run.get("trained_steps", run["steps"]) < run["steps"]


def counts(run: dict) -> bool:
    """A seed that learnt: final accuracy at the threshold, not stopped early."""
    return run["learnt"] and not stopped_early(run)


def summary_table(results: list[dict], recipes: list[str], studied: str) -> str:
    """One row per task and setting, a column per recipe (seeds that learnt, mean final accuracy); the
    worst cell of the ``studied`` recipe first."""
    cells = list(dict.fromkeys((r["task"], r["setting"]) for r in results))
    by = {(r["task"], r["setting"], r["recipe"]): [] for r in results}
    for r in results:
        by[r["task"], r["setting"], r["recipe"]].append(r)

    def score(cell: tuple[str, str], recipe: str) -> float:
        runs = by.get((*cell, recipe), [])
        return sum(map(counts, runs)) / len(runs) if runs else 2.0

    cells.sort(key=lambda cell: score(cell, studied))
    lines = ["| task | lr setting | " + " | ".join(recipes) + " |", "|---|---|" + "---|" * len(recipes)]
    for cell in cells:
        row = []
        for recipe in recipes:
            runs = by.get((*cell, recipe), [])
            mean = statistics.fmean(r["final_accuracy"] for r in runs) if runs else float("nan")
            row.append(f"{sum(map(counts, runs))}/{len(runs)} (mean {mean:.2f})" if runs else "-")
        lines.append(f"| {cell[0]} | {cell[1]} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def table(results: list[dict], threshold: float) -> str:
    headers = [
        "task / setting / recipe",
        "seeds",
        f"learned (final val ≥ {threshold}, not stopped)",
        "stopped early",
        f"reach {threshold} at some validation",
        "final acc (mean)",
        "entropy at the end (mean of last 10 steps)",
        "zero-adv groups in updates (mean / last 10 steps)",
        "longest run of steps without a mixed group (max)",
        "response tokens to threshold (median of runs reaching it)",
        "s / run (mean)",
    ]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for key in dict.fromkeys((r["task"], r["setting"], r["recipe"]) for r in results):
        runs = [r for r in results if (r["task"], r["setting"], r["recipe"]) == key]
        finals = [r["final_accuracy"] for r in runs]
        zero = [r["zero_adv_group_frac"] for r in runs if r["zero_adv_group_frac"] is not None]
        zero_last = [
            r["zero_adv_group_frac_last10"] for r in runs if r["zero_adv_group_frac_last10"] is not None
        ]
        entropy = [r["entropy_last10"] for r in runs if r.get("entropy_last10") is not None]
        reached = [r["tokens_to_threshold"] for r in runs if r["tokens_to_threshold"] is not None]
        stopped = [r for r in runs if stopped_early(r)]
        cells = [
            " / ".join(key),
            str(len(runs)),
            f"{sum(map(counts, runs))}/{len(runs)}",
            f"{len(stopped)}/{len(runs)}",
            f"{len(reached)}/{len(runs)}",  # a run that learns, then settles on one answer, counts here
            f"{statistics.fmean(finals):.2f}",
            f"{statistics.fmean(entropy):.3f}" if entropy else "-",
            f"{statistics.fmean(zero):.2f} / {statistics.fmean(zero_last):.2f}" if zero else "-",
            f"{max(r.get('max_steps_since_mixed', 0) for r in runs):.0f}",
            f"{statistics.median(reached):,.0f}" if reached else "-",
            f"{statistics.fmean(r['wall_s'] for r in runs):.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    per_seed = [
        "",
        "| task / setting / recipe | seed | final acc | accuracy curve (step: acc) | entropy at the end "
        "| recovery steps | stopped / failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r["task"], r["setting"], r["recipe"], r["seed"])):
        curve = " ".join(f"{p['step']}:{p['accuracy']:.2f}" for p in r["curve"])
        entropy = f"{r['entropy_last10']:.3f}" if r.get("entropy_last10") is not None else "-"
        stop = f"at step {r.get('trained_steps')}: {r.get('error', '')}" if stopped_early(r) else ""
        per_seed.append(
            f"| {r['task']} / {r['setting']} / {r['recipe']} | {r['seed']} | {r['final_accuracy']:.2f} | "
            f"{curve} | {entropy} | {r.get('recovery_steps', 0)} | {stop} |"
        )
    return "\n".join(lines + per_seed)


def print_tables(results: list[dict], recipes: list[str], studied: str, threshold: float) -> None:
    print(summary_table(results, recipes, studied))
    print()
    print(table(results, threshold))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(1, 11)))
    # plain GRPO on spatial seed 1 reaches 0.84 at step 40, then settles on one answer (0.50 from step 80)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--recipes", nargs="+", choices=sorted(RECIPES), default=["plain", "entropy"])
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=list(TASKS))
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
    parser.add_argument(
        "--variant", default=None, help="run only this named variant: the example's recipe with --override"
    )
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--val_every", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (one thread each)")
    parser.add_argument("--ranks", type=int, default=1, help="training processes per run")
    parser.add_argument(
        "--override", nargs="*", default=[], help="extra key=value for every run (of the --variant)"
    )
    parser.add_argument("--force", action="store_true", help="rerun runs that have a results file")
    parser.add_argument(
        "--report", action="store_true", help="run nothing: print the tables of every results file there is"
    )
    return parser


def main() -> None:
    args = build_parser().parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.report:
        results = [json.loads(path.read_text()) for path in sorted(RESULTS.glob("*_seed*.json"))]
        present = {run["recipe"] for run in results}  # --recipes' order first, then variants
        recipes = [r for r in args.recipes if r in present] + sorted(present - set(args.recipes))
        print_tables(results, recipes, "entropy" if "entropy" in present else recipes[-1], args.threshold)
        return
    recipes = [args.variant] if args.variant else args.recipes
    # seed-major: an interrupted study has every cell of its first seeds
    cells = [
        Cell(task, setting, recipe, seed)
        for seed in args.seeds
        for task in args.tasks
        for setting in args.settings
        for recipe in recipes
    ]
    results = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for cell, summary in zip(cells, pool.map(lambda cell: run_one(cell, args), cells)):
            print(
                f"[recipes] {cell.name}: final {summary['final_accuracy']:.2f} in {summary['wall_s']:.0f} s",
                flush=True,
            )
            results.append(summary)
    print_tables(results, recipes, recipes[-1], args.threshold)


if __name__ == "__main__":
    main()
