"""Long video end to end on the CPU: GRPO steps on clips of 1,024 frames through the real trainer
(Ray, FSDP2 workers over gloo, rollout, reward, log-prob passes, update), with and without sequence
parallelism.

    python bench/long_video.py [--layouts 2x1 1x2 1x1] [--backends hf vllm] [--sides 56 112]
        [--steps 3] [--frames 1024] [--prompts 2] [--n 2] [--micro_rows 1] [--timeout_s 3600]
        [--towers frozen frozen-unshared frozen-reused trained] [--size tiny | 3b-width]

Model: the random Qwen2.5-VL of :mod:`mmrl.demo.tiny` of ``--size``: ``tiny`` (text hidden 64, 2
layers, 2 query / 1 key-value heads; vision tower 2 blocks), or ``3b-width`` (Qwen2.5-VL-3B's widths
and vocabulary, 2 decoder layers and 2 of 32 vision blocks), built under ``bench/results/models/``.
``--towers``: ``frozen`` (``worker.actor.model.freeze_vision_tower``: each clip encoded once per step
and shared by the step's passes), ``frozen-unshared`` (``share_encodings=false``: every pass encodes,
as before sharing), ``frozen-reused`` (vLLM only: the engine takes the actor's encodings,
``worker.rollout.reuse_encodings``) and ``trained`` (the tower trains). Data: the ``video_long_flashes`` task of
:mod:`mmrl.demo.synthetic` (1,024 frames of 56×56 at 2 fps per clip), written under
``bench/results/data/``; ``data.num_video_frames`` (and ``data.max_video_frames``) = ``--frames``
sample the frames, ``video_min_pixels = video_max_pixels = --side²`` size them (56: as drawn, 4 video
tokens per temporal patch of 2 frames, 2,048 video tokens for 1,024 frames; 112: 8,192). Each step:
``--prompts`` clips, ``--n`` responses each (up to 4 tokens), two optimizer steps (so the old log-probs are computed), no
reference model, no checkpoint; the log-prob passes and the update take ``--micro_rows`` rows (whole
clips) per micro-batch: each row brings its clip's pixel rows, which every rank of an SP group holds
whole (the tower splits the frames' encoding, not the pixels), so a phase's peak grows with it.

Layouts ``UxR``: Ulysses size × ring size on ``U·R`` training ranks (``1x1``: one rank, no SP). With
SP the ranks of a group share each sequence: the trainer splits the tokens after M-RoPE's positions
are computed and the frozen tower's frames over the ranks (:mod:`mmrl.parallel.encoders`).

Numbers per layout, from the run's ``metrics.jsonl``: frames per clip and video tokens (from the
processor's ``video_grid_thw`` of the first clip, computed here as the workers compute it), sequence
length (``prompt_length/mean`` + ``response_length/mean``), seconds per step and per phase (medians
over the steps after the first: ``timing_s/{step,gen,old_log_prob,update_actor,...}``) and the peak
resident memory per rank of each phase (``memory/<phase>_peak_gib``, :mod:`mmrl.workers.memory`: the
largest rank's VmHWM during the phase, the model, Ray's worker runtime and the phase's tensors
included). ``tree GiB``: the whole job's process tree (driver, Ray, workers), summed. ``other load``:
cores' worth of CPU that other processes took during the run (:mod:`harness`): on a shared machine a
row with a high value was slowed by them, so seconds are rough. Prints a markdown table; writes ``bench/results/long_video.json``.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import REPO, RESULTS, GiB, markdown_table, run_monitored, write_json

PHASES = ("gen", "old_log_prob", "reward", "update_actor", "sync")


# how the vision tower is run (--towers): freeze_vision_tower, share_encodings, rollout reuse_encodings
TOWER_MODES = {
    "frozen": {"worker.actor.model.freeze_vision_tower": "true"},
    "frozen-unshared": {  # every pass encodes: the step before encodings were shared
        "worker.actor.model.freeze_vision_tower": "true",
        "worker.actor.model.share_encodings": "false",
    },
    "frozen-reused": {  # vLLM: the engine takes the actor's encodings
        "worker.actor.model.freeze_vision_tower": "true",
        "worker.rollout.reuse_encodings": "true",
    },
    "trained": {"worker.actor.model.freeze_vision_tower": "false"},
}


def build_assets(n_prompts: int, size: str = "tiny") -> tuple[str, Path]:
    """The random Qwen2.5-VL of ``size`` and the long-video task (each returns at once when built)."""
    from mmrl.demo.synthetic import generate_shapes_dataset
    from mmrl.demo.tiny import ensure_tiny_model

    model = ensure_tiny_model("qwen2_5_vl", size, root=RESULTS / "models")
    data = generate_shapes_dataset(
        "video_long_flashes", RESULTS / "data" / "video-long-flashes", n_train=n_prompts, n_val=1
    )
    return str(model), data


def video_tokens(model: str, data: Path, frames: int, side: int) -> dict[str, int]:
    """Frames and video tokens of the first training clip, sampled and processed as the trainer does."""
    import json

    from transformers import AutoProcessor

    from mmrl.data.media import load_video

    row = json.loads((data / "train.jsonl").read_text().splitlines()[0])
    pixels = side * side
    decoded = load_video(
        str(data / row["videos"][0]), pixels, pixels, num_frames=frames, max_frames=frames, factor=28
    )
    processor = AutoProcessor.from_pretrained(model)
    grid_t, grid_h, grid_w = processor.video_processor(
        videos=[decoded.frames], do_resize=False, return_tensors="pt"
    )["video_grid_thw"][0].tolist()
    merge = processor.video_processor.merge_size**2
    return {
        "source_frames": decoded.source_num_frames,
        "frames": len(decoded.frame_indices),
        "video_tokens": grid_t * grid_h * grid_w // merge,
    }


@dataclass(frozen=True)
class Case:
    """One trainer run: frame side (px), rollout backend, SP layout (Ulysses × ring), tower mode."""

    side: int
    backend: str
    layout: tuple[int, int]
    towers: str = "frozen"

    @property
    def name(self) -> str:
        return f"{self.side}px-{self.backend}-{self.layout[0]}x{self.layout[1]}-{self.towers}"


def trainer_command(model: str, data: Path, case: Case, args: argparse.Namespace, out_dir: Path) -> list[str]:
    ulysses, ring = case.layout
    pixels = case.side * case.side
    clip_tokens = args.frames // 2 * (case.side // 28) ** 2
    overrides = {
        "data.train_files": data / "train.jsonl",
        "data.prompt_key": "problem",
        "data.answer_key": "answer",
        "data.video_key": "videos",
        "data.max_prompt_length": clip_tokens + 128,  # and the text
        "data.max_response_length": 4,
        "data.rollout_batch_size": args.prompts,
        "data.num_video_frames": args.frames,
        "data.max_video_frames": args.frames,
        "data.video_min_pixels": pixels,
        "data.video_max_pixels": pixels,
        "data.filter_overlong_prompts": "false",
        "algorithm.adv_estimator": "grpo",
        "algorithm.disable_kl": "true",
        # two optimizer steps per rollout: the second is off-policy, so the step has an old-log-prob pass
        "worker.actor.global_batch_size": args.prompts // 2,
        "worker.actor.micro_batch_size_per_device_for_update": args.micro_rows,
        "worker.actor.micro_batch_size_per_device_for_experience": args.micro_rows,
        "worker.actor.ulysses_size": ulysses,
        "worker.actor.ring_size": ring,
        "worker.actor.model.model_path": model,
        **TOWER_MODES[case.towers],
        "worker.actor.model.enable_gradient_checkpointing": "false",
        "worker.actor.optim.lr": 1e-4,
        "worker.rollout.name": case.backend,
        "worker.rollout.n": args.n,
        "worker.rollout.temperature": 1.0,
        "worker.rollout.enforce_eager": "true",
        "worker.reward.reward_function": f"{REPO / 'reward_functions' / 'shapes.py'}:compute_score",
        "trainer.total_epochs": 1000,
        "trainer.max_steps": args.steps,
        "trainer.logger": "[jsonl]",
        "trainer.nnodes": 1,
        "trainer.n_gpus_per_node": ulysses * ring,
        "trainer.device": "cpu",
        "trainer.val_freq": -1,
        "trainer.val_before_train": "false",
        "trainer.save_freq": 0,
        "trainer.save_checkpoint_path": out_dir,
        "trainer.find_last_checkpoint": "false",
    }
    context = clip_tokens + 128 + 4
    if context > args.max_positions:  # vLLM refuses a context over the config's max_position_embeddings
        overrides["worker.actor.model.override_config.text_config.max_position_embeddings"] = context
        overrides["worker.rollout.max_num_batched_tokens"] = context  # a prompt in one vLLM step
    return [sys.executable, "-m", "mmrl.trainer.main", *(f"{k}={v}" for k, v in overrides.items())]


def median(records: list[dict[str, Any]], key: str) -> float | None:
    values = [record[key] for record in records if record.get(key) is not None]
    return float(statistics.median(values)) if values else None


def summarize(records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """Medians of the step records after the first ``warmup`` steps (all steps if there are no more)."""
    steps = [record for record in records if record.get("timing_s/step") is not None]
    timed = steps[warmup:] or steps
    memory_keys = sorted({key for record in steps for key in record if key.startswith("memory/")})
    return {
        "steps": len(steps),
        "timed_steps": len(timed),
        "s_per_step": median(timed, "timing_s/step"),
        "s_per_step_runs": [record["timing_s/step"] for record in steps],
        "phase_s": {phase: median(timed, f"timing_s/{phase}") for phase in PHASES},
        "prompt_tokens": median(timed, "prompt_length/mean"),
        "response_tokens": median(timed, "response_length/mean"),
        # the peak over all steps, warm-up included: memory is what a run must have
        "memory_gib": {key: max(r[key] for r in steps if key in r) for key in memory_keys},
    }


def run_case(case: Case, model: str, data: Path, args: argparse.Namespace) -> dict[str, Any]:
    out_dir = RESULTS / "long_video" / case.name
    out_dir.mkdir(parents=True, exist_ok=True)
    command = trainer_command(model, data, case, args, out_dir)
    result = run_monitored(
        command, out_dir / "logs" / "metrics.jsonl", out_dir / "output.log", timeout_s=args.timeout_s
    )
    summary = summarize(result.records, warmup=1)
    return {
        "side": case.side,
        "layout": f"{case.layout[0]}x{case.layout[1]}",
        "ranks": case.layout[0] * case.layout[1],
        "backend": case.backend,
        "towers": case.towers,
        **video_tokens(model, data, args.frames, case.side),
        **summary,
        "wall_s": result.wall_s,
        "peak_rss_gib": result.peak_rss_bytes / GiB,
        "other_load_cores": result.other_load_cores,
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "layout (U×R)", "ranks", "backend", "towers", "frame px", "frames", "video tok", "seq len", "s/step",
        "gen s", "old logp s", "update s", "peak GiB/rank old logp", "peak GiB/rank update", "tree GiB", "other load",
    ]  # fmt: skip
    body = []
    for row in rows:
        memory, phases = row["memory_gib"], row["phase_s"]
        seq = (row["prompt_tokens"] or 0) + (row["response_tokens"] or 0)
        body.append(
            [
                row["layout"], row["ranks"], row["backend"], row.get("towers", "frozen"), row["side"], row["frames"], row["video_tokens"],
                f"{seq:.0f}", _fmt(row["s_per_step"]), _fmt(phases["gen"]), _fmt(phases["old_log_prob"]),
                _fmt(phases["update_actor"]),
                _fmt(memory.get("memory/old_log_prob_peak_gib"), 2),
                _fmt(memory.get("memory/update_actor_peak_gib"), 2),
                _fmt(row["peak_rss_gib"], 2),
                _fmt(row["other_load_cores"], 2),
            ]
        )  # fmt: skip
    return markdown_table(headers, body)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["2x1", "1x2", "1x1"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--frames", type=int, default=1024)
    parser.add_argument(
        "--sides", type=int, nargs="+", default=[56], help="frame sides, px (multiples of 28)"
    )
    parser.add_argument("--prompts", type=int, default=2, help="clips per step")
    parser.add_argument("--n", type=int, default=2, help="responses per clip")
    parser.add_argument("--micro_rows", type=int, default=1, help="rows per micro-batch (log-probs, update)")
    parser.add_argument("--backends", nargs="+", choices=("hf", "vllm"), default=["hf"])
    parser.add_argument("--towers", nargs="+", choices=sorted(TOWER_MODES), default=["frozen"])
    parser.add_argument("--size", default="tiny", help="mmrl.demo.tiny size: tiny, or 3b-width (3B widths)")
    parser.add_argument("--timeout_s", type=float, default=3600.0)
    args = parser.parse_args(argv)
    if args.prompts < 2 or args.prompts % 2:
        parser.error("--prompts must be even (two optimizer steps per rollout)")

    start = time.perf_counter()
    from mmrl.demo.tiny import SIZES

    args.max_positions = SIZES[args.size].max_position_embeddings
    model, data = build_assets(args.prompts, args.size)
    rows = []
    grid = itertools.product(args.sides, args.backends, args.layouts, args.towers)
    for side, backend, layout, towers in grid:
        if towers == "frozen-reused" and backend != "vllm":
            continue  # the engine's own input (reuse_encodings is vLLM's)
        case = Case(side, backend, tuple(int(x) for x in layout.split("x")), towers)
        rows.append(run_case(case, model, data, args))
        print(f"  {case.name}: {rows[-1]}", flush=True)
    payload = {"args": vars(args), "rows": rows, "wall_s": time.perf_counter() - start}
    path = write_json("long_video.json", payload)
    print("\n" + format_table(rows))
    print(f"-> {path} ({payload['wall_s']:.0f} s)")
    return payload


if __name__ == "__main__":
    main()
