"""Media alignment, checked before a forward pass: the placeholder tokens of each image and video in a
row against the features its processor outputs give them.

A mismatch would otherwise surface deep in a worker as the model's "Image features and image tokens
do not match"; here it stops with the sample, the turn (0: the prompt; a trajectory's observation
turns by number) and both counts. Qwen-VL families: an image or video of grid ``(t, h, w)`` takes
``t * h * w / merge_size**2`` placeholder tokens (GLM-4.1V: the same, its video frames' image tokens
counted as video by the family's ``token_types_from_ids``). Audio is not checked (Qwen2.5-Omni's count depends
on its feature extractor's lengths).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mmrl.errors import UserInputError
from mmrl.models.families import UnknownModelFamilyError, family_for

# processor output of the grids -> (the config's placeholder token id attribute, what it is called)
GRID_KEYS = {"image_grid_thw": ("image_token_id", "image"), "video_grid_thw": ("video_token_id", "video")}
ID_ALIASES = {"image_token_id": "image_token_index", "video_token_id": "video_token_index"}  # Qwen2.5-Omni


class MediaAlignmentError(UserInputError, ValueError):
    """Placeholder tokens and media features of a sample disagree; the message names both counts."""


def _turns(row_media: Any) -> dict[int, list[dict[str, Any]]]:
    """A row's media outputs by turn. The prompt and an environment's opening observation are both
    turn 0: their placeholders lie in one region (the prompt and the response's turn-0 tokens), so
    their features are counted together."""
    segments = getattr(row_media, "segments", None)  # a trajectory's TrajectoryInputs
    turns: dict[int, list[dict[str, Any]]] = {}
    for turn, outputs in segments if segments is not None else [(0, row_media or {})]:
        turns.setdefault(turn, []).append(outputs)
    return turns


def _features(parts: list[dict[str, Any]], key: str, merge: int) -> tuple[int, list[list[int]]]:
    grids = []
    for outputs in parts:
        grid = outputs.get(key)
        grids += [] if grid is None else torch.as_tensor(grid).reshape(-1, 3).tolist()
    return sum(t * h * w for t, h, w in grids) // merge**2, grids


def alignment_settings(config: Any) -> tuple[dict[str, int], int] | None:
    """``({grid key: placeholder id}, merge size)`` of a model config, or None when it has no grids."""
    vision = getattr(config, "vision_config", None)
    merge = getattr(vision, "spatial_merge_size", None)
    ids = {
        key: getattr(config, attribute, getattr(config, ID_ALIASES[attribute], None))
        for key, (attribute, _) in GRID_KEYS.items()
    }
    ids = {key: token for key, token in ids.items() if token is not None}
    if merge is None or not ids:
        return None
    return ids, int(merge)


def _placeholder_masks(
    config: Any, input_ids: torch.Tensor, token_ids: dict[str, int]
) -> dict[str, torch.Tensor]:
    """{grid key: [B, L] mask of that kind's placeholder tokens}: by id, or by the family's token types
    where one id serves several kinds."""
    try:
        types_from_ids = family_for(config).token_types_from_ids
    except UnknownModelFamilyError:
        types_from_ids = None
    if types_from_ids is None:
        return {key: input_ids == token for key, token in token_ids.items()}
    token_types = types_from_ids(config, input_ids)
    return {"image_grid_thw": token_types == 1, "video_grid_thw": token_types == 2}


def check_media_alignment(
    config: Any,
    input_ids: torch.Tensor,
    media: Sequence[Any] | None,
    response_turns: torch.Tensor | None = None,
    names: Sequence[str] | None = None,
) -> None:
    """Raise :class:`MediaAlignmentError` where a row's placeholder count of an image/video kind in
    a turn differs from its features. ``input_ids`` [B, L]; ``media``: each row's processor outputs
    (a trajectory row's :class:`~mmrl.columns.TrajectoryInputs` is checked turn by turn, with
    ``response_turns`` [B, R] saying which response token belongs to which turn); ``names``: how the
    message names each row (default "row i")."""
    settings = alignment_settings(config)
    if media is None or settings is None:
        return
    token_ids, merge = settings
    prompt_length = input_ids.shape[1] - (0 if response_turns is None else response_turns.shape[1])
    masks = _placeholder_masks(config, input_ids, token_ids)
    # whole-row counts in one pass (one device sync per kind): all a batch without turns needs
    row_counts = {key: mask.sum(-1).tolist() for key, mask in masks.items()}
    for row, row_media in enumerate(media):
        turns = _turns(row_media) if response_turns is not None else {0: [row_media or {}]}
        for turn, parts in turns.items():
            for key, mask in masks.items():
                features, grids = _features(parts, key, merge)
                placeholders = row_counts[key][row]  # the whole row: its only media turn covers all
                if len(turns) > 1:
                    in_turn = mask[row, prompt_length:][response_turns[row] == turn]
                    region = torch.cat([mask[row, :prompt_length], in_turn]) if turn == 0 else in_turn
                    placeholders = int(region.sum())
                if placeholders != features:
                    name = names[row] if names is not None else f"row {row}"
                    where = "the prompt" if turn == 0 else f"turn {turn}"
                    where += " and the opening observation" if turn == 0 and len(parts) > 1 else ""
                    raise MediaAlignmentError(
                        f"{name}, {where}: {placeholders} {GRID_KEYS[key][1]} placeholder tokens but features "
                        f"for {features} ({key} {grids}); its token ids and processor outputs disagree (media "
                        "processed with other settings than the prompt's, or a turn re-tokenized?)"
                    )
