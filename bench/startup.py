"""What a run's processes spend importing, with Python's cyclic garbage collector on and paused.

    python bench/startup.py [--repeats 5] [--config examples/tiny_cpu.yaml] [--roles driver ...] [--size 3b-width]

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
  measured: torch and transformers are in by then);
- tokenizer and processor: the config's model's, loaded as the driver (twice: pre-flight, then the
  trainer) and every training rank load them, after a rank's imports and transformers' (``--size
  3b-width``: a model of the released vocabulary, what its 151,936 tokens cost).

A second table is what the collections cost once a process runs, with the heap it built at start-up
left to the collector and frozen out of its way (:func:`mmrl.runtime.startup.freeze_heap`), again
``--repeats`` fresh processes of each, the role's imports done with the collector paused first:

- a full collection after a rank's or the driver's imports (``gc.collect()``, as the automatic
  passes of the oldest generation do every so often while a run lasts);
- a vLLM engine's start for the config's model (eager, 256 tokens): it collects five times on purpose.

The config (default the colour demo's: ``make assets`` builds its model and data) names the model.
Prints the tables and writes ``bench/results/startup.json``.
"""

from __future__ import annotations

import argparse
import functools
import pickle
import statistics
import subprocess
import sys
from collections.abc import Callable

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
    "tokenizer and processor": """
load_tokenizer_and_processor(MODEL_PATH or MODEL.tokenizer_or_model_path, MODEL.trust_remote_code)
""",
}
# what a role's process has imported before the measured part (a rank imports its worker module first)
BEFORE = {
    "vLLM engine module": "import mmrl.workers.fsdp_workers",
    "tokenizer and processor": """
import mmrl.workers.fsdp_workers
from transformers import AutoProcessor, AutoTokenizer  # transformers' own import is not the load's
from mmrl.config.loading import load_config
from mmrl.data.processing import load_tokenizer_and_processor
MODEL = load_config([f"config={CONFIG}"]).worker.actor.model
""",
}

CHILD = """
import contextlib, json, time
from mmrl.runtime.startup import collector_paused
CONFIG = {config!r}
MODEL_PATH = {model!r}  # --size 3b-width's model folder, else None: the config's model
PICKLED_CONFIG = {pickled!r}  # the config as Ray hands it to a reward worker
{before}
start = time.process_time()
with collector_paused() if {paused} else contextlib.nullcontext():
{body}
print(json.dumps(time.process_time() - start))
"""


# after a role's start-up (its imports with the collector paused), what is timed, the heap frozen or not
AFTER = {
    "a full collection after a training rank's imports": (
        "import mmrl.workers.fsdp_workers",
        "import gc\ngc.collect()",
    ),
    "a full collection after the driver's imports": (ROLES["driver"], "import gc\ngc.collect()"),
    "a vLLM engine's start (tiny model, eager)": (
        "import mmrl.workers.fsdp_workers\nfrom vllm import LLM",
        # vLLM's own engine (mmrl's VLLMRollout freezes the heap before it as a matter of course)
        """
import os, socket
with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
from mmrl.config import RolloutConfig
from mmrl.config.loading import load_config
from mmrl.runtime.debris import vllm_socket_dir
from mmrl.workers.rollout.vllm_spmd import engine_arguments
path = load_config([f"config={CONFIG}"]).worker.actor.model.model_path
settings = RolloutConfig(name="vllm", max_model_len=256, enforce_eager=True, cpu_kv_cache_gib=0.25)
arguments = engine_arguments(path, path, settings, max_model_len=256, on_gpu=False)
start = time.process_time()
with vllm_socket_dir():
    LLM(**arguments)
""",
    ),
}

AFTER_CHILD = """
import json, os, time
from mmrl.runtime.startup import collector_paused, freeze_heap
CONFIG = {config!r}
with collector_paused():
{imports}
if {frozen}:
    freeze_heap()
start = time.process_time()
{body}
print(json.dumps(time.process_time() - start))
os._exit(0)  # a vLLM engine's threads would hold the exit
"""


def indented(code: str) -> str:
    return "\n".join("    " + line for line in code.strip().splitlines())


def run_child(code: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, timeout=300
    )
    return float(done.stdout.strip().splitlines()[-1])


def after_start_up_seconds(case: str, frozen: bool, config: str) -> float:
    imports, body = AFTER[case]
    return run_child(
        AFTER_CHILD.format(config=config, imports=indented(imports), frozen=frozen, body=body.strip())
    )


def cpu_seconds(role: str, paused: bool, config: str, model: str | None) -> float:
    pickled = pickled_config(config) if role == "reward worker" else ""
    code = CHILD.format(
        config=config,
        model=model,
        pickled=pickled,
        paused=paused,
        body=indented(ROLES[role]),
        before=BEFORE.get(role, ""),
    )
    return run_child(code)


@functools.cache
def pickled_config(config: str) -> str:
    from mmrl.config.loading import load_config

    return pickle.dumps(load_config([f"config={config}"])).hex()


def medians(measure: Callable[[bool], float], modes: tuple[str, str], repeats: int) -> dict:
    """``measure(False)`` and ``measure(True)`` ``repeats`` times each, interleaved: the median of each
    under ``modes``' names, and the samples."""
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for index, mode in enumerate(modes):
            samples[mode].append(measure(bool(index)))
    return {**{mode: statistics.median(values) for mode, values in samples.items()}, "samples": samples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--config", default="examples/tiny_cpu.yaml")
    parser.add_argument("--roles", nargs="*", choices=list(ROLES), default=list(ROLES))
    parser.add_argument("--after", nargs="*", choices=list(AFTER), default=list(AFTER))
    parser.add_argument(
        "--size",
        choices=("config", "3b-width"),
        default="config",
        help="the tokenizer and processor row's model: the config's, or mmrl.demo.tiny's 3b-width Qwen2.5-VL "
        "(the released 151,936-token vocabulary; built under assets/models the first time)",
    )
    args = parser.parse_args()
    model = None
    if args.size == "3b-width":
        from mmrl.demo.tiny import ensure_tiny_model

        model = str(ensure_tiny_model("qwen2_5_vl", "3b-width", root=REPO / "assets" / "models"))
    results = {
        role: medians(
            functools.partial(cpu_seconds, role, config=args.config, model=model),
            ("on", "paused"),
            args.repeats,
        )
        for role in args.roles
    }
    rows = [
        [
            role,
            f"{r['on']:.2f}",
            f"{r['paused']:.2f}",
            f"{r['on'] - r['paused']:.2f} ({(r['on'] - r['paused']) / r['on']:.0%})",
        ]
        for role, r in results.items()
    ]
    if rows:
        print(markdown_table(["process", "collector on (CPU-s)", "paused (CPU-s)", "saved"], rows))
    after = {
        case: medians(
            functools.partial(after_start_up_seconds, case, config=args.config),
            ("left", "frozen"),
            args.repeats,
        )
        for case in args.after
    }
    rows = [
        [case, f"{r['left']:.2f}", f"{r['frozen']:.2f}", f"{r['left'] - r['frozen']:.2f}"]
        for case, r in after.items()
    ]
    if rows:
        print()
        print(markdown_table(["after start-up", "heap left (CPU-s)", "frozen (CPU-s)", "saved"], rows))
    path = write_json("startup.json", {"imports": results, "after_start_up": after})
    print(f"medians of {args.repeats} fresh processes each; written to {path}")


if __name__ == "__main__":
    main()
