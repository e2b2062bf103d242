"""The ``algorithm`` section: the advantage estimator, KL, DAPO's online filtering, the rollout correction;
each section's ``check`` beside its fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mmrl.algorithms import ADVANTAGE_ESTIMATORS, OFF_POLICY_OBJECTIVES

if TYPE_CHECKING:
    from mmrl.config.schema import PPOConfig


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Rollout/training mismatch correction of the policy loss (``core_algos.rollout_correction_weights``).

    The rollout engine's log-probs of the sampled tokens (``rollout_log_probs``) and the trainer's
    (``old_log_probs``) differ (vLLM's bf16 kernels are not the trainer's), so the samples come from
    pi_rollout, not from pi_old. Each token's policy loss is multiplied by a weight built from
    rho = pi_old / pi_rollout: a truncated importance weight, a 0/1 rejection, or both. Rejected tokens
    keep counting in the loss's normalisers (as in TRL and OpenRLHF).
    """

    # importance weight min(rho, rollout_is_threshold) on the loss: null (off) | token (rho_t) |
    # sequence (the product of the response's rho_t, on each of its tokens)
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0  # truncation of the importance weight (> 0; typically 1.5-5)
    # rejection: loss weight 0 where the ratio lies outside [lower, threshold]: null (off) | token (rho_t) |
    # sequence (product over the response) | geometric (geometric mean over the response: length-fair)
    rollout_rs: str | None = None
    rollout_rs_threshold: float = 2.0  # upper acceptance bound of the ratio (geometric: e.g. 1.001)
    rollout_rs_threshold_lower: float | None = None  # lower acceptance bound; null = 1 / rollout_rs_threshold

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None

    def check(self) -> list[str]:
        """Thresholds that bound something: a positive truncation, rejection bounds with lower < upper."""
        errors: list[str] = []
        key = "algorithm.rollout_correction"
        if self.rollout_is_threshold <= 0:
            errors.append(
                f"{key}.rollout_is_threshold={self.rollout_is_threshold} must be > 0 (the importance "
                "weight's upper bound; typically 1.5-5)"
            )
        upper, lower = self.rollout_rs_threshold, self.rollout_rs_threshold_lower
        if upper <= 0 or (lower is not None and not 0 <= lower < upper):
            errors.append(
                f"{key}: rejection keeps ratios in [rollout_rs_threshold_lower, rollout_rs_threshold] = "
                f"[{lower}, {upper}]; need 0 <= lower < upper and upper > 0 (lower null = 1 / upper)"
            )
        elif lower is None and upper <= 1:
            errors.append(
                f"{key}.rollout_rs_threshold={upper} must be > 1 when rollout_rs_threshold_lower is null "
                "(the lower bound is then 1 / it, which must lie below it)"
            )
        return errors


@dataclass(frozen=True)
class DecoupledConfig:
    """Decoupled PPO (``algorithm.off_policy=decoupled``; Fu et al. 2025, AReaL): the ratio is clipped
    around the proximal policy (the weights at the start of the update: the old-log-prob pass), and each
    token's loss is weighted by ``w = pi_prox / pi_behav``, the behaviour policy being the one that
    sampled it (the rollout engine's log-probs, ``rollout_log_probs``, of possibly older weights)."""

    # bound on w: tokens whose weight exceeds it are dropped from the loss (over_cap=mask, AReaL's) or
    # get the cap as weight (over_cap=truncate); null: no bound
    behaviour_weight_cap: float | None = 5.0
    over_cap: str = "mask"  # mask | truncate

    def check(self) -> list[str]:
        cap = self.behaviour_weight_cap
        if cap is not None and cap < 1:
            return [
                f"algorithm.decoupled.behaviour_weight_cap={cap} must be >= 1 (a bound on pi_prox / pi_behav, "
                "which is 1 on fresh samples; AReaL uses 5), or null for no bound"
            ]
        return []


@dataclass(frozen=True)
class AlgorithmConfig:
    # advantage estimator, by name: grpo | grpo_passk | rloo | reinforce_plus_plus | remax | gae | any other
    # registered in mmrl/algorithms (docs/algorithms.md)
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True  # grpo, grpo_passk: divide by the group's std; false = Dr. GRPO
    gamma: float = 1.0  # discount of future token rewards (gae, reinforce_plus_plus)
    lam: float = 1.0  # GAE lambda
    disable_kl: bool = False  # no KL term at all (and no reference model)
    use_kl_loss: bool = False  # true: KL as a loss term of the actor; false: KL as a reward penalty
    kl_penalty: str = "low_var_kl"  # KL estimator: k1 (kl) | k2 (mse) | k3 (low_var_kl) | abs
    kl_coef: float = 1e-3  # weight of the KL term (initial value when adaptive)
    kl_type: str = "fixed"  # coefficient controller: fixed | adaptive (reward penalty only)
    kl_target: float = 0.1  # adaptive controller: KL (nats per token) the coefficient steers towards
    kl_horizon: float = 10000.0  # adaptive controller: responses over which the error is corrected
    # DAPO dynamic sampling: drop prompt groups whose `filter_key` scores are all equal or whose mean is
    # outside [filter_low, filter_high], and generate more (data.mini_rollout_batch_size prompts a round,
    # at most trainer.max_try_make_batch rounds) until data.rollout_batch_size groups are kept
    online_filtering: bool = False
    filter_key: str = "overall"  # reward score key the filter reads (`overall` = the reward)
    filter_low: float = 0.01  # keep a group only when its mean score is >= this ...
    filter_high: float = 0.99  # ... and <= this
    # when trainer.max_try_make_batch rounds cannot fill a step: stop (the run ends with a message) |
    # train (the step trains on the groups kept, topped up with groups it dropped: a policy that has
    # settled on one answer keeps training, and an entropy bonus can bring it back; the dropped groups
    # that failed, mean < filter_low, come first and train, the others only fill the batch and are left
    # out of the loss)
    unfilled_step: str = "stop"
    # correction of the mismatch between the rollout engine's and the trainer's probabilities
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # the objective's correction for samples drawn by older weights (trainer.async_mode) or another
    # engine: none (plain PPO: the ratio against the old-log-prob pass's policy) | decoupled (decoupled PPO,
    # section algorithm.decoupled) | any other registered in mmrl/algorithms (docs/async.md)
    off_policy: str = "none"
    decoupled: DecoupledConfig = field(default_factory=DecoupledConfig)

    @property
    def use_reference(self) -> bool:
        return not self.disable_kl

    def check(self, config: PPOConfig) -> list[str]:
        """The estimator's spec (its checks, its need of groups), KL, discounting, online filtering, the
        rollout correction."""
        errors: list[str] = []
        estimator = ADVANTAGE_ESTIMATORS.get(self.adv_estimator)  # an unknown name: _check_choices reports it
        if estimator is not None:
            errors += estimator.problems(self)
        if estimator is not None and estimator.needs_groups and config.worker.rollout.n < 2:
            errors.append(
                f"algorithm.adv_estimator={self.adv_estimator} compares the responses of a prompt: "
                f"set worker.rollout.n >= 2 (found {config.worker.rollout.n})"
            )
        if self.online_filtering:
            _check_online_filtering(errors, config)
        if self.kl_type == "adaptive" and self.use_kl_loss:
            errors.append(
                "algorithm.kl_type=adaptive steers the reward penalty: set algorithm.use_kl_loss=false"
            )
        if self.kl_coef < 0:
            errors.append(f"algorithm.kl_coef={self.kl_coef} must be >= 0")
        if not 0 <= self.gamma <= 1 or not 0 <= self.lam <= 1:
            errors.append(f"algorithm.gamma={self.gamma} and algorithm.lam={self.lam} must lie in [0, 1]")
        errors += self.rollout_correction.check()
        objective = OFF_POLICY_OBJECTIVES.get(self.off_policy)  # unknown or none: nothing to check
        if objective is not None:
            errors += objective.problems(self)
        return errors


def _check_online_filtering(errors: list[str], cfg: PPOConfig) -> None:
    algo, data = cfg.algorithm, cfg.data
    group_estimators = [name for name, spec in ADVANTAGE_ESTIMATORS.items() if spec.needs_groups]
    if algo.adv_estimator not in group_estimators:
        errors.append(
            f"algorithm.online_filtering drops prompt groups whose responses score alike, which only "
            f"matters to a group estimator: set algorithm.adv_estimator to one of {group_estimators} "
            f"(found {algo.adv_estimator}) or algorithm.online_filtering=false"
        )
    if cfg.worker.rollout.n < 2:
        errors.append(
            f"algorithm.online_filtering needs groups of responses: set worker.rollout.n >= 2 "
            f"(found {cfg.worker.rollout.n})"
        )
    if data.mini_rollout_batch_size is not None and data.mini_rollout_batch_size <= 0:
        errors.append(
            f"data.mini_rollout_batch_size={data.mini_rollout_batch_size} must be > 0 (prompts generated "
            "per round), or null for data.rollout_batch_size"
        )
    if algo.filter_low > algo.filter_high:
        errors.append(
            f"algorithm.filter_low={algo.filter_low} exceeds algorithm.filter_high={algo.filter_high}: "
            "no group could be kept"
        )
    if cfg.trainer.max_try_make_batch == 0 or cfg.trainer.max_try_make_batch < -1:
        errors.append(
            f"trainer.max_try_make_batch={cfg.trainer.max_try_make_batch} must be >= 1 (generation rounds "
            "per step), or -1 for no limit"
        )
