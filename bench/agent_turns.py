"""Multi-turn generation with tools of uneven latency: ``lockstep`` against ``as_ready`` turns.

    python bench/agent_turns.py [--size tiny|3b-width] [--prompts 8] [--n 4] [--max_turns 4] [--end_every 32]
                                [--slow_share 0.2] [--slow_s 1.0] [--fast_s 0.05] [--repeats 3] [--threads 2]

The agent loop (``worker.rollout.multi_turn.turn_schedule``) drives the transformers engine on a
Qwen2.5-VL with random weights, ``--size`` tiny or 3b-width (the 3B model's widths and real vocabulary, 2
decoder layers; both built under ``bench/results``), over the colour task's prompts; every ``--end_every``-th
token id ends a turn (a random model's turns are then ~that long). Every model turn calls a zoom tool
(the loop reads each turn as a call: a random model writes none), whose latency is drawn per
call from a seeded stream: ``--slow_s`` with probability ``--slow_share``, else ``--fast_s`` (a search
or a sandboxed program now and then slow). Both schedules see the same latencies: the k-th call of a
trajectory sleeps the same whatever its batch. The tiny model decodes fast; at the 3B widths the
engine's share of the wall time is larger, and so is the cost of its smaller batches.

For each schedule, over ``--repeats`` generations after a warm-up: wall seconds of a generation, the
engine's seconds (its ``generate`` calls), the engine's idle share (1 - engine / wall: it waits for
tools), the engine calls and the trajectories per call. Writes ``bench/results/agent_turns.json``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from harness import build_models_and_data, markdown_table, write_json


def build(args: argparse.Namespace):
    """The prompts (media attached), the engine, and a loop factory for a schedule."""
    import torch

    from mmrl.agent.loop import AgentLoop, LoopOptions, ObservationRenderer
    from mmrl.agent.tools import ToolCall, ToolRunner, tool_from_function
    from mmrl.data.collate import collate_prompts
    from mmrl.data.config import DataConfig
    from mmrl.data.dataset import PromptDataset
    from mmrl.data.processing import MediaProcessor, attach_media, load_tokenizer_and_processor
    from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS
    from mmrl.models.loading import load_model
    from mmrl.workers.rollout.hf import HFRollout

    torch.set_num_threads(args.threads)
    built = build_models_and_data([args.size], n_train=max(64, args.prompts), n_val=1)
    model_path = built["models"][args.size]
    tokenizer, processor = load_tokenizer_and_processor(model_path)
    config = DataConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    media = MediaProcessor(tokenizer, processor, config)
    dataset = PromptDataset(str(Path(built["data_dir"]) / "train.jsonl"), tokenizer, processor, config)
    prompts = attach_media(
        collate_prompts([dataset[i] for i in range(args.prompts)], tokenizer.pad_token_id),
        media,
        rollout_media=True,
    )
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ends = [eos, *range(0, len(tokenizer), args.end_every)]  # a random model's turns end this often
    engine = HFRollout(load_model(model_path), tokenizer, return_log_probs=True)
    engine.eos_token_ids = ends

    calls: dict[str, int] = {}  # trajectory -> its calls so far (cleared before each generation)

    def zoom(x: int, y: int, row: dict = None):
        """Crop a 28x28 region of the image.

        Args:
            x: left edge
            y: top edge
        """
        key = row["trajectory_key"]
        calls[key] = calls.get(key, 0) + 1
        slow = random.Random(f"{args.seed}:{key}:{calls[key]}").random() < args.slow_share
        time.sleep(args.slow_s if slow else args.fast_s)
        return row["images"][0].crop((x, y, x + 28, y + 28))

    def loop(schedule: str) -> AgentLoop:
        return AgentLoop(
            ObservationRenderer(media, "<|im_end|>"),
            lambda text: [
                ToolCall("zoom", {"x": 0, "y": 0})
            ],  # every turn calls (a random model writes none)
            LoopOptions(max_turns=args.max_turns, as_ready=schedule == "as_ready"),
            ends,
            ToolRunner({"zoom": tool_from_function(zoom)}, timeout_s=60, max_concurrency=args.concurrency),
        )

    return prompts, engine, loop, calls


def measure(args: argparse.Namespace) -> dict:
    from mmrl.agent.loop import sample_rows
    from mmrl.sampling import SamplingParams

    prompts, engine, make_loop, calls = build(args)
    sampling = SamplingParams(n=1, temperature=1.0, max_tokens=args.max_tokens, seed=args.seed)
    repeated = prompts.repeat(args.n, interleave=True)
    results = {}
    for schedule in ("lockstep", "as_ready"):
        loop = make_loop(schedule)
        rows = [
            dict(row, trajectory_key=str(i))
            for i, row in enumerate(sample_rows(repeated, loop.renderer.media))
        ]
        runs = []
        for repeat in range(args.repeats + 1):  # the first: a warm-up
            engine_s, sizes = [0.0], []
            generate = engine.turn_generator(repeated, sampling)

            def timed(requests, generate=generate, engine_s=engine_s, sizes=sizes):
                start = time.perf_counter()
                out = generate(requests)
                engine_s[0] += time.perf_counter() - start
                sizes.append(len(requests))
                return out

            calls.clear()
            start = time.perf_counter()
            trajectories = loop.run(rows, args.max_tokens, timed)
            wall = time.perf_counter() - start
            if repeat:
                runs.append(
                    {
                        "wall_s": wall,
                        "engine_s": engine_s[0],
                        "engine_calls": len(sizes),
                        "rows_per_call": sum(sizes) / len(sizes),
                        "turns": sum(t.record.model_turns for t in trajectories),
                        "tool_calls": sum(len(t.record.calls) for t in trajectories),
                    }
                )
        results[schedule] = runs
    return results


def format_table(args: dict, results: dict) -> str:
    """The medians of each schedule's generations as a markdown table, under a line naming the job."""
    rows = []
    for schedule, runs in results.items():
        med = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        rows.append(
            [
                schedule,
                f"{med['wall_s']:.2f}",
                f"{med['engine_s']:.2f}",
                f"{1 - med['engine_s'] / med['wall_s']:.0%}",
                f"{med['engine_calls']:.0f}",
                f"{med['rows_per_call']:.1f}",
                f"{med['turns']:.0f}",
                f"{med['tool_calls']:.0f}",
            ]
        )
    headers = [
        "schedule",
        "wall s",
        "engine s",
        "engine idle",
        "engine calls",
        "trajectories per call",
        "turns",
        "tool calls",
    ]
    job = (
        f"{args.get('size', 'tiny')} model, {args['prompts']} prompts × {args['n']} trajectories, up to "
        f"{args['max_turns']} turns; each call {args['slow_s']:g} s with p={args['slow_share']:g}, else "
        f"{args['fast_s']:g} s; medians of {args['repeats']}"
    )
    return job + "\n" + markdown_table(headers, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", help="tiny, or 3b-width (Qwen2.5-VL-3B's widths, 2 layers)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max_turns", type=int, default=4)
    parser.add_argument("--max_tokens", type=int, default=320)  # the trajectory's budget
    parser.add_argument("--end_every", type=int, default=32)  # every k-th token id ends a turn: ~k tokens
    parser.add_argument("--slow_share", type=float, default=0.2)
    parser.add_argument("--slow_s", type=float, default=1.0)
    parser.add_argument("--fast_s", type=float, default=0.05)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = measure(args)
    print(format_table(vars(args), results))
    print(f"wrote {write_json('agent_turns.json', {'args': vars(args), 'results': results})}")


if __name__ == "__main__":
    main()
