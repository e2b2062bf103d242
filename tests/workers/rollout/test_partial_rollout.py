"""Partial rollouts of the transformers engine (``trainer.async_mode=stream``): a generation decoded a
chunk of tokens at a time, new weights arriving between chunks; every token records the policy version
that sampled it (mmrl/workers/rollout/hf.py: PartialDecode, StreamedGeneration; the thread that decodes
them on a rollout worker: mmrl/workers/rollout/streaming.py)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from mmrl.data.collate import collate_prompts
from mmrl.data.config import DataConfig
from mmrl.data.dataset import PromptDataset
from mmrl.data.processing import attach_media, load_tokenizer_and_processor
from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS
from mmrl.models.inputs import build_forward_inputs
from mmrl.models.loading import load_model
from mmrl.protocol import DataProto
from mmrl.workers.rollout import SamplingParams
from mmrl.workers.rollout.hf import HFRollout, PartialDecode
from mmrl.workers.rollout.streaming import StreamingEngine


@pytest.fixture(scope="module")
def parts(tiny_vl_path, shapes_data_dir):
    """The tokenizer, 3 image prompts (media attached), and the tiny model's weights before and after
    an "update" (every tensor moved by Gaussian noise: other tokens are likely)."""
    tokenizer, processor = load_tokenizer_and_processor(str(tiny_vl_path))
    dataset = PromptDataset(
        str(shapes_data_dir / "train.jsonl"),
        tokenizer,
        processor,
        DataConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
    )
    prompts = attach_media(
        collate_prompts([dataset[i] for i in range(3)], tokenizer.pad_token_id), dataset.media
    )
    updated = load_model(str(tiny_vl_path))
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in updated.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    return tokenizer, prompts, {name: tensor.clone() for name, tensor in updated.state_dict().items()}


@pytest.fixture(scope="module")
def mixed_prompts(tiny_vl_path, shapes_data_dir, tmp_path_factory) -> DataProto:
    """An image prompt (the colour task) and a video prompt (the dot task, 8 frames: 3-D positions,
    frame timing), media attached, in one batch as a mixed loader batch collates them."""
    from mmrl.demo.synthetic import generate_shapes_dataset

    video_dir = generate_shapes_dataset(
        "video_direction", tmp_path_factory.mktemp("partial-video"), n_train=2, n_val=1, seed=0
    )
    tokenizer, processor = load_tokenizer_and_processor(str(tiny_vl_path))
    data = DataConfig(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, video_min_pixels=MIN_PIXELS, video_max_pixels=MAX_PIXELS
    )
    items = []
    for data_dir, rows in ((shapes_data_dir, 1), (video_dir, 1)):
        dataset = PromptDataset(str(data_dir / "train.jsonl"), tokenizer, processor, data)
        items += [dataset[i] for i in range(rows)]
    return attach_media(collate_prompts(items, tokenizer.pad_token_id), dataset.media)


def rollout_of(tiny_vl_path, tokenizer) -> HFRollout:
    # prepacking changes the rollout's numerics slightly (tested elsewhere); the reference runs plain layers
    return HFRollout(load_model(str(tiny_vl_path)), tokenizer, return_log_probs=True, prepack=False)


@torch.no_grad()
def full_forward_sampler(
    rollout: HFRollout,
    models: list[torch.nn.Module],
    switch_at: int,
    prompts: DataProto,
    sampling: SamplingParams,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: every token drawn from a forward of the whole sequence so far (no cache), by
    ``models[0]`` before token ``switch_at`` and ``models[1]`` from it on, the engine's draw
    (``_sample``) with one seeded stream. Rows never end (``ignore_eos``)."""
    repeated = prompts.repeat(sampling.n, interleave=True)
    input_ids, mask = repeated.batch["input_ids"], repeated.batch["attention_mask"]
    media = list(repeated.non_tensor_batch["multi_modal_inputs"])
    generator = torch.Generator().manual_seed(sampling.seed)
    tokens, log_probs = [], []
    for step in range(sampling.max_tokens):
        model = models[0] if step < switch_at else models[1]
        logits = model(**build_forward_inputs(model, input_ids, mask, media)).logits[:, -1]
        token, log_prob = rollout._sample(logits, sampling, generator)
        tokens.append(token)
        log_probs.append(log_prob)
        input_ids = torch.cat([input_ids, token.unsqueeze(-1)], dim=-1)
        mask = torch.cat([mask, mask.new_ones(len(token), 1)], dim=-1)
    return torch.stack(tokens, dim=1), torch.stack(log_probs, dim=1)


@pytest.mark.parametrize("media", ["images", "images and videos"])
def test_a_push_between_chunks_continues_with_the_new_weights_token_for_token(
    tiny_vl_path, parts, media, request
):
    # 3 tokens by the old weights, the push, 3 by the new: the first 3 are what the old weights sample,
    # the rest what the new weights sample after that prefix, with the same random stream (the engine
    # re-encodes the prompt, its images or video frames, and the prefix with the new weights); each
    # token carries its weights' version
    tokenizer, prompts, updated = parts
    if media != "images":
        prompts = request.getfixturevalue("mixed_prompts")
        media_keys = [set(inputs) for inputs in prompts.non_tensor_batch["multi_modal_inputs"]]
        assert ["video_grid_thw" in keys for keys in media_keys] == [False, True], media_keys
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=5, ignore_eos=True)
    rollout = rollout_of(tiny_vl_path, tokenizer)
    old_model, new_model = load_model(str(tiny_vl_path)), load_model(str(tiny_vl_path))
    new_model.load_state_dict(updated)
    decode = PartialDecode(rollout, prompts, sampling, rollout._generator(sampling), version=4)
    decode.advance(3)
    rollout.update_weights(updated.items())
    decode.reload(5)
    decode.advance(100)
    assert decode.done and decode.responses().shape == (2 * len(prompts), 6)
    expected, expected_log_probs = full_forward_sampler(rollout, [old_model, new_model], 3, prompts, sampling)
    assert torch.equal(decode.responses(), expected)
    torch.testing.assert_close(decode.log_probs(), expected_log_probs, atol=2e-5, rtol=1e-5)
    assert decode.versions().tolist() == [[4, 4, 4, 5, 5, 5]] * (2 * len(prompts))
    # the push mattered: the old weights alone sample other tokens after the prefix
    unchanged, _ = full_forward_sampler(rollout, [old_model, old_model], 3, prompts, sampling)
    assert torch.equal(unchanged[:, :3], expected[:, :3]) and not torch.equal(
        unchanged[:, 3:], expected[:, 3:]
    )


def test_chunks_without_a_push_equal_one_generation(tiny_vl_path, parts):
    # the streamed generation of 2-token chunks hands out every prompt's n responses once, when they
    # have all ended, and they equal generate()'s (same micro-batches, same random stream)
    tokenizer, prompts, _ = parts
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=7, seed=3)
    rollout = rollout_of(tiny_vl_path, tokenizer)
    whole = rollout.generate(prompts, sampling)
    stream = rollout.stream(prompts, sampling, version=2)
    taken = []
    while not stream.done:
        stream.advance(2)
        part = stream.take_finished()
        if part is not None:
            taken.append(part)
    streamed = DataProto.concat(taken)
    assert sorted(streamed.non_tensor_batch["uid"]) == sorted(whole.non_tensor_batch["uid"])
    order = [list(streamed.non_tensor_batch["uid"]).index(uid) for uid in whole.non_tensor_batch["uid"][::2]]
    rows = [row + k for row in order for k in range(2)]
    for key in ("responses", "response_mask", "rollout_log_probs", "input_ids", "attention_mask"):
        assert torch.equal(streamed.batch[key][rows], whole.batch[key]), key
    mask = streamed.batch["response_mask"].bool()
    assert (streamed.batch["policy_version"][mask] == 2).all()


def test_prompts_are_handed_out_when_their_n_responses_have_ended(tiny_vl_path, parts):
    # a micro-batch of one prompt per pass: the first prompt's rows are handed out when its decode ends,
    # before the second prompt's micro-batch is prefilled; a push reaches only the micro-batch in progress
    tokenizer, prompts, updated = parts
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=3, ignore_eos=True)
    rollout = HFRollout(load_model(str(tiny_vl_path)), tokenizer, micro_batch_size=2, prepack=False)
    stream = rollout.stream(prompts, sampling, version=0)
    stream.advance(3)
    assert stream.take_finished() is None  # 3 of 4 tokens
    rollout.update_weights(updated.items())
    stream.reload(1)
    stream.advance(3)  # the last token, by version 1
    first = stream.take_finished()
    assert list(first.non_tensor_batch["uid"]) == [prompts.non_tensor_batch["uid"][0]] * 2
    assert first.batch["policy_version"].tolist() == [[0, 0, 0, 1]] * 2
    stream.advance(4)
    second = stream.take_finished()
    assert second.batch["policy_version"].tolist() == [[1, 1, 1, 1]] * 2  # prefilled by version 1
    stream.advance(4)
    assert stream.take_finished() is not None and stream.done


def test_a_push_holding_the_streaming_thread_lands_between_chunks(tiny_vl_path, parts):
    # the rollout worker's thread decodes 2 tokens per chunk; the test holds the engine as a push does
    # (between two chunks), loads new weights and reloads: each row's first k tokens are version 0 and
    # the rest version 1, k being the tokens sampled when the hold began, and the tokens are exactly
    # those of a deterministic partial decode pushed after k tokens
    tokenizer, prompts, updated = parts
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=16, seed=9, ignore_eos=True)
    rollout = rollout_of(tiny_vl_path, tokenizer)
    streaming = StreamingEngine(rollout, chunk_tokens=2)
    # the first chunk that sampled tokens waits, once it has ended, until the test holds the engine: the
    # stream cannot run to its end before the push however the two threads are scheduled
    real_chunk, first_tokens = streaming.chunk, threading.Event()

    @contextlib.contextmanager
    def chunk_then_wait_for_the_push():
        with real_chunk():
            yield
        current = streaming.streams[0].current
        if not first_tokens.is_set() and current is not None and len(current.tokens):
            first_tokens.set()
            deadline = time.monotonic() + 60
            while not streaming.holders and time.monotonic() < deadline:
                time.sleep(0.001)

    streaming.chunk = chunk_then_wait_for_the_push
    streaming.submit(prompts, sampling, version=0)
    assert first_tokens.wait(60)
    with streaming.hold():
        sampled = len(streaming.streams[0].current.tokens)
        rollout.update_weights(updated.items())
        streaming.reload(1)
    assert 0 < sampled < 16 and sampled % 2 == 0
    groups = []
    while len(groups) < 1:
        groups += streaming.take(timeout_s=60)
    streaming.stop()
    (batch,) = groups  # one micro-batch: the 3 prompts end together
    assert batch.batch["policy_version"].tolist() == [[0] * sampled + [1] * (16 - sampled)] * 6
    reference = rollout_of(tiny_vl_path, tokenizer)
    decode = PartialDecode(reference, prompts, sampling, reference._generator(sampling), version=0)
    decode.advance(sampled)
    reference.update_weights(updated.items())
    decode.reload(1)
    decode.advance(16)
    assert torch.equal(batch.batch["responses"], decode.responses())
    assert torch.equal(batch.batch["rollout_log_probs"], decode.log_probs())
