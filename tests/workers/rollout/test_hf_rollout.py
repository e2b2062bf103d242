"""The transformers rollout backend: response layout, sampling controls, parity with the trainer."""

from __future__ import annotations

import pytest
import torch
from _batches import policy_actor
from _models import training_model

from mmrl.data.collate import collate_prompts
from mmrl.data.config import DataConfig
from mmrl.data.dataset import PromptDataset
from mmrl.data.processing import attach_media, load_tokenizer_and_processor
from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS
from mmrl.models.families import family_for
from mmrl.models.inputs import concat_multi_modal_inputs
from mmrl.models.loading import load_model
from mmrl.protocol import DataProto
from mmrl.workers.rollout import SamplingParams, assemble_rollout_batch, response_mask_until_eos
from mmrl.workers.rollout.hf import HFRollout, filter_logits
from mmrl.workers.rollout.prepack import PrepackedLinear, prepack_linears, prepacking_available


@pytest.fixture(scope="module")
def vl_parts(tiny_vl_path):
    tokenizer, processor = load_tokenizer_and_processor(str(tiny_vl_path))
    return tiny_vl_path, tokenizer, processor


@pytest.fixture(scope="module")
def prompts(vl_parts, shapes_data_dir) -> DataProto:
    _, tokenizer, processor = vl_parts
    dataset = PromptDataset(
        str(shapes_data_dir / "train.jsonl"),
        tokenizer,
        processor,
        DataConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
    )
    return attach_media(
        collate_prompts([dataset[i] for i in range(3)], tokenizer.pad_token_id), dataset.media
    )


def make_rollout(vl_parts, **kwargs) -> HFRollout:
    path, tokenizer, _ = vl_parts
    return HFRollout(load_model(str(path)), tokenizer, **kwargs)


def test_response_mask_until_eos_by_hand():
    responses = torch.tensor([[5, 2, 7, 2], [5, 5, 5, 5], [2, 9, 9, 9]])
    assert response_mask_until_eos(responses, [2]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert response_mask_until_eos(responses, [2, 9]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert response_mask_until_eos(responses, [2], ignore_eos=True).tolist() == [[1] * 4] * 3


def test_assemble_pads_after_eos_and_extends_masks():
    prompts = DataProto.from_dict(
        tensors={
            "input_ids": torch.tensor([[0, 11, 12], [13, 14, 15]]),
            "attention_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
            "mm_token_type_ids": torch.tensor([[0, 1, 0], [0, 0, 0]]),
        },
        non_tensors={"uid": ["a", "b"]},
    )
    batch = assemble_rollout_batch(
        prompts, torch.tensor([[7, 2, 7], [8, 8, 8]]), eos_token_ids=[2], pad_token_id=0
    )
    assert batch.batch["responses"].tolist() == [[7, 2, 0], [8, 8, 8]]
    assert batch.batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch.batch["input_ids"].tolist() == [[0, 11, 12, 7, 2, 0], [13, 14, 15, 8, 8, 8]]
    assert batch.batch["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert batch.batch["mm_token_type_ids"].tolist() == [[0, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]]
    assert list(batch.non_tensor_batch["uid"]) == ["a", "b"]


def test_truncated_marks_responses_cut_at_the_width_without_eos():
    # width 3, EOS 2: ended early / EOS exactly on the last position / cut (no EOS) / EOS, then junk
    responses = torch.tensor([[7, 2, 0], [7, 7, 2], [7, 7, 7], [2, 7, 7]])
    prompts = DataProto.from_dict(
        tensors={
            "input_ids": torch.ones(4, 2, dtype=torch.long),
            "attention_mask": torch.ones(4, 2, dtype=torch.long),
        }
    )
    batch = assemble_rollout_batch(prompts, responses, eos_token_ids=[2], pad_token_id=0)
    assert batch.batch["truncated"].tolist() == [0, 0, 1, 0]
    assert batch.batch["truncated"].dtype == torch.long


def test_n_samples_per_prompt_keep_uid_and_media(vl_parts, prompts):
    rollout = make_rollout(vl_parts)
    batch = rollout.generate(prompts, SamplingParams(n=4, max_tokens=5, seed=3))
    assert len(batch) == 12 and batch.batch["responses"].shape == (12, 5)
    uids = list(batch.non_tensor_batch["uid"])
    assert uids == [uid for uid in prompts.non_tensor_batch["uid"] for _ in range(4)]
    for row in range(12):
        assert torch.equal(batch.batch["prompts"][row], prompts.batch["input_ids"][row // 4])
        assert (
            batch.non_tensor_batch["multi_modal_inputs"][row]
            is prompts.non_tensor_batch["multi_modal_inputs"][row // 4]
        )


def test_seeded_sampling_is_reproducible_and_greedy_is_deterministic(vl_parts, prompts):
    rollout = make_rollout(vl_parts)
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=11)
    first = rollout.generate(prompts, sampled).batch["responses"]
    assert torch.equal(first, rollout.generate(prompts, sampled).batch["responses"])
    assert not torch.equal(first, rollout.generate(prompts, sampled.override(seed=12)).batch["responses"])
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=6, seed=1)
    assert torch.equal(
        rollout.generate(prompts, greedy).batch["responses"],
        rollout.generate(prompts, greedy.override(seed=99)).batch["responses"],
    )


def test_placeholder_tokens_are_never_sampled(vl_parts, prompts):
    path, tokenizer, _ = vl_parts
    blocked = family_for(load_model(str(path)).config).placeholder_token_ids(tokenizer)
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") in blocked
    assert tokenizer.eos_token_id not in blocked
    # near-uniform sampling over the ~460-token vocabulary: without the block, 1,152 draws hit one of
    # the placeholders (expected ~10) with probability > 0.9999
    hot = SamplingParams(n=48, temperature=1000.0, max_tokens=8, seed=5, ignore_eos=True)
    rollout = make_rollout(vl_parts)
    responses = rollout.generate(prompts, hot).batch["responses"]
    assert not torch.isin(responses, torch.tensor(blocked)).any()
    rollout.blocked_token_ids = []
    unblocked = rollout.generate(prompts, hot).batch["responses"]
    assert torch.isin(unblocked, torch.tensor(blocked)).any()


def test_rollout_log_probs_match_the_trainer(vl_parts, prompts):
    path, _, _ = vl_parts
    rollout = make_rollout(vl_parts, return_log_probs=True)
    sampling = SamplingParams(n=2, temperature=0.7, max_tokens=6, seed=2)
    batch = rollout.generate(prompts, sampling)
    actor = policy_actor(training_model(path))
    log_probs, _ = actor.compute_log_probs(batch, micro_batch_size=4, temperature=0.7)
    mask = batch.batch["response_mask"].bool()
    gap = (log_probs - batch.batch["rollout_log_probs"]).abs()[mask]
    assert gap.max() < 1e-5


def test_rollout_log_probs_match_the_lora_trainer_after_updates(vl_parts, prompts):
    """LoRA: the rollout (a plain model) gets the merged weights after every update, and its sampled-token
    log-probs equal the adapted trainer's; the updates move the policy far beyond the tolerance."""
    from mmrl.models.lora import apply_lora
    from mmrl.workers.fsdp_engine import build_optimizer
    from mmrl.workers.weight_sync import iter_full_state_dict

    path, tokenizer, _ = vl_parts
    model = training_model(path)
    apply_lora(model, 4, 16, "all-linear", None)
    optimizer = build_optimizer(model.parameters(), lr=5e-2, betas=(0.9, 0.999), weight_decay=0.0)
    actor = policy_actor(model, optimizer, max_response_length=6)
    rollout = make_rollout(vl_parts, return_log_probs=True)
    generator, gaps = torch.Generator().manual_seed(0), []
    for step in range(3):
        rollout.update_weights(iter_full_state_dict(model))  # at start, then after every update
        batch = rollout.generate(prompts, SamplingParams(n=2, temperature=0.7, max_tokens=6, seed=step))
        log_probs, _ = actor.compute_log_probs(batch, micro_batch_size=4, temperature=0.7)
        mask = batch.batch["response_mask"].bool()
        gaps.append(float((log_probs - batch.batch["rollout_log_probs"]).abs()[mask].max()))
        advantages = torch.randn(len(batch), 1, generator=generator).sign() * mask
        columns = DataProto.from_dict(tensors={"old_log_probs": log_probs, "advantages": advantages})
        actor.update_policy(batch.union(columns), len(batch), len(batch), ppo_epochs=1, temperature=0.7)
    assert max(gaps) < 1e-5, gaps
    base_log_probs, _ = policy_actor(training_model(path)).compute_log_probs(batch, 4, temperature=0.7)
    assert (base_log_probs - log_probs).abs()[mask].max() > 0.01  # the adapter moved the policy


@pytest.fixture(scope="module")
def media_data_files(shapes_data_dir, tmp_path_factory) -> dict[str, str]:
    """Image prompts (the colour task), video prompts (the dot task, 8 frames) and audio prompts (the
    beeps task, 1.5 s)."""
    from mmrl.demo.synthetic import generate_shapes_dataset

    files = {"image": str(shapes_data_dir / "train.jsonl")}
    for media, task in (("video", "video_direction"), ("audio", "audio_beeps")):
        folder = generate_shapes_dataset(
            task, tmp_path_factory.mktemp(f"hf-{media}"), n_train=3, n_val=1, seed=0
        )
        files[media] = str(folder / "train.jsonl")
    return files


FAMILY_MEDIA = [
    (family, media)
    for family in ("qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "glm4v", "qwen3_5")
    for media in ("image", "video")
] + [("qwen3_omni_moe", media) for media in ("image", "video", "audio")]


@pytest.mark.parametrize(("family", "media"), FAMILY_MEDIA)
def test_rollout_log_probs_match_the_trainer_per_family(family, media, request, media_data_files):
    """Sampled-token log-probs of the transformers rollout equal the trainer's (packed) log-probs of the
    same tokens, for each vision family on images and on videos (Qwen3-VL: frame timestamps in the
    prompt, deepstack features; its MoE: routed experts; GLM-4.1V: frames as image tokens inside video
    tokens, each frame after its second; Qwen3.5: linear-attention state in the rollout's cache;
    Qwen3-Omni: the audio tower too, and temporal ids counted in seconds)."""
    fixtures = {"qwen2_5_vl": "tiny_vl_path", "qwen3_vl": "tiny_qwen3_vl_path",
                "qwen3_vl_moe": "tiny_qwen3_vl_moe_path", "glm4v": "tiny_glm4v_path", "qwen3_5": "tiny_qwen3_5_path",
                "qwen3_omni_moe": "tiny_qwen3_omni_path"}  # fmt: skip
    path = request.getfixturevalue(fixtures[family])
    tokenizer, processor = load_tokenizer_and_processor(str(path))
    pixels = DataConfig(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, video_min_pixels=MIN_PIXELS, video_max_pixels=MAX_PIXELS
    )
    dataset = PromptDataset(media_data_files[media], tokenizer, processor, pixels)
    prompts = attach_media(
        collate_prompts([dataset[i] for i in range(3)], tokenizer.pad_token_id), dataset.media
    )
    model = training_model(path)
    with torch.no_grad():  # a random tiny model answers everything alike: spread its predictions
        generator = torch.Generator().manual_seed(0)
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    rollout = HFRollout(model, tokenizer, return_log_probs=True)
    batch = rollout.generate(prompts, SamplingParams(n=2, temperature=0.7, max_tokens=6, seed=2))
    prompt_ids = prompts.batch["input_ids"]
    if "mm_token_type_ids" in batch.batch.keys():
        placeholders = (
            batch.batch["mm_token_type_ids"][:, : prompt_ids.shape[1]] == {"image": 1, "video": 2}[media]
        )
    else:  # Omni: each medium has its own placeholder id
        placeholders = prompt_ids == getattr(model.config, f"{media}_token_id")
    assert placeholders.sum(-1).min() > 0  # every prompt has its media
    share_prompts = family != "qwen3_5"  # Qwen3.5's linear attention cannot continue a shared prompt
    log_probs, _ = policy_actor(model, share_prompts=share_prompts).compute_log_probs(
        batch, 4, temperature=0.7
    )
    mask = batch.batch["response_mask"].bool()
    assert mask.sum() > 12
    gap = (log_probs - batch.batch["rollout_log_probs"]).abs()[mask]
    # Qwen3.5: the rollout steps its linear-attention state token by token, the trainer runs the chunked
    # form over the whole sequence; fp32 sums in other orders (1.9e-5 on an AVX-512 CPU, below 1e-5 on AVX2)
    assert gap.max() < (5e-5 if family == "qwen3_5" else 1e-5), gap.max()


def test_update_weights_changes_the_policy(vl_parts, prompts):
    rollout = make_rollout(vl_parts)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=6)
    before = rollout.generate(prompts, greedy).batch["responses"]
    other = load_model(str(vl_parts[0]))
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(torch.randn_like(parameter))
    rollout.update_weights(other.state_dict().items())
    for name, parameter in rollout.model.state_dict().items():
        assert torch.equal(parameter, other.state_dict()[name]), name
    assert not torch.equal(before, rollout.generate(prompts, greedy).batch["responses"])
    with pytest.raises(KeyError, match="'not.a.weight' is neither a state_dict key"):
        rollout.update_weights([("not.a.weight", torch.zeros(1))])


def test_sleep_frees_the_weights_until_the_next_push(vl_parts, prompts):
    # what a training phase does to the rollout's copy (vLLM's level-2 sleep): nothing is left of the
    # weights or their packed copies; generating refuses until weights are pushed, then it is the
    # policy it was
    rollout = make_rollout(vl_parts, return_log_probs=True, prepack=False)
    packed = prepack_linears(rollout.model, rows=8, min_elements=1)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=6)
    before = rollout.generate(prompts, greedy)
    weights = {name: tensor.clone() for name, tensor in rollout.model.state_dict().items()}
    rollout.sleep()
    assert rollout.weights_discarded
    assert all(parameter.numel() == 0 for parameter in rollout.model.parameters())
    layers = [module for module in rollout.model.modules() if isinstance(module, PrepackedLinear)]
    assert len(layers) == packed and all(layer._packed is None for layer in layers)
    with pytest.raises(RuntimeError, match="push weights with update_weights before generating"):
        rollout.generate(prompts, greedy)
    rollout.update_weights(weights.items())
    after = rollout.generate(prompts, greedy)
    assert torch.equal(before.batch["responses"], after.batch["responses"])
    torch.testing.assert_close(before.batch["rollout_log_probs"], after.batch["rollout_log_probs"])


# ---------------------------------------------------------------- the decode loop


@pytest.mark.parametrize("padded", [True, False])
def test_greedy_responses_equal_transformers_generate(vl_parts, prompts, padded):
    """The decode loop (prompt encoded once for its n rows, positions advanced by hand) picks the same
    tokens as transformers' ``generate`` on every expanded row, and stops each row at its EOS; with
    left-padded prompts (a mask every step) and without padding (no mask)."""
    from transformers import GenerationConfig

    rollout = make_rollout(vl_parts)
    assert bool((prompts.batch["attention_mask"] == 0).any()) is False  # equal-length prompts
    if padded:  # two more left-padding columns, as a batch with a longer prompt would have
        tensors = dict(prompts.batch.items())
        pad_values = {"input_ids": rollout.pad_token_id, "attention_mask": 0, "mm_token_type_ids": 0}
        for key, value in pad_values.items():
            tensors[key] = torch.nn.functional.pad(tensors[key], (2, 0), value=value)
        prompts = DataProto.from_dict(tensors=tensors, non_tensors=dict(prompts.non_tensor_batch))
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=12)
    batch = rollout.generate(prompts, greedy)
    expanded = prompts.repeat(2, interleave=True)
    inputs = {key: expanded.batch[key] for key in ("input_ids", "attention_mask", "mm_token_type_ids")}
    inputs.update(concat_multi_modal_inputs(list(expanded.non_tensor_batch["multi_modal_inputs"])))
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=12,
        eos_token_id=rollout.eos_token_ids,
        pad_token_id=rollout.pad_token_id,
        suppress_tokens=rollout.blocked_token_ids,
    )
    reference = rollout.model.generate(**inputs, generation_config=config)[:, inputs["input_ids"].shape[1] :]
    reference = torch.nn.functional.pad(reference, (0, 12 - reference.shape[1]), value=rollout.pad_token_id)
    reference = assemble_rollout_batch(expanded, reference, rollout.eos_token_ids, rollout.pad_token_id)
    assert torch.equal(batch.batch["responses"], reference.batch["responses"])
    assert torch.equal(batch.batch["response_mask"], reference.batch["response_mask"])
    assert batch.batch["response_mask"].sum() > len(batch)  # more than one token per row


def test_filter_logits_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.2, 0.1]]))
    inf = float("-inf")
    assert filter_logits(logits, top_k=2, top_p=1.0).isinf().tolist() == [
        [False, False, False, True]
    ]  # a tie
    # top-p 0.6: 0.5 alone is short of it, 0.5 + 0.2 reaches it -> two tokens (the first 0.2 by sort order)
    kept = filter_logits(logits, top_k=0, top_p=0.6)
    assert (kept != inf).sum() == 2 and kept[0, 0] != inf
    assert (filter_logits(logits, top_k=0, top_p=0.4) != inf).tolist() == [[True, False, False, False]]
    assert torch.equal(filter_logits(logits, top_k=0, top_p=1.0), logits)


def test_sampling_draws_from_the_filtered_tempered_distribution(vl_parts):
    """Inverse-transform draws, 40,000 of them: the frequencies of softmax(logits / T) after top-k,
    within 4 standard errors, and the returned log-probs are those of the unfiltered softmax(logits / T)."""
    rollout = make_rollout(vl_parts, return_log_probs=True)
    rollout.blocked_token_ids = [5]
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 3.0]).repeat(40_000, 1)
    sampling = SamplingParams(temperature=0.5, top_k=3)
    tokens, log_probs = rollout._sample(logits, sampling, torch.Generator().manual_seed(0))
    scaled = logits[0] / 0.5
    allowed = scaled.clone()
    allowed[5] = float("-inf")  # blocked
    expected = filter_logits(allowed.unsqueeze(0), 3, 1.0).softmax(-1)[0]
    frequencies = torch.bincount(tokens, minlength=6).double() / len(tokens)
    assert frequencies[3:].sum() == 0  # outside the top 3 of the allowed tokens
    tolerance = 4 * (expected * (1 - expected) / len(tokens)).sqrt() + 1e-9
    assert ((frequencies - expected).abs() <= tolerance).all(), (frequencies, expected)
    torch.testing.assert_close(log_probs, scaled.log_softmax(-1)[tokens])


# ---------------------------------------------------------------- oneDNN-prepacked linear layers

needs_onednn = pytest.mark.skipif(not prepacking_available(), reason="this PyTorch build has no oneDNN")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_prepacked_linear_equals_linear_and_repacks_after_a_write(bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 80, bias=bias)
    packed = PrepackedLinear(linear, rows=8)
    assert packed.weight is linear.weight and packed.bias is linear.bias
    x = torch.randn(5, 3, 48)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        linear.weight.mul_(-2.0)  # in place, as weight sync writes: the packed copy is stale now
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    linear.weight.data = torch.randn(80, 48)  # a new storage
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    # with autograd on, the layer is a plain linear (the packed op has no backward)
    packed(x).sum().backward()
    torch.testing.assert_close(linear.weight.grad, x.sum((0, 1)).expand(80, 48))


@needs_onednn
def test_prepack_replaces_only_large_fp32_linears_and_keeps_names(vl_parts):
    path, tokenizer, _ = vl_parts
    model = load_model(str(path))
    keys = list(model.state_dict())
    sizes = {name: m.weight.numel() for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    threshold = sorted(sizes.values())[len(sizes) // 2]
    replaced = prepack_linears(model, rows=4, min_elements=threshold)
    packed = {name for name, m in model.named_modules() if isinstance(m, PrepackedLinear)}
    assert replaced == len(packed) and packed == {name for name, size in sizes.items() if size >= threshold}
    assert list(model.state_dict()) == keys
    assert model.lm_head.weight is model.get_input_embeddings().weight  # ties survive
    # an HFRollout packs by default only matrices of 2^18 weights or more: none in the tiny model
    assert not any(isinstance(m, PrepackedLinear) for m in make_rollout(vl_parts).model.modules())


@needs_onednn
def test_prepacked_rollout_equals_plain_rollout_before_and_after_weight_sync(vl_parts, prompts):
    """Every linear of the tiny VL model packed: same greedy tokens and log-probs, sampled tokens the
    same, and after a weight sync both follow the new weights."""
    plain = make_rollout(vl_parts, return_log_probs=True, prepack=False)
    packed = make_rollout(vl_parts, return_log_probs=True, prepack=False)
    assert prepack_linears(packed.model, rows=8, min_elements=1) > 20
    other = training_model(vl_parts[0])  # the trainer's model: it scores the rollout below
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(0.5 * torch.randn_like(parameter))
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=8)
    sampled = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=4)
    greedy_tokens = []
    for synced in (False, True):
        if synced:
            plain.update_weights(other.state_dict().items())
            packed.update_weights(other.state_dict().items())
        for sampling in (greedy, sampled):
            a, b = plain.generate(prompts, sampling), packed.generate(prompts, sampling)
            assert torch.equal(a.batch["responses"], b.batch["responses"]), (synced, sampling)
            torch.testing.assert_close(
                a.batch["rollout_log_probs"], b.batch["rollout_log_probs"], rtol=1e-4, atol=1e-5
            )
            if sampling is greedy:
                greedy_tokens.append(b.batch["responses"])
    assert not torch.equal(*greedy_tokens)  # the sync took effect in the packed layers too
    # and the trainer, on plain linears with the same weights, scores the packed rollout's tokens alike
    batch = packed.generate(prompts, sampled)
    log_probs, _ = policy_actor(other).compute_log_probs(batch, micro_batch_size=4, temperature=1.0)
    gap = (log_probs - batch.batch["rollout_log_probs"]).abs()[batch.batch["response_mask"].bool()]
    assert gap.max() < 1e-4


def test_a_frozen_towers_rollout_encodings_serve_the_scoring_pass(vl_parts, prompts):
    """The transformers rollout runs the actor's own tower: with the step's encoding cache on it, each
    prompt's image is encoded once, in the rollout, and the scoring pass that follows encodes none."""
    from _batches import policy_actor
    from _models import training_model

    from mmrl.models.encoding_cache import EncodingCache, enable_encoding_cache
    from mmrl.models.loading import freeze_vision_tower, vision_modules
    from mmrl.workers.rollout import SamplingParams

    path, tokenizer, _ = vl_parts
    model = training_model(str(path))  # prepared for the trainer's passes; the rollout takes it as it is
    freeze_vision_tower(model)
    cache = EncodingCache()
    enable_encoding_cache(vision_modules(model), cache)
    batch = HFRollout(model, tokenizer).generate(
        prompts, SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=1)
    )
    assert (cache.misses, cache.hashed_items) == (3, 0)  # 3 images, encoded once for the n = 2 samples
    policy_actor(model).compute_log_probs(batch, 4, 1.0)
    # the pass feeds each prompt once for its 2 rows (shared prompts): 3 items, all from the rollout
    assert (cache.misses, cache.hits, cache.hashed_items) == (3, 3, 0)
