"""The driver: one process holding the algorithm, steering Ray worker groups that hold the models.

``RayPPOTrainer.fit`` reads as the algorithm: rollout → reward → log-probs → advantages → update →
sync → log → checkpoint. What a step does (on-policy shortcut, reference, critic, temperature) is
decided once per step (:class:`~mmrl.trainer.step_plan.StepPlan`) and passed to the workers as
arguments. Every phase is a named method; the models live in the workers
(``mmrl.workers.fsdp_workers``) and the maths in ``mmrl.core_algos``.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmrl import core_algos
from mmrl.agent.loop import tool_schemas
from mmrl.agent.metrics import trajectory_log, trajectory_metrics
from mmrl.checkpoint.tracker import (
    CheckpointLayout,
    CheckpointSaveError,
    find_last_checkpoint,
    load_trainer_state,
    save_trainer_state,
)
from mmrl.columns import check_batch
from mmrl.config import PPOConfig
from mmrl.data.collate import collate_prompts, concat_batches
from mmrl.data.dataset import PromptDataset
from mmrl.data.loader import PromptLoader
from mmrl.data.processing import load_tokenizer_and_processor
from mmrl.logging import build_loggers
from mmrl.parallel.packing import balance_batch
from mmrl.protocol import DataProto
from mmrl.rewards.rule import RewardFunctionError, reduce_reward_metrics
from mmrl.rewards.source import RewardSourceError
from mmrl.trainer.asynchrony import (
    Rollout,
    RolloutSchedule,
    check_versions,
    in_background,
    staleness_metrics,
)
from mmrl.trainer.dynamic_sampling import (
    DynamicSamplingError,
    FilterOptions,
    failed_groups,
    filter_scores,
    first_groups,
    kept_groups,
    loss_rows,
    zero_advantage_group_fraction,
)
from mmrl.trainer.metrics import (
    compute_data_metrics,
    compute_timing_metrics,
    saturation_metrics,
    timer,
)
from mmrl.trainer.placement import Placement, plan_placement
from mmrl.trainer.separate_rollout import (
    RolloutWorkers,
    StreamedRollouts,
    check_stream_versions,
    generation_window,
    overlap_s,
    partial_response_fraction,
)
from mmrl.trainer.stages import Stage, first_stage_to_run, plan_stages
from mmrl.trainer.step_plan import StepPlan
from mmrl.workers.fsdp_workers import HybridWorker
from mmrl.workers.rollout import GenerationMode

if TYPE_CHECKING:  # Ray-importing modules, imported where used
    from mmrl.rewards.judge_server import ServedJudge
    from mmrl.single_controller import RayWorkerGroup, TransferCounter
    from mmrl.workers.reward_worker import RewardWorkers

logger = logging.getLogger(__name__)

VAL_METRIC = "val/reward/overall"  # the checkpoint tracker's "best" follows this
FAULT_ENV = "MMRL_FAULT_AT"  # a test hook: see fault_point


def fault_point(phase: str, step: int) -> None:
    """Test hook of the chaos test (``test_sigkill_at_any_moment_*`` in tests/trainer/test_ray_trainer.py):
    with ``MMRL_FAULT_AT=<phase>:<step>`` in the environment, the driver SIGKILLs itself on entering
    ``phase`` ("rollout": the step's start, "generating": its generation just started, on rollout
    workers of their own still in flight, "sync": after the update, "checkpoint": after the workers
    wrote their part of ``global_step_N.tmp``, before the commit) of training step ``step`` (1-based),
    so that a kill lands in a chosen phase. Unset (always, outside tests) it does nothing."""
    if os.environ.get(FAULT_ENV) == f"{phase}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def conform_to_columns(batch: DataProto, phase: str) -> None:
    """Stop with the problems when ``batch`` (after ``phase``) breaks the column schema (mmrl.columns):
    a worker returned a column nobody declared, or a dtype or width other than the listed one."""
    problems = check_batch(batch)
    if problems:
        raise RuntimeError(f"the batch after {phase} does not match mmrl.columns: {'; '.join(problems)}")


def total_training_steps(config: PPOConfig, prompts: int) -> int:
    """Steps of ``data.rollout_batch_size`` prompts over ``trainer.total_epochs`` passes of ``prompts``
    (with online filtering an "epoch" counts the prompts trained on, not those generated for)."""
    steps = config.trainer.total_epochs * (prompts // config.data.rollout_batch_size)
    return min(steps, config.trainer.max_steps) if config.trainer.max_steps else steps


def prompts_per_round(config: PPOConfig) -> int:
    """Prompts the loader yields at a time. With online filtering every generation round draws a
    mini-batch of its own: the loader's position then counts rounds, so a resumed run goes on with the
    prompts an uninterrupted one would have seen."""
    data = config.data
    if config.algorithm.online_filtering and data.mini_rollout_batch_size is not None:
        return data.mini_rollout_batch_size
    return data.rollout_batch_size


def build_filter(config: PPOConfig) -> FilterOptions | None:
    """DAPO dynamic sampling's settings when ``algorithm.online_filtering`` is on."""
    algo = config.algorithm
    if not algo.online_filtering:
        return None
    return FilterOptions(
        key=algo.filter_key,
        low=algo.filter_low,
        high=algo.filter_high,
        groups_per_step=config.data.rollout_batch_size,
        max_rounds=config.trainer.max_try_make_batch,
        train_unfilled=algo.unfilled_step == "train",
        groups_per_round=prompts_per_round(config),
    )


def build_entropy_controller(config: PPOConfig) -> core_algos.EntropyController:
    """The entropy bonus's weight per step: ``worker.actor.entropy_coeff``, steered by
    ``worker.actor.adaptive_entropy`` when enabled."""
    actor = config.worker.actor
    adaptive = actor.adaptive_entropy
    return core_algos.EntropyController(
        actor.entropy_coeff,
        enabled=adaptive.enabled,
        target_entropy=adaptive.target_entropy,
        delta=adaptive.delta_ent_coef,
        low=adaptive.min_ent_coef,
        high=adaptive.max_ent_coef,
    )


def build_collapse_gate(config: PPOConfig) -> core_algos.CollapseGate:
    """The collapse-recovery term's weight per step (``worker.actor.collapse_recovery``)."""
    recovery = config.worker.actor.collapse_recovery
    return core_algos.CollapseGate(
        enabled=recovery.enabled,
        coeff=recovery.coeff,
        all_equal_share=recovery.all_equal_share,
        patience=recovery.patience,
        solved_score=recovery.solved_score,
    )


def build_kl_step_control(config: PPOConfig) -> core_algos.KLStepControl:
    """The learning rate's scale per step (``worker.actor.kl_step_control``)."""
    control = config.worker.actor.kl_step_control
    return core_algos.KLStepControl(
        enabled=control.enabled,
        target_kl=control.target_kl,
        factor=control.factor,
        min_scale=control.min_scale,
    )


def local_cluster_cpus(config: PPOConfig) -> int:
    """Logical CPUs of a local Ray cluster: enough for every worker, even on a 2-core machine (the
    workers size their own thread pools; Ray's CPU count only gates scheduling). One training process
    per device holds every model role, the critic's included; a judge mmrl serves has CPUs of its own."""
    rollout = config.worker.rollout
    processes = config.trainer.world_size + (rollout.num_workers if rollout.separate else 0)
    workers = processes * max(1.0, config.trainer.cpus_per_worker or 1.0)
    rewards = config.worker.reward.num_workers * config.worker.reward.num_cpus
    judge = config.worker.reward.judge
    served_judge = judge.serve.num_cpus if judge.enable and judge.serve.model_path else 0.0
    return max(os.cpu_count() or 1, math.ceil(workers + rewards + served_judge + 1))


def placement_line(node_ids: list[str]) -> str:
    """Which Ray node each training rank runs on, as the ranks reported it (short node ids)."""
    ranks = ", ".join(f"rank {rank}: {node_id[:12]}" for rank, node_id in enumerate(node_ids))
    return f"mmrl: {len(node_ids)} training ranks on {len(set(node_ids))} Ray node(s) ({ranks})"


def load_tokenizer(config: PPOConfig) -> tuple[Any, Any]:
    """The actor model's tokenizer and processor (None for a text-only model), with
    ``data.override_chat_template`` applied."""
    model = config.worker.actor.model
    return load_tokenizer_and_processor(
        model.tokenizer_or_model_path,
        model.trust_remote_code,
        key=model.tokenizer_key,
        chat_template_file=config.data.override_chat_template,
    )


def build_loaders(
    config: PPOConfig, tokenizer: Any, processor: Any, collate: Callable[[list[dict[str, Any]]], DataProto]
) -> tuple[PromptLoader, PromptLoader | None]:
    """The training prompts' loader and the validation prompts' (None without ``data.val_files``)."""
    data = config.data
    tools = tool_schemas(config.worker.rollout.multi_turn)  # None unless multi-turn with tools
    train_set = PromptDataset(data.train_files, tokenizer, processor, data, tools=tools)
    train_loader = PromptLoader(
        train_set,
        prompts_per_round(config),
        collate,
        data.shuffle,
        data.seed,
        num_workers=data.dataloader_num_workers,
    )
    if not data.val_files:
        return train_loader, None
    val_set = PromptDataset(data.val_files, tokenizer, processor, data, tools=tools)
    val_batch = len(val_set) if data.val_batch_size == -1 else data.val_batch_size
    return train_loader, PromptLoader(val_set, val_batch, collate, shuffle=False, drop_last=False)


def start_judge_server(config: PPOConfig) -> ServedJudge | None:
    """The judge model mmrl serves itself (``worker.reward.judge.serve``), when the judge is on and
    names a model to serve."""
    from mmrl.rewards.judge_server import serve_judge

    judge = config.worker.reward.judge
    return serve_judge(judge) if judge.enable else None


def start_reward_workers(
    config: PPOConfig, tokenizer: Any, judge_server: ServedJudge | None, transfers: TransferCounter
) -> RewardWorkers:
    """The reward worker processes of ``worker.reward``; ``tokenizer`` decodes the responses they score."""
    from mmrl.workers.reward_worker import RewardWorkers

    return RewardWorkers(
        config,
        tokenizer,
        transfers,
        judge_url=judge_server.base_url if judge_server else None,
        judge_model=judge_server.model if judge_server else None,
    )


def plan_cluster_placement(config: PPOConfig) -> Placement:
    """GPUs or CPUs, and CPUs and threads per training process, from the Ray cluster's resources (not
    this machine's), less what the reward workers and a served judge take."""
    from mmrl.single_controller import alive_node_resources

    reward = config.worker.reward
    served = reward.judge.serve if reward.judge.enable and reward.judge.serve.model_path else None
    placement = plan_placement(
        config.trainer,
        reward_cpus=reward.num_workers * reward.num_cpus + (served.num_cpus if served else 0.0),
        nodes=alive_node_resources(),
        reward_gpus=reward.num_workers * reward.num_gpus + (served.num_gpus if served else 0.0),
        rollout_workers=config.worker.rollout.num_workers if config.worker.rollout.separate else 0,
    )
    if placement.note:
        print(placement.note, flush=True)
    return placement


def start_model_processes(
    config: PPOConfig, placement: Placement, transfers: TransferCounter
) -> RayWorkerGroup[HybridWorker]:
    """One process per device, each to hold every model role (actor, ref, rollout, critic): started
    and importing now, built by ``RayWorkerGroup.start`` once the driver knows the step count. The
    critic's phases split their rows by its own sequence-parallel size."""
    from mmrl.single_controller import RayWorkerGroup, ResourcePool

    trainer = config.trainer
    pool = ResourcePool(
        trainer.nnodes, trainer.n_gpus_per_node, placement.use_gpu, cpus_per_proc=placement.cpus_per_worker
    )
    return RayWorkerGroup(
        HybridWorker,
        pool,
        name_prefix="model",
        start=False,
        sequence_parallel_size=config.worker.actor.sequence_parallel_size,
        role_sequence_parallel_sizes=(
            {"critic": config.worker.critic.sequence_parallel_size} if config.use_critic else {}
        ),
        transfers=transfers,
    )


def build_kl_controller(config: PPOConfig) -> core_algos.FixedKLController | core_algos.AdaptiveKLController:
    """The KL penalty's coefficient per step (``algorithm.kl_*``): fixed or adaptive."""
    algo = config.algorithm
    return core_algos.build_kl_controller(algo.kl_type, algo.kl_coef, algo.kl_target, algo.kl_horizon)


class RayPPOTrainer:
    """Builds datasets, worker groups, reward workers, loggers and checkpoints from ``config``; with a
    ``stage`` of a multi-stage schedule (:mod:`mmrl.trainer.stages`), its config is the stage's, the
    learning-rate schedule spans the whole schedule and the stage shows in metrics and progress line."""

    def __init__(self, config: PPOConfig, stage: Stage | None = None):
        from mmrl.single_controller import TransferCounter

        self.config = config
        self.stage = stage
        self.transfers = TransferCounter()  # bytes through Ray's object store, logged per step
        # Processes first: the training ranks start (and import torch and transformers) while this
        # process loads the tokenizer and reads the datasets. The reward workers start in a second
        # (they import neither) and decode nothing: they are handed the responses as text.
        self.judge_server = start_judge_server(config)
        placement = plan_cluster_placement(config)
        self.model_workers = start_model_processes(config, placement, self.transfers)
        # worker.rollout.placement=separate: the engines' own processes; None: in the training processes
        self.separate = (
            RolloutWorkers(config, placement, self.transfers) if config.worker.rollout.separate else None
        )
        self.tokenizer, processor = load_tokenizer(config)
        self.rewards = start_reward_workers(config, self.tokenizer, self.judge_server, self.transfers)
        self.train_loader, self.val_loader = build_loaders(config, self.tokenizer, processor, self._collate)
        self.total_steps = total_training_steps(config, len(self.train_loader.dataset))
        self.filter = build_filter(config)  # None: one generation per step, no filtering
        self.policy_version = 0  # actor updates so far: the version of the weights in the engines
        self._build_model_workers(placement)
        self.kl_ctrl = build_kl_controller(config)
        self.entropy_ctrl = build_entropy_controller(config)
        self.collapse, self.group_counts = build_collapse_gate(config), [0, 0, 0]  # (all-equal, all, solved)
        self.step_size = build_kl_step_control(config)
        self.checkpoints = CheckpointLayout(config.trainer.checkpoint_dir, config.trainer.save_limit)
        self.global_step = 0
        self.rollouts = RolloutSchedule(ahead=config.trainer.async_mode == "one_step_off")
        # trainer.async_mode=stream: the rollout workers generate all the time; None otherwise
        self.stream = (
            StreamedRollouts(
                config,
                self.separate,
                self._share_media,
                self.tokenizer.pad_token_id,
                self.rewards,
                self.filter,
            )
            if config.trainer.streams and self.separate is not None
            else None
        )
        self.tracker = None

    def _build_model_workers(self, placement: Placement) -> None:
        """Build every rank's :class:`HybridWorker` in the processes :func:`start_model_processes` started."""
        self.model_workers.start(
            kwargs={
                "config": self.config,
                # the learning-rate schedule spans a multi-stage schedule's steps, not only this stage's
                "total_training_steps": self.total_steps if self.stage is None else self.stage.schedule_steps,
                "cpu_threads": placement.worker_threads,
            }
        )
        print(placement_line(self.model_workers.node_ids), flush=True)
        if self.separate is not None:
            self.separate.start(self.config, placement.worker_threads)
            print(
                f"mmrl: {self.separate.group.world_size} rollout worker(s) of their own (worker.rollout.placement=separate)",
                flush=True,
            )
            self.separate.connect(self.model_workers)
            self._push_weights()  # the engines loaded the model's files; the actor's weights may differ (LoRA)

    def _collate(self, items: list[dict[str, Any]]) -> DataProto:
        return collate_prompts(items, self.tokenizer.pad_token_id)

    def _share_media(self, batch: DataProto) -> DataProto:
        """Each prompt's compact media put in Ray's object store once; the batch carries the refs, so no
        dispatch ships media, and the workers process them where the model runs. (Here and not in
        ``_collate``, which may run in dataloader processes outside Ray.)"""
        from mmrl.single_controller import put_media

        return put_media(batch, self.transfers)

    # ---- the loop -------------------------------------------------------------------------------

    def fit(self) -> dict[str, float]:
        """Train to ``total_steps``; returns the last step's metrics."""
        self.resume()
        self.tracker = self._build_tracker()
        last_metrics: dict[str, float] = {}
        trainer = self.config.trainer
        if self.val_loader is not None and (trainer.val_before_train or trainer.val_only):
            last_metrics = self.validate()
            self.tracker.log(last_metrics, self.global_step)
        if trainer.val_only:  # validated above whatever val_before_train says; no step, no checkpoint
            return last_metrics
        batches = self._training_batches()
        while self.global_step < self.total_steps:
            metrics = self.train_step(batches)
            self.global_step += 1
            if self.stage is not None:
                metrics["trainer/stage"] = self.stage.index + 1
            if self._due(self.config.trainer.val_freq) or self.global_step == self.total_steps:
                metrics.update(self.validate() if self.val_loader is not None else {})
            self.tracker.log(metrics, self.global_step)
            if self._checkpoint_after(self.global_step):
                self.save_checkpoint(metrics.get(VAL_METRIC))
            last_metrics = metrics
        return last_metrics

    def train_step(self, prompts: Iterator[DataProto]) -> dict[str, float]:
        """One PPO step on the next batch of ``prompts``; returns its metrics."""
        plan = StepPlan.for_step(self.config, self.global_step)
        timings: dict[str, float] = {}
        self.group_counts = [0, 0, 0]
        transferred = self.transfers.snapshot()
        with timer("step", timings):
            with timer("gen", timings):
                if self.stream is not None:
                    rollout = self._streamed_batch(prompts)
                else:
                    rollout = self.rollouts.take(
                        self.global_step,
                        lambda step: self.start_batch(prompts, step),
                        self._next_step_trains(),
                    )
                batch, collect_scores = rollout.batch, rollout.collect_scores
                rollout_metrics = {**rollout.metrics, **self._staleness(rollout)}
                # ReMax: the greedy responses too, before a training phase puts the engine to sleep
                collect_baselines = self._greedy_baselines(batch) if plan.greedy_baseline else None
            # rank chunks of equal token counts, not only equal row counts; rows keep their uid
            batch, restore = balance_batch(batch, self.actor_dp_size)
            trained_from = time.time()  # the training passes begin (a generation ahead may overlap them)
            batch = self.compute_log_probs(batch, plan, timings)
            with timer("reward", timings):
                scores = collect_scores().reorder(np.argsort(restore))  # balanced order
                batch = batch.union(
                    scores.select(batch_keys=["token_level_scores"], non_tensor_keys=["reward_scores"])
                )
                if collect_baselines is not None:
                    batch = batch.union(collect_baselines(batch))
            if self.filter is None:  # dynamic sampling counted every round's groups as it went
                self._count_groups(batch)
            self.collapse.observe(*self.group_counts)  # decides this step's recovery weight
            with timer("adv", timings):
                batch, kl_metrics = self.compute_advantages(batch)
            batch, update_metrics = self.update_models(batch, plan, timings, trained_from)
        conform_to_columns(batch, "the training step")
        return {
            **rollout_metrics,
            # the groups this update learnt nothing from; dynamic sampling drives it to 0
            "rollout/zero_adv_group_frac": zero_advantage_group_fraction(
                batch.batch["advantages"], batch.batch["response_mask"], batch.non_tensor_batch["uid"]
            ),
            **compute_data_metrics(batch, self.config.use_critic, self.config.data.max_response_length),
            **reduce_reward_metrics(list(batch.non_tensor_batch["reward_scores"])),
            **self.rewards.take_metrics(),  # each source's seconds, when there are several
            **compute_timing_metrics(timings, self._token_counts(batch), self.model_workers.world_size),
            **kl_metrics,
            **update_metrics,
            "data/skipped_samples": self.train_loader.dataset.num_skipped,
            "data/filtered_prompts": self.train_loader.dataset.num_filtered,
            "actor/entropy_rollout": float(
                core_algos.masked_mean(batch.batch["entropies"], batch.batch["response_mask"])
            ),
            **self._rollout_gap(batch),
            **self._steer_entropy(batch),
            **self.collapse.metrics(),
            **saturation_metrics(batch),
            **{f"transfer/{kind}_bytes": size for kind, size in self.transfers.since(transferred).items()},
            **self._memory_peaks(),  # after the byte count: the call's own bytes are not the step's
            **self._rollout_counters(),
        }

    # ---- phases ---------------------------------------------------------------------------------

    def start_batch(self, prompts: Iterator[DataProto], step: int) -> Callable[[], Rollout]:
        """Start the rollout of step ``step`` (0-based); the returned function waits for it: the
        responses (generation order), a function returning their scores, and the rollout's metrics.
        Without online filtering one batch is generated and scored in the background while the log-prob
        passes run (on rollout workers of their own the generation runs on, and a thread of the driver
        launches its rewards as it ends); with it, :meth:`_filtered_rollout` generates and scores as it
        goes, before returning."""
        fault_point("rollout", step + 1)
        version = self.policy_version
        if self.filter is not None:
            batch, scores, metrics = self._filtered_rollout(prompts, self.filter, step)
            filtered = Rollout(batch, lambda: scores, metrics, version)
            return lambda: filtered
        generation = self._start_generation(next(prompts), round_index=0, step=step)
        fault_point("generating", step + 1)  # one step off: started during the step before, pre-update

        def finish() -> Rollout:
            batch, window = generation()
            pending = self.rewards.launch(batch)  # scored in the background, in generation order
            launched = time.time()
            metrics = {
                "rollout/generated_responses": len(batch),
                "rollout/generated_response_tokens": int(batch.batch["response_mask"].sum()),
            }
            return Rollout(batch, lambda: self.rewards.collect(pending), metrics, version, window, launched)

        if self.separate is not None:  # its rewards start the moment the rollout workers end it
            return in_background(finish)
        done = finish()  # colocated: generated already; its rewards start now
        return lambda: done

    def _streamed_batch(self, prompts: Iterator[DataProto]) -> Rollout:
        """The step's groups from the stream (``trainer.async_mode=stream``), scored in the background
        since they arrived (with online filtering, scored already), and with online filtering the
        groups the step's filter saw counted for the collapse gate (as the rounds of a synchronous step
        are)."""
        # the horizon is the whole schedule's: prompts in flight at a stage's end are generated again by
        # the next stage, from the checkpoint's record of them
        last_step = self.total_steps if self.stage is None else self.stage.schedule_steps
        batch, collect_scores, metrics, group_counts = self.stream.take(
            prompts, self.train_loader.state_dict, self.policy_version, last_step - self.global_step
        )
        conform_to_columns(batch, "generate")
        if self.filter is not None:
            self.group_counts = list(group_counts)
        return Rollout(batch, collect_scores, metrics, self.policy_version)

    def _filtered_rollout(
        self, prompts: Iterator[DataProto], options: FilterOptions, step: int
    ) -> tuple[DataProto, DataProto, dict[str, float]]:
        """DAPO dynamic sampling: generate and score a mini-batch of prompts a round, keep the groups
        :func:`kept_groups` accepts, until ``options.groups_per_step`` are kept; returns exactly that
        many groups (the first kept, in generation order) with their scores. After
        ``options.max_rounds`` rounds, raises :class:`DynamicSamplingError` or, with
        ``options.train_unfilled``, tops the step up with the groups it dropped: first those that
        failed (mean score below the filter's lower bound, :func:`failed_groups`: the policy is wrong
        there, where an entropy bonus and the KL loss may move it), then the others (all right, or all
        alike in between), whose rows the update leaves out of its loss (``left_out`` 1): a group the
        policy already gets right teaches nothing, and its KL and entropy terms alone would pull a
        solved policy back towards its reference. With filtering on the batch always carries
        ``left_out`` (0 on every row of a filled step)."""
        parts: dict[str, list[tuple[DataProto, DataProto]]] = {"kept": [], "failed": [], "other": []}
        kept = dropped = responses = response_tokens = 0
        for round_index in itertools.count():
            if kept >= options.groups_per_step:
                break
            if not options.may_start(round_index):
                if not options.train_unfilled:
                    raise DynamicSamplingError(options.give_up_message(round_index, kept, kept + dropped))
                logger.warning(options.top_up_message(round_index, kept))
                break
            batch = self._generate(next(prompts), round_index, step)
            scores = self.rewards.collect(self.rewards.launch(batch))
            self._count_groups(batch.union(scores.select(batch_keys=["token_level_scores"])))
            uids = batch.non_tensor_batch["uid"]
            values = filter_scores(scores.non_tensor_batch["reward_scores"], options.key)
            keep = kept_groups(uids, values, options.low, options.high)
            failed = ~keep & failed_groups(uids, values, options.low)
            groups, kept_here = len(set(uids)), len(set(uids[keep]))
            kept, dropped = kept + kept_here, dropped + groups - kept_here
            responses += len(batch)
            response_tokens += int(batch.batch["response_mask"].sum())
            masks = {"kept": keep, "failed": failed, "other": ~keep & ~failed}
            for name in parts if options.train_unfilled else ("kept",):
                rows = np.flatnonzero(masks[name])
                parts[name].append((batch[rows], scores[rows]))
        # the dropped ones only reach the step when it is not full: failed first, the others left out
        ordered = [(part, name == "other") for name in parts for part in parts[name]]
        # rounds are loader batches of their own, their prompts padded to their own widths
        batch = concat_batches([part[0] for part, _ in ordered], self.tokenizer.pad_token_id)
        scores = DataProto.concat([part[1] for part, _ in ordered])
        left_out = torch.cat(
            [torch.full((len(part[0]),), int(out), dtype=torch.long) for part, out in ordered]
        )
        batch.batch["left_out"] = left_out
        rows = first_groups(batch.non_tensor_batch["uid"], options.groups_per_step)
        step_left_out = left_out[rows]
        metrics = {
            "rollout/kept_groups": min(kept, options.groups_per_step),
            # dropped = failed the filter + passed it after the step was full (surplus, trimmed away)
            "rollout/dropped_groups": dropped + max(kept - options.groups_per_step, 0),
            "rollout/surplus_groups": max(kept - options.groups_per_step, 0),
            "rollout/unfilled_groups": max(options.groups_per_step - kept, 0),  # topped up with dropped ones
            # of those, the groups left out of the loss (not failed: all right, or all alike in between)
            "rollout/left_out_groups": len(
                set(batch.non_tensor_batch["uid"][rows][step_left_out.numpy() == 1])
            ),
            "rollout/rounds": round_index,
            "rollout/generated_responses": responses,
            "rollout/generated_response_tokens": response_tokens,
        }
        return batch[rows], scores[rows], metrics

    def _generate(self, prompts: DataProto, round_index: int, step: int) -> DataProto:
        """Training responses for ``prompts`` of step ``step`` (its sampling stream, whichever step
        generates them); ``round_index`` gives each round of a step its own stream."""
        return self._start_generation(prompts, round_index, step)()[0]

    def _start_generation(
        self, prompts: DataProto, round_index: int, step: int
    ) -> Callable[[], tuple[DataProto, tuple[float, float] | None]]:
        """:meth:`_generate`, started: the returned function waits for the responses and the window in
        which rollout workers of their own generated them (None colocated, where the generation is done
        when this returns)."""
        generation = self._dispatch_generate(
            self._share_media(prompts), mode=GenerationMode.TRAIN, global_step=step, round_index=round_index
        )

        def finish() -> tuple[DataProto, tuple[float, float] | None]:
            batch = generation()
            window = generation_window(batch)
            conform_to_columns(batch, "generate")
            return batch, window

        return finish

    def _dispatch_generate(self, prompts: DataProto, **kwargs: Any) -> Callable[[], DataProto]:
        """``generate(prompts, **kwargs)`` on the engines: started on rollout workers of their own (the
        returned function waits for it), done in the training processes when colocated."""
        if self.separate is not None:
            return self.separate.start_generation(prompts, **kwargs)
        output = self.model_workers.dispatch(HybridWorker.generate, prompts, **kwargs)
        return lambda: output

    def _push_weights(self) -> dict[str, float]:
        """The actor's weights into the rollout engines: in the training processes, or pushed to rollout
        workers of their own (``transfer/weight_push_bytes``)."""
        if self.separate is None:
            self.model_workers.call(HybridWorker.sync_rollout_weights)
            return {}
        return self.separate.push(self.model_workers, self.policy_version)

    def _settle_ahead(self, trained_from: float, timings: dict[str, float]) -> dict[str, float]:
        """Rollout workers of their own: wait for the generation started ahead (it must not see the
        weights pushed next) and measure how long it ran (``timing_s/gen_ahead``), how much of that
        while this step's passes did (``timing_s/gen_overlap``), and how long its rewards had been
        scoring by then (``timing_s/reward_lead``)."""
        with timer("gen_wait", timings):
            ahead = self.rollouts.settle()
        window = ahead.generated if ahead is not None else None
        scored_from = ahead.scored_from if ahead is not None else None
        settled = time.time()
        return {
            "timing_s/gen_ahead": window[1] - window[0] if window is not None else 0.0,
            "timing_s/gen_overlap": overlap_s(window, trained_from, settled),
            # how long its rewards had been scoring when the step settled it (they start as it ends)
            "timing_s/reward_lead": settled - scored_from if scored_from is not None else 0.0,
        }

    def compute_log_probs(self, batch: DataProto, plan: StepPlan, timings: dict[str, float]) -> DataProto:
        """``batch`` with the passes ``plan`` asks for: old log-probs (unless the update computes them,
        on policy), reference log-probs and the critic's values."""
        workers = self.model_workers
        if not plan.old_log_probs_from_update:
            with timer("old_log_prob", timings):
                old = workers.dispatch(HybridWorker.compute_log_probs, batch, temperature=plan.temperature)
                batch = batch.union(old)
        if plan.use_reference:
            with timer("ref_log_prob", timings):
                ref = workers.dispatch(
                    HybridWorker.compute_ref_log_probs, batch, temperature=plan.temperature
                )
                batch = batch.union(ref)
        if plan.use_critic:
            with timer("values", timings):
                batch = batch.union(workers.dispatch(HybridWorker.compute_values, batch))
        return batch

    def compute_advantages(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        algo, tensors = self.config.algorithm, batch.batch
        metrics: dict[str, float] = {}
        rewards = tensors["token_level_scores"]
        if algo.use_reference and not algo.use_kl_loss:
            rewards, mean_kl = core_algos.apply_kl_penalty(
                rewards,
                tensors["old_log_probs"],
                tensors["ref_log_probs"],
                tensors["response_mask"],
                self.kl_ctrl.value,
                algo.kl_penalty,
            )
            metrics = {"critic/kl": float(mean_kl), "critic/kl_coef": self.kl_ctrl.value}
            self.kl_ctrl.update(float(mean_kl), n_steps=len(batch))
        estimator = core_algos.get_adv_estimator(algo.adv_estimator)
        advantages, returns = estimator(
            rewards,
            tensors["response_mask"],
            index=batch.non_tensor_batch["uid"],
            values=tensors["values"] if "values" in tensors.keys() else None,
            reward_baselines=tensors["reward_baselines"] if "reward_baselines" in tensors.keys() else None,
            gamma=algo.gamma,
            lam=algo.lam,
            norm_adv_by_std=algo.norm_adv_by_std,
        )
        added = {"token_level_rewards": rewards, "advantages": advantages, "returns": returns}
        return batch.union(DataProto.from_dict(tensors=added)), metrics

    @property
    def actor_dp_size(self) -> int:
        """Data-parallel shares of the actor's (and ref's) passes: ranks / sequence-parallel size."""
        return self.config.trainer.world_size // self.config.worker.actor.sequence_parallel_size

    def update_models(
        self, batch: DataProto, plan: StepPlan, timings: dict[str, float], trained_from: float
    ) -> tuple[DataProto, dict[str, float]]:
        """Critic, then actor updates, then the new weights into the rollout; ``batch`` gains the
        on-policy update's ``old_log_probs`` and ``entropies`` when it computed them (for the metrics).
        ``trained_from``: when the step's training passes began (time.time)."""
        metrics: dict[str, float] = {}
        if plan.use_critic:
            with timer("update_critic", timings):
                update = self.model_workers.dispatch(HybridWorker.update_critic, batch)
                metrics.update(self._worker_metrics(update))
        if plan.update_actor:
            with timer("update_actor", timings):
                update = self.model_workers.dispatch(
                    HybridWorker.update_actor,
                    loss_rows(batch),
                    temperature=plan.temperature,
                    on_policy=plan.old_log_probs_from_update,
                    entropy_coeff=self.entropy_ctrl.coefficient,
                    spread_coeff=self.collapse.coefficient,
                    lr_scale=self.step_size.scale,
                )
                metrics.update(self._worker_metrics(update))
            metrics.update(self.step_size.metrics())  # the scale this update trained with ...
            self.step_size.update(metrics.get("actor/ppo_kl_k3", float("nan")))  # ... and the next one's
            self.policy_version += 1
            if plan.old_log_probs_from_update:
                batch = batch.union(update.select(batch_keys=["old_log_probs", "entropies"]))
            if self.separate is not None:
                metrics.update(self._settle_ahead(trained_from, timings))
            with timer("sync", timings):
                fault_point("sync", self.global_step + 1)
                metrics.update(self._push_weights())
        return batch, metrics

    def _greedy_baselines(self, batch: DataProto) -> Callable[[DataProto], DataProto]:
        """ReMax: generates each prompt's greedy response and scores it in the background; returns a
        function giving a batch (any row order) the reward of its prompt's greedy response, by uid."""
        uids = batch.non_tensor_batch["uid"]
        first_rows = sorted({uid: row for row, uid in reversed(list(enumerate(uids)))}.values())
        prompts = batch[first_rows].select(
            batch_keys=["input_ids", "attention_mask"]
            + (["mm_token_type_ids"] if "mm_token_type_ids" in batch.batch.keys() else [])
        )
        prompts = DataProto.from_dict(
            tensors={k: v[:, : batch.batch["prompts"].shape[-1]] for k, v in prompts.batch.items()},
            non_tensors={k: v[first_rows] for k, v in batch.non_tensor_batch.items() if k != "reward_scores"},
        )
        greedy = self._dispatch_generate(prompts, mode=GenerationMode.GREEDY, global_step=self.global_step)()
        generation_window(greedy)
        pending = self.rewards.launch(greedy)

        def collect(rows: DataProto) -> DataProto:
            scores = self.rewards.collect(pending).batch["token_level_scores"].sum(-1)
            baseline_of = dict(zip(greedy.non_tensor_batch["uid"], scores.tolist()))
            baselines = [baseline_of[uid] for uid in rows.non_tensor_batch["uid"]]
            return DataProto.from_dict(
                tensors={"reward_baselines": torch.tensor(baselines, dtype=torch.float32)}
            )

        return collect

    def validate(self) -> dict[str, float]:
        """Generate for every validation prompt (validation sampling) and score; means per data source."""
        scores, sources, samples, records = [], [], [], []
        for batch in self._validation_batches():
            prompts = self._share_media(batch)
            output = self._dispatch_generate(
                prompts, mode=GenerationMode.VALIDATE, global_step=self.global_step
            )()
            generation_window(output)  # not a training batch: its window is not measured
            scored = self.rewards.collect(self.rewards.launch(output))
            scores.extend(scored.non_tensor_batch["reward_scores"])
            sources.extend(
                output.non_tensor_batch.get("data_source", np.full(len(output), "data", dtype=object))
            )
            samples.extend(self._generation_samples(output, scored))
            records.extend(output.non_tensor_batch.get("trajectory", ()))
        metrics = {f"val/{key}": value for key, value in reduce_reward_metrics(scores).items()}
        # multi-turn: the validation trajectories' turns, tool calls and stops (val/agent/...)
        metrics.update({f"val/{key}": value for key, value in trajectory_metrics(records).items()})
        for source in sorted(set(sources)):
            picked = [score["overall"] for score, s in zip(scores, sources) if s == source]
            metrics[f"val/{source}/overall"] = float(np.mean(picked))
        if self.config.trainer.val_generations_to_log and self.tracker is not None:
            self.tracker.log_generations(
                samples[: self.config.trainer.val_generations_to_log], self.global_step
            )
        return metrics

    # ---- checkpoints ----------------------------------------------------------------------------

    def save_checkpoint(self, val_metric: float | None = None) -> None:
        """Writes ``global_step_N.tmp`` and renames it; a failed write (full disk, unwritable folder)
        raises :class:`CheckpointSaveError`, leaving the last complete checkpoint and the tracker as they
        were (the ``.tmp`` folder is ignored on resume and removed by the next save)."""
        from mmrl.single_controller import WorkerGroupError

        previous = self.checkpoints.latest_step()
        try:
            self._write_checkpoint(val_metric)
        except (OSError, WorkerGroupError) as err:
            if isinstance(err, WorkerGroupError) and not isinstance(err.cause, OSError):
                raise  # a rank died or failed otherwise: not a write failure
            kept = (
                "No earlier checkpoint was complete."
                if previous is None
                else f"The last complete checkpoint ({self.checkpoints.step_dir(previous)}) is intact."
            )
            raise CheckpointSaveError(
                f"could not write the checkpoint of step {self.global_step} under "
                f"trainer.save_checkpoint_path={self.checkpoints.save_dir}: {err}\n{kept} Free disk space "
                "or make the folder writable, then resume with trainer.find_last_checkpoint=true."
            ) from err

    def _write_checkpoint(self, val_metric: float | None) -> None:
        tmp_dir = str(self.checkpoints.begin(self.global_step))
        per_rank = self.model_workers.call(
            HybridWorker.save_checkpoint, tmp_dir
        )  # {role: report}, the critic's too
        fault_point("checkpoint", self.global_step)  # the workers' part written, not yet committed
        reports = {role: [rank_reports[role] for rank_reports in per_rank] for role in per_rank[0]}
        parts = ["actor", "trainer_state.json"] + (["critic"] if self.config.use_critic else [])
        state = {
            "global_step": self.global_step,
            "loader": self.train_loader.state_dict(),
            "kl_coef": self.kl_ctrl.value,
            "entropy_ctrl": self.entropy_ctrl.state_dict(),
            "collapse": self.collapse.state_dict(),
            "step_size": self.step_size.state_dict(),
            "policy_version": self.policy_version,
        }
        if self.stream is not None:  # the loader resumes at the oldest prompt not trained (docs/async.md)
            stream = self.stream.state_dict(self.train_loader.state_dict())
            state["loader"], state["stream"] = stream.pop("loader"), stream
        save_trainer_state(tmp_dir, state)
        self.checkpoints.commit(
            self.global_step, parts, metric=val_metric, metric_name=VAL_METRIC, reports=reports
        )

    def resume(self) -> None:
        trainer = self.config.trainer
        path = trainer.load_checkpoint_path
        if path is None and trainer.find_last_checkpoint:
            path = find_last_checkpoint(trainer.checkpoint_dir)
        if path is None:
            return
        logger.warning("resuming from %s", path)
        from mmrl.checkpoint.safe_load import check_role_folder

        # a tampered file is refused here, with one message, rather than in every rank
        for role in ("actor", "critic"):
            if os.path.isdir(os.path.join(path, role)):
                check_role_folder(os.path.join(path, role))
        self.model_workers.call(HybridWorker.load_checkpoint, str(path))  # the critic's too
        state = load_trainer_state(path)
        self.global_step = state["global_step"]
        # checkpoints written before versions were counted: every step after the critic's warm-up updated
        self.policy_version = state.get(
            "policy_version", max(0, self.global_step - self.config.trainer.critic_warmup)
        )
        self._push_weights()
        self.train_loader.load_state_dict(state["loader"])
        if self.stream is not None and "stream" in state:
            self.stream.load_state_dict(state["stream"])
        self.kl_ctrl.value = state["kl_coef"]
        if "entropy_ctrl" in state:  # checkpoints written before the controller existed have none
            self.entropy_ctrl.load_state_dict(state["entropy_ctrl"])
        if "collapse" in state:
            self.collapse.load_state_dict(state["collapse"])
        if "step_size" in state:
            self.step_size.load_state_dict(state["step_size"])

    # ---- helpers --------------------------------------------------------------------------------

    def _build_tracker(self):
        trainer = self.config.trainer
        log_dir = os.path.join(trainer.checkpoint_dir, "logs")
        return build_loggers(
            trainer.logger,
            trainer.project_name,
            trainer.experiment_name,
            log_dir,
            asdict(self.config),
            self.total_steps,
            start_step=self.global_step,
            label=self.stage.label if self.stage is not None else "",
        )

    def _training_batches(self) -> Iterator[DataProto]:
        while True:
            yield from self.train_loader

    def _validation_batches(self) -> Iterator[DataProto]:
        self.val_loader.load_state_dict({"epoch": 0, "batch_index": 0})
        yield from self.val_loader

    def _due(self, frequency: int) -> bool:
        return frequency > 0 and self.global_step % frequency == 0

    def _checkpoint_after(self, steps_done: int) -> bool:
        """A checkpoint is written once ``steps_done`` steps are: every ``trainer.save_freq`` steps, and
        after the last one unless ``save_freq`` is 0."""
        save_freq = self.config.trainer.save_freq
        if steps_done == self.total_steps:
            return save_freq != 0
        return save_freq > 0 and steps_done % save_freq == 0

    def _next_step_trains(self) -> bool:
        """The step after this one runs in this trainer with no checkpoint before it: only then may its
        batch be generated ahead (a checkpoint holds no batch in flight, :mod:`mmrl.trainer.asynchrony`)."""
        steps_done = self.global_step + 1
        return steps_done < self.total_steps and not self._checkpoint_after(steps_done)

    def _staleness(self, rollout: Rollout) -> dict[str, float]:
        """Versions behind of the step's tokens when they train (``trainer.records_policy_versions``),
        after checking that the engines sampled with the version the driver had pushed."""
        trainer = self.config.trainer
        if not trainer.records_policy_versions:
            return {}
        if self.stream is None:
            check_versions(rollout)
            partial = {}
        else:  # a response may hold tokens of several versions (partial rollouts)
            check_stream_versions(rollout.batch, self.policy_version, trainer.max_staleness)
            partial = {"rollout/partial_response_frac": partial_response_fraction(rollout.batch)}
        batch = rollout.batch.batch
        return {
            **staleness_metrics(batch["policy_version"], batch["response_mask"], self.policy_version),
            **partial,
        }

    @staticmethod
    def _worker_metrics(output: DataProto) -> dict[str, float]:
        return {key: float(np.mean(values)) for key, values in output.meta_info.get("metrics", {}).items()}

    def _rollout_counters(self) -> dict[str, float]:
        """The workers' rollout counters since the last step, the largest over the ranks."""
        per_rank = self.model_workers.call(HybridWorker.take_rollout_counters)
        return {key: max(counters[key] for counters in per_rank) for key in per_rank[0]}

    def _memory_peaks(self) -> dict[str, float]:
        """Memory per phase since the last step over the ranks (GiB; mmrl.workers.memory): the largest
        peak (GPUs: tensors, and what torch reserved; CPUs: the resident set) and the smallest device
        free memory of any rank."""
        from mmrl.workers.memory import combine_rank_peaks

        return combine_rank_peaks(self.model_workers.call(HybridWorker.take_memory_peaks))

    @staticmethod
    def _token_counts(batch: DataProto) -> dict[str, int]:
        response_tokens = int(batch.batch["response_mask"].sum())
        all_tokens = int(batch.batch["attention_mask"].sum())
        return {
            "gen": response_tokens,
            "step": all_tokens,
            "update_actor": all_tokens,
            "old_log_prob": all_tokens,
        }

    def _steer_entropy(self, batch: DataProto) -> dict[str, float]:
        """The entropy coefficient this step trained with, then the controller's update with the step's
        token-mean entropy (the actor's measure, ``worker.actor.entropy_top_k``) for the next step."""
        metrics = self.entropy_ctrl.metrics()
        entropy = core_algos.masked_mean(batch.batch["entropies"], batch.batch["response_mask"])
        self.entropy_ctrl.update(float(entropy))
        return metrics

    def _count_groups(self, batch: DataProto) -> None:
        """Add ``batch``'s groups, those whose responses all got the same score and those of them solved,
        to the step's counts (the collapse gate's input)."""
        scores = batch.batch["token_level_scores"].sum(-1).float().cpu().numpy()
        counts = core_algos.all_equal_groups(
            batch.non_tensor_batch["uid"], scores, self.collapse.solved_score
        )
        self.group_counts = [total + count for total, count in zip(self.group_counts, counts)]

    @staticmethod
    def _rollout_gap(batch: DataProto) -> dict[str, float]:
        """|rollout − trainer| log-prob gap of the sampled tokens: the two engines should agree."""
        if "rollout_log_probs" not in batch.batch.keys():
            return {}
        mask = batch.batch["response_mask"].bool()
        gap = (batch.batch["rollout_log_probs"] - batch.batch["old_log_probs"]).abs()[mask]
        return {"rollout/log_prob_gap_mean": float(gap.mean()), "rollout/log_prob_gap_max": float(gap.max())}

    def _generation_samples(self, output: DataProto, scored: DataProto) -> list[dict[str, Any]]:
        prompts = self.tokenizer.batch_decode(output.batch["prompts"], skip_special_tokens=True)
        truths = output.non_tensor_batch.get("ground_truth", [None] * len(output))
        samples = [
            {"prompt": prompt, "response": response, "ground_truth": truth, "score": score["overall"]}
            for prompt, response, truth, score in zip(
                prompts,
                scored.non_tensor_batch["response_text"],
                truths,
                scored.non_tensor_batch["reward_scores"],
            )
        ]
        if "trajectory" in output.non_tensor_batch:  # multi-turn: the turns, calls and returned media
            for sample, record in zip(samples, output.non_tensor_batch["trajectory"]):
                sample["trajectory"] = trajectory_log(record)
        return samples

    def stop_workers(self) -> None:
        """Stop the reward workers and the judge server (the training ranks go with the Ray cluster, or,
        between the stages of a schedule, here)."""
        self.rewards.shutdown()
        if self.stage is not None:  # the next stage builds workers of its own
            self.model_workers.shutdown()
            if self.separate is not None:
                self.separate.shutdown()
        if self.judge_server is not None:
            self.judge_server.stop()

    def finish_tracking(self, failed: bool = False) -> None:
        """Close the loggers; ``failed``: training stopped with an error, marked where a tracker can
        show it (wandb, MLflow) and in the console's last line."""
        if self.tracker is not None:
            self.tracker.finish(failed)

    def shutdown(self, failed: bool = False) -> None:
        self.finish_tracking(failed)
        self.stop_workers()


def planned_runs(config: PPOConfig) -> list[tuple[PPOConfig, Stage | None]]:
    """``(config, stage)`` of each trainer the run starts: one, or the stages of ``trainer.stages``
    from the one the newest checkpoint falls in."""
    stages = plan_stages(config)
    if not stages:
        return [(config, None)]
    trainer = config.trainer
    latest = CheckpointLayout(trainer.checkpoint_dir).latest_step() if trainer.find_last_checkpoint else None
    return [(stage.config, stage) for stage in stages[first_stage_to_run(stages, latest) :]]


def run(config: PPOConfig) -> int:
    """Start Ray, train (every stage of ``trainer.stages`` in turn), and turn worker or reward failures
    into a message and exit code 1."""
    import ray

    from mmrl.runtime.debris import clean_stale_debris
    from mmrl.single_controller import WorkerGroupError, init_ray

    clean_stale_debris()  # what killed runs left (shared memory, Ray sessions, temp folders)
    ray_cfg = config.trainer.ray
    init_ray(
        address=ray_cfg.address,
        num_cpus=ray_cfg.num_cpus or local_cluster_cpus(config),
        include_dashboard=ray_cfg.include_dashboard,
        object_store_memory_bytes=ray_cfg.object_store_memory_bytes,
    )
    runs, stopped = planned_runs(config), None
    for index, (run_config, stage) in enumerate(runs):
        if stage is not None:
            print(stage.describe(), flush=True)
        trainer = RayPPOTrainer(run_config, stage)
        failed = True  # until fit returns: any exception, caught here or by main, fails the run
        try:
            trainer.fit()
            failed = False
        except (
            WorkerGroupError,
            RewardFunctionError,
            RewardSourceError,
            DynamicSamplingError,
            CheckpointSaveError,
        ) as err:
            stopped = err
        finally:
            try:
                trainer.stop_workers()
            finally:
                # Ray prints the log lines its deduplication held back ("... [repeated 4x across
                # cluster]") when the driver leaves it: leaving first keeps them above the loggers' and
                # mmrl's last lines
                if failed or index == len(runs) - 1:
                    ray.shutdown()
                trainer.finish_tracking(failed)
        if failed:
            break
    if stopped is not None:
        print(f"mmrl: training stopped: {stopped}", file=sys.stderr, flush=True)
        return 1
    return 0
