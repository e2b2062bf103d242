"""Multi-stage training: the stages of ``trainer.stages`` one after the other in one command.

Skywork-OR1 trains at 8k, then 16k, then 32k response tokens; a stage may change any key but the ones
that hold the schedule together (``mmrl.config.loading.STAGE_FIXED_KEYS``). All stages share one checkpoint
folder and one step count: stage ``i`` trains steps ``first_step + 1 .. last_step``, saves at its end
(the trainer always saves at its last step) and stage ``i + 1`` starts from that checkpoint with fresh
workers built from its own config (a new response length needs a new rollout engine). Model,
optimizer, scheduler position, data position, random state and the KL and entropy controllers carry
over; the learning rate is the stage's (``checkpoint.state.load_train_state`` keeps the config's
peak rate). A killed run resumes mid-stage: the latest checkpoint's step picks the stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.config import PPOConfig
from mmrl.config.loading import stage_configs


@dataclass(frozen=True)
class Stage:
    """Stage ``index`` (0-based) of ``count``: global steps ``first_step + 1 .. last_step`` of a schedule
    of ``schedule_steps`` steps, run with ``config``."""

    index: int
    count: int
    name: str
    first_step: int
    last_step: int
    schedule_steps: int
    overrides: tuple[str, ...]
    config: PPOConfig

    @property
    def label(self) -> str:
        """``stage 2/3 16k``: the progress line's prefix."""
        return f"stage {self.index + 1}/{self.count}" + (f" {self.name}" if self.name else "")

    def describe(self) -> str:
        changes = ", ".join(self.overrides) or "the run's config"
        return f"mmrl: {self.label}: steps {self.first_step + 1}-{self.last_step} with {changes}"


def plan_stages(config: PPOConfig) -> list[Stage]:
    """The schedule of ``config.trainer.stages`` (empty without one)."""
    configs = stage_configs(config)
    stages, first_step = [], 0
    schedule_steps = sum(stage.steps for stage in config.trainer.stages)
    for index, (stage, stage_config) in enumerate(zip(config.trainer.stages, configs)):
        last_step = first_step + stage.steps
        stages.append(
            Stage(
                index,
                len(configs),
                stage.name,
                first_step,
                last_step,
                schedule_steps,
                tuple(stage.overrides),
                stage_config,
            )
        )
        first_step = last_step
    return stages


def first_stage_to_run(stages: list[Stage], latest_step: int | None) -> int:
    """The stage a run starts with when its newest checkpoint is at ``latest_step`` (None: none): the
    first one that ends after it (the last one when the schedule is complete: it has nothing left to do)."""
    if latest_step is None:
        return 0
    return next((stage.index for stage in stages if stage.last_step > latest_step), len(stages) - 1)
