"""The typed configuration tree of a run: ``PPOConfig(data, algorithm, worker, trainer)``.

Every knob lives in a section's dataclass with its meaning and unit, and every rule on it in that
section's ``check``, beside its fields:

- :mod:`~mmrl.config.schema`: the root, the rules across sections, the keys with a fixed set of values;
- :mod:`~mmrl.config.algorithm`, :mod:`~mmrl.config.actor` (actor, ref, critic), :mod:`~mmrl.config.model`
  (model, optimizer, FSDP, offload), :mod:`~mmrl.config.rollout`, :mod:`~mmrl.config.reward`,
  :mod:`~mmrl.config.trainer`; the ``data`` section lives with the data layer (:mod:`mmrl.data.config`);
- :mod:`~mmrl.config.files`: the checks that read the disk (files and model folders a run names);
- :mod:`~mmrl.config.loading`: YAML, ``key=value`` arguments and EasyR1's spellings
  (:mod:`~mmrl.config.easyr1`) merged over the defaults, then every section's ``check`` at once.

Key names follow EasyR1's where the meaning is the same, so its users' YAML files carry over. Loading
merges dataclass defaults ← YAML ← ``key=value`` arguments, resolves relative paths, and validates
once; the dataclasses are frozen afterwards, so the config printed at start is the config that runs.
Derived values are properties, never written back.
"""

from mmrl.config.actor import (
    ActorConfig,
    AdaptiveEntropyConfig,
    CollapseRecoveryConfig,
    CriticConfig,
    KLStepControlConfig,
    MoEConfig,
    PolicyLossConfig,
    RefConfig,
)
from mmrl.config.algorithm import AlgorithmConfig, DecoupledConfig, RolloutCorrectionConfig
from mmrl.config.model import (
    ActorModelConfig,
    FSDPConfig,
    LoraConfig,
    ModelConfig,
    OffloadConfig,
    OptimConfig,
    RefOffloadConfig,
)
from mmrl.config.reward import (
    CodeConfig,
    JudgeConfig,
    JudgeServeConfig,
    RewardConfig,
    RewardModelConfig,
    RewardSourceConfig,
    SandboxConfig,
    split_function_spec,
)
from mmrl.config.rollout import SAMPLING_KEYS, MultiTurnConfig, RolloutConfig
from mmrl.config.schema import (
    CHOICES,
    DTYPES,
    LOSS_AVG_MODES,
    STORAGE_DTYPES,
    PPOConfig,
    WorkerConfig,
)
from mmrl.config.trainer import LOGGERS, RayConfig, StageConfig, TrainerConfig
from mmrl.data.config import (
    DATA_FILE_SUFFIXES,
    DATA_FORMATS,
    DataConfig,
    split_dataset_spec,
    unsupported_data_file,
)

__all__ = [
    "CHOICES",
    "DATA_FILE_SUFFIXES",
    "DATA_FORMATS",
    "DTYPES",
    "LOGGERS",
    "LOSS_AVG_MODES",
    "SAMPLING_KEYS",
    "STORAGE_DTYPES",
    "ActorConfig",
    "ActorModelConfig",
    "AdaptiveEntropyConfig",
    "CollapseRecoveryConfig",
    "KLStepControlConfig",
    "MoEConfig",
    "AlgorithmConfig",
    "CodeConfig",
    "CriticConfig",
    "DataConfig",
    "FSDPConfig",
    "JudgeConfig",
    "JudgeServeConfig",
    "LoraConfig",
    "ModelConfig",
    "MultiTurnConfig",
    "OffloadConfig",
    "OptimConfig",
    "PPOConfig",
    "PolicyLossConfig",
    "RayConfig",
    "RefConfig",
    "RefOffloadConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RewardSourceConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "DecoupledConfig",
    "SandboxConfig",
    "StageConfig",
    "TrainerConfig",
    "WorkerConfig",
    "split_dataset_spec",
    "split_function_spec",
    "unsupported_data_file",
]
