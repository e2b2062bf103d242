"""The policy: log-probabilities of responses, and the PPO-style update (PPO, GSPO, CISPO losses).

Batch keys (see the engine contract): ``input_ids``/``attention_mask`` [B, P + R], ``responses`` and
``response_mask`` [B, R], optional ``mm_token_type_ids`` [B, P + R] and the object column
``multi_modal_inputs``; the update also reads ``old_log_probs`` and ``advantages`` (and
``ref_log_probs`` with the KL loss), all [B, R].

``padding_free`` runs every forward on packed rows (no padding token computed), with ``share_prompts``
each distinct prompt of a micro-batch once, followed by its responses; micro-batches hold
``micro_batch_size`` rows, or with ``max_tokens_per_micro_batch`` as many rows as fit in that many
packed tokens. Either way, log-probs and entropies are computed on the valid response tokens only
([K, vocab] logits, never [b, R, vocab]) and laid out as [b, R] with zeros on padding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mmrl.models.inputs import response_token_outputs, scatter_response_tokens, sequence_position_ids
from mmrl.parallel.sequence import SequenceParallelGroups
from mmrl.protocol import DataProto
from mmrl.trainer.core_algos import (
    LOSS_AGG_MODES,
    aggregate_loss,
    entropy_from_logits,
    get_kl_estimator,
    get_policy_loss,
    kl_penalty,
    log_probs_from_logits,
)
from mmrl.workers.fsdp_engine import micro_batch_rows, token_share, train_on_batch

FORWARD_KEYS = ("input_ids", "attention_mask", "responses")
OPTIONAL_FORWARD_KEYS = ("mm_token_type_ids", "position_ids")
MEDIA_COLUMN = "multi_modal_inputs"
ROW_KEY = "_row"  # each row's place in the update's batch (on-policy updates return per-row outputs)


@dataclass
class PolicyUpdate:
    """What :meth:`PolicyActor.update_policy` returns: the step's metrics and, for an on-policy update
    (the batch had no ``old_log_probs``), the log-probs [B, R] and entropies [B, R] it computed before
    its optimizer step, in the batch's row order: exactly what the separate old-log-prob pass would
    have returned."""

    metrics: dict[str, float]
    log_probs: torch.Tensor | None = None
    entropies: torch.Tensor | None = None


def forward_columns(data: DataProto, extra_keys: tuple[str, ...] = ()) -> DataProto:
    """The columns a forward pass needs (plus ``extra_keys``), so micro-batches move nothing else."""
    batch_keys = [*FORWARD_KEYS, *extra_keys]
    batch_keys += [key for key in OPTIONAL_FORWARD_KEYS if key in data.batch.keys()]
    missing = [key for key in batch_keys if key not in data.batch.keys()]
    if missing:
        raise KeyError(f"the batch lacks {missing}; it has {sorted(data.batch.keys())}")
    media = [MEDIA_COLUMN] if MEDIA_COLUMN in data.non_tensor_batch else []
    return data.select(batch_keys=batch_keys, non_tensor_keys=media, meta_info_keys=[])


def forward_arguments(data: DataProto) -> tuple:
    """``(input_ids, attention_mask, response_length, multi_modal_inputs, mm_token_type_ids)`` of a
    batch: the leading arguments of the forward helpers of :mod:`mmrl.models.inputs`."""
    batch = data.batch
    media = data.non_tensor_batch.get(MEDIA_COLUMN)
    return (
        batch["input_ids"],
        batch["attention_mask"],
        batch["responses"].shape[-1],
        None if media is None else list(media),
        batch["mm_token_type_ids"] if "mm_token_type_ids" in batch.keys() else None,
    )


def add_position_ids(module: nn.Module, data: DataProto) -> DataProto:
    """``data`` (a rollout batch) with its ``position_ids`` column, numbered once per distinct prompt by
    :func:`mmrl.models.inputs.sequence_position_ids`; every later pass reads them instead of running
    ``get_rope_index`` per row."""
    data.batch["position_ids"] = sequence_position_ids(module, *forward_arguments(data))
    return data


def micro_batch_token_outputs(
    module: nn.Module,
    micro_batch: DataProto,
    padding_free: bool,
    sequence_parallel: SequenceParallelGroups | None = None,
    share_prompts: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's head outputs predicting the K valid response tokens, [K, D], and where those tokens
    are, ``response_valid`` [b, R] (see ``mmrl.models.inputs.response_token_outputs``)."""
    batch = micro_batch.batch
    return response_token_outputs(
        module,
        *forward_arguments(micro_batch),
        padding_free=padding_free,
        sequence_parallel=sequence_parallel,
        position_ids=batch["position_ids"] if "position_ids" in batch.keys() else None,
        share_prompts=share_prompts,
    )


def check_sequence_parallel(
    sequence_parallel: SequenceParallelGroups | None, padding_free: bool, dp_group: dist.ProcessGroup | None
) -> SequenceParallelGroups | None:
    """``sequence_parallel`` when it splits rows (None for size 1), after checking its requirements."""
    if sequence_parallel is None or sequence_parallel.size == 1:
        return None
    if not padding_free:
        raise ValueError("sequence parallelism runs on packed rows: set padding_free=true")
    if dp_group is not sequence_parallel.dp_group:
        raise ValueError("with sequence parallelism, dp_group must be sequence_parallel.dp_group")
    return sequence_parallel


def fsdp_size(sequence_parallel: SequenceParallelGroups | None) -> int | None:
    """Ranks FSDP averages over when they are more than the data-parallel ones (sequence parallelism)."""
    if sequence_parallel is None:
        return None
    return sequence_parallel.size * sequence_parallel.dp_size


def forward_micro_batches(
    data: DataProto,
    micro_batch_size: int,
    max_tokens_per_micro_batch: int | None,
    device: torch.device | str,
    group: dist.ProcessGroup | None,
) -> tuple[list[DataProto], np.ndarray]:
    """``data``'s micro-batches for a forward-only pass (still where ``data`` is), and ``restore``: the
    row order that puts the micro-batches' concatenated outputs back in the order of ``data``.
    ``device`` is where the micro-batch count is agreed on with the other ranks (a token budget)."""
    attention_mask = data.batch["attention_mask"].to(device)
    groups = micro_batch_rows(attention_mask, micro_batch_size, max_tokens_per_micro_batch, group)
    order = np.concatenate([np.asarray(rows, dtype=np.int64) for rows in groups])
    return [data[rows] for rows in groups], np.argsort(order)


class PolicyActor:
    """A policy model with its optimizer and scheduler, and the loss settings of its update.

    Without an optimizer it only scores responses (the reference policy). ``dp_group`` holds one rank
    per data-parallel share (None: the default group, or a single process); ``sequence_parallel`` the
    groups of a sequence-parallel layout (then ``dp_group`` is its ``dp_group`` and FSDP spans all ranks).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        *,
        device: torch.device | str = "cpu",
        dp_group: dist.ProcessGroup | None = None,
        loss_type: str = "ppo",
        loss_avg_mode: str = "token_mean",
        clip_ratio_low: float = 0.2,
        clip_ratio_high: float = 0.3,
        clip_ratio_dual: float | None = None,
        entropy_coeff: float = 0.0,
        use_kl_loss: bool = False,
        kl_penalty: str = "low_var_kl",
        kl_coef: float = 0.0,
        max_grad_norm: float = 1.0,
        max_response_length: int | None = None,
        padding_free: bool = True,
        share_prompts: bool = True,
        max_tokens_per_micro_batch: int | None = None,
        sequence_parallel: SequenceParallelGroups | None = None,
    ):
        if loss_avg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_avg_mode {loss_avg_mode!r} is not one of {LOSS_AGG_MODES}")
        self.policy_loss_fn = get_policy_loss(loss_type)
        if use_kl_loss:
            get_kl_estimator(kl_penalty)  # fail at construction, not in the middle of the first update
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.device = torch.device(device)
        self.dp_group = dp_group
        self.loss_type = loss_type
        self.loss_avg_mode = loss_avg_mode
        self.clip_ratio_low = clip_ratio_low
        self.clip_ratio_high = clip_ratio_high
        self.clip_ratio_dual = clip_ratio_dual
        self.entropy_coeff = entropy_coeff
        self.use_kl_loss = use_kl_loss
        self.kl_penalty = kl_penalty
        self.kl_coef = kl_coef
        self.max_grad_norm = max_grad_norm
        self.max_response_length = max_response_length
        self.padding_free = padding_free
        self.share_prompts = share_prompts
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch
        self.sequence_parallel = check_sequence_parallel(sequence_parallel, padding_free, dp_group)

    def _response_logits(
        self, micro_batch: DataProto, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``logits / temperature`` at the valid response tokens [K, V], and ``response_valid`` [b, R]."""
        logits, response_valid = micro_batch_token_outputs(
            self.module, micro_batch, self.padding_free, self.sequence_parallel, self.share_prompts
        )
        return logits / temperature, response_valid

    @torch.no_grad()
    def compute_log_probs(
        self, data: DataProto, micro_batch_size: int, temperature: float, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``log softmax(logits / temperature)[responses]`` [B, R] float32 on the CPU, and the entropy
        of the same distribution [B, R] when ``with_entropy``. Padding positions hold 0."""
        self.module.eval()
        log_probs, entropies = [], []
        micro_batches, restore = forward_micro_batches(
            forward_columns(data),
            micro_batch_size,
            self.max_tokens_per_micro_batch,
            self.device,
            self.dp_group,
        )
        for micro_batch in micro_batches:
            micro_batch = micro_batch.to(self.device)
            logits, response_valid = self._response_logits(micro_batch, temperature)  # [K, V]
            tokens = micro_batch.batch["responses"][response_valid]  # [K]
            token_log_probs = log_probs_from_logits(logits, tokens).float()
            log_probs.append(scatter_response_tokens(token_log_probs, response_valid).cpu())
            if with_entropy:
                entropy = entropy_from_logits(logits.float())
                entropies.append(scatter_response_tokens(entropy, response_valid).cpu())
        restore = torch.from_numpy(restore)
        return torch.cat(log_probs)[restore], torch.cat(entropies)[restore] if with_entropy else None

    def update_policy(
        self,
        data: DataProto,
        mini_batch_size: int,
        micro_batch_size: int,
        ppo_epochs: int,
        temperature: float,
    ) -> PolicyUpdate:
        """``ppo_epochs`` passes over this rank's rows, one optimizer step per mini-batch; the scheduler
        advances once per call (one training step). Sizes count this rank's rows.

        On-policy: without an ``old_log_probs`` column the batch must make exactly one optimizer step
        (``ppo_epochs`` 1, at most ``mini_batch_size`` rows). The old policy is then the current one, so
        the ratio's denominator is the update's own log-probs, detached (ratio 1, gradient
        ``A * grad log p``), and the separate no-grad pass over the batch is saved; those log-probs and
        entropies come back in the :class:`PolicyUpdate`.

        Metrics (mini-batch values averaged over steps, equal on every rank): ``pg_loss``,
        ``pg_clipfrac``, ``pg_clipfrac_dual``, ``ppo_kl``, ``entropy`` (token means), ``kl_loss``
        (with the KL loss), ``grad_norm``, ``skipped_steps`` (non-finite gradient norm), ``lr``,
        ``padding_ratio`` (padding share of the tokens computed; 0 when padding-free).
        """
        if self.optimizer is None:
            raise RuntimeError(
                "PolicyActor.update_policy needs an optimizer; this actor only scores (reference)"
            )
        on_policy = "old_log_probs" not in data.batch.keys()
        if on_policy and (ppo_epochs != 1 or len(data) > mini_batch_size):
            raise ValueError(
                f"the batch has no old_log_probs, which is only allowed when it makes one optimizer step "
                f"(ppo_epochs={ppo_epochs}, {len(data)} rows for mini-batches of {mini_batch_size}); "
                "compute them first (PolicyActor.compute_log_probs)"
            )
        extra_keys = ("response_mask", "advantages") + (() if on_policy else ("old_log_probs",))
        extra_keys += ("ref_log_probs",) if self.use_kl_loss else ()
        columns = forward_columns(data, extra_keys)
        outputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        if on_policy:
            outputs = []
            columns.batch[ROW_KEY] = torch.arange(len(data))
        self.module.train()
        metrics = train_on_batch(
            self.module,
            self.optimizer,
            columns,
            functools.partial(self._micro_batch_loss, temperature=temperature, on_policy_outputs=outputs),
            mini_batch_size=mini_batch_size,
            micro_batch_size=micro_batch_size,
            epochs=ppo_epochs,
            max_grad_norm=self.max_grad_norm,
            device=self.device,
            group=self.dp_group,
            max_tokens_per_micro_batch=self.max_tokens_per_micro_batch,
            padding_free=self.padding_free,
            fsdp_size=fsdp_size(self.sequence_parallel),
        )
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        if not outputs:
            return PolicyUpdate(metrics)
        rows, log_probs, entropies = (torch.cat(parts) for parts in zip(*outputs))
        restore = torch.argsort(rows)
        return PolicyUpdate(metrics, log_probs[restore], entropies[restore])

    def _micro_batch_loss(
        self,
        micro_batch: DataProto,
        num_tokens: torch.Tensor,
        num_seqs: torch.Tensor,
        temperature: float,
        on_policy_outputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's share of the mini-batch loss
        ``pg_loss - entropy_coeff * entropy + kl_coef * kl`` (each aggregated by ``loss_avg_mode``).
        On-policy (``on_policy_outputs`` given) the old log-probs are this pass's own, detached, and
        (rows, log-probs, entropies) are appended to ``on_policy_outputs``."""
        batch = micro_batch.batch
        response_mask = batch["response_mask"]
        aggregate = functools.partial(
            aggregate_loss,
            mask=response_mask,
            mode=self.loss_avg_mode,
            global_num_tokens=num_tokens,
            global_num_seqs=num_seqs,
            max_response_length=self.max_response_length,
        )
        logits, response_valid = self._response_logits(micro_batch, temperature)  # [K, V]
        token_log_probs = log_probs_from_logits(logits, batch["responses"][response_valid])  # [K]
        log_probs = scatter_response_tokens(token_log_probs, response_valid)  # [b, R]
        old_log_probs = log_probs.detach() if on_policy_outputs is not None else batch["old_log_probs"]
        pg_loss_mat, diagnostics = self.policy_loss_fn(
            old_log_probs,
            log_probs,
            batch["advantages"],
            response_mask,
            clip_ratio_low=self.clip_ratio_low,
            clip_ratio_high=self.clip_ratio_high,
            clip_ratio_dual=self.clip_ratio_dual,
        )
        pg_loss = aggregate(pg_loss_mat)
        loss = pg_loss
        if self.entropy_coeff != 0.0:
            entropy = scatter_response_tokens(entropy_from_logits(logits.float()), response_valid)
            loss = loss - self.entropy_coeff * aggregate(entropy)
        else:  # logged only: no graph through the softmax
            with torch.no_grad():
                entropy = scatter_response_tokens(
                    entropy_from_logits(logits.detach().float()), response_valid
                )

        if on_policy_outputs is not None:
            on_policy_outputs.append(
                (batch[ROW_KEY].cpu(), old_log_probs.float().cpu(), entropy.detach().float().cpu())
            )
        shares = {
            "pg_loss": pg_loss.detach(),
            "pg_clipfrac": token_share(diagnostics["pg_clipfrac"], response_mask, num_tokens),
            "pg_clipfrac_dual": token_share(diagnostics["pg_clipfrac_dual"], response_mask, num_tokens),
            "ppo_kl": token_share(diagnostics["ppo_kl"], response_mask, num_tokens),
            "entropy": token_share(entropy, response_mask, num_tokens),
        }
        if self.use_kl_loss:
            kl_loss = aggregate(kl_penalty(log_probs, batch["ref_log_probs"], self.kl_penalty))
            loss = loss + self.kl_coef * kl_loss
            shares["kl_loss"] = kl_loss.detach()
        return loss, shares
