"""Media processing shared by the dataset and the workers: the processed media attached to a batch from
its compact column, shared by the rows of a prompt, kept for the next phase and dropped after."""

from __future__ import annotations

import pytest
import torch

from mmrl.data.collate import collate_prompts
from mmrl.data.config import DataConfig
from mmrl.data.dataset import PromptDataset
from mmrl.data.processing import MediaCache, attach_media, load_tokenizer_and_processor, without_model_media
from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS


@pytest.fixture(scope="module")
def dataset(tiny_vl_path, shapes_data_dir) -> PromptDataset:
    tokenizer, processor = load_tokenizer_and_processor(str(tiny_vl_path))
    config = DataConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    return PromptDataset(str(shapes_data_dir / "train.jsonl"), tokenizer, processor, config)


def test_a_model_folders_tokenizer_is_read_once_with_the_collector_paused(
    tiny_vl_path, tiny_text_path, monkeypatch
):
    """The multimodal processor holds the tokenizer that is returned (not a second one parsed from the
    same files), a text model's tokenizer is read once too, and Python's cyclic collector is paused while
    a vocabulary loads, then on again (together 5.1 -> 2.0 CPU-s for the released vocabulary, in the
    driver and every rank: bench/startup.py)."""
    import gc

    from transformers import PreTrainedTokenizerBase

    reads = []  # (class, collector on) of each tokenizer read
    read = PreTrainedTokenizerBase.from_pretrained.__func__

    def counted(cls, *args, **kwargs):
        reads.append((cls.__name__, gc.isenabled()))
        return read(cls, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "from_pretrained", classmethod(counted))
    assert gc.isenabled()
    tokenizer, processor = load_tokenizer_and_processor(str(tiny_vl_path))
    assert processor.tokenizer is tokenizer
    assert reads == [(type(tokenizer).__name__, False)]
    reads.clear()
    tokenizer, processor = load_tokenizer_and_processor(str(tiny_text_path))
    assert processor is None
    assert reads == [(type(tokenizer).__name__, False)]
    assert gc.isenabled()


def test_rows_of_a_prompt_share_its_processed_media_and_phases_reuse_them(dataset):
    prompts = collate_prompts([dataset[i] for i in range(4)], dataset.tokenizer.pad_token_id)
    batch = prompts.repeat(2, interleave=True)  # [a, a, b, b, ...] as generate returns them
    cache = MediaCache()
    first = attach_media(batch, dataset.media, cache, rollout_media=True)
    inputs, rollout_media = (
        first.non_tensor_batch["multi_modal_inputs"],
        first.non_tensor_batch["multi_modal_data"],
    )
    assert inputs[0] is inputs[1] and inputs[0] is not inputs[2]  # one result per prompt, shared
    assert rollout_media[0]["images"][0].size == (56, 56)
    assert (cache.processed, cache.reused) == (4, 0)

    # the next phase on the same rows (another order): nothing is processed again
    again = attach_media(batch.reorder([7, 6, 5, 4, 3, 2, 1, 0]), dataset.media, cache)
    assert again.non_tensor_batch["multi_modal_inputs"][7] is inputs[0]
    assert "multi_modal_data" not in again.non_tensor_batch
    assert (cache.processed, cache.reused) == (4, 4)

    # a new batch (the next step) drops what it does not hold before processing its own
    next_step = collate_prompts([dataset[i] for i in range(4, 6)], dataset.tokenizer.pad_token_id)
    attach_media(next_step, dataset.media, cache)
    assert len(cache.entries) == 2 and (cache.processed, cache.reused) == (6, 4)

    stripped = without_model_media(first)
    assert not {"multi_modal_inputs", "multi_modal_data"} & set(stripped.non_tensor_batch)
    assert "prompt_media" in stripped.non_tensor_batch and torch.equal(
        stripped.batch["input_ids"], first.batch["input_ids"]
    )


def test_a_batch_without_media_columns_is_left_alone(dataset):
    prompts = collate_prompts([dataset[0]], dataset.tokenizer.pad_token_id)
    text_only = prompts.select(non_tensor_keys=["uid"])
    assert attach_media(text_only, dataset.media) is text_only
