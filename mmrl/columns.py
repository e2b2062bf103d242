"""Every column a training batch (:class:`~mmrl.protocol.DataProto`) carries, in one place.

Each column is listed once with the phase that produces it, the phases that read it, its dtype and
its shape (``B`` rows, ``P`` prompt and ``R`` response columns, ``L = P + R``). Code refers to
columns by these names; ``tests/test_columns.py`` checks that every column name the library uses is
listed here, and that the batch of a real training step matches the listed dtypes and shapes after
every phase (:func:`check_batch`).

Besides these, a prompt batch carries the data file's own columns (``data_source`` and whatever else a
row holds) as object columns: they are passed through to the reward function untouched and are not
listed (:data:`PASS_THROUGH` says so).

**Trajectories** (multi-turn rollouts, :mod:`mmrl.agent`). A rollout may be a trajectory: model turns
and tool/environment observation turns, kept as token ids. Everything downstream sees a trajectory as
*a response with holes in its mask*:

- ``responses`` [B, R] holds every token after the prompt: the model's and the observations';
- ``attention_mask`` is 1 on all of them (the trajectory's valid tokens stay contiguous and
  right-padded, so packing, token budgets, balancing, shared prompts and sequence parallelism see an
  ordinary row), while ``response_mask`` is 1 only on the model's own tokens: log-probs, entropy,
  KL, advantages and the loss count those alone;
- ``response_turns`` [B, R] says which turn each token belongs to: model turns are odd (1, 3, ...),
  observation turns even (2, 4, ...), an opening observation of an environment (before the model's
  first turn) 0, padding -1; turn 0 is also the prompt's;
- ``trajectory_media`` carries the media the observations returned, in compact form, each item with
  its turn (:class:`mmrl.data.processing.TrajectoryMedia`); on the workers the row's
  ``multi_modal_inputs`` is then a :class:`TrajectoryInputs`: the prompt's and the observations'
  processor outputs joined in row order, as every forward takes them;
- ``turn_rewards`` (environments' per-turn rewards) and ``trajectory`` (what happened in each turn)
  are object columns for the reward function, the metrics and the generations log.

Single-turn rollouts carry none of these four columns and are unchanged.

``meta_info`` carries no modes: how a phase runs (validation or training sampling, temperature,
on-policy update) is an explicit argument of the worker method. The only key left is ``metrics``,
the scalars a worker returns (merged over ranks by the worker group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "COLUMNS",
    "Column",
    "TrajectoryInputs",
    "check_batch",
    "column",
    "concat_multi_modal_inputs",
    "prompt_inputs",
    "response_inputs",
    "media_segments",
]


@dataclass(frozen=True)
class Column:
    name: str
    producer: str  # the phase (or component) that adds it
    consumers: tuple[str, ...]  # the phases that read it
    dtype: torch.dtype | None  # None: an object column (one Python value per row)
    shape: str  # documentation of the layout, e.g. "[B, R]"
    meaning: str

    @property
    def is_tensor(self) -> bool:
        return self.dtype is not None

    def width(self, prompt_length: int, response_length: int) -> int | None:
        """The size of the last dim the shape implies: P, R or L = P + R (before generation R is 0);
        None for 1-D and object columns."""
        last = self.shape.rsplit(",", 1)[-1].strip(" ]") if "," in self.shape else None
        return {"P": prompt_length, "R": response_length, "L": prompt_length + response_length}.get(last)

    def prompt_dim(self, ndim: int) -> int | None:
        """The dim that starts with the prompt (P or L) in the listed layout of ``ndim`` dims (``[B, 3,
        L] or [B, L]``); None for columns without one (responses, 1-D and object columns)."""
        for layout in self.shape.replace(" then ", " or ").split(" or "):
            dims = [dim.strip() for dim in layout.strip("[] ").split(",")]
            if self.is_tensor and len(dims) == ndim:
                return next((index for index, dim in enumerate(dims) if dim in ("P", "L")), None)
        return None


_LONG, _FLOAT = torch.int64, torch.float32
_SPECS = (
    # ---- prompts: mmrl.data (dataset items -> collate_prompts)
    Column("input_ids", "data", ("generate", "log_probs", "update"), _LONG, "[B, P] then [B, L]",
           "token ids: left-padded prompt, after generation followed by the right-padded response"),
    Column("attention_mask", "data", ("generate", "log_probs", "update", "metrics"), _LONG,
           "[B, P] then [B, L]", "1 on valid tokens, 0 on padding"),
    Column("mm_token_type_ids", "data", ("generate", "log_probs", "update"), _LONG, "[B, P] then [B, L]",
           "Qwen-VL processors: 0 text, 1 image, 2 video placeholder (optional)"),
    Column("raw_prompt_ids", "data", ("generate",), None, "[B]",
           "the prompt's ids without padding (what the vLLM engine gets)"),
    Column("prompt_media", "data", ("generate", "log_probs", "update"), None, "[B]",
           "the prompt's media in compact form (mmrl.data.processing.PromptMedia: encoded file bytes), "
           "on the driver a Ray ref to it, put once per step; None without media"),
    # ---- made on the workers from prompt_media (mmrl.data.processing.attach_media); never returned
    Column("multi_modal_data", "attach_media", ("generate",), None, "[B]",
           "decoded media of the prompt (PIL images, frames, waveforms) for the rollout engine"),
    Column("multi_modal_embeds", "attach_media", ("generate",), None, "[B]",
           "the actor's frozen-tower encodings of the prompt's images/videos for the vLLM engine "
           "(worker.rollout.reuse_encodings; mmrl.models.encoding_cache.prompt_encodings); None without"),
    Column("multi_modal_inputs", "attach_media", ("generate", "log_probs", "update"), None, "[B]",
           "the processor's media tensors of the prompt (pixel_values, grids, audio features); of a "
           "trajectory with observation media a TrajectoryInputs (prompt's and observations' joined)"),
    Column("ground_truth", "data", ("reward",), None, "[B]", "the answer handed to the reward function"),
    Column("uid", "data", ("advantages", "remax_baseline", "dynamic_sampling", "metrics"), None, "[B]",
           "one id per prompt, shared by its n responses (grouping is by uid, never by position)"),
    Column("sample_index", "data", ("reward",), None, "[B]", "the prompt's position in its dataset"),
    # ---- generate: mmrl.workers.rollout (assemble_rollout_batch) and the worker's position ids
    Column("prompts", "generate", ("remax_baseline", "logging"), _LONG, "[B, P]", "the prompt's ids"),
    Column("responses", "generate", ("reward", "log_probs", "update", "metrics"), _LONG, "[B, R]",
           "sampled ids, pad_token_id after EOS"),
    Column("response_mask", "generate", ("reward", "advantages", "update", "metrics"), _LONG, "[B, R]",
           "1 on the model's own tokens, up to and including EOS (a trajectory: 0 on observation tokens)"),
    Column("truncated", "generate", ("update",), _LONG, "[B]",
           "1 where the response was cut at the maximum length without EOS (actor.mask_truncated_responses)"),
    # ---- generate, multi-turn only: mmrl.agent (assemble_trajectory_batch); see the module docstring
    Column("response_turns", "generate", ("reward", "log_probs", "update", "metrics", "logging"), _LONG,
           "[B, R]", "turn of each response token: model turns odd, observation turns even, an opening "
           "observation 0, padding -1"),
    Column("trajectory_media", "generate", ("log_probs", "update"), None, "[B]",
           "the observations' media in compact form (mmrl.data.processing.TrajectoryMedia, each item with "
           "its turn and place); None where the observations returned none"),
    Column("turn_rewards", "generate", ("reward",), None, "[B]",
           "environment rewards, one float per observation turn ([] for tools), for the reward function"),
    Column("trajectory", "generate", ("metrics", "logging"), None, "[B]",
           "what happened in each turn (mmrl.agent.trajectory.TrajectoryRecord): tool calls, errors, "
           "seconds, observation tokens, media returned, and how the trajectory ended"),
    Column("left_out", "dynamic_sampling", ("update",), _LONG, "[B]",
           "1 on the rows of dynamic sampling's top-up groups that did not fail: the update leaves them out"),
    Column("rollout_log_probs", "generate", ("update", "metrics"), _FLOAT, "[B, R]",
           "log_softmax(logits / T) of the sampled tokens as the rollout engine computed them"),
    Column("routed_experts", "generate", ("log_probs", "update"), torch.int16, "[B, L, layers, k]",
           "MoE with worker.actor.moe.routing_replay: each token's experts per layer as the transformers "
           "rollout routed it, -1 where it was not fed (padding, the last response token)"),
    Column("policy_version", "generate", ("metrics",), _LONG, "[B, R]",
           "the policy version (actor updates so far) whose weights sampled each response token (with "
           "trainer.async_mode=stream the tokens of one response may differ: partial rollouts); only "
           "when trainer.async_mode is not sync (trainer.records_policy_versions)"),
    Column("position_ids", "generate", ("log_probs", "update"), _LONG, "[B, 3, L] or [B, L]",
           "M-RoPE (or 1-D) ids numbered once per distinct prompt"),
    # ---- reward: mmrl.workers.reward_worker
    Column("token_level_scores", "reward", ("advantages", "metrics"), _FLOAT, "[B, R]",
           "the reward function's overall score on each response's last valid token"),
    Column("reward_scores", "reward", ("dynamic_sampling", "metrics"), None, "[B]",
           "every score key the function returned"),
    Column("response_text", "reward", ("logging",), None, "[B]", "the decoded response"),
    Column("reward_baselines", "remax_baseline", ("advantages",), _FLOAT, "[B]",
           "ReMax: the reward of the prompt's greedy response"),
    # ---- log-prob and value passes: mmrl.workers.fsdp_workers
    Column("old_log_probs", "log_probs", ("advantages", "update", "metrics"), _FLOAT, "[B, R]",
           "the behaviour policy's log-probs (from the update itself when on-policy)"),
    Column("entropies", "log_probs", ("metrics",), _FLOAT, "[B, R]", "entropy of the policy at each token"),
    Column("ref_log_probs", "ref_log_probs", ("advantages", "update"), _FLOAT, "[B, R]",
           "the reference policy's log-probs (KL penalty or KL loss)"),
    Column("values", "values", ("advantages", "update_critic", "metrics"), _FLOAT, "[B, R]",
           "the critic's value of the state before each response token"),
    # ---- advantages: the driver (mmrl.core_algos)
    Column("token_level_rewards", "advantages", ("metrics",), _FLOAT, "[B, R]",
           "scores after the KL reward penalty"),
    Column("advantages", "advantages", ("update", "metrics"), _FLOAT, "[B, R]", "per-token advantages"),
    Column("returns", "advantages", ("update_critic", "metrics"), _FLOAT, "[B, R]",
           "per-token returns (the critic's targets)"),
)  # fmt: skip

COLUMNS: dict[str, Column] = {spec.name: spec for spec in _SPECS}
PASS_THROUGH = "the data file's other columns: object columns handed to the reward function"
METRICS_META_KEY = "metrics"  # the one meta_info key: scalars a worker returns


def concat_multi_modal_inputs(
    multi_modal_inputs: Sequence[dict[str, Any]], device: torch.device | str | None = None
) -> dict[str, Any]:
    """Join the rows' processor outputs along dim 0, in row order (``{}`` rows contribute nothing).

    ``pixel_values`` [N_patches, D], ``image_grid_thw`` [n_images, 3] and the video keys simply
    concatenate. Tensors whose later dims differ between rows (audio ``input_features`` [n, mel, frames]
    and ``feature_attention_mask`` [n, frames] of clips of different lengths) are right-padded with
    zeros first. Non-tensor values (``use_audio_in_video``) must agree between rows and are kept once.
    """
    pieces: dict[str, list[Any]] = {}
    for row in multi_modal_inputs:
        for key, value in (row or {}).items():
            pieces.setdefault(key, []).append(value)
    joined: dict[str, Any] = {}
    for key, values in pieces.items():
        if not isinstance(values[0], (torch.Tensor, list, tuple)):
            if any(value != values[0] for value in values):
                raise ValueError(
                    f"multi_modal_inputs[{key!r}] differs between rows of one micro-batch: {values}"
                )
            joined[key] = values[0]
            continue
        tensors = [torch.as_tensor(value) for value in values]
        tensors = [tensor.reshape(1) if tensor.dim() == 0 else tensor for tensor in tensors]
        joined[key] = torch.cat(_pad_trailing_dims(tensors))
        if device is not None:
            joined[key] = joined[key].to(device)
    return joined


def _pad_trailing_dims(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Zero-pad every dim after the first to the largest size among ``tensors``."""
    max_shape = [max(sizes) for sizes in zip(*(tensor.shape[1:] for tensor in tensors))]
    padded = []
    for tensor in tensors:
        if list(tensor.shape[1:]) == max_shape:
            padded.append(tensor)
            continue
        pad: list[int] = []  # F.pad order: last dim first, (left, right) per dim
        for size, target in zip(reversed(tensor.shape[1:]), reversed(max_shape)):
            pad += [0, target - size]
        padded.append(nn.functional.pad(tensor, pad))
    return padded


class TrajectoryInputs(dict):
    """``multi_modal_inputs`` of a trajectory row whose observations returned media: the processor
    outputs of the prompt and of every observation joined in row order (the dict itself, what a
    forward over the whole row takes), with the parts kept apart for the passes that need them:

    - ``prompt``: the prompt's outputs alone (shared by the n rows of a prompt: rows with the same
      prompt are grouped by it, and a shared-prompt pass feeds it once);
    - ``response``: the observations' outputs joined (what follows the prompt in a shared-prompt pass);
    - ``segments``: ``(turn, outputs)`` of the prompt (turn 0) and of each observation that returned
      media, in row order (the media alignment check names the turn of a mismatch).
    """

    def __init__(
        self,
        joined: dict[str, Any],
        prompt: dict[str, Any],
        response: dict[str, Any],
        segments: tuple[tuple[int, dict[str, Any]], ...],
    ):
        super().__init__(joined)
        self.prompt, self.response, self.segments = prompt, response, segments

    def __reduce__(self):  # the parts travel with the joined dict
        return (TrajectoryInputs, (dict(self), self.prompt, self.response, self.segments))


def prompt_inputs(row_media: dict[str, Any] | None) -> dict[str, Any]:
    """The prompt's processor outputs of a row's ``multi_modal_inputs`` (a trajectory's prompt part)."""
    if isinstance(row_media, TrajectoryInputs):
        return row_media.prompt
    return row_media or {}


def response_inputs(row_media: dict[str, Any] | None) -> dict[str, Any]:
    """The processor outputs of media inside the response (a trajectory's observations); ``{}`` else."""
    return row_media.response if isinstance(row_media, TrajectoryInputs) else {}


def media_segments(row_media: dict[str, Any] | None) -> tuple[tuple[int, dict[str, Any]], ...]:
    """``(turn, outputs)`` of each part of a row's media in row order: the prompt's is turn 0."""
    if isinstance(row_media, TrajectoryInputs):
        return row_media.segments
    return ((0, row_media or {}),)


def column(name: str) -> str:
    """``name``, after checking it is a listed column (for names built at run time)."""
    if name not in COLUMNS:
        raise KeyError(f"{name!r} is not a batch column listed in mmrl.columns; add it there")
    return name


def check_batch(data, allow_unlisted_objects: bool = True) -> list[str]:
    """Problems of ``data`` (a DataProto) against the schema: unlisted tensor columns, wrong dtypes,
    wrong widths, tensor/object mix-ups; [] when it conforms. Unlisted object columns are the data
    file's pass-through columns, allowed unless ``allow_unlisted_objects`` is false."""
    problems = []
    tensors = data.batch
    prompt_length = tensors["prompts"].shape[-1] if "prompts" in tensors.keys() else None
    response_length = tensors["responses"].shape[-1] if "responses" in tensors.keys() else 0
    if prompt_length is None and "input_ids" in tensors.keys():
        prompt_length = tensors["input_ids"].shape[-1]
    for name in tensors.keys():
        spec = COLUMNS.get(name)
        if spec is None or not spec.is_tensor:
            problems.append(f"tensor column {name!r} is {'an object column' if spec else 'not listed'}")
            continue
        tensor = tensors[name]
        if tensor.dtype != spec.dtype:
            problems.append(f"{name}: dtype {tensor.dtype}, listed {spec.dtype}")
        width = spec.width(prompt_length or 0, response_length)
        if width is not None and tensor.shape[-1] != width:
            problems.append(f"{name}: shape {tuple(tensor.shape)}, listed {spec.shape}")
    for name in data.non_tensor_batch:
        spec = COLUMNS.get(name)
        if spec is not None and spec.is_tensor:
            problems.append(f"{name}: an object column, listed as a {spec.dtype} tensor")
        elif spec is None and not allow_unlisted_objects:
            problems.append(f"object column {name!r} is not listed")
    unexpected_meta = set(data.meta_info) - {METRICS_META_KEY}
    if unexpected_meta:
        problems.append(f"meta_info carries {sorted(unexpected_meta)}; modes are arguments, not meta keys")
    return problems
