"""What one training step does, decided once from the config and the step number.

The driver builds a :class:`StepPlan` at the start of every step and passes its fields to the worker
methods as explicit arguments; no worker infers a mode from the presence of a batch column or a
``meta_info`` key.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmrl.algorithms import advantage_estimator
from mmrl.config import PPOConfig


@dataclass(frozen=True)
class StepPlan:
    # the temperature the training responses were sampled at; every log-prob pass scores at it
    temperature: float
    # the actor is updated this step (false while the critic warms up)
    update_actor: bool
    # on-policy: the update's own forward gives the old log-probs, no separate pass (see for_step)
    old_log_probs_from_update: bool
    use_reference: bool  # reference log-probs for a KL term
    use_critic: bool  # values before, a critic update after the advantages
    greedy_baseline: bool  # the estimator scores each prompt's greedy response as its baseline (ReMax)

    @classmethod
    def for_step(cls, config: PPOConfig, global_step: int) -> StepPlan:
        """The plan of step ``global_step`` (0-based).

        The old policy equals the current one when the rollout feeds exactly one optimizer step
        (``global_batch_size == rollout_batch_size``, ``ppo_epochs == 1``) and nothing needs the old
        log-probs before the update (a KL *reward* penalty does); the update then computes them itself.
        ``worker.actor.skip_old_log_prob_on_policy=false`` always runs the separate pass.
        """
        actor, algorithm = config.worker.actor, config.algorithm
        update_actor = global_step >= config.trainer.critic_warmup
        kl_in_reward = algorithm.use_reference and not algorithm.use_kl_loss
        on_policy = (
            actor.skip_old_log_prob_on_policy
            and actor.ppo_epochs == 1
            and actor.global_batch_size == config.data.rollout_batch_size
            and not kl_in_reward
        )
        temperature = config.worker.rollout.temperature
        return cls(
            temperature=temperature if temperature > 0 else 1.0,  # greedy responses are scored at T = 1
            update_actor=update_actor,
            old_log_probs_from_update=on_policy and update_actor,
            use_reference=algorithm.use_reference,
            use_critic=config.use_critic,
            greedy_baseline=advantage_estimator(algorithm.adv_estimator).greedy_baseline,
        )
