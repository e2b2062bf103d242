"""Vision encodings reused within a step (mmrl.models.encoding_cache): with the tower frozen, the
n responses of a prompt and a second pass reuse the first encoding, with the same head outputs and
the same decoder gradients as encoding every time; a training tower is never served from the cache."""

from __future__ import annotations

import torch
from _batches import build_batch
from _models import training_model

from mmrl.models.encoding_cache import EncodingCache, enable_encoding_cache
from mmrl.models.inputs import response_token_outputs
from mmrl.models.loading import freeze_vision_tower, vision_modules
from mmrl.workers.forward import forward_arguments


def _outputs(model, batch):
    return response_token_outputs(model, *forward_arguments(batch), padding_free=True)[0]


def _decoder_grads(model, batch) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    _outputs(model, batch).float().pow(2).mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_frozen_tower_encodes_each_item_once_with_equal_outputs_and_gradients(tiny_vl_path):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    rows = [{"image": (84, 56)}, {"video_frames": 4}, {}]
    batch = build_batch(processor, rows, (3, 2, 4), seed=3).repeat(2)  # two responses per prompt
    model = training_model(tiny_vl_path)
    freeze_vision_tower(model)
    with torch.no_grad():
        expected = _outputs(model, batch)
    expected_grads = _decoder_grads(model, batch)

    (tower,) = vision_modules(model)[:1]
    encoded = []  # patches each call of the first vision block encoded
    tower.blocks[0].register_forward_hook(lambda m, args, out: encoded.append(args[0].shape[0]))
    cache = EncodingCache()
    assert enable_encoding_cache(vision_modules(model), cache) == 1
    with torch.no_grad():
        first = _outputs(model, batch)
        second = _outputs(model, batch)
    torch.testing.assert_close(first, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(second, expected, rtol=1e-6, atol=1e-6)
    image_patches, video_patches = 4 * 6, 2 * 4 * 4
    assert encoded == [image_patches, video_patches]  # each distinct item once; the second pass: none
    assert (cache.misses, cache.hits) == (2, 2 + 4)
    grads = _decoder_grads(model, batch)  # the update: the frozen tower's encodings reused too
    assert encoded == [image_patches, video_patches]
    assert set(grads) == set(expected_grads) and not any("visual" in name for name in grads)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)

    tower.requires_grad_(True)  # a training tower: every call encodes, nothing reused
    _decoder_grads(model, batch)
    assert encoded[2:] == [2 * image_patches, 2 * video_patches]


def test_the_actor_worker_shares_encodings_only_with_a_frozen_tower_and_no_adapter(tiny_vl_path):
    from mmrl.config import ActorModelConfig, LoraConfig
    from mmrl.workers.fsdp_workers import build_encoding_cache

    model = training_model(tiny_vl_path)
    assert build_encoding_cache(model, ActorModelConfig(freeze_vision_tower=False)) is None
    assert (
        build_encoding_cache(model, ActorModelConfig(freeze_vision_tower=True, lora=LoraConfig(rank=4)))
        is None
    )
    cache = build_encoding_cache(model, ActorModelConfig(freeze_vision_tower=True))
    assert cache is not None and vision_modules(model)[0]._mmrl_encoding_cache is cache
