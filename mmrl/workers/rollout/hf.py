"""Transformers ``generate`` rollout: the fallback where vLLM is absent (and the CPU demo's default).

It keeps its own unsharded copy of the policy on the worker's device; after every actor update the
new weights are copied in (``update_weights``), one tensor at a time, exactly as the vLLM backend
receives them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from transformers import GenerationConfig

from mmrl.models.inputs import concat_multi_modal_inputs
from mmrl.protocol import DataProto
from mmrl.workers.rollout import SamplingParams, assemble_rollout_batch
from mmrl.workers.weight_sync import load_into

# Tokens that only the processor may place: sampling one breaks re-scoring of the response
# ("Image features and image tokens do not match"), so they are suppressed during generation.
MULTIMODAL_PLACEHOLDERS = (
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|audio_pad|>",
    "<|AUDIO|>",
    "<|IMAGE|>",
    "<|VIDEO|>",
    "<|audio_bos|>",
    "<|audio_eos|>",
    "<|vision_bos|>",
    "<|vision_eos|>",
    "<|audio_start|>",
    "<|audio_end|>",
)


def placeholder_token_ids(tokenizer: Any) -> list[int]:
    """Ids of the multimodal placeholder tokens this tokenizer knows (never to be sampled)."""
    vocab = tokenizer.get_vocab()
    return sorted({vocab[token] for token in MULTIMODAL_PLACEHOLDERS if token in vocab})


def eos_token_ids(tokenizer: Any, generation_config: GenerationConfig | None) -> list[int]:
    """EOS ids from the model's generation config (may be several) and the tokenizer."""
    ids = set()
    configured = getattr(generation_config, "eos_token_id", None)
    if configured is not None:
        ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


class HFRollout:
    """Samples with ``model.generate`` on this process's share of the prompts."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        micro_batch_size: int = 64,
        return_log_probs: bool = False,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.micro_batch_size = micro_batch_size
        self.return_log_probs = return_log_probs
        self.eos_token_ids = eos_token_ids(tokenizer, getattr(model, "generation_config", None))
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        )
        self.blocked_token_ids = placeholder_token_ids(tokenizer)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_into(self.model, named_tensors)  # every tensor must arrive: a partial sync is an error

    def _generation_config(self, sampling: SamplingParams) -> GenerationConfig:
        return GenerationConfig(
            do_sample=not sampling.greedy,
            temperature=sampling.temperature if not sampling.greedy else None,
            top_p=sampling.top_p if not sampling.greedy else None,
            top_k=(sampling.top_k if sampling.top_k > 0 else 0) if not sampling.greedy else None,
            max_new_tokens=sampling.max_tokens,
            min_new_tokens=sampling.max_tokens if sampling.ignore_eos else None,
            eos_token_id=None if sampling.ignore_eos else self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            suppress_tokens=self.blocked_token_ids or None,
            output_logits=self.return_log_probs,
            return_dict_in_generate=True,
        )

    def _generate_micro_batch(
        self, batch: DataProto, sampling: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = self.device
        inputs = {
            "input_ids": batch.batch["input_ids"].to(device),
            "attention_mask": batch.batch["attention_mask"].to(device),
        }
        if "mm_token_type_ids" in batch.batch.keys():
            inputs["mm_token_type_ids"] = batch.batch["mm_token_type_ids"].to(device)
        if "multi_modal_inputs" in batch.non_tensor_batch:
            inputs.update(
                concat_multi_modal_inputs(list(batch.non_tensor_batch["multi_modal_inputs"]), device)
            )
        prompt_width = inputs["input_ids"].shape[-1]
        output = self.model.generate(**inputs, generation_config=self._generation_config(sampling))
        responses = output.sequences[:, prompt_width:]  # [b, r <= max_tokens]
        log_probs = None
        if self.return_log_probs:
            logits = torch.stack(output.logits, dim=1).float()  # [b, r, V], raw (before processors)
            if not sampling.greedy:
                logits = logits / sampling.temperature
            log_probs = torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        return responses, log_probs

    def _pad_width(self, tensor: torch.Tensor, width: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1]), value=value)

    def generate(self, prompts: DataProto, sampling: SamplingParams) -> DataProto:
        expanded = prompts.repeat(sampling.n, interleave=True)  # [a, a, b, b]: uid order kept
        torch.manual_seed(sampling.seed)  # the worker passes a per-step, per-rank seed
        responses, log_probs = [], []
        for part in expanded.split(self.micro_batch_size):
            part_responses, part_log_probs = self._generate_micro_batch(part, sampling)
            responses.append(self._pad_width(part_responses.cpu(), sampling.max_tokens, self.pad_token_id))
            if part_log_probs is not None:
                log_probs.append(self._pad_width(part_log_probs.cpu(), sampling.max_tokens, 0.0))
        return assemble_rollout_batch(
            expanded,
            torch.cat(responses, dim=0),
            self.eos_token_ids,
            self.pad_token_id,
            ignore_eos=sampling.ignore_eos,
            rollout_log_probs=torch.cat(log_probs, dim=0) if log_probs else None,
        )
