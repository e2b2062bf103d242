"""Profile one trainer's step on the CPU (pyinstrument or the torch profiler): where mmrl's or TRL's time goes.

    python bench/profile_step.py [--trainer mmrl|trl] [--size tiny|small] [--profiler pyinstrument|torch]
                                 [--prompts 8] [--n 8] [--response_length 64] [--micro_batch 16] [--steps 3]
                                 [--updates_per_rollout 1] [--kl_coef 0] [--free_length] [--warm]
                                 [--threads N]

By default the work of ``bench/vs_trl.py`` (forced-length responses, one optimizer step per rollout,
no KL); ``--prompts 16 --response_length 4 --free_length --updates_per_rollout 4 --kl_coef 0.02
--warm`` is the work of ``bench/time_to_accuracy.py``. In this process, so a profiler sees all of it:

- ``mmrl``: the training worker (``HybridWorker``: FSDP2 actor on a one-rank gloo group + transformers
  rollout) driven step by step as in ``bench/cost_curves.py`` (generate → old log-probs unless the
  update is on-policy → reward → advantages → update + weight push); Ray's transport is not in it (compare ``timing_s/step`` of a
  ``bench/vs_trl.py`` run with the in-process step time printed here to see Ray's share);
- ``trl``: ``GRPOTrainer.train`` as ``bench/trl_grpo.py`` builds it.

One warm-up step runs unprofiled, then ``--steps`` profiled ones. Writes the report to
``bench/results/profiles/<trainer>_<size>_<profiler>.txt`` (pyinstrument: the call tree; torch: the
operators by self CPU time) and prints its head.
"""

from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from harness import REPO, RESULTS, JobSettings, build_models_and_data


@contextmanager
def profiled(kind: str, out: Path):
    """Profile the block with ``kind`` and write its text report to ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if kind == "pyinstrument":
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.001)
        profiler.start()
        try:
            yield
        finally:
            profiler.stop()
            # trl's and transformers' frames stay visible (pyinstrument folds library code by default);
            # torch internals are folded, calls under 1 % left out
            options = {"show_regex": r".*[\\/](trl|transformers)[\\/].*", "filter_threshold": 0.01}
            out.write_text(profiler.output_text(unicode=False, color=False, processor_options=options))
    else:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as profiler:
            yield
        out.write_text(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))


def profile_mmrl(job: JobSettings, args: argparse.Namespace, out: Path) -> float:
    from cost_curves import WorkerStep

    runner = WorkerStep(job, threads=args.threads)
    runner.step(0)
    start = time.perf_counter()
    with profiled(args.profiler, out):
        for index in range(1, 1 + args.steps):
            print({k: round(v, 3) for k, v in runner.step(index).items() if k.endswith("_s")}, flush=True)
    return (time.perf_counter() - start) / args.steps


def profile_trl(job: JobSettings, args: argparse.Namespace, out: Path) -> float:
    import torch
    import trl_grpo
    from transformers import TrainerCallback

    trl_args = SimpleNamespace(
        model=job.model,
        output_dir=RESULTS / "runs" / "profile_trl",
        prompts=job.prompts,
        n=job.n,
        response_length=job.response_length,
        force_length=job.force_length,
        micro_batch=job.micro_batch,
        updates_per_rollout=job.updates_per_rollout,
        lr=job.lr,
        beta=job.kl_coef,
        steps=1 + args.steps,
        seed=job.seed,
    )
    torch.set_num_threads(args.threads)
    trainer, _, _ = trl_grpo.build_trainer(trl_args, trl_grpo.load_split(Path(job.data_dir), "train"))
    state = {}

    class ProfileAfterWarmup(TrainerCallback):
        def on_step_begin(self, train_args, trainer_state, control, **kwargs):
            if trainer_state.global_step == 1:  # the first step warmed up
                state["context"] = profiled(args.profiler, out)
                state["context"].__enter__()
                state["start"] = time.perf_counter()

        def on_train_end(self, train_args, trainer_state, control, **kwargs):
            state["seconds"] = time.perf_counter() - state["start"]
            state["context"].__exit__(None, None, None)

    trainer.add_callback(ProfileAfterWarmup())
    trainer.train()
    return state["seconds"] / args.steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trainer", default="mmrl", choices=["mmrl", "trl"])
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--profiler", default="pyinstrument", choices=["pyinstrument", "torch"])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response_length", type=int, default=64)
    parser.add_argument("--micro_batch", type=int, default=16)
    parser.add_argument("--updates_per_rollout", type=int, default=1)
    parser.add_argument("--kl_coef", type=float, default=0.0)
    parser.add_argument("--free_length", action="store_true", help="stop at EOS (default: forced length)")
    parser.add_argument("--warm", action="store_true", help="the `make assets` warm-up model (tiny only)")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps after one warm-up step")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count(), help="torch threads (1 is steadier on a busy machine)"
    )
    args = parser.parse_args()

    assets = build_models_and_data([args.size])
    model = assets["models"][args.size]
    if args.warm:
        model = str(REPO / "assets" / "models" / "tiny-qwen2.5-vl-warm")
    job = JobSettings(
        model=model,
        data_dir=assets["data_dir"],
        prompts=args.prompts,
        n=args.n,
        response_length=args.response_length,
        force_length=not args.free_length,
        micro_batch=args.micro_batch,
        lr=1e-4,
        steps=1 + args.steps,
        updates_per_rollout=args.updates_per_rollout,
        kl_coef=args.kl_coef,
    )
    out = RESULTS / "profiles" / f"{args.trainer}_{args.size}_{args.profiler}.txt"
    profile = profile_mmrl if args.trainer == "mmrl" else profile_trl
    seconds = profile(job, args, out)
    print(f"\n{args.trainer}, {args.size}: {seconds:.3f} s per profiled step (profiler overhead included)")
    print("\n".join(out.read_text().splitlines()[:80]))
    print(f"\nwritten to {out}")
    os._exit(0)  # skip the gloo group's teardown (see bench/cost_curves.py)


if __name__ == "__main__":
    main()
