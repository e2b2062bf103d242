"""Model inputs of a padded micro-batch: media tensors of its rows joined, position ids made explicit.

Rows are left-padded prompts followed by right-padded responses (``attention_mask`` 0 on both kinds of
padding). Position ids are computed here rather than left to the model, because a model that infers
them from the sequence length counts left padding as positions and so shifts every valid token:

- Qwen-VL / Qwen-Omni: M-RoPE ids ``[3, B, L]`` from the model's own ``get_rope_index`` over the valid
  tokens of each row (transformers v5: on ``model.model`` for Qwen-VL, taking ``mm_token_type_ids``;
  on the thinker itself for Omni, taking the audio lengths).
- Text models: ``(attention_mask.cumsum(-1) - 1).clamp(min=0)`` ``[B, L]``.

:func:`response_head_outputs` is the one place a micro-batch goes through the model; a packed
(padding-free) forward replaces it without touching its callers.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

# Media keys used only to compute positions; the forward gets the finished position ids instead.
POSITION_ONLY_KEYS = ("second_per_grid_ts", "video_second_per_grid", "use_audio_in_video")
MM_TOKEN_TYPES = {"image_token_id": 1, "video_token_id": 2}  # Qwen-VL v5: 0 text, 1 image, 2 video


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


def _rope_index_owner(model: nn.Module) -> nn.Module | None:
    """The module whose ``get_rope_index`` computes M-RoPE ids, or None for 1-D RoPE models."""
    for owner in (getattr(model, "model", None), model):
        if isinstance(owner, nn.Module) and callable(getattr(owner, "get_rope_index", None)):
            return owner
    return None


def mm_token_types_from_ids(config, input_ids: torch.Tensor) -> torch.Tensor:
    """Qwen-VL ``mm_token_type_ids`` [B, L] from placeholder ids: 1 image, 2 video, 0 otherwise."""
    token_types = torch.zeros_like(input_ids)
    for attribute, token_type in MM_TOKEN_TYPES.items():
        token_id = getattr(config, attribute, None)
        if token_id is not None:
            token_types[input_ids == token_id] = token_type
    return token_types


def compute_position_ids(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    media: dict[str, Any],
    mm_token_type_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Position ids of a padded batch: M-RoPE ``[3, B, L]`` or 1-D ``[B, L]``; padding gets 0 or 1.

    ``media`` is the joined output of :func:`concat_multi_modal_inputs` for the same rows. Without
    ``mm_token_type_ids`` (Qwen-VL) they are derived from the image/video placeholder ids.
    """
    owner = _rope_index_owner(model)
    if owner is None:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, L]
    parameters = inspect.signature(owner.get_rope_index).parameters
    if "mm_token_type_ids" in parameters:  # Qwen2/2.5-VL (transformers v5)
        if mm_token_type_ids is None:
            mm_token_type_ids = mm_token_types_from_ids(owner.config, input_ids)
        position_ids, _ = owner.get_rope_index(
            input_ids,
            mm_token_type_ids=mm_token_type_ids,
            image_grid_thw=media.get("image_grid_thw"),
            video_grid_thw=media.get("video_grid_thw"),
            second_per_grid_ts=media.get("second_per_grid_ts"),
            attention_mask=attention_mask,
        )
        return position_ids
    if "audio_seqlens" in parameters:  # Qwen2.5-Omni thinker
        feature_mask = media.get("feature_attention_mask")
        position_ids, _ = owner.get_rope_index(
            input_ids,
            image_grid_thw=media.get("image_grid_thw"),
            video_grid_thw=media.get("video_grid_thw"),
            attention_mask=attention_mask,
            use_audio_in_video=bool(media.get("use_audio_in_video", False)),
            audio_seqlens=None if feature_mask is None else feature_mask.sum(-1),
            second_per_grids=media.get("video_second_per_grid"),
        )
        return position_ids
    raise NotImplementedError(
        f"{type(owner).__name__}.get_rope_index has an unknown signature {list(parameters)}; add its "
        "model family to mmrl.models.inputs.compute_position_ids"
    )


def build_forward_inputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    multi_modal_inputs: Sequence[dict[str, Any]] | None,
    mm_token_type_ids: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``model(**inputs)`` on a padded micro-batch.

    ``input_ids``/``attention_mask`` [B, L]; ``multi_modal_inputs`` one processor-output dict per row
    (``{}`` for text rows; None for a text model). Returns ``input_ids``, ``attention_mask``,
    ``position_ids`` and the joined media tensors on ``input_ids.device``.
    """
    media = concat_multi_modal_inputs(multi_modal_inputs or [], device=input_ids.device)
    position_ids = compute_position_ids(model, input_ids, attention_mask, media, mm_token_type_ids)
    forward_media = {key: value for key, value in media.items() if key not in POSITION_ONLY_KEYS}
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        **forward_media,
    }


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    return "logits_to_keep" in inspect.signature(type(model).forward).parameters


def response_head_outputs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    multi_modal_inputs: Sequence[dict[str, Any]] | None = None,
    mm_token_type_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The head's outputs at the positions that predict the response tokens: ``[B, R, D]``.

    ``input_ids`` [B, P + R] ends with the R response tokens; the output at position ``t`` predicts
    token ``t + 1``, so positions ``P - 1 .. P + R - 2`` are kept. ``D`` is the vocabulary for a policy
    (logits, before temperature) and 1 for a critic (values of the states before each response token).
    """
    inputs = build_forward_inputs(model, input_ids, attention_mask, multi_modal_inputs, mm_token_type_ids)
    # Only the last R + 1 positions reach lm_head: a [B, P + R, vocab] tensor is the largest of the pass.
    keep = {"logits_to_keep": response_length + 1} if _accepts_logits_to_keep(model) else {}
    logits = model(**inputs, use_cache=False, **keep).logits
    return logits[:, -response_length - 1 : -1]  # [B, R, D]
