"""Vision encodings reused within a step (mmrl.models.encoding_cache): with the tower frozen, the
n responses of a prompt and a second pass reuse the first encoding, with the same head outputs and
the same decoder gradients as encoding every time; a training tower is never served from the cache."""

from __future__ import annotations

import torch
from _batches import build_batch
from _models import training_model

from mmrl.models.encoding_cache import (
    EncodingCache,
    announce_media,
    enable_encoding_cache,
    item_digests,
    media_key,
    prompt_encodings,
)
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
    assert cache.hashed_items == 0  # the forward helpers announced every item: no call hashed pixels
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
    assert (
        build_encoding_cache(model, ActorModelConfig(freeze_vision_tower=True, share_encodings=False)) is None
    )
    cache = build_encoding_cache(model, ActorModelConfig(freeze_vision_tower=True))
    assert cache is not None and vision_modules(model)[0]._mmrl_encoding_cache is cache


def test_announced_items_are_not_hashed_again_and_a_stale_announcement_is_never_used(tiny_vl_path):
    model = training_model(tiny_vl_path)
    freeze_vision_tower(model)
    (tower,) = vision_modules(model)[:1]
    cache = EncodingCache()
    enable_encoding_cache([tower], cache)
    patch_dim = tower.config.in_channels * tower.config.temporal_patch_size * tower.config.patch_size**2
    grid = torch.tensor([[1, 4, 6], [2, 4, 4]])  # an image, a two-patch video
    pixels = torch.randn(24 + 32, patch_dim, generator=torch.Generator().manual_seed(0))
    row = {"pixel_values": pixels, "image_grid_thw": grid}
    # digests once per processed tensor, kept while it lives, equal to hashing the call's rows
    keys = item_digests(pixels, grid)
    assert item_digests(pixels, grid) is keys
    assert keys == [media_key([1, 4, 6], pixels[:24]), media_key([2, 4, 4], pixels[24:])]
    with torch.no_grad():
        expected = tower(pixels, grid).pooler_output  # not announced: hashed
        assert cache.hashed_items == 2 and cache.misses == 2
        joined = torch.cat([pixels])  # the micro-batch's joined copy, as the forward helpers make it
        announce_media([tower], {"pixel_values": joined, "image_grid_thw": grid}, [row])
        again = tower(joined, grid).pooler_output
        assert cache.hashed_items == 2 and cache.hits == 2  # the announced keys: the same entries
        torch.testing.assert_close(again, expected, rtol=0, atol=0)
        # other pixels of the same grids while the announcement lives: hashed, encoded anew
        other = pixels + 1
        fresh = tower(other, grid).pooler_output
        assert cache.hashed_items == 4 and cache.misses == 4
        assert not torch.allclose(fresh, expected)
        # the model cast the announced rows to the tower's dtype: still the announced items
        cache.clear()
        announce_media([tower], {"pixel_values": joined, "image_grid_thw": grid}, [row])
        tower(joined.double(), grid)
        assert cache.hashed_items == 4
    del joined, row, pixels, keys
    assert not cache.announced or all(ref() is None for ref, _, _ in cache.announced)


def test_prompt_encodings_are_the_towers_and_the_step_reuses_them(tiny_vl_path):
    """What a training rollout's engine gets (worker.rollout.reuse_encodings): each prompt's items as
    the tower encodes them, kept for the step's passes, which then encode nothing."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    batch = build_batch(
        processor, [{"image": (84, 56)}, {"video_frames": 4, "video_fps": 2.0}, {}], (3, 2, 4), seed=3
    ).repeat(2)
    model = training_model(tiny_vl_path)
    freeze_vision_tower(model)
    towers = vision_modules(model)
    rows = list(batch.non_tensor_batch["multi_modal_inputs"])
    image, video = rows[0], rows[2]  # rows: the image prompt twice, the video prompt twice, text twice
    with torch.no_grad():
        expected = {
            "image": towers[0](image["pixel_values"], image["image_grid_thw"]).pooler_output,
            "video": towers[0](video["pixel_values_videos"], video["video_grid_thw"]).pooler_output,
        }
        cache = EncodingCache()
        enable_encoding_cache(towers, cache)
        encodings = prompt_encodings(towers, rows, torch.device("cpu"))
        assert (cache.misses, cache.hits, cache.hashed_items) == (2, 0, 0)
        _outputs(model, batch)  # the step's scoring pass: every item from the rollout's encodings
    assert (cache.misses, cache.hits, cache.hashed_items) == (2, 4, 0)
    assert [sorted(row) if row else None for row in encodings] == [["image"]] * 2 + [["video"]] * 2 + [
        None
    ] * 2
    for modality, row in zip(("image", "video"), (image, video)):
        item = encodings[rows.index(row)][modality]
        torch.testing.assert_close(item[f"{modality}_embeds"], expected[modality], rtol=1e-6, atol=1e-6)
        assert torch.equal(item[f"{modality}_grid_thw"], row[f"{modality}_grid_thw"])
    # a video whose temporal patches are 2 s apart stays media (vLLM's input would number it at 1 s)
    slow = {**video, "second_per_grid_ts": torch.tensor([2.0])}
    with torch.no_grad():
        assert prompt_encodings(towers, [slow], torch.device("cpu")) == [None]
