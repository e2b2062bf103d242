"""Where the training processes run: GPUs or CPUs, and how many CPUs (threads) each one gets.

Decided by the driver from the Ray cluster's resources (``ray.nodes()``), not from the driver's own
machine: a driver on a CPU-only head node of a GPU cluster trains on the GPU nodes, and a config that
asks for more GPUs than the cluster has stops with one message naming what it has.

``trainer.device``: ``cuda`` needs ``trainer.nnodes × trainer.n_gpus_per_node`` GPUs in the cluster;
``auto`` trains on GPUs when the cluster has any (with the same need), else on CPUs and says so;
``cpu`` trains on CPUs whatever the cluster has (the ranks then see no GPU at all).

CPUs: Ray reserves ``trainer.cpus_per_worker`` CPUs per training process and sets the process's
``OMP_NUM_THREADS`` to that many; media decoding and processing of the process's rows run on them,
so the worker sets torch's threads to the same number. ``null``: on GPU nodes each node's CPUs
(after the reward workers' ``num_workers × num_cpus``) shared by its ``n_gpus_per_node`` processes
(Ray's default for an actor, 1 CPU, would leave one thread per GPU); on a CPU machine 0.5 each, and
each rank then uses the machine's cores divided by the ranks on it.

Rollout workers of their own (``worker.rollout.placement=separate``, ``rollout_workers`` of them) are
placed like training processes: a GPU each besides the training ranks', and the same CPUs; on a CPU
machine the training ranks and the rollout workers split its cores between them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mmrl.config import TrainerConfig
from mmrl.errors import UserInputError

CPU_RANK_CPUS = 0.5  # Ray CPUs per rank on a CPU machine: the ranks share the cores (threads set per rank)


class PlacementError(UserInputError):
    """The config asks for devices the Ray cluster does not have."""


@dataclass(frozen=True)
class Placement:
    use_gpu: bool
    cpus_per_worker: float  # Ray CPUs reserved per training process
    worker_threads: int | None  # torch threads per training process; None: the CPU ranks' own split
    note: str | None = None  # a line for the user (e.g. "no GPUs: training on CPUs")


def _describe(nodes: list[dict[str, float]]) -> str:
    return "; ".join(f"{node.get('CPU', 0):g} CPU, {node.get('GPU', 0):g} GPU" for node in nodes) or "none"


def plan_placement(
    trainer: TrainerConfig,
    reward_cpus: float,
    nodes: list[dict[str, float]],
    reward_gpus: float = 0.0,
    rollout_workers: int = 0,
) -> Placement:
    """The placement of ``trainer.world_size`` training processes (and ``rollout_workers`` rollout
    workers of their own) on a cluster whose alive nodes have ``nodes`` resources
    (``{"CPU": 16.0, "GPU": 8.0, ...}`` each); ``reward_cpus`` / ``reward_gpus`` = what the reward
    workers and a served judge take. Raises :class:`PlacementError` when GPUs are asked for and the
    cluster lacks them."""
    gpus = sum(node.get("GPU", 0.0) for node in nodes) - reward_gpus
    asked = trainer.world_size + rollout_workers
    use_gpu = trainer.device == "cuda" or (trainer.device == "auto" and gpus + reward_gpus > 0)
    note = None
    if trainer.device == "auto" and not use_gpu:
        note = f"mmrl: the Ray cluster has no GPUs (nodes: {_describe(nodes)}): training on CPUs"
    if use_gpu and gpus < asked:
        how = (
            "trainer.device=cuda"
            if trainer.device == "cuda"
            else "trainer.device=auto and the cluster has GPUs"
        )
        besides = f" besides the {reward_gpus:g} of the reward workers" if reward_gpus else ""
        raise PlacementError(
            f"{how}: trainer.nnodes={trainer.nnodes} × trainer.n_gpus_per_node={trainer.n_gpus_per_node}"
            + (
                f" + worker.rollout.num_workers={rollout_workers} (placement=separate)"
                if rollout_workers
                else ""
            )
            + f" = {asked} GPUs asked for,"
            f" but the Ray cluster has {gpus:g}{besides} (nodes: {_describe(nodes)}). Lower "
            "trainer.n_gpus_per_node / trainer.nnodes, add GPU nodes (`ray start --address=<head>:6379` on "
            "each), or set trainer.device=cpu"
        )
    if trainer.cpus_per_worker is not None:
        cpus = trainer.cpus_per_worker
        return Placement(use_gpu, cpus, max(1, math.floor(cpus)), note)
    if not use_gpu:
        return Placement(False, CPU_RANK_CPUS, None, note)
    gpu_node_cpus = min(node.get("CPU", 0.0) for node in nodes if node.get("GPU", 0.0) > 0)
    processes = trainer.n_gpus_per_node + rollout_workers  # a separate rollout's workers: on one node
    per_process = max(1, math.floor((gpu_node_cpus - reward_cpus) / processes))
    return Placement(True, float(per_process), per_process, note)
