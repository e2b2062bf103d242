"""The driver's handle on rollout workers of their own (``worker.rollout.placement=separate``).

``worker.rollout.num_workers`` :class:`~mmrl.workers.rollout_worker.RolloutWorker` processes, each on a
GPU (on CPUs: cores) of its own, generate while the training ranks do something else: a generation is
started (:meth:`RolloutWorkers.start_generation`) and waited for later. After every update the driver
pushes the weights (:meth:`RolloutWorkers.push`): the training ranks gather them, rank 0 broadcasts
them over the push group (:mod:`mmrl.workers.weight_push`) that :meth:`RolloutWorkers.connect` built
once. A push waits for the generation running on the rollout workers (a Ray actor runs one call at a
time), so the weights never change under a batch being generated.

Streaming (``trainer.async_mode=stream``, :class:`StreamedRollouts`): the rollout workers generate all
the time in a thread of their own; the driver submits whole prompt batches while the
:class:`~mmrl.trainer.asynchrony.StreamSchedule` has room, fetches finished groups, and a push lands
between two chunks of tokens of the generations in flight.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from mmrl.config import PPOConfig
from mmrl.data.collate import concat_batches
from mmrl.protocol import DataProto
from mmrl.trainer.asynchrony import StreamSchedule, StreamTake, step_batch
from mmrl.trainer.dynamic_sampling import FilterOptions
from mmrl.trainer.placement import Placement
from mmrl.workers.fsdp_workers import HybridWorker
from mmrl.workers.rollout_worker import GENERATION_FINISHED, GENERATION_STARTED, RolloutWorker

if TYPE_CHECKING:
    from mmrl.single_controller import RayWorkerGroup, TransferCounter
    from mmrl.workers.reward_worker import PendingRewards, RewardWorkers


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

    def stream_submit(self, prompts: DataProto, submission: int) -> None:
        """``prompts`` into the stream of one rollout worker (in turn: submission modulo the workers)."""
        self.group.call_rank(
            submission % self.group.world_size, RolloutWorker.stream_submit, prompts, submission
        )

    def stream_take(self, timeout_s: float, pad_token_id: int) -> DataProto | None:
        """The groups every rollout worker finished since the last call, waiting up to ``timeout_s``
        (prompts padded to one width with ``pad_token_id``)."""
        parts = [part for part in self.group.call(RolloutWorker.stream_take, timeout_s) if part is not None]
        return concat_batches(parts, pad_token_id) if parts else None

    def shutdown(self) -> None:
        self.group.shutdown()


class StreamedRollouts:
    """The driver's side of ``trainer.async_mode=stream``: prompts submitted as the schedule allows,
    finished groups gathered until a step's worth of fresh ones is there, stale ones' prompts sent again.

    ``share_media`` puts a prompt batch's media in Ray's object store (the trainer's). Every batch of
    finished groups is scored by ``rewards`` from its arrival on (a judge, sandbox or reward model works
    while the stream goes on); with online filtering (``options``) the schedule waits for the scores to
    judge the groups, without, the step that trains a group collects them."""

    WAIT_S = 0.5  # how long one fetch waits for a finished group

    def __init__(
        self,
        config: PPOConfig,
        workers: RolloutWorkers,
        share_media: Callable[[DataProto], DataProto],
        pad_token_id: int,
        rewards: RewardWorkers | None = None,
        options: FilterOptions | None = None,
    ):
        self.groups_per_step = config.data.rollout_batch_size
        self.schedule = StreamSchedule(
            self.groups_per_step,
            config.trainer.max_staleness,
            options,
            config.worker.actor.collapse_recovery.solved_score,
        )
        self.workers, self.share_media, self.rewards = workers, share_media, rewards
        self.pad_token_id = pad_token_id  # prompts of different loader batches meet in a step
        self.prompts: dict[str, DataProto] = {}  # uid -> its prompt row, until its group is consumed
        self.scoring: list[tuple[DataProto, PendingRewards]] = []  # arrived, being scored (filtering)
        self.submissions = 0

    def take(
        self,
        batches: Iterator[DataProto],
        loader_position: Callable[[], dict[str, int]],
        current: int,
        steps_left: int,
    ) -> tuple[DataProto, Callable[[], DataProto], dict[str, float], tuple[int, int]]:
        """The next step's groups (policy version ``current``: the updates so far), a function returning
        their scores (launched as they arrived), the stream's metrics, and the (all-equal, all) groups the step's
        filter saw (the collapse gate's input); submits new prompts while fewer than ``steps_left`` steps'
        groups are outstanding."""
        dropped = 0
        while True:
            self._score_arrivals()
            step = self.schedule.take(current)
            for group in step.filtered:  # consumed: its prompt is not generated again
                del self.prompts[group.uid]
            if step.stale:
                dropped += len(step.stale)
                stale = [self.prompts[group.uid] for group in step.stale]
                self._submit(concat_batches(stale, self.pad_token_id))
            if step.groups is not None:
                break
            # whole loader batches while groups are missing (a resumed run's batches may be short)
            while (
                min(self.schedule.room(), steps_left * self.groups_per_step - self.schedule.outstanding) > 0
            ):
                self._submit_next(batches, loader_position)
            arrived = self.workers.stream_take(self.WAIT_S, self.pad_token_id)
            if arrived is None:
                continue
            pending = self.rewards.launch(arrived)  # scored from now on, as the groups arrive
            if self.schedule.filter is not None:
                self.scoring.append((arrived, pending))  # judged on the next pass
            else:  # collected when a step trains them (their rewards ran while the stream went on)
                self.schedule.arrive(arrived, pending=functools.partial(self.rewards.collect, pending))
        return self._step_batch(step, dropped)

    def _score_arrivals(self) -> None:
        """The groups being scored, with their scores, into the schedule."""
        for arrived, pending in self.scoring:
            self.schedule.arrive(arrived, self.rewards.collect(pending))
        self.scoring = []

    def _step_batch(
        self, step: StreamTake, dropped: int
    ) -> tuple[DataProto, Callable[[], DataProto], dict[str, float], tuple[int, int]]:
        for group in step.groups:
            self.prompts.pop(group.uid, None)  # a top-up group's went when the filter dropped it
        batch, scores, metrics, group_counts = step_batch(
            step, self.schedule.filter is not None, self.pad_token_id
        )
        assert scores is not None  # every arrival's rewards were launched
        metrics = {
            "rollout/stream_dropped_groups": dropped,  # finished too old, their prompts generated again
            "rollout/stream_outstanding_groups": self.schedule.outstanding,
            **metrics,
        }
        return batch, scores, metrics, group_counts

    def _submit_next(
        self, batches: Iterator[DataProto], loader_position: Callable[[], dict[str, int]]
    ) -> None:
        """The loader's next batch into the stream, less the rows trained before a resume."""
        prompts = next(batches)
        position = loader_position()  # the batch just drawn is batch_index - 1 of its epoch
        epoch, index = position["epoch"], position["batch_index"] - 1
        rows = [row for row in range(len(prompts)) if self.schedule.keep((epoch, index, row))]
        if rows:
            self._submit(prompts[rows], [(epoch, index, row) for row in rows])

    def _submit(self, prompts: DataProto, origins: list[tuple[int, int, int]] | None = None) -> None:
        if origins is not None:  # new prompts: media shared once, rows kept until they train
            prompts = self.share_media(prompts)
            for row in range(len(prompts)):
                self.prompts[str(prompts.non_tensor_batch["uid"][row])] = prompts[row : row + 1]
        self.schedule.submitted([str(uid) for uid in prompts.non_tensor_batch["uid"]], origins)
        self.workers.stream_submit(prompts, self.submissions)
        self.submissions += 1

    def state_dict(self, loader_position: dict[str, int]) -> dict:
        return {**self.schedule.state_dict(loader_position), "submissions": self.submissions}

    def load_state_dict(self, state: dict) -> None:
        self.schedule.load_state_dict(state)
        self.submissions = int(state["submissions"])


def check_stream_versions(batch: DataProto, current: int, max_staleness: int) -> None:
    """Stop when a streamed token claims a version the driver has not pushed yet, or one older than
    the schedule admits: the engines hold other weights than the driver believes."""
    versions = batch.batch["policy_version"][batch.batch["response_mask"].bool()]
    if versions.numel() and (int(versions.max()) > current or int(versions.min()) < current - max_staleness):
        raise RuntimeError(
            f"streamed tokens carry policy versions {int(versions.min())}..{int(versions.max())}, but the "
            f"driver is at version {current} with trainer.max_staleness={max_staleness}"
        )


def partial_response_fraction(batch: DataProto) -> float:
    """Share of the responses whose tokens were sampled by more than one policy version."""
    mask = batch.batch["response_mask"].bool()
    versions = batch.batch["policy_version"]
    newest = versions.masked_fill(~mask, -1).amax(dim=-1)
    oldest = versions.masked_fill(~mask, 2**62).amin(dim=-1)
    return float(((newest > oldest) & mask.any(dim=-1)).float().mean()) if len(versions) else 0.0


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
