"""The critic: values of the states before each response token, and the clipped value-loss update.

The module is a model loaded with ``role="critic"`` (``lm_head`` replaced by ``nn.Linear(hidden, 1)``).
As in verl, the value of response token ``t`` is read at the position that predicts it (the last
prompt token for ``t = 0``), i.e. it estimates the return of the state before the token is chosen.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mmrl.config import CriticConfig
from mmrl.core_algos import LOSS_AGG_MODES, aggregate_loss, compute_value_loss
from mmrl.models.inputs import scatter_response_tokens
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
from mmrl.workers.fsdp_engine import reshard_after_no_grad, token_share
from mmrl.workers.towers import media_step


class ValueCritic:
    """A value model with its optimizer and scheduler, and its config section (value clipping, loss
    aggregation, packing); ``dp_group`` and ``sequence_parallel`` as in :class:`PolicyActor`."""

    def __init__(
        self,
        module: nn.Module,
        config: CriticConfig | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        *,
        max_response_length: int | None = None,
        device: torch.device | str = "cpu",
        dp_group: dist.ProcessGroup | None = None,
        sequence_parallel: SequenceParallelGroups | None = None,
    ):
        self.config = config = config or CriticConfig()
        if config.loss_avg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_avg_mode {config.loss_avg_mode!r} is not one of {LOSS_AGG_MODES}")
        self.sequence_parallel = check_sequence_parallel(sequence_parallel, config.padding_free, dp_group)
        self.module = module
        self.share_prompts = prompts_shared(module, config.share_prompts)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.device = torch.device(device)
        self.dp_group = dp_group
        self.max_response_length = max_response_length

    def _values(self, micro_batch: DataProto) -> torch.Tensor:
        """Values [b, R] float32; 0 on padding (only the valid response tokens are computed)."""
        values, response_valid = micro_batch_token_outputs(
            self.module,
            micro_batch,
            self.config.padding_free,
            self.sequence_parallel,
            self.share_prompts,
        )
        return scatter_response_tokens(values[:, 0].float(), response_valid)

    @torch.no_grad()
    def compute_values(self, data: DataProto, micro_batch_size: int) -> torch.Tensor:
        """Values [B, R] float32 on the CPU (0 on padding)."""
        self.module.eval()
        micro_batches, media, restore = role_micro_batches(self, data, micro_batch_size)
        values = []
        for micro_batch, agreed in zip(micro_batches, media):
            with media_step(self.module, agreed):
                values.append(self._values(micro_batch.to(self.device)).cpu())
        reshard_after_no_grad(self.module)  # no backward frees the root unit's gathered weights
        return torch.cat(values)[torch.from_numpy(restore)]

    def update_critic(
        self,
        data: DataProto,
        mini_batch_size: int,
        micro_batch_size: int,
        ppo_epochs: int,
    ) -> dict[str, float]:
        """Minimise ``compute_value_loss`` (clipped to ``cliprange_value`` around the rollout's
        ``values``, targets ``returns``) aggregated by ``loss_avg_mode``; steps and normalisation as
        :meth:`PolicyActor.update_policy`. Metrics: ``vf_loss``, ``vf_clipfrac``, ``vpred_mean`` (token
        means), ``grad_norm``, ``skipped_steps``, ``lr``, ``padding_ratio``."""
        if self.optimizer is None:
            raise RuntimeError("ValueCritic.update_critic needs an optimizer")
        columns = forward_columns(data, ("response_mask", "values", "returns"))
        return train_role(
            self, columns, self._micro_batch_loss, mini_batch_size, micro_batch_size, ppo_epochs
        )

    def _micro_batch_loss(
        self,
        micro_batch: DataProto,
        num_tokens: torch.Tensor,
        num_seqs: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        batch = micro_batch.batch
        response_mask = batch["response_mask"]
        vpreds = self._values(micro_batch)  # [b, R]
        loss_mat, diagnostics = compute_value_loss(
            vpreds, batch["returns"], batch["values"], response_mask, self.config.cliprange_value
        )
        vf_loss = aggregate_loss(
            loss_mat,
            response_mask,
            self.config.loss_avg_mode,
            global_num_tokens=num_tokens,
            global_num_seqs=num_seqs,
            max_response_length=self.max_response_length,
        )

        shares = {
            "vf_loss": vf_loss.detach(),
            "vf_clipfrac": token_share(diagnostics["vf_clipfrac"], response_mask, num_tokens),
            "vpred_mean": token_share(vpreds, response_mask, num_tokens),
        }
        return vf_loss, shares
