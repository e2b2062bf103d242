"""The seam between the agent loop and a rollout backend: turn-level generation.

The agent loop (:mod:`mmrl.agent.loop`) owns every trajectory from its prompt to its end; a backend
only samples model turns. :class:`TurnBackend` is all it needs of one: given a batch of prompts (one
row per trajectory) and the sampling settings, a :data:`GenerateTurns` function that samples one model
turn for each of a list of :class:`TurnRequest` (a prompt row, the trajectory so far as token ids with
its observations' media, and the tokens it may add) and returns each as a :class:`SampledTurn`: the
sampled ids, ending with an end-of-turn id (EOS) unless ``max_tokens`` cut it, and their log-probs
(``log_softmax(logits / T)``, as the trainer scores them). Ids past the first EOS or ``max_tokens``
may come back (a batched decode samples on): the loop drops them.

A backend continues a trajectory from its context, built in the backend's form from the prompt row
and the trajectory: :func:`trajectory_contexts` is the processor's form (placeholders expanded, the
prompt's and the observations' ``multi_modal_inputs`` joined; transformers), :func:`engine_context` an
engine's (placeholders collapsed, decoded media after the prompt's; vLLM).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from mmrl.agent.trajectory import Trajectory
from mmrl.data.processing import trajectory_inputs
from mmrl.protocol import DataProto
from mmrl.sampling import SamplingParams


@dataclass(frozen=True)
class TurnRequest:
    """One model turn to sample: trajectory ``row`` (its prompt is row ``row`` of the prompt batch)
    continued from its ids so far, with at most ``max_tokens`` new ids."""

    row: int
    trajectory: Trajectory
    max_tokens: int


class SampledTurn(NamedTuple):
    token_ids: list[int]
    log_probs: list[float]  # one per id
    # decoded in chunks (DecodeChunks): the policy version of the weights that sampled each id
    versions: list[int] | None = None


# a backend's token generation: one sampled turn per request, in order
GenerateTurns = Callable[[Sequence[TurnRequest]], list[SampledTurn]]


class DecodeChunks(Protocol):
    """Model turns decoded a chunk of tokens at a time (``trainer.async_mode=stream``), so that new
    weights may land between two chunks, and while tools run (:class:`mmrl.workers.rollout.streaming.AgentStream`)."""

    tokens: int  # tokens per row between two chances for a push to land
    version: int  # the policy version of the weights the engine holds now

    def engine(self) -> AbstractContextManager[None]:
        """The engine to the decoder for one prefill or chunk: no push lands meanwhile."""


class TurnBackend(Protocol):
    """A rollout backend as the agent loop drives it (:class:`~mmrl.workers.rollout.hf.HFRollout`,
    :class:`~mmrl.workers.rollout.vllm_spmd.VLLMRollout`)."""

    pad_token_id: int  # the batch's padding id

    def turn_generator(
        self, prompts: DataProto, sampling: SamplingParams, chunks: DecodeChunks | None = None
    ) -> GenerateTurns:
        """The model turns of the trajectories of ``prompts`` (one row per trajectory, left-padded,
        with ``multi_modal_inputs``/``multi_modal_data`` as :func:`~mmrl.data.processing.attach_media`
        gives them), sampled with ``sampling`` (its ``n`` and ``max_tokens`` unused: each request
        says its budget). One function per generation: a backend may keep a random stream in it.
        ``chunks`` (streaming): each turn decoded a chunk of tokens at a time, pushes landing between."""


# ---- contexts, in a backend's form ------------------------------------------------------------


def trajectory_contexts(prompts: DataProto, requests: Sequence[TurnRequest], pad_token_id: int) -> DataProto:
    """The left-padded context of each request, prompt and trajectory so far, as a prompt batch
    (``input_ids``, ``attention_mask``, ``mm_token_type_ids`` where the prompts have them, and
    ``multi_modal_inputs``: the prompt's media joined with the observations')."""
    batch, columns = prompts.batch, prompts.non_tensor_batch
    has_types = "mm_token_type_ids" in batch.keys()
    ids, types, media = [], [], []
    for request in requests:
        valid = batch["attention_mask"][request.row].bool()
        turns = request.trajectory.turns
        ids.append(batch["input_ids"][request.row][valid].tolist() + request.trajectory.token_ids())
        if has_types:
            prompt_types = batch["mm_token_type_ids"][request.row][valid].tolist()
            types.append(
                prompt_types + [t for turn in turns for t in (turn.token_types or [0] * len(turn.token_ids))]
            )
        if "multi_modal_inputs" in columns:
            media.append(
                trajectory_inputs(
                    columns["multi_modal_inputs"][request.row] or {}, request.trajectory.observation_inputs()
                )
            )
    width = max(len(row) for row in ids)
    tensors = {
        "input_ids": torch.full((len(ids), width), pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros(len(ids), width, dtype=torch.long),
    }
    if has_types:
        tensors["mm_token_type_ids"] = torch.zeros(len(ids), width, dtype=torch.long)
    for index, row in enumerate(ids):
        tensors["input_ids"][index, width - len(row) :] = torch.tensor(row)
        tensors["attention_mask"][index, width - len(row) :] = 1
        if has_types:
            tensors["mm_token_type_ids"][index, width - len(row) :] = torch.tensor(types[index])
    return DataProto.from_dict(tensors=tensors, non_tensors={"multi_modal_inputs": media} if media else None)


def collapse_placeholders(token_ids: Sequence[int], placeholder_ids: Sequence[int]) -> list[int]:
    """``token_ids`` with each run of one placeholder id (an expanded image, video or audio) cut to a
    single id: the form an engine that expands placeholders itself (vLLM) takes."""
    placeholders = set(placeholder_ids)
    collapsed: list[int] = []
    for token in token_ids:
        if token in placeholders and collapsed and collapsed[-1] == token:
            continue
        collapsed.append(token)
    return collapsed


def engine_context(
    prompt: dict[str, Any], trajectory: Trajectory, placeholder_ids: Sequence[int], modalities: dict[str, str]
) -> dict[str, Any]:
    """A vLLM token prompt for the next turn: the prompt's engine input (unexpanded ids and decoded
    media) followed by the trajectory's ids, observation placeholders collapsed, and the observations'
    decoded media after the prompt's, in turn order (``modalities``: our keys -> the engine's)."""
    ids = [int(token) for token in prompt["prompt_token_ids"]]
    data = {key: list(items) for key, items in prompt.get("multi_modal_data", {}).items()}
    for turn in trajectory.turns:
        ids += turn.token_ids if turn.by_model else collapse_placeholders(turn.token_ids, placeholder_ids)
        for key, items in turn.engine_media.items():
            data.setdefault(modalities[key], []).extend(items)
    return {"prompt_token_ids": ids, **({"multi_modal_data": data} if data else {})}
