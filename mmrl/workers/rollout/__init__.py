"""Rollout: sampling responses for a batch of prompts, with weights pushed in after every update.

Two backends implement :class:`Rollout`: ``hf`` (transformers, :mod:`.hf`) and ``vllm`` (vLLM in SPMD
mode, :mod:`.vllm_spmd`). Both return the same batch layout (see :func:`assemble_rollout_batch`), and
both generate model turns for the agent loop (:class:`mmrl.agent.backend.TurnBackend`), which runs
multi-turn trajectories with either.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum
from typing import Any, Protocol

import torch

from mmrl.protocol import DataProto
from mmrl.sampling import SamplingParams  # where the backends and the agent loop both read it


class GenerationMode(Enum):
    """What a generation is for; it decides the sampling settings (:func:`mmrl.workers.rollout.engine.sampling_params`)."""

    TRAIN = "train"  # worker.rollout sampling, n responses per prompt, scored and trained on
    VALIDATE = "validate"  # worker.rollout.val_override_config applied; scored only
    GREEDY = "greedy"  # one greedy response per prompt (ReMax's baseline); scored only


class Rollout(Protocol):
    def generate(self, prompts: DataProto, sampling: SamplingParams) -> DataProto:
        """Prompts (left-padded, see ``mmrl.data.collate``) → ``len(prompts) * n`` responses."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new policy weights, given one full tensor at a time under Hugging Face names."""


def eos_token_ids(tokenizer: Any, generation_config: Any | None) -> list[int]:
    """EOS ids from the model's generation config (may be several) and the tokenizer."""
    ids = set()
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def response_mask_until_eos(
    responses: torch.Tensor, eos_token_ids: list[int], ignore_eos: bool = False
) -> torch.Tensor:
    """``[B, R]`` 1 up to and including each row's first EOS token, 0 after (all 1 without EOS)."""
    if ignore_eos:
        return torch.ones_like(responses)
    is_eos = torch.isin(responses, torch.tensor(eos_token_ids, device=responses.device))
    # eos_before[t] counts EOS tokens strictly before position t
    eos_before = torch.cumsum(is_eos.long(), dim=-1) - is_eos.long()
    return (eos_before == 0).long()


def truncated_responses(
    responses: torch.Tensor, response_mask: torch.Tensor, eos_token_ids: list[int]
) -> torch.Tensor:
    """``[B]`` 1 for responses cut at the width R (the maximum response length) before they ended: the
    last position is valid and its token is not an EOS token; 0 for responses that ended (an EOS on
    the last position included)."""
    ends_with_eos = torch.isin(responses[:, -1], torch.tensor(eos_token_ids, device=responses.device))
    return (response_mask[:, -1].bool() & ~ends_with_eos).long()


def assemble_rollout_batch(
    prompts: DataProto,
    responses: torch.Tensor,
    eos_token_ids: list[int],
    pad_token_id: int,
    ignore_eos: bool = False,
    rollout_log_probs: torch.Tensor | None = None,
) -> DataProto:
    """Join the (already repeated) prompt batch with its ``[B, R]`` responses into a training batch.

    Adds ``prompts``, ``responses``, ``response_mask``, ``truncated``, and extends ``input_ids``, ``attention_mask``
    (and ``mm_token_type_ids``) over the response; tokens after EOS become ``pad_token_id``.
    """
    response_mask = response_mask_until_eos(responses, eos_token_ids, ignore_eos)
    truncated = truncated_responses(responses, response_mask, eos_token_ids)
    responses = responses.masked_fill(response_mask == 0, pad_token_id)
    batch = prompts.batch
    tensors = {
        "prompts": batch["input_ids"],
        "responses": responses,
        "response_mask": response_mask,
        "truncated": truncated,
        "input_ids": torch.cat([batch["input_ids"], responses], dim=-1),  # [B, P+R]
        "attention_mask": torch.cat([batch["attention_mask"], response_mask], dim=-1),
    }
    if "mm_token_type_ids" in batch.keys():
        tensors["mm_token_type_ids"] = torch.cat(
            [batch["mm_token_type_ids"], torch.zeros_like(responses)], dim=-1
        )
    if rollout_log_probs is not None:
        tensors["rollout_log_probs"] = rollout_log_probs.masked_fill(response_mask == 0, 0.0)
    return DataProto.from_dict(
        tensors=tensors, non_tensors=dict(prompts.non_tensor_batch), meta_info=dict(prompts.meta_info)
    )
