"""A trajectory as token ids, and the training batch it becomes (the layout of :mod:`mmrl.columns`).

A :class:`Trajectory` is what one multi-turn rollout appended after its prompt, turn by turn: the ids
the model generated (with their log-probs) and the ids of each observation rendered by the chat
template (with the token types and media the processor gave them). Nothing is decoded and encoded
again: :func:`assemble_trajectory_batch` lays the turns' ids side by side, so the batch's response is
exactly what was generated plus what was appended.

Turn numbers: the model's turns are odd (1, 3, ...), the observation after model turn ``t`` is
``t + 1``; an environment's opening observation (before the model's first turn) is turn 0, like the
prompt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mmrl.data.processing import PromptMedia, TrajectoryMedia, trajectory_inputs
from mmrl.protocol import DataProto

PADDING_TURN = -1  # response_turns on padding

# how a trajectory ended
STOP_ANSWER = "answer"  # a model turn without a tool call (or the environment said done)
STOP_MAX_TURNS = "max_turns"  # worker.rollout.multi_turn.max_turns model turns
STOP_BUDGET = "budget"  # the response budget (max_response_length) ran out
STOP_REASONS = (STOP_ANSWER, STOP_MAX_TURNS, STOP_BUDGET)


@dataclass
class Turn:
    """One turn's ids. A model turn has ``log_probs`` (one per id); an observation has the processor's
    ``token_types`` (``mm_token_type_ids``, Qwen-VL), its ``media`` in compact form and their processor
    outputs ``inputs`` (empty without media)."""

    index: int  # the turn number (see the module docstring)
    token_ids: list[int]
    by_model: bool
    log_probs: list[float] | None = None
    token_types: list[int] | None = None
    media: PromptMedia | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    # the decoded media a rollout engine takes (multi_modal_data's form), for the vLLM backend's next
    # turns; never part of the batch
    engine_media: dict[str, list[Any]] = field(default_factory=dict)
    # a model turn decoded in chunks (streaming): the policy version that sampled each id
    versions: list[int] | None = None


@dataclass
class ToolCallRecord:
    """One tool call (or environment step) as the metrics and the generations log show it."""

    name: str
    arguments: Any
    seconds: float = 0.0
    error: str | None = None  # None, or one of mmrl.agent.tools.ERROR_KINDS
    output: str = ""  # the text the model was shown (cut for the log)
    media: tuple[str, ...] = ()  # e.g. ("image 64x48",): what the call returned


@dataclass
class TrajectoryRecord:
    """What happened in one trajectory (column ``trajectory``)."""

    model_turns: int = 0
    calls: list[ToolCallRecord] = field(default_factory=list)
    observation_tokens: int = 0
    stop: str = STOP_ANSWER
    turn_texts: list[str] = field(default_factory=list)  # each turn decoded, for the generations log


@dataclass
class Trajectory:
    """The turns appended after one prompt, and what they did."""

    turns: list[Turn] = field(default_factory=list)
    record: TrajectoryRecord = field(default_factory=TrajectoryRecord)
    turn_rewards: list[float] = field(default_factory=list)
    media_key: str = ""  # identifies its TrajectoryMedia in the workers' caches

    @property
    def length(self) -> int:
        return sum(len(turn.token_ids) for turn in self.turns)

    @property
    def next_turn(self) -> int:
        """The number the next turn gets (model turns odd, observations even)."""
        return self.turns[-1].index + 1 if self.turns else 1

    def token_ids(self) -> list[int]:
        return [token for turn in self.turns for token in turn.token_ids]

    def media(self) -> TrajectoryMedia | None:
        """The observations' media in compact form, each with its turn; None without any."""
        observed = [(turn.index, turn.media) for turn in self.turns if turn.media is not None]
        if not observed:
            return None
        turns, media = zip(*observed)
        return TrajectoryMedia(tuple(turns), tuple(media), key=self.media_key)

    def observation_inputs(self) -> list[tuple[int, dict[str, Any]]]:
        """``(turn, processor outputs)`` of each observation that returned media, in order."""
        return [(turn.index, turn.inputs) for turn in self.turns if turn.inputs]


def trajectory_rows(
    trajectories: Sequence[Trajectory], width: int, pad_token_id: int
) -> dict[str, torch.Tensor]:
    """``responses``, ``response_mask``, ``response_turns``, ``rollout_log_probs`` and the response
    part of ``mm_token_type_ids``, each [B, width] (see :mod:`mmrl.columns`)."""
    rows = len(trajectories)
    responses = torch.full((rows, width), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(rows, width, dtype=torch.long)
    turns = torch.full((rows, width), PADDING_TURN, dtype=torch.long)
    log_probs = torch.zeros(rows, width, dtype=torch.float32)
    token_types = torch.zeros(rows, width, dtype=torch.long)
    for row, trajectory in enumerate(trajectories):
        start = 0
        for turn in trajectory.turns:
            end = start + len(turn.token_ids)
            if end > width:
                raise ValueError(
                    f"trajectory {row}: {end} response tokens do not fit the response width {width}"
                )
            responses[row, start:end] = torch.tensor(turn.token_ids, dtype=torch.long)
            turns[row, start:end] = turn.index
            if turn.by_model:
                response_mask[row, start:end] = 1
                if turn.log_probs is not None:
                    log_probs[row, start:end] = torch.tensor(turn.log_probs, dtype=torch.float32)
            elif turn.token_types is not None:
                token_types[row, start:end] = torch.tensor(turn.token_types, dtype=torch.long)
            start = end
    return {
        "responses": responses,
        "response_mask": response_mask,
        "response_turns": turns,
        "rollout_log_probs": log_probs,
        "mm_token_type_ids": token_types,
    }


def trajectory_versions(trajectories: Sequence[Trajectory], width: int) -> torch.Tensor | None:
    """``policy_version`` [B, width] of trajectories whose model turns recorded their tokens'
    versions (streaming; None otherwise): a model token's own, an observation or padding token the
    version of the model token before it (the row's first one's before any)."""
    if not any(turn.versions is not None for t in trajectories for turn in t.turns if turn.by_model):
        return None
    versions = torch.zeros(len(trajectories), width, dtype=torch.long)
    for row, trajectory in enumerate(trajectories):
        stamped = [v for turn in trajectory.turns if turn.by_model for v in (turn.versions or [])]
        current, start = (stamped[0] if stamped else 0), 0
        for turn in trajectory.turns:
            end = start + len(turn.token_ids)
            if turn.by_model and turn.versions:
                versions[row, start:end] = torch.tensor(turn.versions, dtype=torch.long)
                current = turn.versions[-1]
            else:
                versions[row, start:end] = current
            start = end
        versions[row, start:] = current
    return versions


def assemble_trajectory_batch(
    prompts: DataProto, trajectories: Sequence[Trajectory], width: int, pad_token_id: int
) -> DataProto:
    """Join the prompt batch (one row per trajectory) with its trajectories into a training batch of
    response width ``width``: the columns :func:`~mmrl.workers.rollout.assemble_rollout_batch` makes,
    with ``response_mask`` 0 on observation tokens and ``attention_mask`` 1 on them, plus
    ``response_turns``, ``trajectory_media``, ``turn_rewards`` and ``trajectory`` (and
    ``policy_version`` where the turns recorded it: :func:`trajectory_versions`). ``truncated`` is 1
    where the response budget ended the trajectory. Rows whose prompt carries ``multi_modal_inputs``
    get them joined with their observations' (:func:`~mmrl.data.processing.trajectory_inputs`)."""
    if len(prompts) != len(trajectories):
        raise ValueError(f"{len(prompts)} prompt rows for {len(trajectories)} trajectories")
    rows = trajectory_rows(trajectories, width, pad_token_id)
    batch = prompts.batch
    valid = (rows["response_turns"] != PADDING_TURN).long()
    tensors = {
        "prompts": batch["input_ids"],
        "responses": rows["responses"],
        "response_mask": rows["response_mask"],
        "response_turns": rows["response_turns"],
        "truncated": torch.tensor([t.record.stop == STOP_BUDGET for t in trajectories], dtype=torch.long),
        "input_ids": torch.cat([batch["input_ids"], rows["responses"]], dim=-1),  # [B, P+R]
        "attention_mask": torch.cat([batch["attention_mask"], valid], dim=-1),
        "rollout_log_probs": rows["rollout_log_probs"],
    }
    if "mm_token_type_ids" in batch.keys():
        tensors["mm_token_type_ids"] = torch.cat(
            [batch["mm_token_type_ids"], rows["mm_token_type_ids"]], dim=-1
        )
    versions = trajectory_versions(trajectories, width)
    if versions is not None:
        tensors["policy_version"] = versions
    columns = dict(prompts.non_tensor_batch)
    columns["trajectory_media"] = [trajectory.media() for trajectory in trajectories]
    columns["turn_rewards"] = [list(trajectory.turn_rewards) for trajectory in trajectories]
    columns["trajectory"] = [trajectory.record for trajectory in trajectories]
    if "multi_modal_inputs" in columns:
        columns["multi_modal_inputs"] = [
            trajectory_inputs(prompt or {}, trajectory.observation_inputs())
            for prompt, trajectory in zip(columns["multi_modal_inputs"], trajectories)
        ]
    return DataProto.from_dict(tensors=tensors, non_tensors=columns, meta_info=dict(prompts.meta_info))
