"""Asynchronous RL on the CPU: synchronous colocated vs rollout workers of their own, synchronous and one
step off, on the colour demo.

    python bench/async.py [--steps 6] [--warmup 1] [--prompts 8] [--n 8] [--response_length 24]
        [--engine hf|vllm]

Runs of the same GRPO job (``bench/harness.py``'s ``mmrl_command``, transformers rollout, one
training process):

- ``sync colocated, 2 threads``: the engine in the training process, which has the machine's cores;
- ``sync colocated, 1 thread``: the same on one core (``trainer.cpus_per_worker=1``): on a shared
  2-core machine two threads per process contend with the other jobs' load;
- ``sync colocated, 2 ranks``: the colour demo's layout, two training processes of one core each;
- ``separate sync``: the engine in a rollout worker of its own (``worker.rollout.placement=separate``),
  one core each (``trainer.cpus_per_worker=1``): each step waits for its own generation;
- ``one_step_off separate``: the same, with ``trainer.async_mode=one_step_off`` (decoupled PPO): the
  generation of step k+1 runs while step k trains;
- ``stream separate, staleness 1`` and ``4``: ``trainer.async_mode=stream`` with that
  ``trainer.max_staleness``: the rollout worker generates all the time; its idle share is not
  measured (the driver sees only how long it waited for groups: the trainer's idle share).

Per run, medians over the steps after ``--warmup``: seconds per step, samples (responses) per second,
the idle share of the training process (the step's seconds it waits for a generation: ``timing_s/gen``
plus ``timing_s/gen_wait``) and of the rollout engine (the step's seconds it is not generating: colocated
and separate sync ``timing_s/gen``, one step off ``timing_s/gen_ahead``), the push's seconds and bytes.

A cost model then predicts, from the separate synchronous run's phase times (generation G on one core,
the rest of the step T on one core, the push P) and the colocated run's in-process copy S, the speed-up
of one step off on an 8-GPU node split 4/4 and 6/2 (rollout/training) over synchronous colocated on all
8, assuming each phase scales linearly with its devices: colocated (G + T) / 8 + S, one step off
max(G / r, T / t) + P. It is a prediction from
CPU phase ratios, not a GPU measurement (on GPUs generation is memory-bound and the ratio differs).

Prints the tables and writes ``bench/results/async.json``; ``--report`` prints them again from it.
``--engine vllm`` runs the same job on the vLLM engine (eager; streamed, a chunk of
``worker.rollout.stream_chunk_tokens`` tokens is one engine call over the rows not yet ended) and
writes ``bench/results/async_vllm.json``. ``--stream_chunk_tokens N`` sets that chunk (default: the
config's) for the streamed rows and writes ``async[_vllm]_chunk<N>.json``.

``--accuracy`` (the issue's learning question): each mode over ``--seeds``, on the colour task from the
answer-format warm-up model of ``make assets`` (chance accuracy, 1/4), with ``bench/time_to_accuracy.py``'s
job (16 prompts x 8 responses of at most 4 tokens, 4 optimizer steps per rollout, KL 0.02, greedy
validation on the 64 validation images before training and every 5 steps), each run stopped at the
first validation at or above ``--target`` (or after ``--max_steps``). Per run: the wall time from launch
to that validation (start-up and validations included), the step and the samples (responses) trained
to reach it, and every validation's accuracy against wall time and samples. The modes run seed by seed,
each seed's modes one after the other, so a change of load meets every mode alike; the table gives
medians over seeds and each seed's numbers. Writes ``bench/results/async_accuracy.json``
(``async_accuracy_vllm.json`` with ``--engine vllm``); ``--accuracy --report`` prints its tables again.

``--agent``: the speed table for the multi-turn agent demo (``examples/tiny_cpu_agent.yaml``, its tool
returning an image; ``make assets-agent`` first): the same modes, ``--steps`` steps of 16 prompts x 8
trajectories, one training process, no validation. Writes ``bench/results/async_agent.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

from harness import (
    REPO,
    RESULTS,
    JobSettings,
    build_models_and_data,
    first_reaching,
    markdown_table,
    mmrl_command,
    run_monitored,
    validation_records,
    write_json,
)

RUN_TIMEOUT_S = 3600  # a safety net for hangs on a shared machine
MODES = {
    "sync colocated, 2 threads": [],
    "sync colocated, 1 thread": ["trainer.cpus_per_worker=1"],
    # the colour demo's layout: two training processes (one core each), each with its engine
    "sync colocated, 2 ranks": ["trainer.n_gpus_per_node=2", "trainer.cpus_per_worker=1"],
    "separate sync": ["worker.rollout.placement=separate", "trainer.cpus_per_worker=1"],
    "one_step_off separate": [
        "worker.rollout.placement=separate",
        "trainer.cpus_per_worker=1",
        "trainer.async_mode=one_step_off",
        "algorithm.off_policy=decoupled",
    ],
    **{
        f"stream separate, staleness {staleness}": [
            "worker.rollout.placement=separate",
            "trainer.cpus_per_worker=1",
            "trainer.async_mode=stream",
            f"trainer.max_staleness={staleness}",
            "algorithm.off_policy=decoupled",
        ]
        for staleness in (1, 4)
    },
}
# --accuracy: the rows the issue asks for (the colocated one at the machine's threads, as `make demo`)
ACCURACY_MODES = [
    "sync colocated, 2 threads",
    "sync colocated, 2 ranks",
    "separate sync",
    "one_step_off separate",
    "stream separate, staleness 1",
    "stream separate, staleness 4",
]
VAL_KEY = "val/reward/accuracy"
AGENT_CONFIG = REPO / "examples" / "tiny_cpu_agent.yaml"
AGENT_RESPONSES_PER_STEP = 16 * 8  # its data.rollout_batch_size x worker.rollout.n
SPLITS = ((4, 4), (6, 2))  # (rollout GPUs, training GPUs) of 8


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def summarize(records: list[dict], warmup: int, responses_per_step: int) -> dict:
    """Medians over the training steps after ``warmup``, and the phase times the cost model reads."""
    steps = [record for record in records if record.get("timing_s/step") is not None][warmup:]
    if not steps:
        raise ValueError(f"no step after the {warmup} warm-up step(s)")
    step_s = median([r["timing_s/step"] for r in steps])
    gen_s = median([r["timing_s/gen"] for r in steps])
    waited = median([r["timing_s/gen"] + r.get("timing_s/gen_wait", 0.0) for r in steps])
    # one step off: the generation ran ahead (its window); otherwise inside the step (timing_s/gen)
    generating = median([r.get("timing_s/gen_ahead") or r["timing_s/gen"] for r in steps])
    sync_s = median([r.get("timing_s/sync", 0.0) for r in steps])
    return {
        "steps": len(steps),
        "s_per_step": step_s,
        "samples_per_s": responses_per_step / step_s,
        "trainer_idle": waited / step_s,
        # streaming: the rollout worker generates between steps too, which no driver metric shows
        "rollout_idle": None
        if "rollout/stream_outstanding_groups" in steps[0]
        else max(0.0, 1 - generating / step_s),
        "gen_s": gen_s,
        "rest_s": median(
            [r["timing_s/step"] - r["timing_s/gen"] - r.get("timing_s/sync", 0.0) for r in steps]
        ),
        "push_s": sync_s,
        "push_bytes": median([r.get("transfer/weight_push_bytes", 0.0) for r in steps]),
        "overlap_s": median([r.get("timing_s/gen_overlap", 0.0) for r in steps]),
        # versions behind per token, responses sampled by several versions, groups dropped as too old
        "staleness_mean": median([r.get("rollout/staleness_mean", 0.0) for r in steps]),
        "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in steps),
        # a mean: a push reaches the few batches in flight, which train at different steps
        "partial_frac": statistics.mean(r.get("rollout/partial_response_frac", 0.0) for r in steps),
        "dropped_groups": sum(r.get("rollout/stream_dropped_groups", 0.0) for r in steps),
    }


def cost_model(separate: dict, colocated_sync_s: float, devices: int = 8) -> list[dict]:
    """Predicted seconds per step on ``devices`` GPUs from one-core phase times (module docstring):
    ``separate``'s generation, rest of the step and push; ``colocated_sync_s``: the in-process weight
    copy of a colocated step."""
    generate, rest, push = separate["gen_s"], separate["rest_s"], separate["push_s"]
    colocated = (generate + rest) / devices + colocated_sync_s
    rows = []
    for rollout, train in SPLITS:
        off = max(generate / rollout, rest / train) + push
        rows.append(
            {
                "split": f"{rollout}/{train}",
                "colocated_s": colocated,
                "one_step_off_s": off,
                "speedup": colocated / off,
            }
        )
    return rows


def print_tables(results: dict, predictions: list[dict]) -> None:
    rows = [
        [
            mode,
            f"{r['s_per_step']:.2f}",
            f"{r['samples_per_s']:.1f}",
            f"{r['trainer_idle']:.0%}",
            "n/a" if r["rollout_idle"] is None else f"{r['rollout_idle']:.0%}",
            f"{r['overlap_s']:.2f}",
            f"{r['push_s']:.3f}",
            f"{r['push_bytes'] / 2**20:.1f}",
            f"{r['other_load_cores']:.1f}",
        ]
        for mode, r in results.items()
    ]
    headers = [
        "mode",
        "s/step",
        "samples/s",
        "trainer idle",
        "rollout idle",
        "overlap s",
        "sync/push s",
        "push MiB",
    ]
    print(markdown_table([*headers, "other load (cores)"], rows))
    stale = [
        [
            mode,
            f"{r['staleness_mean']:.2f}",
            f"{r['staleness_max']:.0f}",
            f"{r['partial_frac']:.0%}",
            f"{r['dropped_groups']:.0f}",
        ]
        for mode, r in results.items()
        if "staleness_mean" in r
    ]
    headers = ["mode", "staleness mean", "staleness max", "partial responses", "dropped groups"]
    print(markdown_table(headers, stale))
    headers = [
        "8 GPUs, rollout/training",
        "sync colocated s/step",
        "one_step_off s/step",
        "predicted speed-up",
    ]
    if not predictions:
        return
    cells = [
        [p["split"], f"{p['colocated_s']:.3f}", f"{p['one_step_off_s']:.3f}", f"{p['speedup']:.2f}x"]
        for p in predictions
    ]
    print(markdown_table(headers, cells))


def predict(results: dict) -> list[dict]:
    if "separate sync" not in results or "sync colocated, 1 thread" not in results:
        return []  # --modes left out the runs the model reads
    return cost_model(results["separate sync"], results["sync colocated, 1 thread"]["push_s"])


def accuracy_job(args: argparse.Namespace, seed: int) -> JobSettings:
    """``bench/time_to_accuracy.py``'s job on the colour task from the ``make assets`` warm-up."""
    model, data = (
        REPO / "assets" / "models" / "tiny-qwen2.5-vl-warm",
        REPO / "assets" / "data" / "shapes-color",
    )
    for path in (model, data):
        if not path.exists():
            raise SystemExit(f"{path} does not exist: run `make assets` first (the colour demo's warm-up)")
    return JobSettings(
        model=str(model),
        data_dir=str(data),
        prompts=16,
        n=8,
        response_length=4,
        force_length=False,
        micro_batch=16,
        lr=5e-4,
        steps=args.max_steps,
        updates_per_rollout=4,
        val_every=5,
        kl_coef=0.02,
        seed=seed,
    )


def run_to_accuracy(mode: str, seed: int, args: argparse.Namespace) -> dict:
    """One mode and seed until the first validation at ``args.target`` (or ``args.max_steps``)."""
    job = accuracy_job(args, seed)
    folder = f"{mode.replace(' ', '_').replace(',', '')}_seed{seed}"
    run_dir = RESULTS / "runs" / accuracy_name(args) / folder
    run_dir.mkdir(parents=True, exist_ok=True)
    command, log_file = mmrl_command(job, args.engine, run_dir)
    command += [*MODES[mode], f"worker.rollout.seed={seed}"]

    def reached(record: dict) -> bool:
        return record.get(VAL_KEY) is not None and record[VAL_KEY] >= args.target - 1e-9

    run = run_monitored(command, log_file, run_dir / "output.txt", RUN_TIMEOUT_S, reached)
    samples_per_step = job.prompts * job.n
    validations = [
        {**v, "samples": v["step"] * samples_per_step} for v in validation_records(run.records, VAL_KEY)
    ]
    hit = first_reaching(validations, args.target)
    steps = [r["timing_s/step"] for r in run.records if r.get("timing_s/step") is not None]
    return {
        "mode": mode,
        "seed": seed,
        "reached": hit is not None,
        "step": hit["step"] if hit else None,
        "wall_s": hit["time_s"] if hit else None,
        "samples": hit["samples"] if hit else None,
        "s_per_step": statistics.median(steps) if steps else None,
        "steps_run": len(steps),
        "validations": validations,
        "other_load_cores": run.other_load_cores,
    }


def per_seed(runs: list[dict], key: str, spec: str) -> str:
    return ", ".join("-" if run[key] is None else format(run[key], spec) for run in runs)


def print_accuracy_tables(runs: list[dict], target: float) -> None:
    """Per mode: seeds that reached ``target``, medians over them, each seed's wall seconds and samples."""
    rows = []
    for mode in dict.fromkeys(run["mode"] for run in runs):
        mine = [run for run in runs if run["mode"] == mode]
        hits = [run for run in mine if run["reached"]]

        rows.append(
            [
                mode,
                f"{len(hits)}/{len(mine)}",
                f"{median([run['wall_s'] for run in hits]):.0f}" if hits else "-",
                per_seed(mine, "wall_s", ".0f"),
                f"{median([run['samples'] for run in hits]):.0f}" if hits else "-",
                per_seed(mine, "samples", ".0f"),
                f"{median([run['s_per_step'] for run in mine if run['s_per_step']]):.2f}",
                f"{median([run['other_load_cores'] for run in mine]):.1f}",
            ]
        )
    headers = [
        "mode",
        f"reached {target}",
        "wall s (median)",
        "wall s per seed",
        "samples (median)",
        "samples per seed",
        "s/step",
        "other load (cores)",
    ]
    print(markdown_table(headers, rows))
    curves = [
        [
            run["mode"],
            run["seed"],
            " ".join(f"{v['accuracy']:.2f}@{v['time_s']:.0f}s/{v['samples']}" for v in run["validations"]),
        ]
        for run in runs
    ]
    print(markdown_table(["mode", "seed", "validation accuracy @ wall s / samples"], curves))


def accuracy_name(args: argparse.Namespace) -> str:
    """The accuracy study's results name: ``async_accuracy``, ``_vllm`` added on that engine."""
    return "async_accuracy" if args.engine == "hf" else f"async_accuracy_{args.engine}"


def accuracy_study(args: argparse.Namespace) -> None:
    if args.report:
        saved = json.loads((RESULTS / f"{accuracy_name(args)}.json").read_text())
        print_accuracy_tables(saved["runs"], saved["settings"]["target"])
        return
    modes = args.modes if args.modes != list(MODES) else ACCURACY_MODES
    runs = []
    for seed in args.seeds:
        for mode in modes:
            runs.append(run_to_accuracy(mode, seed, args))
            print(f"{mode} seed {seed}: {runs[-1]['step']} steps, {runs[-1]['wall_s']} s", flush=True)
            write_json(f"{accuracy_name(args)}.json", {"settings": vars(args), "runs": runs})
    print_accuracy_tables(runs, args.target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response_length", type=int, default=24)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--modes", nargs="*", default=list(MODES), help="the rows to run (default: all)")
    parser.add_argument(
        "--report", action="store_true", help="print the tables of the last run's results file"
    )
    parser.add_argument("--accuracy", action="store_true", help="time and samples to --target, per seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--max_steps", type=int, default=60)
    parser.add_argument(
        "--agent", action="store_true", help="the agent demo's steps instead of the colour job's"
    )
    parser.add_argument(
        "--engine",
        choices=["hf", "vllm"],
        default="hf",
        help="the colour job's rollout engine (vllm: results in async_vllm.json)",
    )
    parser.add_argument(
        "--stream_chunk_tokens", type=int, default=None, help="tokens a streamed row decodes per engine call"
    )
    args = parser.parse_args()
    name = "async" if args.engine == "hf" else f"async_{args.engine}"
    chunk = []  # the config's chunk unless given
    if args.stream_chunk_tokens is not None:
        chunk = [f"worker.rollout.stream_chunk_tokens={args.stream_chunk_tokens}"]
        name += f"_chunk{args.stream_chunk_tokens}"
    if args.accuracy:
        accuracy_study(args)
        return
    if args.report:
        results = json.loads((RESULTS / f"{name}.json").read_text())["results"]
        print_tables(results, predict(results))
        return
    if args.agent:
        agent_demo(args)
        return
    assets = build_models_and_data(["tiny"])
    job = JobSettings(
        model=assets["models"]["tiny"],
        data_dir=assets["data_dir"],
        prompts=args.prompts,
        n=args.n,
        response_length=args.response_length,
        force_length=True,  # every response as long: the modes do the same work
        micro_batch=args.prompts * args.n // 2,  # a whole share of each of two ranks (the demo's layout)
        lr=5e-4,
        steps=args.steps,
        seed=args.seed,
    )

    def command(run_dir: Path) -> tuple[list[str], Path]:
        line, log_file = mmrl_command(job, args.engine, run_dir)
        return line + chunk, log_file

    results = speed_runs(args.modes, command, name, args.warmup, job.prompts * job.n)
    predictions = predict(results)
    print_tables(results, predictions)
    write_json(f"{name}.json", {"settings": vars(args), "results": results, "cost_model": predictions})


def speed_runs(
    modes: list[str],
    command: Callable[[Path], tuple[list[str], Path]],
    name: str,
    warmup: int,
    responses: int,
) -> dict:
    """Each mode's run of ``command`` (its folder -> command line and metrics file), summarized."""
    results = {}
    for mode in modes:
        run_dir = RESULTS / "runs" / name / mode.replace(" ", "_").replace(",", "")
        run_dir.mkdir(parents=True, exist_ok=True)
        line, log_file = command(run_dir)
        run = run_monitored(line + MODES[mode], log_file, run_dir / "output.txt", RUN_TIMEOUT_S)
        results[mode] = {
            **summarize(run.records, warmup, responses),
            "other_load_cores": run.other_load_cores,
        }
        print(f"{mode}: {results[mode]}", flush=True)
    return results


def agent_demo(args: argparse.Namespace) -> None:
    """``--agent``: the multi-turn agent demo (``examples/tiny_cpu_agent.yaml``: a tool that returns an
    image; ``make assets-agent`` builds its warm-up) in each mode, ``--steps`` steps, one training process
    (two in the colour demo's layout), no validation: seconds per step and the idle shares."""
    if args.report:
        results = json.loads((RESULTS / "async_agent.json").read_text())["results"]
        print_tables(results, [])
        return
    if not (REPO / "assets" / "models" / "tiny-qwen2.5-vl-agent-warm").exists():
        raise SystemExit("the agent demo's warm-up is missing: run `make assets-agent` first")

    def command(run_dir: Path) -> tuple[list[str], Path]:
        overrides = [
            f"trainer.max_steps={args.steps}",
            "trainer.n_gpus_per_node=1",
            "trainer.val_before_train=false",
            "trainer.val_freq=-1",
            "trainer.save_freq=-1",
            "trainer.logger=[jsonl]",
            f"trainer.save_checkpoint_path={run_dir}",
            f"trainer.seed={args.seed}",
            f"worker.rollout.seed={args.seed}",
        ]
        line = [sys.executable, "-m", "mmrl.trainer.main", f"config={AGENT_CONFIG}", *overrides]
        return line, run_dir / "logs" / "metrics.jsonl"

    modes = args.modes if args.modes != list(MODES) else ACCURACY_MODES
    results = speed_runs(modes, command, "async_agent", args.warmup, AGENT_RESPONSES_PER_STEP)
    print_tables(results, [])
    write_json("async_agent.json", {"settings": vars(args), "results": results})


if __name__ == "__main__":
    main()
