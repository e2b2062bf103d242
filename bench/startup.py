"""What a run's processes spend importing, with Python's cyclic garbage collector on and paused.

    python bench/startup.py [--repeats 5] [--config examples/tiny_cpu.yaml] [--roles driver ...]

Every process of a run imports torch and transformers before it does anything (``mmrl.runtime.startup``).
Each role's start-up runs in a fresh process, ``--repeats`` times with the collector on and as many
paused (:func:`mmrl.runtime.startup.collector_paused`), interleaved; the table holds the median CPU
seconds of each (``time.process_time`` in that process):

- driver: the config loaded and checked, pre-flight (tokenizer, processor, model folder, data rows),
  the trainer's module imported (Ray);
- training rank: the worker module a rank imports (``mmrl.workers.fsdp_workers``);
- reward worker: the scorer's module and the run's reward sources, built as a reward worker does
  (``mmrl.rewards.scorer``; it is handed decoded responses, so neither torch nor transformers);
- vLLM engine module: what a rank imports when its rollout is vLLM, after its worker module (not
  measured: torch and transformers are in by then).

The config (default the colour demo's: ``make assets`` builds its model and data) names the model.
Prints the table and writes ``bench/results/startup.json``.
"""

from __future__ import annotations

import argparse
import functools
import pickle
import statistics
import subprocess
import sys

from harness import REPO, markdown_table, write_json

ROLES = {
    "driver": """
from mmrl.config.loading import load_config
from mmrl.trainer.preflight import preflight
config = load_config([f"config={CONFIG}"])
preflight(config)
import mmrl.trainer.ray_trainer
""",
    "training rank": """
import mmrl.workers.fsdp_workers
""",
    "reward worker": """
import pickle
from mmrl.rewards.scorer import RewardScorer
RewardScorer(pickle.loads(bytes.fromhex(PICKLED_CONFIG)))
""",
    "vLLM engine module": """
from vllm import LLM
""",
}
# what a role's process has imported before the measured part (a rank imports its worker module first)
BEFORE = {"vLLM engine module": "import mmrl.workers.fsdp_workers"}

CHILD = """
import contextlib, json, time
from mmrl.runtime.startup import collector_paused
CONFIG = {config!r}
PICKLED_CONFIG = {pickled!r}  # the config as Ray hands it to a reward worker
{before}
start = time.process_time()
with collector_paused() if {paused} else contextlib.nullcontext():
{body}
print(json.dumps(time.process_time() - start))
"""


def cpu_seconds(role: str, paused: bool, config: str) -> float:
    body = "\n".join("    " + line for line in ROLES[role].strip().splitlines())
    pickled = pickled_config(config) if role == "reward worker" else ""
    code = CHILD.format(config=config, pickled=pickled, paused=paused, body=body, before=BEFORE.get(role, ""))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, timeout=300
    )
    return float(done.stdout.strip().splitlines()[-1])


@functools.cache
def pickled_config(config: str) -> str:
    from mmrl.config.loading import load_config

    return pickle.dumps(load_config([f"config={config}"])).hex()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--config", default="examples/tiny_cpu.yaml")
    parser.add_argument("--roles", nargs="+", choices=list(ROLES), default=list(ROLES))
    args = parser.parse_args()
    results = {}
    for role in args.roles:
        samples = {"on": [], "paused": []}
        for _ in range(args.repeats):
            for mode in samples:
                samples[mode].append(cpu_seconds(role, mode == "paused", args.config))
        results[role] = {mode: statistics.median(values) for mode, values in samples.items()}
        results[role]["samples"] = samples
    rows = [
        [
            role,
            f"{r['on']:.2f}",
            f"{r['paused']:.2f}",
            f"{r['on'] - r['paused']:.2f} ({(r['on'] - r['paused']) / r['on']:.0%})",
        ]
        for role, r in results.items()
    ]
    print(markdown_table(["process", "collector on (CPU-s)", "paused (CPU-s)", "saved"], rows))
    print(f"medians of {args.repeats} fresh processes each; written to {write_json('startup.json', results)}")


if __name__ == "__main__":
    main()
