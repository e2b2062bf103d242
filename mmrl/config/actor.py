"""The training roles' sections: ``worker.actor`` (its policy loss and entropy bonus), ``worker.ref``,
``worker.critic``; each section's ``check`` beside its fields."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mmrl.algorithms import POLICY_LOSSES, policy_clip_range
from mmrl.config.model import (
    ActorModelConfig,
    FSDPConfig,
    ModelConfig,
    OffloadConfig,
    OptimConfig,
    RefOffloadConfig,
)

if TYPE_CHECKING:
    from mmrl.config.schema import PPOConfig


@dataclass(frozen=True)
class PolicyLossConfig:
    """The policy loss and its knobs: keys of ``worker.actor`` (:class:`ActorConfig` derives from this).
    The losses of :mod:`mmrl.core_algos.policy_losses` receive this section whole and read what they
    need, so a new knob is a field here and a line in its loss."""

    # policy loss: ppo | gspo | gspo_token | cispo | sapo | clip_cov | kl_cov | any other registered in
    # mmrl/algorithms (docs/algorithms.md)
    loss_type: str = "ppo"
    # ratio clipped to [1 - clip_ratio_low, 1 + clip_ratio_high]; null = the loss's own default (ppo and
    # clip_cov 0.2 / 0.3 (DAPO clip-higher), gspo(_token) 3e-4 / 4e-4, cispo 1 / 4 (no lower bound; 0:
    # weight >= 1), sapo and kl_cov none)
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_dual: float = 3.0  # ppo: dual-clip constant c (> 1): loss bounded by c·|A| for A < 0
    tau_positive: float = 1.0  # sapo: gate temperature for tokens with advantage >= 0
    tau_negative: float = 1.05  # sapo: gate temperature for tokens with advantage < 0
    # clip_cov and kl_cov (Cui et al. 2025): act on the few tokens whose covariance between log-prob and
    # advantage, (A - mean A)(log p - mean log p) over a micro-batch's valid tokens, is highest
    clip_cov_ratio: float = 2e-4  # clip_cov: fraction of the valid tokens whose gradient is cut (>= 1 token)
    clip_cov_lb: float = 1.0  # clip_cov: tokens are drawn among those with covariance above this ...
    clip_cov_ub: float = 5.0  # ... and below this
    kl_cov_ratio: float = 2e-3  # kl_cov: fraction of the valid tokens (highest covariance) penalised (>= 1)
    kl_cov_coef: float = 1.0  # kl_cov: weight of |log p - old log p| added to those tokens' loss

    @property
    def clip_range(self) -> tuple[float, float] | None:
        """``(clip_ratio_low, clip_ratio_high)`` the loss runs with: null keys take ``loss_type``'s default
        (its spec's ``clip_defaults``, :mod:`mmrl.algorithms`); None for a loss without clip (sapo, kl_cov)."""
        return policy_clip_range(self.loss_type, self.clip_ratio_low, self.clip_ratio_high)

    def check_loss(self) -> list[str]:
        """Clip ratios that mean something for ``loss_type`` (its spec's checks; null: the loss's
        default), SAPO temperatures, the covariance losses' fractions."""
        errors: list[str] = []
        if self.clip_ratio_high is not None and self.clip_ratio_high <= 0:
            errors.append(
                f"worker.actor.clip_ratio_high={self.clip_ratio_high} must be > 0 (the ratio's upper bound is 1 + it)"
            )
        if self.loss_type in POLICY_LOSSES:  # an unknown name: _check_choices reports it
            errors += POLICY_LOSSES[self.loss_type].problems(self)
        for key in ("tau_positive", "tau_negative"):
            if getattr(self, key) <= 0:
                errors.append(f"worker.actor.{key}={getattr(self, key)} must be > 0 (SAPO gate temperature)")
        for key in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0 < getattr(self, key) <= 1:
                errors.append(
                    f"worker.actor.{key}={getattr(self, key)} must lie in (0, 1] (a fraction of the tokens)"
                )
        if self.clip_cov_lb >= self.clip_cov_ub:
            errors.append(
                f"worker.actor.clip_cov_lb={self.clip_cov_lb} must be below clip_cov_ub={self.clip_cov_ub} "
                "(clip_cov draws tokens whose covariance lies between them)"
            )
        if self.kl_cov_coef < 0:
            errors.append(f"worker.actor.kl_cov_coef={self.kl_cov_coef} must be >= 0")
        return errors


@dataclass(frozen=True)
class AdaptiveEntropyConfig:
    """Skywork-OR1's entropy control (Zhou et al. 2025, sec. 4): after each step the coefficient rises by
    ``delta_ent_coef`` while the step's entropy is below ``target_entropy`` and falls by it at or above,
    within ``[min_ent_coef, max_ent_coef]``, starting at ``worker.actor.entropy_coeff``; the bonus applies
    only while the entropy is below the target. The entropy is the one the actor measures
    (``entropy_top_k``), as a token mean over the step's responses."""

    enabled: bool = False  # steer the entropy coefficient (worker.actor.entropy_coeff is its start)
    target_entropy: float = 0.2  # nats per response token the control keeps the policy's entropy above
    delta_ent_coef: float = 1e-4  # change of the coefficient per step
    min_ent_coef: float = 0.0  # the coefficient's lower bound
    max_ent_coef: float = 5e-3  # the coefficient's upper bound


@dataclass(frozen=True)
class CollapseRecoveryConfig:
    """A loss term that pulls a collapsed policy (one answer at p ~ 1 for every prompt) back open: while
    the driver sees a collapse, the update adds ``coeff * KL(u_K || pi)``, ``u_K`` uniform over the
    policy's own ``top_k`` most probable tokens at each response token. Its logit gradient is
    ``pi - u_K``, of norm ~1 at a saturated softmax, where the policy gradient, the sample-based KL and
    the entropy bonus all vanish. A collapse: for ``patience`` steps in a row (this one included), at
    least ``all_equal_share`` of the step's generated groups not solved (all scores >= ``solved_score``)
    had all-equal scores. Outside a collapse the term is not computed, so the update is exactly the one
    without it (docs/recipes.md)."""

    enabled: bool = False  # add the term while a collapse lasts (off: never computed)
    coeff: float = 0.05  # weight of KL(u_K || pi) in the loss while active
    top_k: int = 8  # K: the most probable tokens the term spreads probability over
    all_equal_share: float = 0.95  # a collapsed step: at least this share of its groups all-equal
    patience: int = 2  # consecutive collapsed steps before the term applies (this step included)
    # an all-equal group scoring at least this is solved, not collapsed: the share is judged among the
    # groups not solved (a policy right on every prompt is no collapse); null: every all-equal group counts
    solved_score: float | None = 1.0


@dataclass(frozen=True)
class KLStepControlConfig:
    """The learning rate scaled down while the updates move the policy too far (the adaptive step of PPO
    implementations; :class:`~mmrl.core_algos.KLStepControl`). A step's optimizer steps after its first
    see how far the earlier ones moved the policy (``actor/ppo_kl_k3``, the k3 estimate of
    ``KL(old || current)`` per response token, mean over the step's mini-batches); above
    ``2 * target_kl`` the next step's learning rate scale falls by ``factor`` (not below ``min_scale``),
    below ``target_kl / 2`` it rises by ``factor`` (not above 1: never above the schedule). It needs
    several optimizer steps per training step (``global_batch_size < data.rollout_batch_size`` or
    ``ppo_epochs > 1``). Off, the update is exactly the one without it (docs/recipes.md)."""

    enabled: bool = False  # scale each step's learning rate by the controller's (logged as actor/lr_scale)
    target_kl: float = 0.01  # KL(old || current) per response token a step's updates may move the policy
    factor: float = 1.5  # the scale's change per step while the KL is off target
    min_scale: float = 0.1  # the scale's floor (a fraction of the scheduled learning rate)


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts models (the families with routers, e.g. Qwen3-VL MoE; docs/moe.md). Router
    metrics are logged for every MoE model whatever these keys say."""

    # weight of the routers' load-balancing loss (E * sum_i f_i * P_i, mean over layers; 1 = balanced)
    # added to the actor loss, weighted per micro-batch by its share of the response tokens; 0 = off
    aux_loss_coef: float = 0.0
    # rollout routing replay: the transformers rollout records each token's experts per layer and the
    # actor's old-log-prob and update passes route every token by them (needs worker.rollout.name=hf,
    # single-turn rollouts, worker.actor.share_prompts=false, no sequence parallelism)
    routing_replay: bool = False


@dataclass(frozen=True)
class ActorConfig(PolicyLossConfig):
    global_batch_size: int = 128  # prompts per optimizer step (each brings rollout.n responses)
    micro_batch_size_per_device_for_update: int = 4  # responses per forward/backward in the update
    micro_batch_size_per_device_for_experience: int = 16  # responses per forward in log-prob passes
    max_grad_norm: float = 1.0  # gradient clipping norm; a non-finite norm skips the step
    # DAPO overlong filtering: responses cut at max_response_length (no EOS) are left out of the loss
    mask_truncated_responses: bool = False
    loss_avg_mode: str = (
        "token_mean"  # token_mean | seq_mean_token_mean | seq_mean_token_sum | seq_mean_token_sum_norm
    )
    ppo_epochs: int = 1  # passes over each rollout batch
    # one optimizer step per rollout (global_batch_size = rollout_batch_size, ppo_epochs 1, no KL reward
    # penalty): take the old log-probs from the update's own forward instead of a separate pass
    skip_old_log_prob_on_policy: bool = True
    entropy_coeff: float = 0.0  # weight of the entropy bonus (0 = logged only); adaptive: its start value
    # entropy over the entropy_top_k most probable tokens, renormalised (bonus, metrics, adaptive control):
    # on a small model a whole-vocabulary bonus spreads probability over non-words; 0 = whole vocabulary
    entropy_top_k: int = 0
    adaptive_entropy: AdaptiveEntropyConfig = field(default_factory=AdaptiveEntropyConfig)
    collapse_recovery: CollapseRecoveryConfig = field(default_factory=CollapseRecoveryConfig)
    kl_step_control: KLStepControlConfig = field(default_factory=KLStepControlConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    padding_free: bool = True  # train on packed sequences without padding tokens
    share_prompts: bool = True  # packed: each distinct prompt of a micro-batch once, before its responses
    max_tokens_per_micro_batch: int | None = None  # packed tokens per forward (actor, ref); null = by count
    # packed tokens per forward of the no-grad passes (old log-probs, reference): no activations are
    # kept, so it may be larger than the update's; null = max_tokens_per_micro_batch
    max_tokens_per_micro_batch_for_experience: int | None = None
    # response tokens per chunk of the log-prob/entropy head (actor, ref): [chunk, vocab] logits at a
    # time, in forward and backward; 0 = the whole [tokens, vocab] logits at once
    log_prob_chunk_tokens: int = 1024
    # FSDP2 gradient accumulation without a reduction per micro-batch (FSDP's no_sync): each rank sums
    # a mini-batch's gradients unsharded, in fsdp.mp_reduce_dtype, and reduce-scatters them once, in its
    # last micro-batch. One reduction per optimizer step instead of one per micro-batch, for a whole
    # gradient of the model held on every rank's device until then (memory, CPU offload or not); the
    # step is the same to that dtype's rounding
    reduce_grads_once: bool = False
    # FSDP2 parameters left gathered from one micro-batch's backward to the next one's forward of the same
    # optimizer step (set_reshard_after_backward; the step's last backward reshards): no gather between
    # them, for the whole model in the compute dtype on every rank through the step. With
    # fsdp.enable_full_shard=false, each unit is gathered once per step
    keep_params_gathered: bool = False
    ulysses_size: int = 1  # sequence parallel: attention heads split over this many ranks (actor and ref)
    ring_size: int = 1  # sequence parallel: each sequence split over this many Ulysses groups in a ring
    model: ActorModelConfig = field(default_factory=ActorModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks that share one data-parallel share of the rows (ring x Ulysses)."""
        return self.ulysses_size * self.ring_size

    def check(self, config: PPOConfig) -> list[str]:
        """Sizes, the loss's and the entropy bonus's knobs, the model section."""
        errors: list[str] = []
        _check_actor_sizes(errors, self)
        errors += self.check_loss()
        _check_entropy(errors, self)
        _check_collapse_recovery(errors, self.collapse_recovery)
        _check_kl_step_control(errors, self, config)
        _check_moe(errors, self, config)
        return errors + self.model.check(config)


def _check_moe(errors: list[str], actor: ActorConfig, config: PPOConfig) -> None:
    """The load-balancing weight; what routing replay needs (the rollout that records the experts, the
    token layouts it replays into)."""
    if actor.moe.aux_loss_coef < 0:
        errors.append(f"worker.actor.moe.aux_loss_coef={actor.moe.aux_loss_coef} must be >= 0 (0: off)")
    if not actor.moe.routing_replay:
        return
    key = "worker.actor.moe.routing_replay=true"
    rollout = config.worker.rollout
    if rollout.name != "hf":
        errors.append(
            f"{key} needs worker.rollout.name=hf (the backend that records experts), got {rollout.name!r}"
        )
    if rollout.multi_turn.enable:
        errors.append(f"{key} replays single-turn rollouts only: set worker.rollout.multi_turn.enable=false")
    if actor.padding_free and actor.share_prompts:
        errors.append(f"{key} needs worker.actor.share_prompts=false (shared prompts reorder the tokens)")
    if actor.sequence_parallel_size > 1:
        errors.append(f"{key} does not support sequence parallelism: set ulysses_size and ring_size to 1")


def _check_actor_sizes(errors: list[str], actor: ActorConfig) -> None:
    positive = {
        "worker.actor.global_batch_size": actor.global_batch_size,
        "worker.actor.micro_batch_size_per_device_for_update": actor.micro_batch_size_per_device_for_update,
        "worker.actor.micro_batch_size_per_device_for_experience": actor.micro_batch_size_per_device_for_experience,
        "worker.actor.ppo_epochs": actor.ppo_epochs,
        "worker.actor.optim.lr": actor.optim.lr,
    }
    errors.extend(f"{key}={value} must be > 0" for key, value in positive.items() if value <= 0)
    _check_token_budget(errors, "actor", actor.max_tokens_per_micro_batch)
    _check_token_budget(errors, "actor", actor.max_tokens_per_micro_batch_for_experience, "_for_experience")
    if actor.log_prob_chunk_tokens < 0:
        errors.append(
            f"worker.actor.log_prob_chunk_tokens={actor.log_prob_chunk_tokens} must be >= 0 (tokens per "
            "chunk of the log-prob head; 0 = unchunked)"
        )
    if actor.clip_ratio_dual <= 1:
        errors.append(
            f"worker.actor.clip_ratio_dual={actor.clip_ratio_dual} must be > 1 (dual-clip constant c)"
        )


def _check_token_budget(errors: list[str], role: str, budget: int | None, suffix: str = "") -> None:
    if budget is not None and budget <= 0:
        errors.append(
            f"worker.{role}.max_tokens_per_micro_batch{suffix}={budget} must be > 0 (packed tokens per forward "
            "pass; a longer sequence gets a micro-batch of its own), or null to count responses"
        )


def _check_entropy(errors: list[str], actor: ActorConfig) -> None:
    """The entropy bonus, its top-k measure and the adaptive control's bounds."""
    adaptive = actor.adaptive_entropy
    key = "worker.actor.adaptive_entropy"
    if actor.entropy_top_k < 0:
        errors.append(
            f"worker.actor.entropy_top_k={actor.entropy_top_k} must be >= 0 (0: the whole vocabulary)"
        )
    if not adaptive.enabled:
        return
    if adaptive.target_entropy <= 0:
        errors.append(f"{key}.target_entropy={adaptive.target_entropy} must be > 0 (nats per token)")
    if adaptive.delta_ent_coef <= 0:
        errors.append(f"{key}.delta_ent_coef={adaptive.delta_ent_coef} must be > 0")
    if not 0 <= adaptive.min_ent_coef <= adaptive.max_ent_coef:
        errors.append(
            f"{key}: need 0 <= min_ent_coef <= max_ent_coef; found {adaptive.min_ent_coef} and "
            f"{adaptive.max_ent_coef}"
        )
    elif not adaptive.min_ent_coef <= actor.entropy_coeff <= adaptive.max_ent_coef:
        errors.append(
            f"worker.actor.entropy_coeff={actor.entropy_coeff} is the adaptive coefficient's start: it must "
            f"lie in [{key}.min_ent_coef, max_ent_coef] = [{adaptive.min_ent_coef}, {adaptive.max_ent_coef}]"
        )


def _check_kl_step_control(errors: list[str], actor: ActorConfig, config: PPOConfig) -> None:
    """The step-size controller's bounds, and the optimizer steps per training step it measures with."""
    control = actor.kl_step_control
    if not control.enabled:
        return
    key = "worker.actor.kl_step_control"
    if control.target_kl <= 0:
        errors.append(f"{key}.target_kl={control.target_kl} must be > 0 (KL per response token)")
    if control.factor <= 1:
        errors.append(f"{key}.factor={control.factor} must be > 1 (the scale's change per step)")
    if not 0 < control.min_scale <= 1:
        errors.append(f"{key}.min_scale={control.min_scale} must be in (0, 1] (a fraction of the rate)")
    if actor.ppo_epochs == 1 and actor.global_batch_size >= config.data.rollout_batch_size:
        errors.append(
            f"{key}.enabled=true measures how far a step's first optimizer steps moved the policy, but "
            f"worker.actor.global_batch_size={actor.global_batch_size} >= data.rollout_batch_size="
            f"{config.data.rollout_batch_size} with ppo_epochs=1 makes one optimizer step per training step: "
            "lower global_batch_size, raise ppo_epochs, or set enabled=false"
        )


def _check_collapse_recovery(errors: list[str], recovery: CollapseRecoveryConfig) -> None:
    """The collapse-recovery term's weight, its K and its gate."""
    if not recovery.enabled:
        return
    key = "worker.actor.collapse_recovery"
    if recovery.coeff <= 0:
        errors.append(f"{key}.coeff={recovery.coeff} must be > 0 (or set {key}.enabled=false)")
    if recovery.top_k < 2:
        errors.append(f"{key}.top_k={recovery.top_k} must be >= 2 (the tokens probability spreads over)")
    if not 0 < recovery.all_equal_share <= 1:
        errors.append(
            f"{key}.all_equal_share={recovery.all_equal_share} must be in (0, 1] (share of a step's "
            "groups whose scores are all equal)"
        )
    if recovery.patience < 1:
        errors.append(f"{key}.patience={recovery.patience} must be >= 1 (collapsed steps in a row)")


@dataclass(frozen=True)
class RefConfig:
    micro_batch_size_per_device_for_experience: int | None = None  # null = the actor's
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    offload: RefOffloadConfig = field(default_factory=RefOffloadConfig)  # frozen: no optimizer to offload


@dataclass(frozen=True)
class CriticConfig:
    global_batch_size: int = 128  # prompts per optimizer step, as for the actor
    micro_batch_size_per_device_for_update: int = 4  # responses per forward/backward
    micro_batch_size_per_device_for_experience: int = 16  # responses per forward in the value pass
    max_grad_norm: float = 1.0  # gradient clipping norm
    cliprange_value: float = 0.5  # values clipped to old value ± this in the value loss
    loss_avg_mode: str = "token_mean"  # aggregation of the value loss; the actor's modes
    ppo_epochs: int = 1  # passes over each rollout batch
    padding_free: bool = True  # train on packed sequences
    share_prompts: bool = True  # packed: each distinct prompt of a micro-batch once, before its responses
    max_tokens_per_micro_batch: int | None = None  # packed tokens per forward; null = by response count
    # packed tokens per forward of the no-grad value pass; null = max_tokens_per_micro_batch
    max_tokens_per_micro_batch_for_experience: int | None = None
    reduce_grads_once: bool = False  # one gradient reduction per optimizer step, as the actor's
    keep_params_gathered: bool = False  # parameters gathered across a step's micro-batches, as the actor's
    ulysses_size: int = 1  # sequence parallel: attention heads split over this many ranks
    ring_size: int = 1  # sequence parallel: each sequence split over this many Ulysses groups in a ring
    # model_path null = the actor's folder; the other model keys are the critic's own
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)

    @property
    def sequence_parallel_size(self) -> int:
        """Ranks that share one data-parallel share of the rows (ring x Ulysses)."""
        return self.ulysses_size * self.ring_size

    def check(self) -> list[str]:
        errors = self.model.check_checkpointing("worker.critic.model")
        _check_token_budget(errors, "critic", self.max_tokens_per_micro_batch)
        _check_token_budget(
            errors, "critic", self.max_tokens_per_micro_batch_for_experience, "_for_experience"
        )
        return errors
