"""The actor's update on 2 gloo ranks with its gradients reduced in every micro-batch (the default) and
once per optimizer step (``worker.actor.reduce_grads_once``), and with its parameters also gathered once
per step (``worker.actor.fsdp.enable_full_shard=false``, ``worker.actor.keep_params_gathered``).

    python bench/grad_reduction.py [--widths 3b] [--layers 2] [--vocab 8192] [--rows 8] [--repeats 3]

Each rank builds the Qwen2.5-VL layout of ``bench/gpu_mfu.py`` (random weights from seed 0, ``--layers``
decoder layers, 2 vision blocks, fp32: this CPU emulates bf16), shards it with mmrl's ``apply_fsdp2``
over both ranks and runs ``PolicyActor.update_policy`` on its half of ``--rows`` text rows in
micro-batches of one row, ``--repeats`` times after a warm-up, once per setting, each from the same
weights. The table holds the median update seconds, the all-gathers and reduce-scatters FSDP2 started in
the last timed update (every unit's, counted as they start; the warm-up gathers every unit once more
for the first update that reduces once) and the warm-up update's loss and gradient norm (the same
numbers every way, to fp32 rounding). ``bench/results/grad_reduction.json`` keeps them. What is reduced
once instead of per micro-batch is the gradient traffic between ranks: on one rank there is none to save
(``bench/gpu_mfu.py --reduce_grads_once`` counts that case's ops).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from gpu_mfu import build_config, build_model, random_batch
from harness import markdown_table, write_json

# name -> (reduce_grads_once, parameters gathered once per step)
SETTINGS = {
    "per micro-batch": (False, False),
    "once per step": (True, False),
    "once per step, parameters gathered once": (True, True),
}


def _counting_collectives() -> dict[str, int]:
    """Counts of the all-gathers and reduce-scatters FSDP2 starts in this process from now on."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    counts = {"gathers": 0, "reductions": 0}
    gather, reduce = group_module.foreach_all_gather, group_module.foreach_reduce

    def counted_gather(*args, **kwargs):
        counts["gathers"] += 1
        return gather(*args, **kwargs)

    def counted_reduce(*args, **kwargs):
        counts["reductions"] += 1
        return reduce(*args, **kwargs)

    group_module.foreach_all_gather, group_module.foreach_reduce = counted_gather, counted_reduce
    return counts


def rank_job(rank: int, world_size: int, options: dict) -> dict:
    """This rank's figures for each of :data:`SETTINGS`."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from mmrl.config import ActorConfig, FSDPConfig
    from mmrl.models.prepare import prepare_for_training
    from mmrl.protocol import DataProto
    from mmrl.workers.actor import PolicyActor
    from mmrl.workers.forward import add_position_ids
    from mmrl.workers.fsdp_engine import apply_fsdp2, build_optimizer

    device = torch.device("cpu")
    config = build_config(options["widths"], layers=options["layers"], vision_depth=2, vocab=options["vocab"])
    rows, response = options["rows"], options["response_length"]
    batch = random_batch(rows, options["prompt_length"], response, options["vocab"], seed=0)
    shard = batch.chunk(world_size)[rank]
    mesh = init_device_mesh("cpu", (world_size,))
    collectives = _counting_collectives()
    results = {}
    for name, (once, gathered_once) in SETTINGS.items():
        model = build_model(config, device)
        prepare_for_training(model, packing=True, score_tokens=True)
        model = apply_fsdp2(
            model,
            mesh,
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
            reshard_after_forward=not gathered_once,
        )
        optimizer = build_optimizer(model.parameters(), lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
        actor_config = ActorConfig(
            padding_free=True,
            reduce_grads_once=once,
            keep_params_gathered=gathered_once,
            fsdp=FSDPConfig(enable_full_shard=not gathered_once),
        )
        actor = PolicyActor(
            model, actor_config, optimizer=optimizer, device=device, max_response_length=response
        )
        data = add_position_ids(model, shard[:])
        if "old_log_probs" not in data.batch.keys():
            old = actor.compute_log_probs(data, 1, temperature=1.0)[0]
            data = data.union(DataProto.from_dict(tensors={"old_log_probs": old}))
        seconds, first = [], None
        for repeat in range(options["repeats"] + 1):  # the first is a warm-up
            before, started = dict(collectives), time.perf_counter()
            metrics = actor.update_policy(data, len(data), 1, ppo_epochs=1, temperature=1.0).metrics
            if repeat == 0:
                first = {"loss": metrics["pg_loss"], "grad_norm": metrics["grad_norm"]}
            else:
                seconds.append(time.perf_counter() - started)
            # of a timed update (the warm-up gathers every unit once more: fsdp_engine._gathered_once)
            started_collectives = {kind: collectives[kind] - before[kind] for kind in collectives}
        results[name] = {"update_s": statistics.median(seconds), **started_collectives, **first}
        del actor, model, optimizer
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", choices=["3b", "small", "smoke"], default="3b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=8, help="rows of both ranks (micro-batches of one row)")
    parser.add_argument("--prompt_length", type=int, default=64)
    parser.add_argument("--response_length", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="the JSON file (default bench/results/...)")
    args = parser.parse_args()

    from mmrl.demo.ranks import run_on_ranks

    options = {key: value for key, value in vars(args).items() if key != "out"}
    results = run_on_ranks(rank_job, 2, options, timeout_s=3600)
    table = [
        [
            name,
            f"{results[0][name]['update_s']:.2f}",
            results[0][name]["gathers"],
            results[0][name]["reductions"],
            f"{results[0][name]['loss']:.6f}",
            f"{results[0][name]['grad_norm']:.6f}",
        ]
        for name in SETTINGS
    ]
    print(
        f"the actor's update on 2 gloo ranks, Qwen2.5-VL layout at {args.widths} widths, {args.layers} decoder "
        f"layers, vocabulary {args.vocab:,}; {args.rows} rows of {args.prompt_length} + {args.response_length} "
        f"tokens, micro-batches of one row ({args.rows // 2} per rank); fp32; median of {args.repeats} (rank 0)\n"
    )
    print(
        markdown_table(
            ["gradients reduced", "update s", "all-gathers", "reduce-scatters", "loss", "grad norm"], table
        )
    )
    payload = {"args": options, "ranks": results}
    out = write_json("grad_reduction.json", payload, args.out)
    print(f"\nwritten to {out}")


if __name__ == "__main__":
    main()
