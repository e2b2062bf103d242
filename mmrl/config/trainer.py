"""The ``trainer`` section: the run's length, processes, validation, checkpoints, loggers, stages and Ray;
its ``check`` beside its fields."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmrl.config.schema import PPOConfig


@dataclass(frozen=True)
class RayConfig:
    address: str | None = None  # existing cluster (`auto` after `ray start`); null = start a local one
    num_cpus: int | None = None  # CPUs of a local cluster; null = all
    include_dashboard: bool = False  # the dashboard costs ~0.7 GB of memory
    object_store_memory_bytes: int | None = 2_000_000_000  # local object store size


LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "swanlab")


@dataclass(frozen=True)
class StageConfig:
    """One stage of a multi-stage schedule (``trainer.stages``): the run's config with ``overrides``,
    for ``steps`` steps, continuing from the previous stage's last checkpoint."""

    name: str = ""  # shown on the progress line and in the logs; empty = its number
    steps: int = 0  # training steps of this stage (> 0)
    # key=value overrides of this stage, written as on the command line, e.g.
    # [data.max_response_length=16384, worker.rollout.n=16, worker.actor.optim.lr=5.0e-7]
    overrides: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TrainerConfig:
    total_epochs: int = 15  # passes over the training prompts
    max_steps: int | None = None  # stop after this many steps (overrides total_epochs when smaller)
    project_name: str = "mmrl"  # logger project
    experiment_name: str = "demo"  # logger run name
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # any of LOGGERS
    nnodes: int = 1  # machines
    n_gpus_per_node: int = 8  # training processes per machine (GPUs; CPU processes on a CPU machine)
    device: str = "auto"  # auto (GPUs when the Ray cluster has any) | cuda | cpu
    # CPUs Ray reserves per training process, also its torch threads (media decoding and processing);
    # null = on GPU nodes the node's CPUs (less the reward workers') shared by its processes, 0.5 on CPUs
    cpus_per_worker: float | None = None
    seed: int = 1  # seed of model init, dropout and sampling RNGs
    critic_warmup: int = 0  # steps that update the critic only
    val_freq: int = -1  # validate every this many steps; -1 = never during training
    val_before_train: bool = True  # validate once before the first step
    val_only: bool = False  # validate and exit
    val_generations_to_log: int = 0  # sample generations written to the loggers per validation
    save_freq: int = -1  # checkpoint every this many steps and at the end; -1 = only at the end; 0 = never
    save_limit: int = -1  # keep at most this many checkpoints; -1 = all
    save_checkpoint_path: str | None = None  # null = checkpoints/<project_name>/<experiment_name>
    load_checkpoint_path: str | None = None  # a global_step_N folder to resume from
    find_last_checkpoint: bool = True  # resume from the latest checkpoint under save_checkpoint_path
    # online_filtering: generation rounds a step may take to fill its batch; -1 = no limit
    max_try_make_batch: int = 20
    # multi-stage training (Skywork-OR1: 8k, then 16k, then 32k response tokens): the stages run one after
    # the other in one command, each resuming from the last one's checkpoint; their steps replace
    # max_steps; empty = one stage, this config
    stages: list[StageConfig] = field(default_factory=list)
    # when a step's responses are generated (docs/async.md): sync (at the step's start, by the weights it
    # trains) | one_step_off (during the step before, by the weights before its update: every sample is
    # one update old, except after a checkpoint, where nothing is generated ahead) | stream (rollout
    # workers of their own generate continuously, prompt group by group; a weight push lands between
    # chunks of tokens, and while a trajectory's tools run; the generations in flight continue with the
    # new weights)
    async_mode: str = "sync"
    # async_mode=stream: a step trains only groups whose oldest token is at most this many updates
    # behind the weights it updates; older finished groups are dropped and their prompts generated again
    max_staleness: int = 1
    ray: RayConfig = field(default_factory=RayConfig)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.n_gpus_per_node

    @property
    def records_policy_versions(self) -> bool:
        """The rollout stamps each token with the policy version that sampled it (``policy_version``):
        only when samples may be older than the weights they train (a synchronous batch is version
        for version the policy it trains, and stays byte for byte what it was)."""
        return self.async_mode != "sync"

    @property
    def streams(self) -> bool:
        return self.async_mode == "stream"

    @property
    def checkpoint_dir(self) -> str:
        if self.save_checkpoint_path:
            return self.save_checkpoint_path
        return os.path.abspath(os.path.join("checkpoints", self.project_name, self.experiment_name))

    def check(self) -> list[str]:
        positive = {
            "total_epochs": self.total_epochs,
            "nnodes": self.nnodes,
            "n_gpus_per_node": self.n_gpus_per_node,
        }
        errors = [f"trainer.{key}={value} must be > 0" for key, value in positive.items() if value <= 0]
        if self.max_steps is not None and self.max_steps <= 0:
            errors.append(f"trainer.max_steps={self.max_steps} must be > 0 (or null for total_epochs)")
        if self.async_mode == "one_step_off" and self.save_freq == 1:
            errors.append(
                "trainer.async_mode=one_step_off generates nothing ahead of a checkpoint (a checkpoint holds "
                "no batch in flight), and trainer.save_freq=1 saves after every step: the run would be "
                "synchronous. Set trainer.save_freq >= 2 (or -1: only at the end), or trainer.async_mode=sync"
            )
        if self.max_staleness < 1:
            errors.append(
                f"trainer.max_staleness={self.max_staleness} must be >= 1 (updates a streamed group may lag "
                "the weights it trains; 1 = at most one update old)"
            )
        if self.cpus_per_worker is not None and self.cpus_per_worker <= 0:
            errors.append(
                f"trainer.cpus_per_worker={self.cpus_per_worker} must be > 0 (CPUs per training process), or null"
            )
        return errors

    def check_stream(self, config: PPOConfig) -> list[str]:
        """What ``async_mode=stream`` needs of the rest of the run (docs/async.md)."""
        if self.async_mode != "stream":
            return []
        rollout = config.worker.rollout
        needs = {
            "worker.rollout.placement=separate (the engines must generate while the trainer trains)": (
                not rollout.separate
            ),
            "worker.actor.moe.routing_replay=false (a re-encoded prefix's routing is not recorded)": (
                config.worker.actor.moe.routing_replay
            ),
        }
        return [
            f"trainer.async_mode=stream needs {what}: set it, or use trainer.async_mode=one_step_off or sync"
            for what, missing in needs.items()
            if missing
        ]
