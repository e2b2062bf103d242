"""A judge teaches: the numbers of ``make demo-judge`` (``examples/tiny_cpu_judge.yaml``).

    python bench/judge_demo.py [--judge assets/models/tiny-judge-colour] [--data_dir assets/data/shapes-color]
        [--metrics outputs/tiny_cpu_judge/logs/metrics.jsonl] [--skip_serve]

1. **The judge's own accuracy, served.** The judge folder is served by vLLM's OpenAI-compatible server
   on loopback (:class:`mmrl.rewards.judge_server.VllmServer`, the server a run starts in its Ray actor)
   and asked through the run's client and prompt (:func:`mmrl.rewards.judge.build_judge`) about every
   held-out image (``val.jsonl``, which the judge never saw) with each colour as the response: accuracy
   over all pairs, on the true colour (should say yes) and on the others (should say no), unreadable
   answers, and requests per second; the verdicts pair by pair against the training script's (same
   pairs, same order); and the training script's junk responses (random tokens, two per image), to
   which it should say no.
2. **The policy's curve.** From the run's ``metrics.jsonl``: at each validation, the greedy answers'
   accuracy by the rule file (``val/reward/rule/accuracy``; weight 0 in the run, so a yardstick only)
   beside the judge's mean verdict on them (``val/reward/judge/overall``); per training step the same two
   on the sampled responses.
3. **The judge's share of step time.** ``timing_s/reward_judge`` (the judge's wall time in the reward
   worker: all requests of the step) over ``timing_s/step``; scoring runs beside the log-prob passes, so
   ``timing_s/reward`` (what the driver waited for the rewards after them) is what it added to the step.

Prints tables and writes ``bench/results/judge_demo.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import yaml
from harness import REPO, markdown_table, write_json

sys.path.insert(0, str(REPO))

from mmrl.config import JudgeConfig  # noqa: E402
from mmrl.data.processing import PromptMedia  # noqa: E402
from mmrl.rewards.judge import build_judge  # noqa: E402
from mmrl.rewards.judge_server import VllmServer  # noqa: E402

TEMPLATE = REPO / "format_prompts" / "judge_colour.jinja"


def served_accuracy(
    judge_dir: Path, data_dir: Path, max_images: int | None, max_tokens: int, junk: list[str]
) -> dict:
    """Serves ``judge_dir`` and asks it about every held-out image × colour (see the module docstring),
    ``max_tokens`` per answer as the run's judge config allows; then about ``junk`` (the training script's
    junk responses, two per image in order), where it should say no."""
    rows = [json.loads(line) for line in (data_dir / "val.jsonl").read_text().splitlines() if line.strip()]
    rows = rows[:max_images]
    colours = sorted({row["answer"] for row in rows})
    server = VllmServer(
        str(judge_dir),
        "judge",
        ["--max-model-len", "512", "--enforce-eager"],
        {"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    start = time.perf_counter()
    try:
        base_url = server.start(timeout_s=600)
        startup_s = time.perf_counter() - start
        config = JudgeConfig(
            prompt_template=str(TEMPLATE), max_tokens=max_tokens, cache=False, max_concurrency=16
        )
        judge = build_judge(config, base_url, "judge", None, prompt_key="problem")
        samples = [
            {
                "problem": row["problem"],
                "response": colour,
                "ground_truth": row["answer"],
                "media": PromptMedia(prompt="", images=(str(data_dir / row["images"][0]),)),
            }
            for row in rows
            for colour in colours
        ]
        start = time.perf_counter()
        scores = judge.score(samples)
        seconds = time.perf_counter() - start
        per_image = len(junk) // len(rows) if junk else 0
        junk_samples = [
            {**samples[index * len(colours)], "response": text}
            for index in range(len(rows))
            for text in junk[index * per_image : (index + 1) * per_image]
        ]
        junk_scores = judge.score(junk_samples) if junk_samples else []
        judge.close()
    finally:
        server.stop()
    right = {"yes": [], "no": []}
    unreadable = 0
    verdicts = []
    for sample, score in zip(samples, scores):
        truth = "yes" if sample["response"] == sample["ground_truth"] else "no"
        if not isinstance(score, dict) or score.get("unparseable", 0.0):
            unreadable += 1
            right[truth].append(False)
            verdicts.append(None)
            continue
        verdicts.append("yes" if score["overall"] == 1.0 else "no")
        right[truth].append(verdicts[-1] == truth)
    every = right["yes"] + right["no"]
    return {
        "pairs": len(every),
        "accuracy": sum(every) / len(every),
        "yes_accuracy": sum(right["yes"]) / len(right["yes"]),
        "no_accuracy": sum(right["no"]) / len(right["no"]),
        "balanced_accuracy": (sum(right["yes"]) / len(right["yes"]) + sum(right["no"]) / len(right["no"]))
        / 2,
        "unreadable": unreadable,
        "verdicts": verdicts,
        "junk_pairs": len(junk_scores),
        "junk_no_accuracy": (
            sum(
                isinstance(score, dict) and score["overall"] == 0.0 and not score.get("unparseable", 0.0)
                for score in junk_scores
            )
            / len(junk_scores)
            if junk_scores
            else None
        ),
        "requests_per_s": len(samples) / seconds,
        "server_startup_s": startup_s,
    }


def run_numbers(metrics_file: Path) -> dict:
    """The policy's curve and the judge's share of step time from a run's ``metrics.jsonl``."""
    by_step: dict[int, dict] = {}
    for line in metrics_file.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step.setdefault(record["step"], {}).update(record)  # a resumed run's last line wins
    validations = [
        {
            "step": step,
            "rule_accuracy": record["val/reward/rule/accuracy"],
            "judge_yes": record.get("val/reward/judge/overall"),
        }
        for step, record in sorted(by_step.items())
        if record.get("val/reward/rule/accuracy") is not None
    ]
    steps = [
        {
            "step": step,
            "rule_accuracy": record.get("reward/rule/accuracy"),
            "judge_yes": record.get("reward/judge/overall"),
            "step_s": record["timing_s/step"],
            "judge_s": record.get("timing_s/reward_judge"),
            "reward_wait_s": record.get("timing_s/reward"),
        }
        for step, record in sorted(by_step.items())
        if record.get("timing_s/step") is not None
    ]
    timed = [s for s in steps if s["judge_s"] is not None]
    total_step = sum(s["step_s"] for s in timed)
    share = {
        "steps": len(timed),
        "median_step_s": statistics.median(s["step_s"] for s in timed) if timed else None,
        "median_judge_s": statistics.median(s["judge_s"] for s in timed) if timed else None,
        "judge_share": sum(s["judge_s"] for s in timed) / total_step if timed else None,
        "reward_wait_share": sum(s["reward_wait_s"] or 0.0 for s in timed) / total_step if timed else None,
    }
    return {"validations": validations, "steps": steps, "time": share}


def agreement(generations_file: Path) -> dict[int, float]:
    """Per validation step: the fraction of the policy's answers on which the judge's verdict (the logged
    score) equals the rule file's accuracy."""
    sys.path.insert(0, str(REPO / "reward_functions"))
    from shapes import accuracy_reward

    same: dict[int, list[bool]] = {}
    for line in generations_file.read_text().splitlines():
        if line.strip():
            sample = json.loads(line)
            rule = accuracy_reward(sample["response"], sample["ground_truth"])
            same.setdefault(sample["step"], []).append(rule == sample["score"])
    return {step: sum(values) / len(values) for step, values in same.items()}


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--judge", default=str(REPO / "assets" / "models" / "tiny-judge-colour"))
    parser.add_argument("--data_dir", default=str(REPO / "assets" / "data" / "shapes-color"))
    parser.add_argument(
        "--metrics", default=str(REPO / "outputs" / "tiny_cpu_judge" / "logs" / "metrics.jsonl")
    )
    parser.add_argument("--max_images", type=int, default=None, help="held-out images asked about (all)")
    parser.add_argument("--skip_serve", action="store_true", help="only the run's numbers")
    parser.add_argument(
        "--config", default=str(REPO / "examples" / "tiny_cpu_judge.yaml"), help="the run's job"
    )
    args = parser.parse_args()
    max_tokens = yaml.safe_load(Path(args.config).read_text())["worker"]["reward"]["judge"]["max_tokens"]
    results: dict = {}
    trained = Path(args.judge) / "judge_eval.json"
    if trained.is_file():
        results["judge_in_process"] = json.loads(trained.read_text())
    if not args.skip_serve:
        junk = (results.get("judge_in_process") or {}).get("junk_responses", [])
        results["judge_served"] = served_accuracy(
            Path(args.judge), Path(args.data_dir), args.max_images, max_tokens, junk
        )
    rows = [
        [how, numbers["pairs" if "pairs" in numbers else "rows"], _fmt(numbers["accuracy"]),
         _fmt(numbers["yes_accuracy"]), _fmt(numbers["no_accuracy"]), _fmt(numbers.get("junk_no_accuracy"))]
        for how, numbers in (("in-process (training script)", results.get("judge_in_process")),
                             ("served (vLLM, OpenAI API)", results.get("judge_served")))
        if numbers
    ]  # fmt: skip
    print("\nThe judge on held-out images (each image with every colour as the response)\n")
    headers = ["judge", "pairs", "accuracy", "on the true colour", "on other colours", "no to junk"]
    print(markdown_table(headers, rows))
    if "judge_served" in results:
        served = results["judge_served"]
        print(
            f"\nserved: {served['unreadable']} unreadable answers, {served['requests_per_s']:.1f} requests/s, "
            f"server up in {served['server_startup_s']:.0f} s"
        )
        in_process = (results.get("judge_in_process") or {}).get("verdicts")
        if in_process and len(in_process) == len(served["verdicts"]):  # the same pairs in the same order
            same = sum(a == b for a, b in zip(in_process, served["verdicts"]))
            served["same_verdicts_as_in_process"] = same
            print(f"served and in-process verdicts agree on {same} of {len(in_process)} pairs")
    if Path(args.metrics).is_file():
        run = run_numbers(Path(args.metrics))
        results["run"] = run
        print("\nThe policy, trained on the judge's verdict alone (rule accuracy: a yardstick, weight 0)\n")
        generations = Path(args.metrics).with_name("generations.jsonl")
        agree = agreement(generations) if generations.is_file() else {}
        for validation in run["validations"]:
            validation["judge_agrees"] = agree.get(validation["step"])
        table = [
            [v["step"], _fmt(v["rule_accuracy"]), _fmt(v["judge_yes"]), _fmt(v["judge_agrees"])]
            for v in run["validations"]
        ]
        headers = ["step", "val accuracy (rule)", "val judge says yes", "judge agrees with the rule"]
        print(markdown_table(headers, table))
        time_share = run["time"]
        print(
            f"\njudge share of step time over {time_share['steps']} steps: {_fmt(time_share['judge_share'])} "
            f"(median step {_fmt(time_share['median_step_s'], 2)} s, judge {_fmt(time_share['median_judge_s'], 2)} "
            f"s); the driver's wait for rewards after the log-prob passes: {_fmt(time_share['reward_wait_share'])}"
        )
    print(f"\nwrote {write_json('judge_demo.json', results)}")


if __name__ == "__main__":
    main()
