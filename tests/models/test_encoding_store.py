"""Frozen-tower encodings on disk across epochs (mmrl.models.encoding_store) and shared between equal
towers (mmrl.models.encoding_cache keyed by the weights' digest): the second epoch reads instead of
encoding with equal outputs, a changed weight misses, a corrupt file is ignored with a warning, the
folder stays under its bound, two processes writing one key leave a whole file, and the reference's
tower reuses the actor's encodings over a step."""

from __future__ import annotations

import logging
import multiprocessing

import pytest
import torch
from _batches import build_batch
from _models import training_model

from mmrl.models.encoding_cache import EncodingCache, enable_encoding_cache, label_weights, weights_digest
from mmrl.models.encoding_store import EncodingStore
from mmrl.models.inputs import response_token_outputs
from mmrl.models.loading import freeze_vision_tower, vision_modules
from mmrl.workers.forward import forward_arguments

IMAGE_PATCHES, VIDEO_PATCHES = 4 * 6, 2 * 4 * 4  # the patches of the batch's two media items


@pytest.fixture(scope="module")
def batch(tiny_vl_path):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vl_path)
    rows = [{"image": (84, 56)}, {"video_frames": 4}, {}]
    return build_batch(processor, rows, (3, 2, 4), seed=3).repeat(2)  # two responses per prompt


def _outputs(model, batch):
    with torch.no_grad():
        return response_token_outputs(model, *forward_arguments(batch), padding_free=True)[0]


def _frozen_model(path):
    """The model as a frozen-tower run builds it: its tower labelled with its weights' digest, and
    the patches of every call of its first vision block recorded."""
    model = training_model(path)
    freeze_vision_tower(model)
    (tower,) = vision_modules(model)
    label_weights(tower, weights_digest(tower, torch.float32))
    model.encoded = []
    tower.blocks[0].register_forward_hook(lambda m, args, out: model.encoded.append(args[0].shape[0]))
    return model


def _cached(model, store):
    cache = EncodingCache(store=store)
    assert enable_encoding_cache(vision_modules(model), cache) == 1
    return cache


def test_second_epoch_reads_the_disk_instead_of_encoding(tiny_vl_path, batch, tmp_path, caplog):
    expected = _outputs(training_model(tiny_vl_path), batch)
    store = EncodingStore(tmp_path, max_bytes=1 << 30, settings="min_pixels=...")
    first_epoch = _frozen_model(tiny_vl_path)
    _cached(first_epoch, store)
    torch.testing.assert_close(_outputs(first_epoch, batch), expected, rtol=1e-6, atol=1e-6)
    assert first_epoch.encoded == [IMAGE_PATCHES, VIDEO_PATCHES] and store.writes == 2
    first_files = list(tmp_path.glob("*.pt"))

    # a new run (fresh model and memory): every item read from disk, the tower never called
    second_epoch = _frozen_model(tiny_vl_path)
    cache = _cached(second_epoch, EncodingStore(tmp_path, max_bytes=1 << 30, settings="min_pixels=..."))
    torch.testing.assert_close(_outputs(second_epoch, batch), expected, rtol=1e-6, atol=1e-6)
    assert second_epoch.encoded == [] and (cache.loaded, cache.misses, cache.hits) == (2, 0, 2)

    # other media settings name other files: nothing read
    other = _frozen_model(tiny_vl_path)
    _cached(other, EncodingStore(tmp_path, max_bytes=1 << 30, settings="min_pixels=other"))
    _outputs(other, batch)
    assert other.encoded == [IMAGE_PATCHES, VIDEO_PATCHES]

    # a changed tower weight changes the digest: the stale entries are not read
    changed = training_model(tiny_vl_path)
    with torch.no_grad():
        vision_modules(changed)[0].blocks[0].mlp.down_proj.weight.mul_(1.5)
    changed_expected = _outputs(changed, batch)
    changed = _frozen_model(tiny_vl_path)
    with torch.no_grad():
        vision_modules(changed)[0].blocks[0].mlp.down_proj.weight.mul_(1.5)
    label_weights(vision_modules(changed)[0], weights_digest(vision_modules(changed)[0], torch.float32))
    _cached(changed, EncodingStore(tmp_path, max_bytes=1 << 30, settings="min_pixels=..."))
    torch.testing.assert_close(_outputs(changed, batch), changed_expected, rtol=1e-6, atol=1e-6)
    assert changed.encoded == [IMAGE_PATCHES, VIDEO_PATCHES]

    # a truncated file (a disk that filled up, a copy cut short): a warning, that item encoded again
    video_file = max(first_files, key=lambda path: path.stat().st_size)
    video_file.write_bytes(video_file.read_bytes()[:100])
    caplog.set_level(logging.WARNING, logger="mmrl.models.encoding_store")
    third_epoch = _frozen_model(tiny_vl_path)
    cache = _cached(third_epoch, EncodingStore(tmp_path, max_bytes=1 << 30, settings="min_pixels=..."))
    torch.testing.assert_close(_outputs(third_epoch, batch), expected, rtol=1e-6, atol=1e-6)
    assert third_epoch.encoded == [VIDEO_PATCHES] and (cache.loaded, cache.misses) == (1, 1)
    assert any("ignoring and removing" in record.message for record in caplog.records)
    assert torch.load(video_file, weights_only=True)["pooled"].shape[0] == VIDEO_PATCHES // 4  # rewritten


def test_the_reference_tower_reuses_the_actor_encodings_over_a_step(tiny_vl_path, batch):
    """Actor (frozen tower) and reference are two models of equal tower weights sharing one cache, as
    the hybrid worker builds them: rollout-side old log-probs, reference log-probs and the update's
    forward encode each item once, all on the actor's tower; equal outputs to encoding every time."""
    expected = _outputs(training_model(tiny_vl_path), batch)
    actor, ref = _frozen_model(tiny_vl_path), _frozen_model(tiny_vl_path)
    ref.requires_grad_(False)
    cache = EncodingCache()
    for model in (actor, ref):
        enable_encoding_cache(vision_modules(model), cache)
    torch.testing.assert_close(_outputs(actor, batch), expected, rtol=1e-6, atol=1e-6)  # old log-probs
    torch.testing.assert_close(_outputs(ref, batch), expected, rtol=1e-6, atol=1e-6)  # reference
    actor_update = response_token_outputs(actor, *forward_arguments(batch), padding_free=True)[0]
    actor_update.float().pow(2).mean().backward()
    assert actor.encoded == [IMAGE_PATCHES, VIDEO_PATCHES] and ref.encoded == []
    assert (cache.misses, cache.hits) == (2, 3 * 4 - 2)  # 4 items a pass

    # a reference of other tower weights keeps its own encodings
    other = _frozen_model(tiny_vl_path)
    with torch.no_grad():
        vision_modules(other)[0].blocks[0].mlp.down_proj.weight.mul_(1.5)
    label_weights(vision_modules(other)[0], weights_digest(vision_modules(other)[0], torch.float32))
    enable_encoding_cache(vision_modules(other), cache)
    _outputs(other, batch)
    assert other.encoded == [IMAGE_PATCHES, VIDEO_PATCHES]


def _entry(rows: int, value: float) -> tuple[torch.Tensor, None]:
    return torch.full((rows, 8), value), None


def test_the_folder_stays_under_its_bound_oldest_evicted_first(tmp_path):
    one = len(_saved_bytes(tmp_path / "probe"))
    store = EncodingStore(tmp_path / "bounded", max_bytes=3 * one)
    for index in range(5):
        store.save(("w", index), *_entry(16, index))
        sizes = [path.stat().st_size for path in store.directory.glob("*.pt")]
        assert sum(sizes) <= store.max_bytes
    assert store.load(("w", 3), 16, torch.device("cpu")) is not None  # read: now the most recent
    store.save(("w", 5), *_entry(16, 5))
    kept = [key for key in range(6) if store.load(("w", key), 16, torch.device("cpu")) is not None]
    assert kept == [3, 4, 5]  # 2 was the least recently used: read 3 moved it behind 4


def _saved_bytes(directory) -> bytes:
    store = EncodingStore(directory, max_bytes=1 << 30)
    store.save(("w", 0), *_entry(16, 0))
    return store.path(("w", 0)).read_bytes()


def _write_many(directory: str, value: float, count: int) -> None:
    store = EncodingStore(directory, max_bytes=1 << 30)
    for _ in range(count):
        store.save(("w", "shared"), torch.full((4096, 8), value), None)
        assert store.load(("w", "shared"), 4096, torch.device("cpu")) is not None  # never a partial file


def test_two_processes_writing_one_key_leave_a_whole_file(tmp_path):
    # forked: a spawned child would import torch again (seconds); these children only save and load
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write_many, args=(str(tmp_path), 1.0, 30)) for _ in range(2)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(timeout=120)
    assert [writer.exitcode for writer in writers] == [0, 0]
    pooled, _ = EncodingStore(tmp_path, max_bytes=1 << 30).load(("w", "shared"), 4096, torch.device("cpu"))
    assert torch.equal(pooled, torch.ones(4096, 8))
    assert [path.name for path in tmp_path.iterdir()] == [
        EncodingStore(tmp_path, 1).path(("w", "shared")).name
    ]
