"""The policy: log-probabilities of responses, and the PPO-style update (the losses of
:data:`mmrl.core_algos.POLICY_LOSSES`: PPO, GSPO, GSPO-token, CISPO, SAPO, Clip-Cov, KL-Cov).

Batch columns (:mod:`mmrl.columns`): the forward columns of :mod:`mmrl.workers.forward`; the update
also reads ``response_mask``, ``advantages`` and, unless on-policy, ``old_log_probs`` (and
``ref_log_probs`` with the KL loss, ``rollout_log_probs`` with ``algorithm.rollout_correction`` or
``algorithm.off_policy``), all
[B, R], and with ``mask_truncated_responses`` ``truncated`` [B].

The actor takes its config section (:class:`~mmrl.config.ActorConfig`: loss, clipping,
aggregation, packing) and the algorithm section (the KL loss). The policy loss receives the section
itself (its :class:`~mmrl.config.PolicyLossConfig` part), so a new loss knob is a field there and a
line in the loss; nothing here copies knobs. The entropy bonus's weight comes with each update (the
driver's :class:`~mmrl.core_algos.EntropyController` may change it every step).

``padding_free`` runs every forward on packed rows, with
``share_prompts`` each distinct prompt of a micro-batch once, followed by its responses;
micro-batches hold ``micro_batch_size`` rows, or with ``max_tokens_per_micro_batch`` as many rows as
fit in that many packed tokens. Log-probs and entropies are computed on the valid response tokens
only and laid out as [b, R] with zeros on padding: inside the model's head, ``log_prob_chunk_tokens``
tokens at a time (:mod:`mmrl.models.token_scoring`: [chunk, vocab] logits, in forward and backward),
or with ``log_prob_chunk_tokens`` 0 from the whole [K, vocab] logits.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from mmrl.algorithms import off_policy_objective
from mmrl.config import ActorConfig, AlgorithmConfig
from mmrl.core_algos import (
    LOSS_AGG_MODES,
    aggregate_loss,
    compute_policy_loss,
    entropy_from_logits,
    get_kl_estimator,
    kl_penalty,
    log_probs_from_logits,
    rollout_correction_weights,
    spread_from_logits,
)
from mmrl.models.inputs import ResponseScoring, scatter_response_tokens
from mmrl.models.moe import (
    ROUTED_EXPERTS,
    RouterRecorder,
    forward_routing,
    mean_load_balancing_loss,
    num_experts_of,
    router_metrics,
)
from mmrl.models.token_scoring import token_scoring_head
from mmrl.parallel.sequence import SequenceParallelGroups
from mmrl.protocol import DataProto
from mmrl.workers.forward import (
    check_sequence_parallel,
    forward_columns,
    micro_batch_token_outputs,
    prompts_shared,
    role_micro_batches,
    train_role,
)
from mmrl.workers.fsdp_engine import all_reduce_sum, reshard_after_no_grad, token_share
from mmrl.workers.towers import media_step

ROW_KEY = "_row"  # each row's place in the update's batch (on-policy updates return per-row outputs)
# token means of rollout_correction_weights' diagnostics, logged as actor/<name>_mean or _frac
CORRECTION_METRICS = {
    "rollout_is_weight": "rollout_is_weight_mean",
    "rollout_is_truncated": "rollout_is_truncated_frac",
    "rollout_rs_masked": "rollout_rs_masked_frac",
    "rollout_kl_k1": "rollout_kl_k1",
    "rollout_kl_k3": "rollout_kl_k3",
}


@dataclass
class PolicyUpdate:
    """What :meth:`PolicyActor.update_policy` returns: the step's metrics and, for an on-policy update
    (the batch had no ``old_log_probs``), the log-probs [B, R] and entropies [B, R] it computed before
    its optimizer step, in the batch's row order: exactly what the separate old-log-prob pass would
    have returned."""

    metrics: dict[str, float]
    log_probs: torch.Tensor | None = None
    entropies: torch.Tensor | None = None


class ResponseScores(NamedTuple):
    """A micro-batch's scores of its K valid response tokens (float32 [K] each), and where they are."""

    log_probs: torch.Tensor  # log softmax(logits / temperature) of each token
    entropies: torch.Tensor  # the actor's entropy measure (worker.actor.entropy_top_k)
    response_valid: torch.Tensor  # [b, R]
    full_entropies: torch.Tensor  # the whole vocabulary's entropy, logged only
    spreads: torch.Tensor | None = None  # the collapse-recovery term, when asked for


class PolicyActor:
    """A policy model with its optimizer and scheduler, and the loss settings of its update.

    Without an optimizer it only scores responses (the reference policy). ``dp_group`` holds one rank
    per data-parallel share (None: the default group, or a single process); ``sequence_parallel`` the
    groups of a sequence-parallel layout (then ``dp_group`` is its ``dp_group`` and FSDP spans all ranks).
    """

    def __init__(
        self,
        module: nn.Module,
        config: ActorConfig | None = None,
        algorithm: AlgorithmConfig | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        *,
        max_response_length: int | None = None,
        device: torch.device | str = "cpu",
        dp_group: dist.ProcessGroup | None = None,
        sequence_parallel: SequenceParallelGroups | None = None,
        replay_routing: bool = False,
    ):
        self.config = config = config or ActorConfig()
        algorithm = algorithm or AlgorithmConfig()
        if config.loss_avg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_avg_mode {config.loss_avg_mode!r} is not one of {LOSS_AGG_MODES}")
        config.clip_range  # noqa: B018 (an unknown loss, or a clip it cannot take, fails here, not mid-update)
        # the KL loss term needs the reference's log-probs: only when a reference exists
        self.use_kl_loss = algorithm.use_kl_loss and algorithm.use_reference
        self.kl_penalty, self.kl_coef = algorithm.kl_penalty, algorithm.kl_coef
        if self.use_kl_loss:
            get_kl_estimator(self.kl_penalty)  # fail at construction, not in the middle of the first update
        # weights on the policy loss from the rollout engine's log-probs (None: no correction)
        self.rollout_correction = (
            algorithm.rollout_correction if algorithm.rollout_correction.enabled else None
        )
        # decoupled PPO and the like (algorithm.off_policy): weights from the behaviour log-probs (the
        # objective's function, imported once here rather than in every micro-batch's loss)
        objective = off_policy_objective(algorithm.off_policy)
        self.off_policy = objective.load() if objective is not None else None
        self.algorithm = algorithm
        self.share_prompts = prompts_shared(module, config.share_prompts)
        if config.log_prob_chunk_tokens > 0 and token_scoring_head(module) is None:
            raise ValueError(
                f"log_prob_chunk_tokens={config.log_prob_chunk_tokens} scores tokens in the model's head, "
                f"but {type(module).__name__} has the plain one: build it with "
                "mmrl.models.prepare.prepare_for_training(model, ..., score_tokens=True), or set "
                "worker.actor.log_prob_chunk_tokens=0"
            )
        self.num_experts = num_experts_of(module)  # 0: a dense model
        if config.moe.aux_loss_coef > 0 and not self.num_experts:
            raise ValueError(
                f"worker.actor.moe.aux_loss_coef={config.moe.aux_loss_coef} adds the routers' load-balancing "
                f"loss, but {type(module).__name__} has no MoE routers; set it to 0"
            )
        # a MoE model's routers: metrics and the load-balancing loss; with ``replay_routing`` every
        # pass routes each token by the experts the rollout recorded (the batch's routed_experts)
        self.routers = RouterRecorder(module) if self.num_experts else None
        self.replay_routing = replay_routing
        if replay_routing:
            _check_replayable(module, self.num_experts, config, sequence_parallel)
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.max_response_length = max_response_length
        self.device = torch.device(device)
        self.dp_group = dp_group
        self.sequence_parallel = check_sequence_parallel(sequence_parallel, config.padding_free, dp_group)

    @property
    def version(self) -> int:
        """The policy version: optimizer updates so far (the scheduler advances once per
        :meth:`update_policy` and is checkpointed with the optimizer, so a resumed actor counts on)."""
        return self.lr_scheduler.last_epoch if self.lr_scheduler is not None else 0

    def _response_scores(
        self,
        micro_batch: DataProto,
        temperature: float,
        entropy_grad: bool = False,
        spread_top_k: int = 0,
    ) -> ResponseScores:
        """The valid response tokens' scores (:class:`ResponseScores`): entropies differentiable with
        ``entropy_grad``, the spread term with ``spread_top_k`` > 0."""
        chunk_tokens, top_k = self.config.log_prob_chunk_tokens, self.config.entropy_top_k
        scoring = (
            ResponseScoring(temperature, chunk_tokens, entropy_grad, top_k, spread_top_k)
            if chunk_tokens > 0
            else None
        )
        outputs, response_valid = micro_batch_token_outputs(
            self.module,
            micro_batch,
            self.config.padding_free,
            self.sequence_parallel,
            self.share_prompts,
            scoring,
        )
        if scoring is not None:  # [K, 4]: the head scored the tokens chunk by chunk
            entropies = outputs[:, 1] if entropy_grad else outputs[:, 1].detach()
            spreads = outputs[:, 2] if spread_top_k > 0 else None
            return ResponseScores(outputs[:, 0], entropies, response_valid, outputs[:, 3].detach(), spreads)
        logits = outputs / temperature  # [K, V]
        log_probs = log_probs_from_logits(logits, micro_batch.batch["responses"][response_valid]).float()
        spreads = spread_from_logits(logits.float(), spread_top_k) if spread_top_k > 0 else None
        with torch.no_grad():  # logged only: no graph through the softmax
            full_entropies = entropy_from_logits(logits.detach().float())
            if not entropy_grad:
                entropies = entropy_from_logits(logits.detach().float(), top_k)
        if entropy_grad:
            entropies = entropy_from_logits(logits.float(), top_k)
        return ResponseScores(log_probs, entropies, response_valid, full_entropies, spreads)

    @torch.no_grad()
    def compute_log_probs(
        self, data: DataProto, micro_batch_size: int, temperature: float, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``log softmax(logits / temperature)[responses]`` [B, R] float32 on the CPU, and the entropy
        of the same distribution [B, R] when ``with_entropy``. Padding positions hold 0."""
        self.module.eval()
        log_probs, entropies = [], []
        micro_batches, media, restore = role_micro_batches(self, data, micro_batch_size)
        with self._hooked_routers():
            for micro_batch, agreed in zip(micro_batches, media):
                micro_batch = micro_batch.to(self.device)
                self._begin_routing(micro_batch)
                with media_step(self.module, agreed):
                    scores = self._response_scores(micro_batch, temperature)
                log_probs.append(scatter_response_tokens(scores.log_probs, scores.response_valid).cpu())
                if with_entropy:
                    entropies.append(scatter_response_tokens(scores.entropies, scores.response_valid).cpu())
        reshard_after_no_grad(self.module)  # no backward frees the root unit's gathered weights
        restore = torch.from_numpy(restore)
        return torch.cat(log_probs)[restore], torch.cat(entropies)[restore] if with_entropy else None

    def update_policy(
        self,
        data: DataProto,
        mini_batch_size: int,
        micro_batch_size: int,
        ppo_epochs: int,
        temperature: float,
        *,
        on_policy: bool = False,
        entropy_coeff: float | None = None,
        spread_coeff: float = 0.0,
        lr_scale: float = 1.0,
    ) -> PolicyUpdate:
        """``ppo_epochs`` passes over this rank's rows, one optimizer step per mini-batch; the scheduler
        advances once per call (one training step). Sizes count this rank's rows.

        ``on_policy`` (the driver's :class:`~mmrl.trainer.step_plan.StepPlan` decides): the batch makes
        exactly one optimizer step (``ppo_epochs`` 1, at most ``mini_batch_size`` rows), so the old
        policy is the current one and the ratio's denominator is the update's own log-probs, detached
        (ratio 1, gradient ``A * grad log p``); the batch needs no ``old_log_probs``, the separate no-grad
        pass is saved, and those log-probs and entropies come back in the :class:`PolicyUpdate`.
        ``entropy_coeff``: this step's weight of the entropy bonus (0: the entropy is only measured; the
        driver's controller decides it each step); None: ``worker.actor.entropy_coeff``, a fixed bonus.
        ``spread_coeff``: this step's weight of the collapse-recovery term (the driver's
        :class:`~mmrl.core_algos.CollapseGate`, ``worker.actor.collapse_recovery``); 0: not computed.
        ``lr_scale``: this step's factor on the scheduled learning rate (the driver's
        :class:`~mmrl.core_algos.KLStepControl`, ``worker.actor.kl_step_control``); 1: the schedule's.

        Metrics (mini-batch values averaged over steps, equal on every rank): ``pg_loss``,
        ``pg_clipfrac``, ``pg_clipfrac_dual``, ``ppo_kl`` (k1) and ``ppo_kl_k3`` (k3: ``r - 1 - log r``,
        ``r`` the current over the old probability; how far the step's earlier optimizer steps moved the
        policy), ``entropy`` and ``entropy_full`` (the actor's
        measure, ``entropy_top_k``, and the whole vocabulary's; token means; with clip_cov or kl_cov
        ``pg_covfrac``, the share of tokens the covariance selected), ``kl_loss`` (with the KL loss),
        ``collapse_spread`` (with ``spread_coeff``), ``grad_norm``, ``skipped_steps`` (non-finite
        gradient norm), ``lr``,
        ``padding_ratio`` (padding share of the tokens computed; 0 when padding-free), and with
        ``mask_truncated_responses`` ``truncated_masked_ratio`` (fraction of the rows left out of the
        loss; they need the ``truncated`` column), and with ``algorithm.rollout_correction`` (the batch
        then needs ``rollout_log_probs``) the token means ``rollout_is_weight_mean``,
        ``rollout_is_truncated_frac``, ``rollout_rs_masked_frac``, ``rollout_kl_k1``, ``rollout_kl_k3``
        and, when whole responses are rejected, ``rollout_rs_masked_seq_frac``; with a MoE model
        ``moe_aux_loss``, ``moe_max_expert_share`` and ``moe_router_entropy`` (:mod:`mmrl.models.moe`;
        micro-batch values weighted by their response tokens); with ``algorithm.off_policy`` (it too
        needs ``rollout_log_probs``) its diagnostics' token means (decoupled: ``behaviour_weight``,
        ``behaviour_over_cap``, ``behaviour_kl``).
        """
        if self.optimizer is None:
            raise RuntimeError(
                "PolicyActor.update_policy needs an optimizer; this actor only scores (reference)"
            )
        if on_policy and (ppo_epochs != 1 or len(data) > mini_batch_size):
            raise ValueError(
                f"an on-policy update takes no old_log_probs, which is only right when it makes one "
                f"optimizer step (ppo_epochs={ppo_epochs}, {len(data)} rows for mini-batches of "
                f"{mini_batch_size}); compute them first (PolicyActor.compute_log_probs)"
            )
        extra_keys = ("response_mask", "advantages") + (() if on_policy else ("old_log_probs",))
        extra_keys += ("ref_log_probs",) if self.use_kl_loss else ()
        behaviour = self.rollout_correction is not None or self.off_policy is not None
        extra_keys += ("rollout_log_probs",) if behaviour else ()
        columns = forward_columns(data, extra_keys)
        truncated_ratio = None
        if self.config.mask_truncated_responses:
            columns.batch["response_mask"], truncated_ratio = self._mask_truncated(data)
        outputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        if on_policy:
            outputs = []
            columns.batch[ROW_KEY] = torch.arange(len(data))
        loss = functools.partial(
            self._micro_batch_loss,
            temperature=temperature,
            entropy_coeff=self.config.entropy_coeff if entropy_coeff is None else entropy_coeff,
            on_policy_outputs=outputs,
            spread_coeff=spread_coeff,
        )
        with self._hooked_routers():  # through backward: recomputed layers route as in their forward
            metrics = train_role(
                self, columns, loss, mini_batch_size, micro_batch_size, ppo_epochs, lr_scale=lr_scale
            )
        if truncated_ratio is not None:
            metrics["truncated_masked_ratio"] = truncated_ratio
        if not outputs:
            return PolicyUpdate(metrics)
        rows, log_probs, entropies = (torch.cat(parts) for parts in zip(*outputs))
        restore = torch.argsort(rows)
        return PolicyUpdate(metrics, log_probs[restore], entropies[restore])

    def _mask_truncated(self, data: DataProto) -> tuple[torch.Tensor, float]:
        """``response_mask`` [B, R] with the rows of truncated responses (``truncated``: cut at the
        maximum length without EOS, DAPO's overlong filtering) zeroed, and the fraction of rows masked
        over all data-parallel ranks. A zeroed row adds nothing to any loss term (policy, entropy, KL)
        nor to the token and sequence counts that normalise them (``global_counts``), so the update is
        the one of the batch without those rows."""
        truncated = data.batch["truncated"].bool()  # [B]
        counts = torch.tensor([float(truncated.sum()), float(len(truncated))], device=self.device)
        all_reduce_sum(counts, self.dp_group)
        response_mask = data.batch["response_mask"].masked_fill(truncated.unsqueeze(-1), 0)
        return response_mask, float(counts[0] / counts[1].clamp(min=1.0))

    def _micro_batch_loss(
        self,
        micro_batch: DataProto,
        num_tokens: torch.Tensor,
        num_seqs: torch.Tensor,
        temperature: float,
        entropy_coeff: float = 0.0,
        on_policy_outputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
        spread_coeff: float = 0.0,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the mini-batch loss
        ``pg_loss - entropy_coeff * entropy + kl_coef * kl + spread_coeff * spread`` (each aggregated by
        ``loss_avg_mode``; the spread term only with ``spread_coeff`` != 0).
        On-policy (``on_policy_outputs`` given) the old log-probs are this pass's own, detached, and
        (rows, log-probs, entropies) are appended to ``on_policy_outputs``."""
        config, batch = self.config, micro_batch.batch
        response_mask = batch["response_mask"]
        aggregate = functools.partial(
            aggregate_loss,
            mask=response_mask,
            mode=config.loss_avg_mode,
            global_num_tokens=num_tokens,
            global_num_seqs=num_seqs,
            max_response_length=self.max_response_length,
        )
        entropy_bonus = entropy_coeff != 0.0
        spread_top_k = config.collapse_recovery.top_k if spread_coeff != 0.0 else 0
        self._begin_routing(micro_batch)
        scores = self._response_scores(micro_batch, temperature, entropy_bonus, spread_top_k)  # [K] each
        response_valid = scores.response_valid
        log_probs = scatter_response_tokens(scores.log_probs, response_valid)  # [b, R]
        entropy = scatter_response_tokens(scores.entropies, response_valid)  # [b, R]
        old_log_probs = log_probs.detach() if on_policy_outputs is not None else batch["old_log_probs"]
        pg_loss_mat, diagnostics = compute_policy_loss(
            old_log_probs, log_probs, batch["advantages"], response_mask, config
        )
        correction_shares = {}
        if self.rollout_correction is not None:
            pg_loss_mat, correction_shares = self._corrected(
                pg_loss_mat, old_log_probs, batch["rollout_log_probs"], response_mask, num_tokens, num_seqs
            )
        if self.off_policy is not None:  # the proximal policy is the old one: the ratio's denominator
            weights, off_policy_diagnostics = self.off_policy(
                old_log_probs, batch["rollout_log_probs"], response_mask, self.algorithm
            )
            pg_loss_mat = pg_loss_mat * weights
            correction_shares.update(
                {
                    key: token_share(value, response_mask, num_tokens)
                    for key, value in off_policy_diagnostics.items()
                }
            )
        pg_loss = aggregate(pg_loss_mat)
        loss = pg_loss
        if entropy_bonus:
            loss = loss - entropy_coeff * aggregate(entropy)
        spread_share = {}
        if scores.spreads is not None:  # only while the driver's gate sees a collapse
            spread = aggregate(scatter_response_tokens(scores.spreads, response_valid))
            loss = loss + spread_coeff * spread
            spread_share["collapse_spread"] = spread.detach()

        if on_policy_outputs is not None:
            on_policy_outputs.append(
                (batch[ROW_KEY].cpu(), old_log_probs.float().cpu(), entropy.detach().float().cpu())
            )
        log_ratio = (log_probs - old_log_probs).detach()
        shares = {
            "pg_loss": pg_loss.detach(),
            **{key: token_share(value, response_mask, num_tokens) for key, value in diagnostics.items()},
            "ppo_kl_k3": token_share(torch.expm1(log_ratio) - log_ratio, response_mask, num_tokens),
            "entropy": token_share(entropy, response_mask, num_tokens),
            "entropy_full": token_share(
                scatter_response_tokens(scores.full_entropies, response_valid), response_mask, num_tokens
            ),
            **correction_shares,
            **spread_share,
        }
        if self.use_kl_loss:
            kl_loss = aggregate(kl_penalty(log_probs, batch["ref_log_probs"], self.kl_penalty))
            loss = loss + self.kl_coef * kl_loss
            shares["kl_loss"] = kl_loss.detach()
        if self.routers is not None:
            weight = response_mask.sum() / num_tokens.clamp(min=1.0)
            loss = self._add_router_terms(loss, shares, self.routers, weight)
        return loss, shares

    def _hooked_routers(self) -> contextlib.AbstractContextManager:
        return self.routers.hooked() if self.routers is not None else contextlib.nullcontext()

    def _begin_routing(self, micro_batch: DataProto) -> None:
        """A new forward for the routers: recorded calls cleared, and with ``replay_routing`` the
        micro-batch's recorded experts laid out as its forward's routers see the tokens."""
        if self.routers is None:
            return
        replay = None
        if self.replay_routing:
            batch = micro_batch.batch
            if ROUTED_EXPERTS not in batch.keys():
                raise KeyError(
                    f"routing replay: the batch has no {ROUTED_EXPERTS!r} column; the transformers rollout "
                    "records it when worker.actor.moe.routing_replay=true"
                )
            replay = forward_routing(batch[ROUTED_EXPERTS], batch["attention_mask"], self.config.padding_free)
        self.routers.begin(replay)

    def _add_router_terms(
        self,
        loss: torch.Tensor,
        shares: dict[str, torch.Tensor],
        routers: RouterRecorder,
        weight: torch.Tensor,
    ) -> torch.Tensor:
        """``loss`` plus ``moe.aux_loss_coef`` times this micro-batch's load-balancing loss, both weighted
        by ``weight`` (its share of the mini-batch's response tokens, so that the micro-batches' terms
        sum to a token-weighted mean); the router metrics' shares go into ``shares``."""
        aux_loss = mean_load_balancing_loss(routers.calls, self.num_experts)
        shares["moe_aux_loss"] = aux_loss.detach() * weight
        for name, value in router_metrics(routers.calls, self.num_experts).items():
            shares[name] = value * weight
        coef = self.config.moe.aux_loss_coef
        return loss + coef * weight * aux_loss if coef > 0 else loss

    def _corrected(
        self,
        pg_loss_mat: torch.Tensor,
        old_log_probs: torch.Tensor,
        rollout_log_probs: torch.Tensor,
        response_mask: torch.Tensor,
        num_tokens: torch.Tensor,
        num_seqs: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The per-token policy loss [b, R] times the rollout-correction weights, and the micro-batch's
        shares of their metrics (token means; ``rollout_rs_masked_seq_frac``: responses rejected whole)."""
        weights, diagnostics = rollout_correction_weights(
            old_log_probs, rollout_log_probs, response_mask, self.rollout_correction
        )
        shares = {
            name: token_share(diagnostics[key], response_mask, num_tokens)
            for key, name in CORRECTION_METRICS.items()
        }
        if self.rollout_correction.rollout_rs in ("sequence", "geometric"):
            rejected = (diagnostics["rollout_rs_masked"].sum(-1) > 0).float()  # [b]: whole responses
            shares["rollout_rs_masked_seq_frac"] = rejected.sum() / num_seqs.clamp(min=1.0)
        return pg_loss_mat * weights, shares


def _check_replayable(
    module: nn.Module, num_experts: int, config: ActorConfig, sequence_parallel: SequenceParallelGroups | None
) -> None:
    """Routing replay lays the recorded experts out as one padded or packed forward sees the tokens."""
    if not num_experts:
        raise ValueError(f"routing replay needs a MoE model; {type(module).__name__} has no routers")
    if config.padding_free and config.share_prompts:
        raise ValueError(
            "routing replay: set worker.actor.share_prompts=false (shared prompts reorder tokens)"
        )
    if sequence_parallel is not None and sequence_parallel.size > 1:
        raise ValueError(
            "routing replay: sequence parallelism (ulysses_size, ring_size > 1) is not supported"
        )
