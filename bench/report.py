"""Print the tables of every CPU benchmark from its last results (``bench/results/*.json``), in one place.

    python bench/report.py

``make bench`` ends with it, so the tables are not lost between the benchmarks' progress lines. A
benchmark that has not been run (no JSON) is listed as missing.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import agent_turns
import colocated_critic
import cost_curves
import long_video
import packing
import rollout_speed
import sequence_parallel
import time_to_accuracy
import vs_trl
from harness import RESULTS


def _sections() -> list[tuple[str, str, Callable[[dict], str]]]:
    return [
        (
            "vs_trl.json",
            "mmrl vs TRL GRPOTrainer, same work per step",
            lambda d: vs_trl.format_table(d["rows"]),
        ),
        (
            "time_to_accuracy.json",
            "time to validation accuracy, mmrl vs TRL",
            lambda d: time_to_accuracy.format_table(d["rows"], d["args"]["target"]),
        ),
        (
            "cost_curves.json",
            "cost curves (mmrl worker step)",
            lambda d: cost_curves.format_tables(d["rows"], d["args"]["n"]),
        ),
        ("packing.json", "padded vs packed actor passes", lambda d: packing._table(d["rows"])),
        (
            "colocated_critic.json",
            "GAE with the critic in the actor's processes",
            lambda d: colocated_critic.format_table(d["rows"]),
        ),
        ("rollout_speed.json", "rollout: vLLM vs transformers", lambda d: rollout_speed._table(d["rows"])),
        (
            "agent_turns.json",
            "multi-turn generation with tools of uneven latency: lockstep vs as_ready turns",
            lambda d: agent_turns.format_table(d["args"], d["results"]),
        ),
        (
            "sequence_parallel.json",
            "sequence parallelism: step, memory and longest row per layout",
            lambda d: sequence_parallel.format_table(d["rows"], d["longest_in_budget"], d["budget_mb"]),
        ),
        (
            "long_video.json",
            "long video end to end: 1,024-frame clips through rollout and update, with and without SP",
            lambda d: long_video.format_table(d["rows"]),
        ),
    ]


def main() -> None:
    for name, title, table in _sections():
        path = RESULTS / name
        if not path.is_file():
            print(f"\n## {title}\n\n(missing: {path} — run its benchmark)")
            continue
        print(f"\n## {title} ({name})\n\n{table(json.loads(path.read_text()))}")


if __name__ == "__main__":
    main()
