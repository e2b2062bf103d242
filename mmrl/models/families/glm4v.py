"""GLM-4.1V (``Glm4vForConditionalGeneration``: GLM-4.1V-9B-Thinking, -Base).

- Vision tower at ``model.visual`` (14-pixel patches, learned 2-D positions interpolated per image, a
  2x2 merge by a strided convolution); GLM-4 text layers whose 3-D RoPE turns part of each head.
- A video is a run of frames, each ``<|begin_of_image|>`` + image tokens + ``<|end_of_image|>`` followed
  by its second as text, the whole run between ``<|begin_of_video|>`` and ``<|end_of_video|>``: video
  frames use the *image* token id, and only the surrounding video tokens tell them apart
  (:func:`token_types_from_ids`; the processor's ``mm_token_type_ids`` say the same).
- M-RoPE ids from ``model.model.get_rope_index`` (taking ``mm_token_type_ids``): each frame is a block of
  one temporal patch, text after a block resumes at its largest id + 1, as in vLLM.
- vLLM's weight names equal transformers' on-disk ones. transformers' GLM-4 attention always has q/k/v
  biases; vLLM (0.32) builds them only when the text config says ``attention_bias`` (its default: none),
  so :func:`vllm_builds_attention_biases` says it (the released configs do; one without the key would
  otherwise lose its trained biases on vLLM without a word).

The fix: transformers' ``get_placeholder_mask`` (5.19) marks every image-id token as a slot for the image
features and for the video features alike, so a forward given both images and videos (one prompt with
both, or a packed row or padded micro-batch of an image prompt and a video prompt) fails on a count
mismatch. :func:`separate_image_and_video_slots` makes it tell the slots apart by the video tokens around
them; it checks the behaviour rather than a version, and leaves a fixed release alone.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from mmrl.models.families import ModelFamily, token_type_position_ids


def token_types_from_ids(config, input_ids: torch.Tensor) -> torch.Tensor:
    """``mm_token_type_ids`` [B, L] from the token ids: 1 on image tokens outside a video, 2 on those
    between ``<|begin_of_video|>`` and ``<|end_of_video|>``, 0 elsewhere."""
    image = input_ids == config.image_token_id
    opened = (input_ids == config.video_start_token_id).cumsum(-1)
    closed = (input_ids == config.video_end_token_id).cumsum(-1)
    video = image & (opened > closed)
    return image.long() + video.long()


def _needs_patch(owner: nn.Module) -> bool:
    """True when ``owner.get_placeholder_mask`` counts a video's frame tokens as image slots (a probe
    on ``image, <|begin_of_video|>, image, <|end_of_video|>``)."""
    config = owner.config
    ids = [
        config.image_token_id,
        config.video_start_token_id,
        config.image_token_id,
        config.video_end_token_id,
    ]
    input_ids = torch.tensor([ids])
    embeds = torch.zeros(1, 4, 1)
    image_mask, _ = owner.get_placeholder_mask(input_ids, embeds)
    return bool(image_mask[0, 2].any())


def separate_image_and_video_slots(model: nn.Module) -> bool:
    """Wrap ``model.model.get_placeholder_mask`` on this instance so that image features fill the image
    tokens outside videos and video features those inside (see module doc); returns whether it wrapped."""
    owner = model.model
    if getattr(owner.get_placeholder_mask, "mmrl_separates_video", False) or not _needs_patch(owner):
        return False
    original = owner.get_placeholder_mask

    @functools.wraps(original)
    def get_placeholder_mask(input_ids, inputs_embeds, image_features=None, video_features=None):
        if input_ids is None:  # embeddings only: the model's own way
            return original(input_ids, inputs_embeds, image_features, video_features)
        token_types = token_types_from_ids(owner.config, input_ids)
        masks = []
        for token_type, features in ((1, image_features), (2, video_features)):
            slots = token_types == token_type
            if features is not None and int(slots.sum()) * inputs_embeds.shape[-1] != features.numel():
                kind = "image" if token_type == 1 else "video"
                raise ValueError(
                    f"{kind} features and {kind} tokens do not match: {int(slots.sum())} tokens, "
                    f"{features.shape[0]} features"
                )
            masks.append(slots.unsqueeze(-1).to(inputs_embeds.device))
        return masks[0], masks[1]

    get_placeholder_mask.mmrl_separates_video = True
    owner.get_placeholder_mask = get_placeholder_mask
    return True


def vllm_builds_attention_biases(config) -> None:
    """Make vLLM build the q/k/v biases transformers always builds (see the module doc)."""
    config.get_text_config().attention_bias = True


def position_ids(model, input_ids, attention_mask, media, mm_token_type_ids=None):
    """M-RoPE ids [3, B, L] from the model's own ``get_rope_index``; token types derived from the video
    tokens when not given (the placeholder ids alone cannot tell a video's frames from an image)."""
    if mm_token_type_ids is None:
        mm_token_type_ids = token_types_from_ids(model.model.config, input_ids)
    return token_type_position_ids(model, input_ids, attention_mask, media, mm_token_type_ids)


FAMILY = ModelFamily(
    name="glm4v",
    model_types=("glm4v",),
    auto_class="AutoModelForImageTextToText",
    position_ids=position_ids,
    towers=("model.visual",),
    placeholder_tokens=(
        "<|image|>",
        "<|video|>",
        "<|begin_of_image|>",
        "<|end_of_image|>",
        "<|begin_of_video|>",
        "<|end_of_video|>",
    ),
    position_keys=("image_grid_thw", "video_grid_thw"),
    fix_model=separate_image_and_video_slots,
    fix_vllm_config=vllm_builds_attention_biases,
    token_types_from_ids=token_types_from_ids,
)
