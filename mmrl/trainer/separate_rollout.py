"""The driver's handle on rollout workers of their own (``worker.rollout.placement=separate``).

``worker.rollout.num_workers`` :class:`~mmrl.workers.rollout_worker.RolloutWorker` processes, each on a
GPU (on CPUs: cores) of its own, generate while the training ranks do something else: a generation is
started (:meth:`RolloutWorkers.start_generation`) and waited for later. After every update the driver
pushes the weights (:meth:`RolloutWorkers.push`): the training ranks gather them, rank 0 broadcasts
them over the push group (:mod:`mmrl.workers.weight_push`) that :meth:`RolloutWorkers.connect` built
once. A push waits for the generation running on the rollout workers (a Ray actor runs one call at a
time), so the weights never change under a batch being generated.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mmrl.config import PPOConfig
from mmrl.protocol import DataProto
from mmrl.trainer.placement import Placement
from mmrl.workers.fsdp_workers import HybridWorker
from mmrl.workers.rollout_worker import GENERATION_FINISHED, GENERATION_STARTED, RolloutWorker

if TYPE_CHECKING:
    from mmrl.single_controller import RayWorkerGroup, TransferCounter


class RolloutWorkers:
    """The rollout worker processes, started (importing) at construction, built by :meth:`start`."""

    def __init__(self, config: PPOConfig, placement: Placement, transfers: TransferCounter):
        from mmrl.single_controller import RayWorkerGroup, ResourcePool

        pool = ResourcePool(
            1, config.worker.rollout.num_workers, placement.use_gpu, cpus_per_proc=placement.cpus_per_worker
        )
        self.group: RayWorkerGroup[RolloutWorker] = RayWorkerGroup(
            RolloutWorker, pool, name_prefix="rollout", start=False, transfers=transfers
        )

    def start(self, config: PPOConfig, cpu_threads: int | None) -> None:
        self.group.start(kwargs={"config": config, "cpu_threads": cpu_threads})

    def connect(self, trainers: RayWorkerGroup[HybridWorker]) -> None:
        """Build the push group: training rank 0 (its rank 0) and the rollout workers, which get the
        manifest of what every push sends."""
        host, port = trainers.call_rank(0, HybridWorker.weight_push_address)
        manifest = trainers.call_rank(0, HybridWorker.weight_manifest)
        members = 1 + self.group.world_size
        opening = trainers.call_async(HybridWorker.join_weight_push, host, port, members)
        joining = self.group.call_async(RolloutWorker.join_weight_push, host, port, members, manifest)
        trainers.collect(opening)
        self.group.collect(joining)

    def push(self, trainers: RayWorkerGroup[HybridWorker], version: int) -> dict[str, float]:
        """The actor's weights (policy ``version``) into every rollout worker; the bytes each received
        (``transfer/weight_push_bytes``)."""
        sending = trainers.call_async(HybridWorker.push_rollout_weights)
        receiving = self.group.call_async(RolloutWorker.receive_weights, version)
        sent = trainers.collect(sending)[0]  # rank 0 sends
        self.group.collect(receiving)
        return {"transfer/weight_push_bytes": float(sent)}

    def start_generation(self, prompts: DataProto, **kwargs: Any) -> Callable[[], DataProto]:
        """``RolloutWorker.generate`` started on the rollout workers' shares of ``prompts``; the returned
        function waits for the responses."""
        return self.group.dispatch_async(RolloutWorker.generate, prompts, **kwargs)

    def shutdown(self) -> None:
        self.group.shutdown()


def generation_window(batch: DataProto) -> tuple[float, float] | None:
    """The wall-clock window (earliest start, latest end over the rollout workers) in which ``batch``
    was generated, taken out of its ``meta_info``; None for a batch of the training processes."""
    metrics = batch.meta_info.get("metrics", {})
    if GENERATION_STARTED not in metrics:
        return None
    window = min(metrics.pop(GENERATION_STARTED)), max(metrics.pop(GENERATION_FINISHED))
    if not metrics:
        del batch.meta_info["metrics"]
    return window


def overlap_s(window: tuple[float, float] | None, start: float, end: float) -> float:
    """Seconds of ``window`` within ``[start, end]`` (0 when they are apart or there is no window)."""
    if window is None:
        return 0.0
    return max(0.0, min(window[1], end) - max(window[0], start))
