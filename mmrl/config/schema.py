"""The root of the config tree, ``PPOConfig(data, algorithm, worker, trainer)``, the rules across its
sections (how the roles share the processes and the batch) and the keys with a fixed set of values."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from mmrl.algorithms import ADVANTAGE_ESTIMATORS, OFF_POLICY_OBJECTIVES, POLICY_LOSSES
from mmrl.config.actor import ActorConfig, CriticConfig, RefConfig
from mmrl.config.algorithm import AlgorithmConfig, DecoupledConfig, RolloutCorrectionConfig
from mmrl.config.files import check_files
from mmrl.config.model import (
    PACKED_ATTENTION_KERNELS,
    ActorModelConfig,
    FSDPConfig,
    ModelConfig,
    OptimConfig,
)
from mmrl.config.reward import CodeConfig, JudgeConfig, RewardConfig, RewardModelConfig, SandboxConfig
from mmrl.config.rollout import MultiTurnConfig, RolloutConfig
from mmrl.config.trainer import LOGGERS, TrainerConfig
from mmrl.data.config import DataConfig


@dataclass(frozen=True)
class WorkerConfig:
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)

    def check(self, config: PPOConfig, check_paths: bool) -> list[str]:
        """Each role's section, and how the roles share the processes and the batch."""
        errors = self.actor.check(config) + self.critic.check()
        _check_batches(errors, config)
        _check_sequence_parallel(errors, config)
        errors += self.rollout.check(config)
        return errors + self.reward.check(config, check_paths)


def _check_batches(errors: list[str], cfg: PPOConfig) -> None:
    data, actor, rollout, trainer = cfg.data, cfg.worker.actor, cfg.worker.rollout, cfg.trainer
    world = trainer.world_size
    if data.rollout_batch_size % actor.global_batch_size:
        errors.append(
            f"data.rollout_batch_size={data.rollout_batch_size} must be a multiple of "
            f"worker.actor.global_batch_size={actor.global_batch_size} (each step runs whole mini-batches)"
        )
    sp_size = actor.sequence_parallel_size  # its own errors come from _check_sequence_parallel
    dp_size = world // sp_size if sp_size > 0 and world % sp_size == 0 else world
    where = (
        f"the {dp_size} data-parallel shares (trainer.nnodes × trainer.n_gpus_per_node = {world} processes "
        f"/ sequence-parallel size {actor.sequence_parallel_size})"
        if actor.sequence_parallel_size > 1
        else f"trainer.nnodes × trainer.n_gpus_per_node = {world} processes"
    )
    if cfg.responses_per_update % dp_size:
        errors.append(
            f"worker.actor.global_batch_size × worker.rollout.n = {cfg.responses_per_update} responses per update "
            f"must divide evenly over {where}"
        )
    else:
        per_device = cfg.responses_per_update // dp_size
        if per_device % actor.micro_batch_size_per_device_for_update:
            errors.append(
                f"{per_device} responses per data-parallel share per update are not a multiple of "
                f"worker.actor.micro_batch_size_per_device_for_update={actor.micro_batch_size_per_device_for_update}"
            )
    if world % rollout.tensor_parallel_size:
        errors.append(
            f"worker.rollout.tensor_parallel_size={rollout.tensor_parallel_size} must divide the "
            f"{world} training processes"
        )
    if cfg.use_critic and cfg.data.rollout_batch_size % cfg.worker.critic.global_batch_size:
        errors.append(
            f"data.rollout_batch_size={data.rollout_batch_size} must be a multiple of "
            f"worker.critic.global_batch_size={cfg.worker.critic.global_batch_size}"
        )
    if not cfg.use_critic:
        return
    critic = cfg.worker.critic
    critic_sp = critic.sequence_parallel_size  # the critic's layout may differ from the actor's
    critic_dp = world // critic_sp if critic_sp > 0 and world % critic_sp == 0 else world
    if (critic.global_batch_size * rollout.n) % critic_dp:
        errors.append(
            f"worker.critic.global_batch_size × worker.rollout.n = {critic.global_batch_size * rollout.n} "
            f"responses per critic update must divide evenly over the critic's {critic_dp} data-parallel "
            f"shares ({world} processes / its sequence-parallel size {critic_sp})"
        )


def _check_sequence_parallel(errors: list[str], cfg: PPOConfig) -> None:
    world = cfg.trainer.world_size
    for role in ("actor", "critic"):
        role_cfg = getattr(cfg.worker, role)
        if role == "critic" and not cfg.use_critic:
            continue
        for key in ("ulysses_size", "ring_size"):
            if getattr(role_cfg, key) < 1:
                errors.append(f"worker.{role}.{key}={getattr(role_cfg, key)} must be >= 1")
        size = role_cfg.sequence_parallel_size
        if min(role_cfg.ulysses_size, role_cfg.ring_size) < 1 or size == 1:
            continue
        if world % size:
            errors.append(
                f"worker.{role}.ulysses_size × worker.{role}.ring_size = {size} must divide trainer.nnodes × "
                f"trainer.n_gpus_per_node = {world} processes (each data-parallel share uses {size} of them)"
            )
        if not role_cfg.padding_free:
            errors.append(
                f"worker.{role}.ulysses_size/ring_size > 1 split packed rows: set worker.{role}.padding_free=true"
            )


@dataclass(frozen=True)
class PPOConfig:
    data: DataConfig = field(default_factory=DataConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def use_critic(self) -> bool:
        spec = ADVANTAGE_ESTIMATORS.get(self.algorithm.adv_estimator)  # unknown: validation reports it
        return spec is not None and spec.needs_critic

    @property
    def responses_per_step(self) -> int:
        return self.data.rollout_batch_size * self.worker.rollout.n

    @property
    def responses_per_update(self) -> int:
        """Responses in one actor optimizer step (EasyR1 multiplied the config value in place)."""
        return self.worker.actor.global_batch_size * self.worker.rollout.n

    def check(self, check_paths: bool = True) -> list[str]:
        """Every rule of the run, one message per problem (empty when valid); ``check_paths=False`` leaves
        out the checks that files and model folders exist."""
        errors = self.data.check() + self.trainer.check() + self.worker.check(self, check_paths)
        errors += self.algorithm.check(self) + self.trainer.check_stream(self)
        _check_choices(errors, self)
        return errors + (check_files(self) if check_paths else [])


# ---------------------------------------------------------------------------------------------
# Choices: every key whose value is one of a fixed set of names, declared here once. PPOConfig.check
# validates against these; the registries that implement the names (mmrl.algorithms, core_algos,
# fsdp_engine, logging) are checked against them by tests/trainer/test_config_contract.py, which also
# fails when a name is exercised by no test. Keyed by (section class, field): a class used by several
# sections (FSDPConfig for actor, ref and critic) is validated in each of them.
# ---------------------------------------------------------------------------------------------

DTYPES = ("auto", "fp32", "bf16")  # auto = bf16 on GPU, fp32 on CPU (fp32 storage for torch_dtype)
STORAGE_DTYPES = ("fp32", "bf16")
LOSS_AVG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")


CHOICES: dict[tuple[type, str], tuple[str, ...]] = {
    (AlgorithmConfig, "adv_estimator"): tuple(ADVANTAGE_ESTIMATORS),  # mmrl/algorithms
    (AlgorithmConfig, "kl_penalty"): ("kl", "k1", "mse", "k2", "low_var_kl", "k3", "abs"),
    (AlgorithmConfig, "kl_type"): ("fixed", "adaptive"),
    (AlgorithmConfig, "unfilled_step"): ("stop", "train"),
    (RolloutCorrectionConfig, "rollout_is"): ("token", "sequence"),  # or null: off
    (RolloutCorrectionConfig, "rollout_rs"): ("token", "sequence", "geometric"),  # or null: off
    (AlgorithmConfig, "off_policy"): ("none", *OFF_POLICY_OBJECTIVES),  # mmrl/algorithms
    (DecoupledConfig, "over_cap"): ("mask", "truncate"),
    (ActorConfig, "loss_type"): tuple(POLICY_LOSSES),  # mmrl/algorithms
    (ActorConfig, "loss_avg_mode"): LOSS_AVG_MODES,
    (CriticConfig, "loss_avg_mode"): LOSS_AVG_MODES,
    (OptimConfig, "strategy"): ("adamw", "adamw_bf16"),
    (OptimConfig, "lr_scheduler_type"): ("constant", "cosine"),
    (FSDPConfig, "torch_dtype"): DTYPES,
    (FSDPConfig, "mp_param_dtype"): DTYPES,
    (FSDPConfig, "mp_reduce_dtype"): STORAGE_DTYPES,
    (FSDPConfig, "mp_buffer_dtype"): STORAGE_DTYPES,
    (ModelConfig, "packed_attention"): PACKED_ATTENTION_KERNELS,
    (ActorModelConfig, "packed_attention"): PACKED_ATTENTION_KERNELS,
    (RolloutConfig, "name"): ("vllm", "hf"),
    (RolloutConfig, "dtype"): DTYPES,
    (RolloutConfig, "placement"): ("colocated", "separate"),
    (MultiTurnConfig, "turn_schedule"): ("lockstep", "as_ready"),
    (RewardConfig, "reward_type"): ("batch", "sequential"),  # or null: the reward file's REWARD_TYPE
    (CodeConfig, "score"): ("pass_rate", "all_passed"),
    (SandboxConfig, "isolation"): ("namespaces", "process"),
    (RewardConfig, "combine"): ("weighted_sum", "rule_function"),
    (JudgeConfig, "parser"): ("yes_no", "number", "rubric"),
    (RewardModelConfig, "head"): ("classification", "yes_token"),
    (RewardModelConfig, "normalize"): ("none", "sigmoid", "batch_zscore"),
    (RewardModelConfig, "device"): ("auto", "cuda", "cpu"),
    (TrainerConfig, "logger"): LOGGERS,  # a list: each entry one of these
    (TrainerConfig, "device"): ("auto", "cuda", "cpu"),
    (TrainerConfig, "async_mode"): ("sync", "one_step_off", "stream"),
}


def _check_choices(errors: list[str], node: Any, prefix: str = "") -> None:
    """Every key declared in ``config.CHOICES``, in every section of its class (a list: each entry)."""
    for f in dataclasses.fields(node):
        key, value = f"{prefix}{f.name}", getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            _check_choices(errors, value, key + ".")
        elif (type(node), f.name) in CHOICES and value is not None:  # null: the documented default
            for item in value if isinstance(value, list) else [value]:
                _choice(errors, key, item, CHOICES[type(node), f.name])


def _choice(errors: list[str], key: str, value: str, valid: Sequence[str]) -> None:
    if value not in valid:
        close = difflib.get_close_matches(str(value), list(valid), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        errors.append(f"{key}='{value}' is not one of {', '.join(valid)}{hint}")
