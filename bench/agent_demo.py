"""Demos that need their tool: the numbers of ``make demo-agent`` (``--demo zoom``, the default:
``examples/tiny_cpu_agent.yaml``) and ``make demo-agent-video`` (``--demo video``:
``examples/tiny_cpu_agent_video.yaml``, a tool that returns video frames).

    python bench/agent_demo.py [--demo zoom|video] [--steps 80] [--val_freq 10] [--skip_runs]
        [--out_dir outputs/agent_demo[_video]] [--variants tool no_tool] [-- extra trainer overrides]

Runs the demo's job twice, one after the other, from the same call-format warm-up model: ``tool``
(the example config: multi-turn, ``examples/tools/zoom_center.py`` or ``play_clip.py``) and ``no_tool``
(the same config with ``worker.rollout.multi_turn.enable=false``: one prompt, one answer, no tool in
the prompt). Then, from each run's ``metrics.jsonl``:

- at each validation (greedy, the 64 held-out prompts): accuracy (``val/reward/accuracy``) and, with
  the tool, the tool calls per trajectory (``val/agent/tool_calls/mean``);
- per training step (8 samples of 16 prompts): accuracy (``reward/accuracy``), tool calls per
  trajectory (``agent/tool_calls/mean``), observation tokens per trajectory
  (``agent/observation_tokens/mean``: the tool turns' tokens, video or image included), bad calls
  (``agent/errors/bad_call``), and the step's seconds (``timing_s/step``; median over the run after its
  first 2 steps).

Prints the tables and writes ``bench/results/agent_demo.json`` (``agent_demo_video.json``).
``--skip_runs`` only reads the logs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from harness import REPO, markdown_table, write_json

# demo -> (config, default output folder, results file)
DEMOS = {
    "zoom": ("examples/tiny_cpu_agent.yaml", "outputs/agent_demo", "agent_demo.json"),
    "video": ("examples/tiny_cpu_agent_video.yaml", "outputs/agent_demo_video", "agent_demo_video.json"),
}
VARIANTS = {"tool": [], "no_tool": ["worker.rollout.multi_turn.enable=false"]}


def run(config: str, variant: str, out_dir: Path, steps: int, val_freq: int, extra: list[str]) -> float:
    """One trainer run of ``config``'s ``variant`` into ``out_dir / variant``; its wall seconds."""
    command = [
        sys.executable, "-m", "mmrl.trainer.main", f"config={config}", *VARIANTS[variant],
        f"trainer.max_steps={steps}", f"trainer.val_freq={val_freq}", "trainer.logger=[jsonl]",
        f"trainer.save_checkpoint_path={out_dir / variant}", f"trainer.experiment_name={out_dir.name}_{variant}",
        *extra,
    ]  # fmt: skip
    shutil.rmtree(out_dir / variant, ignore_errors=True)  # metrics.jsonl is appended to
    start = time.perf_counter()
    log = out_dir / f"{variant}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as file:
        subprocess.run(command, cwd=REPO, stdout=file, stderr=subprocess.STDOUT, check=True)
    return time.perf_counter() - start


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summarize(rows: list[dict]) -> dict:
    """Validations and training steps of one run's metrics lines."""
    validations = [
        {"step": row["step"], "accuracy": row["val/reward/accuracy"],
         "tool_calls": row.get("val/agent/tool_calls/mean")}
        for row in rows if "val/reward/accuracy" in row
    ]  # fmt: skip
    steps = [
        {"step": row["step"], "accuracy": row.get("reward/accuracy"),
         "tool_calls": row.get("agent/tool_calls/mean"), "bad_calls": row.get("agent/errors/bad_call"),
         "observation_tokens": row.get("agent/observation_tokens/mean"), "seconds": row["timing_s/step"]}
        for row in rows if "timing_s/step" in row
    ]  # fmt: skip
    seconds = [step["seconds"] for step in steps[2:]] or [step["seconds"] for step in steps]
    return {
        "validations": validations,
        "steps": steps,
        "median_step_s": statistics.median(seconds) if seconds else None,
    }


def window_means(steps: list[dict], key: str, width: int) -> list[tuple[str, float | None]]:
    """``key``'s mean over consecutive windows of ``width`` steps (training numbers are noisy)."""
    out = []
    for start in range(0, len(steps), width):
        values = [step[key] for step in steps[start : start + width] if step[key] is not None]
        label = f"{steps[start]['step']}-{steps[min(start + width, len(steps)) - 1]['step']}"
        out.append((label, statistics.mean(values) if values else None))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", choices=list(DEMOS), default="zoom")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--val_freq", type=int, default=10)
    parser.add_argument("--out_dir", default=None, help="default: the demo's (see DEMOS)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--skip_runs", action="store_true", help="only read the runs' logs")
    parser.add_argument("extra", nargs="*", help="trainer overrides for both runs")
    args = parser.parse_args(argv)
    config, default_out_dir, results_file = DEMOS[args.demo]
    out_dir = REPO / (args.out_dir or default_out_dir)
    results = {}
    for variant in args.variants:
        wall = None
        if not args.skip_runs:
            wall = run(config, variant, out_dir, args.steps, args.val_freq, args.extra)
            print(f"[agent_demo] {variant}: {wall:.0f} s", flush=True)
        results[variant] = {
            **summarize(read_metrics(out_dir / variant / "logs" / "metrics.jsonl")),
            "wall_s": wall,
        }

    by_step: dict[int, dict[str, dict]] = {}
    for variant, result in results.items():
        for validation in result["validations"]:
            by_step.setdefault(validation["step"], {})[variant] = validation
    headers = ["step", *[f"val accuracy ({v})" for v in results]]
    headers += ["val tool calls / trajectory (tool)"] if "tool" in results else []
    rows = []
    for step in sorted(by_step):
        row = [step, *[fmt(by_step[step].get(v, {}).get("accuracy")) for v in results]]
        if "tool" in results:
            row.append(fmt(by_step[step].get("tool", {}).get("tool_calls")))
        rows.append(row)
    print(f"\nValidation (greedy, 64 held-out prompts; {config})\n")
    print(markdown_table(headers, rows))

    width = args.val_freq
    headers = ["training steps", *[f"accuracy ({v})" for v in results]]
    headers += (
        [
            "tool calls / trajectory (tool)",
            "observation tokens / trajectory (tool)",
            "bad calls / step (tool)",
        ]
        if "tool" in results
        else []
    )
    columns = {v: window_means(r["steps"], "accuracy", width) for v, r in results.items()}
    if "tool" in results:
        columns["calls"] = window_means(results["tool"]["steps"], "tool_calls", width)
        columns["observation"] = window_means(results["tool"]["steps"], "observation_tokens", width)
        columns["bad"] = window_means(results["tool"]["steps"], "bad_calls", width)
    labels = [label for label, _ in next(iter(columns.values()))]
    rows = [[label, *[fmt(values[i][1]) if i < len(values) else "-" for values in columns.values()]]
            for i, label in enumerate(labels)]  # fmt: skip
    print(f"\nTraining (means over {width} steps of 16 prompts x 8 samples)\n")
    print(markdown_table(headers, rows))
    print("\n" + markdown_table(
        ["run", "median s / step", "wall s"],
        [[v, fmt(r["median_step_s"]), fmt(r["wall_s"], 0)] for v, r in results.items()],
    ))  # fmt: skip
    print(f"\nwrote {write_json(results_file, results)}")


if __name__ == "__main__":
    main()
