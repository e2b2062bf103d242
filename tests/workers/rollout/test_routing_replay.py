"""Rollout routing replay on the tiny Qwen3-VL MoE and Qwen3.5 MoE: the transformers rollout records
each fed token's experts per layer, and the actor's passes route by them (mmrl.models.moe)."""

from __future__ import annotations

import pytest
import torch
from _batches import policy_actor
from _models import training_model

from mmrl.columns import check_batch
from mmrl.data.collate import collate_prompts
from mmrl.data.config import DataConfig
from mmrl.data.dataset import PromptDataset
from mmrl.data.processing import attach_media, load_tokenizer_and_processor
from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS
from mmrl.models.moe import FREE, ROUTED_EXPERTS, forward_routing, router_modules
from mmrl.protocol import DataProto
from mmrl.workers.rollout import SamplingParams
from mmrl.workers.rollout.hf import HFRollout

TEMPERATURE = 0.7


def _spread(model, seed: int, scale: float = 0.2):
    """A random tiny model answers everything alike: spread its predictions (and its routers)."""
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for parameter in model.parameters():
            parameter.add_(scale * torch.randn(parameter.shape, generator=generator))
    return model


def _rollout(model_path, shapes_data_dir) -> DataProto:
    tokenizer, processor = load_tokenizer_and_processor(str(model_path))
    pixels = DataConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    dataset = PromptDataset(str(shapes_data_dir / "train.jsonl"), tokenizer, processor, pixels)
    prompts = attach_media(
        collate_prompts([dataset[i] for i in range(3)], tokenizer.pad_token_id), dataset.media
    )
    model = _spread(training_model(model_path), seed=0)
    rollout = HFRollout(model, tokenizer, return_log_probs=True, record_routing=True)
    return rollout.generate(prompts, SamplingParams(n=2, temperature=TEMPERATURE, max_tokens=6, seed=2))


@pytest.fixture(scope="module")
def rollout_batch(tiny_qwen3_vl_moe_path, shapes_data_dir) -> DataProto:
    return _rollout(tiny_qwen3_vl_moe_path, shapes_data_dir)


@pytest.fixture(scope="module", params=["qwen3_vl_moe", "qwen3_5_moe"])
def family_rollout(request, shapes_data_dir) -> tuple[object, DataProto]:
    """(model path, rollout batch) of each MoE family; Qwen3.5 MoE: linear-attention layers beside the
    routed experts, and a shared expert no router chooses."""
    if request.param == "qwen3_vl_moe":
        return request.getfixturevalue("tiny_qwen3_vl_moe_path"), request.getfixturevalue("rollout_batch")
    path = request.getfixturevalue("tiny_qwen3_5_moe_path")
    return path, _rollout(path, shapes_data_dir)


def test_the_rollout_records_every_fed_token_and_frees_the_rest(family_rollout):
    _, rollout_batch = family_rollout
    batch = rollout_batch.batch
    routed, valid = batch[ROUTED_EXPERTS], batch["attention_mask"].bool()  # [B, L, layers, k], [B, L]
    assert routed.shape == (*valid.shape, 2, 2) and check_batch(rollout_batch) == []
    recorded = (routed != FREE).all(-1).all(-1)  # [B, L]
    assert not recorded[~valid].any()  # padding (prompt's left, after EOS) routes freely
    prompt_length = batch["prompts"].shape[1]
    assert recorded[:, :prompt_length][valid[:, :prompt_length]].all()
    # every valid response token but the last sampled step (never fed back) was recorded
    last_fed = int(recorded.any(0).nonzero().max())
    assert (recorded | ~valid)[:, : last_fed + 1].all() and not recorded[:, last_fed + 1 :].any()
    assert ((routed >= 0) & (routed < 4)).all(-1).all(-1).eq(recorded).all()
    top = routed[recorded]  # [tokens, layers, k]: k distinct experts per token and layer
    assert (top[..., 0] != top[..., 1]).all()


@pytest.mark.parametrize("padding_free", [True, False])
def test_replayed_routing_gives_exactly_the_recorded_experts(family_rollout, padding_free):
    """A different policy (perturbed weights, routers included) replaying the rollout's routing: each
    router of the old-log-prob pass took exactly the recorded experts, where left alone it would have
    chosen others for some tokens."""
    model_path, rollout_batch = family_rollout
    model = _spread(_spread(training_model(model_path), seed=0), seed=5, scale=0.5)
    batch = rollout_batch.batch
    expected = forward_routing(batch[ROUTED_EXPERTS], batch["attention_mask"], padding_free)  # [T, layers, k]
    recorded = (expected != FREE).all(-1).all(-1)
    chosen = {}
    for replay in (True, False):
        actor = policy_actor(model, padding_free=padding_free, share_prompts=False, replay_routing=replay)
        actor.compute_log_probs(rollout_batch, len(rollout_batch), TEMPERATURE)  # one micro-batch
        chosen[replay] = actor.routers.layer_experts()
    assert chosen[True].shape == expected.shape
    assert torch.equal(chosen[True][recorded], expected[recorded].long())
    assert not torch.equal(chosen[False][recorded], expected[recorded].long())  # replay made a difference


def test_replaying_the_rollouts_own_routing_keeps_the_log_probs(tiny_qwen3_vl_moe_path, rollout_batch):
    """On CPU fp32 the trainer routes every fed token as the rollout did, so replay changes nothing and
    both match the rollout's log-probs; replay also serves the update (packed, gradients through the
    replayed weights and the router's logits). (Qwen3.5 MoE: its trainer run, tests/trainer.)"""
    model = _spread(training_model(tiny_qwen3_vl_moe_path), seed=0)
    mask = rollout_batch.batch["response_mask"].bool()
    log_probs = {}
    for replay in (True, False):
        actor = policy_actor(model, share_prompts=False, replay_routing=replay)
        log_probs[replay], _ = actor.compute_log_probs(rollout_batch, 4, TEMPERATURE)
    torch.testing.assert_close(log_probs[True], log_probs[False], atol=1e-6, rtol=0)
    gap = (log_probs[True] - rollout_batch.batch["rollout_log_probs"]).abs()[mask]
    assert gap.max() < 1e-5, gap.max()

    batch = rollout_batch.select(
        batch_keys=list(rollout_batch.batch.keys()), non_tensor_keys=["multi_modal_inputs"]
    )
    batch.batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    batch.batch["old_log_probs"] = log_probs[True]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    actor = policy_actor(model, optimizer, share_prompts=False, replay_routing=True)
    before = {name: router.weight.detach().clone() for name, router in router_modules(model)}
    metrics = actor.update_policy(batch, len(batch), len(batch), 1, TEMPERATURE).metrics
    assert metrics["grad_norm"] > 0 and 1.0 <= metrics["moe_aux_loss"] <= 2.0
    assert all(not torch.equal(router.weight, before[name]) for name, router in router_modules(model))


def test_replay_refuses_layouts_it_cannot_follow(tiny_qwen3_vl_moe_path, tiny_qwen3_vl_path, rollout_batch):
    model = training_model(tiny_qwen3_vl_moe_path)
    with pytest.raises(ValueError, match="share_prompts=false"):
        policy_actor(model, share_prompts=True, replay_routing=True)
    with pytest.raises(ValueError, match="needs a MoE model"):
        policy_actor(training_model(tiny_qwen3_vl_path), share_prompts=False, replay_routing=True)
    without = rollout_batch.select(
        batch_keys=["input_ids", "attention_mask", "responses"], non_tensor_keys=["multi_modal_inputs"]
    )
    with pytest.raises(KeyError, match="no 'routed_experts' column"):
        policy_actor(model, share_prompts=False, replay_routing=True).compute_log_probs(
            without, 6, TEMPERATURE
        )


def test_a_replayed_update_with_gradient_checkpointing_equals_one_without(
    tiny_qwen3_vl_moe_path, rollout_batch
):
    """The routers stay hooked through backward: layers recomputed by gradient checkpointing route by
    the replayed experts too (a policy whose free routing differs from the recorded one)."""
    batch = rollout_batch.select(
        batch_keys=list(rollout_batch.batch.keys()), non_tensor_keys=["multi_modal_inputs"]
    )
    batch.batch["advantages"] = torch.randn(
        batch.batch["response_mask"].shape, generator=torch.Generator().manual_seed(0)
    )
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
    after = {}
    for checkpointing in (False, True):
        model = _spread(_spread(training_model(tiny_qwen3_vl_moe_path), seed=0), seed=5, scale=0.5)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        actor = policy_actor(
            model, torch.optim.SGD(model.parameters(), lr=0.1), share_prompts=False, replay_routing=True
        )
        actor.update_policy(batch, len(batch), len(batch), 1, TEMPERATURE)
        after[checkpointing] = {
            name: router.weight.detach().clone() for name, router in router_modules(model)
        }
        after[checkpointing]["experts"] = (
            model.model.language_model.layers[0].mlp.experts.down_proj.detach().clone()
        )
    for name, weight in after[False].items():
        torch.testing.assert_close(after[True][name], weight, atol=1e-6, rtol=0, msg=name)
