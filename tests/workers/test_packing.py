"""Padding-free training: packed forward passes equal padded ones, token-budget micro-batches, balancing.

Batches are built by hand as the rollout hands them over (left-padded prompts, right-padded responses
of uneven lengths) from the tiny Qwen2.5-VL (images, videos), Qwen2.5-Omni thinker (audio, video
with its sound track) and Qwen3-VL (images, videos with frame timestamps; deepstack features). Everything runs in fp32, where packed and padded passes differ only by the
order of floating-point sums.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from _batches import (
    ACTOR_SETTINGS,
    TEMPERATURE,
    add_training_columns,
    build_batch,
    policy_actor,
    value_critic,
)
from _models import training_model
from torch.utils._python_dispatch import TorchDispatchMode

from mmrl.core_algos import log_probs_from_logits
from mmrl.demo.ranks import run_on_ranks
from mmrl.models.inputs import (
    build_packed_forward_inputs,
    concat_multi_modal_inputs,
    model_layout,
    packed_position_ids,
    response_head_outputs,
)
from mmrl.models.loading import tower_modules
from mmrl.parallel.packing import (
    balance_batch,
    balance_by_length,
    padding_counts,
    split_groups,
    token_budget_groups,
)
from mmrl.protocol import DataProto
from mmrl.workers.forward import forward_arguments
from mmrl.workers.fsdp_engine import build_optimizer, micro_batch_rows
from mmrl.workers.weight_sync import iter_full_state_dict

# Row specs: keyword arguments of encode_prompt. Response lengths are uneven (1 to 7 tokens).
IMAGE_ROWS = ({"image": (56, 56)}, {"image": (84, 56)}, {"image": (56, 112)})
VIDEO_ROWS = ({"video_frames": 4}, {"video_frames": 2})
MIXED_ROWS = ({}, {"image": (84, 56)}, {"video_frames": 4}, {}, {"image": (56, 56)})
# Qwen3-VL: frames passed as sampled at 2 fps, so the prompt holds one timestamp per temporal patch
QWEN3_VIDEO_ROWS = ({"video_frames": 4, "video_fps": 2.0}, {"video_frames": 6, "video_fps": 2.0})
QWEN3_MIXED_ROWS = ({}, {"image": (84, 56)}, {"video_frames": 4, "video_fps": 2.0}, {}, {"image": (56, 56)})
AUDIO_ROWS = (
    {"audio_s": 1.0},
    {"image": (56, 56), "audio_s": 0.5},
    {"video_frames": 4, "audio_s": 2.0, "audio_in_video": True},
)


@pytest.fixture(scope="module")
def vl_processor(tiny_vl_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vl_path)


@pytest.fixture(scope="module")
def omni_processor(tiny_omni_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_omni_path)


@pytest.fixture(scope="module")
def qwen3_processor(tiny_qwen3_vl_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_qwen3_vl_path)


@pytest.fixture(scope="module")
def glm4v_processor(tiny_glm4v_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_glm4v_path)


@pytest.fixture(scope="module")
def omni3_processor(tiny_qwen3_omni_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_qwen3_omni_path)


@pytest.fixture(scope="module")
def batches(
    vl_processor, omni_processor, qwen3_processor, glm4v_processor, omni3_processor
) -> dict[str, DataProto]:
    return {
        "image": build_batch(vl_processor, IMAGE_ROWS, (7, 2, 5), seed=0),
        "video": build_batch(vl_processor, VIDEO_ROWS, (3, 6), seed=10),
        "mixed": build_batch(vl_processor, MIXED_ROWS, (6, 1, 4, 3, 7), seed=20),
        "audio": build_batch(omni_processor, AUDIO_ROWS, (4, 7, 2), seed=30),
        "qwen3_image": build_batch(qwen3_processor, IMAGE_ROWS, (7, 2, 5), seed=40),
        "qwen3_video": build_batch(qwen3_processor, QWEN3_VIDEO_ROWS, (3, 6), seed=50),
        "qwen3_mixed": build_batch(qwen3_processor, QWEN3_MIXED_ROWS, (6, 1, 4, 3, 7), seed=60),
        "qwen3_moe_mixed": build_batch(qwen3_processor, QWEN3_MIXED_ROWS, (6, 1, 4, 3, 7), seed=70),
        # GLM-4.1V: image rows and video rows (frames are image-id tokens) in one packed row
        "glm4v_mixed": build_batch(glm4v_processor, QWEN3_MIXED_ROWS, (6, 1, 4, 3, 7), seed=80),
        # Qwen3.5 (the same tokenizer as Qwen3-VL): linear-attention layers, run per packed sequence
        "qwen3_5_mixed": build_batch(qwen3_processor, QWEN3_MIXED_ROWS, (6, 1, 4, 3, 7), seed=90),
        # Qwen3.5 MoE: the same, with routed and shared experts
        "qwen3_5_moe_mixed": build_batch(qwen3_processor, QWEN3_MIXED_ROWS, (6, 1, 4, 3, 7), seed=100),
        # Qwen3-Omni: audio, image + audio, video with its sound track, text; MoE routers, deepstack
        "omni3_audio": build_batch(omni3_processor, (*AUDIO_ROWS, {}), (4, 7, 2, 5), seed=100),
    }


@pytest.fixture(scope="module")
def mixed_training_batch(tiny_vl_path, batches) -> DataProto:
    return add_training_columns(batches["mixed"], tiny_vl_path)


@pytest.fixture(scope="module")
def model_paths(
    tiny_vl_path,
    tiny_omni_path,
    tiny_qwen3_vl_path,
    tiny_qwen3_vl_moe_path,
    tiny_glm4v_path,
    tiny_qwen3_5_path,
    tiny_qwen3_5_moe_path,
    tiny_qwen3_omni_path,
) -> dict[str, object]:
    """The tiny model of each batch kind's family."""
    return {"qwen2_5_vl": tiny_vl_path, "qwen2_5_omni": tiny_omni_path, "qwen3_vl": tiny_qwen3_vl_path,
            "qwen3_vl_moe": tiny_qwen3_vl_moe_path, "glm4v": tiny_glm4v_path,
            "qwen3_5": tiny_qwen3_5_path, "qwen3_5_moe": tiny_qwen3_5_moe_path,
            "qwen3_omni_moe": tiny_qwen3_omni_path}  # fmt: skip


def _model_path(kind: str, model_paths):
    if kind.startswith("qwen3_5_moe_"):
        return model_paths["qwen3_5_moe"]
    if kind.startswith("omni3_"):
        return model_paths["qwen3_omni_moe"]
    if kind.startswith("qwen3_5_"):
        return model_paths["qwen3_5"]
    if kind.startswith("glm4v_"):
        return model_paths["glm4v"]
    if kind.startswith("qwen3_moe_"):  # the Qwen3-VL batches on the MoE model (the same tokenizer)
        return model_paths["qwen3_vl_moe"]
    if kind.startswith("qwen3_"):
        return model_paths["qwen3_vl"]
    return model_paths["qwen2_5_omni" if kind == "audio" else "qwen2_5_vl"]


def _head_outputs(model, batch: DataProto, padding_free: bool) -> torch.Tensor:
    return response_head_outputs(model, *forward_arguments(batch), padding_free=padding_free)


def _log_probs_and_grads(model, batch: DataProto, padding_free: bool):
    """Response log-probs [B, R] and the gradients of their masked sum (reaches every parameter)."""
    model.zero_grad(set_to_none=True)
    log_probs = log_probs_from_logits(
        _head_outputs(model, batch, padding_free) / TEMPERATURE, batch.batch["responses"]
    )
    (log_probs * batch.batch["response_mask"]).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return log_probs.detach(), grads


def _unique_state(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in iter_full_state_dict(model)}


# ---------------------------------------------------------------- packed == padded


@pytest.mark.parametrize(
    "kind",
    ["image", "video", "mixed", "audio", "qwen3_image", "qwen3_video", "qwen3_mixed", "qwen3_moe_mixed",
     "glm4v_mixed", "qwen3_5_mixed", "qwen3_5_moe_mixed", "omni3_audio"],
)  # fmt: skip
def test_packed_log_probs_and_gradients_equal_padded(kind, batches, model_paths):
    batch = batches[kind]
    model = training_model(str(_model_path(kind, model_paths)))
    padded, padded_grads = _log_probs_and_grads(model, batch, padding_free=False)
    packed, packed_grads = _log_probs_and_grads(model, batch, padding_free=True)

    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)
    assert torch.isfinite(packed).all()
    assert packed_grads.keys() == padded_grads.keys()
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)
    # The towers the batch needs were reached (the audio batch holds images and videos too).
    for tower_name, tower in tower_modules(model):
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tower.parameters()), tower_name


@pytest.mark.parametrize("kind", ["mixed", "qwen3_mixed", "glm4v_mixed", "qwen3_5_mixed"])
def test_packed_values_equal_padded_and_boundaries_matter(kind, batches, model_paths):
    batch = batches[kind]
    mask = batch.batch["response_mask"].bool()
    critic = training_model(str(_model_path(kind, model_paths)), role="critic").eval()
    with torch.no_grad():
        padded = _head_outputs(critic, batch, padding_free=False)[..., 0]
        packed = _head_outputs(critic, batch, padding_free=True)[..., 0]
    torch.testing.assert_close(packed[mask], padded[mask], atol=1e-5, rtol=0)

    # Not vacuous: the same packed row without its boundaries (one causal sequence) lets later rows
    # attend to earlier ones, and their log-probs change.
    model = training_model(str(_model_path(kind, model_paths))).eval()
    tensors = batch.batch
    inputs = build_packed_forward_inputs(
        model,
        tensors["input_ids"],
        tensors["attention_mask"],
        list(batch.non_tensor_batch["multi_modal_inputs"]),
        tensors["mm_token_type_ids"],
    )
    with torch.no_grad():
        bounded = model(**inputs).logits
        inputs.pop("packed_sequences")
        unbounded = model(**inputs).logits
    first = int(tensors["attention_mask"][0].sum())
    torch.testing.assert_close(unbounded[:, :first], bounded[:, :first], atol=1e-5, rtol=0)
    assert (unbounded[:, first:] - bounded[:, first:]).abs().max() > 1e-3


def _decoder_positions(model, run) -> torch.Tensor:
    """The position ids the text decoder receives during ``run()`` (M-RoPE rows last three)."""
    captured = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda module, args, kwargs: captured.append(kwargs["position_ids"]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            run()
    finally:
        hook.remove()
    return captured[-1][-3:]  # [3, B, L]


@pytest.mark.parametrize("kind", ["image", "video", "audio", "qwen3_image", "qwen3_video"])
def test_packed_mrope_positions_are_the_models_own(kind, batches, model_paths):
    """Each packed sequence gets the ids the model computes itself (no ``position_ids`` given) for that
    sequence alone: images, videos, and (Omni) audio, image + audio, and video with its sound track."""
    batch = batches[kind]
    model = training_model(str(_model_path(kind, model_paths))).eval()
    packed = _decoder_positions(model, lambda: _head_outputs(model, batch, padding_free=True))  # [3, 1, T]
    tensors = batch.batch
    lengths = tensors["attention_mask"].sum(-1).tolist()
    spatial_rows = 0
    for row, row_positions in enumerate(packed[:, 0].split(lengths, dim=-1)):
        valid = tensors["attention_mask"][row].bool()
        media = dict(batch.non_tensor_batch["multi_modal_inputs"][row])
        inputs = {"input_ids": tensors["input_ids"][row, valid][None], **media}
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        if "mm_token_type_ids" in tensors.keys():
            inputs["mm_token_type_ids"] = tensors["mm_token_type_ids"][row, valid][None]
        own = _decoder_positions(model, lambda inputs=inputs: model(**inputs))[:, 0]  # [3, L_row]
        assert torch.equal(row_positions, own), f"{kind} row {row}"
        spatial_rows += int(not torch.equal(own[1], own[0]) or not torch.equal(own[2], own[0]))
    # Not vacuous: images and videos get height/width ids that differ from the temporal ones.
    assert spatial_rows == (2 if kind == "audio" else len(batch))
    if kind == "audio":  # video with its sound track: audio tokens are numbered within the video's span
        audio_id = model.config.audio_token_id
        row = 2
        ids = tensors["input_ids"][row, tensors["attention_mask"][row].bool()]
        row_positions = packed[0, 0].split(lengths)[row]
        video_id = model.config.video_token_id
        assert row_positions[ids == audio_id].max() > row_positions[ids == video_id].min()


# ---------------------------------------------------------------- training steps


@pytest.mark.parametrize("kind", ["mixed", "audio", "qwen3_mixed", "qwen3_moe_mixed", "omni3_audio"])
def test_packed_step_changes_every_trainable_tensor_towers_included(kind, batches, model_paths):
    """One packed update on text + image + video rows (Qwen2.5-VL) and on audio + image + video-with-audio
    rows (Omni thinker) moves every tensor, the vision and audio towers included."""
    path = _model_path(kind, model_paths)
    batch = add_training_columns(batches[kind], path)
    model = training_model(str(path))
    before = _unique_state(model)
    optimizer = build_optimizer(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    actor = policy_actor(model, optimizer, **ACTOR_SETTINGS, padding_free=True)
    metrics = actor.update_policy(batch, len(batch), len(batch), 1, TEMPERATURE).metrics
    after = _unique_state(model)
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    # Qwen2.5-Omni's audio tower defines this embedding but its forward never reads it (transformers 5.19).
    assert unchanged == (["audio_tower.audio_bos_eos_token.weight"] if kind == "audio" else [])
    prefixes = [name + "." for name, _ in tower_modules(model)]
    assert len(prefixes) == (2 if "audio" in kind else 1)
    assert all(any(name.startswith(prefix) for name in before) for prefix in prefixes)
    assert metrics["padding_ratio"] == 0.0 and metrics["skipped_steps"] == 0


def test_packed_token_budget_update_equals_padded_sample_count_update(tiny_vl_path, mixed_training_batch):
    """The same step (plain SGD: the weight change is the gradient) from packed micro-batches formed by a
    token budget as from padded micro-batches of a fixed row count; only the padding share differs."""
    batch = mixed_training_batch
    seq_lengths = batch.batch["attention_mask"].sum(-1).tolist()
    assert seq_lengths == [36, 39, 44, 33, 43] and batch.batch["attention_mask"].shape == (5, 47)
    budget = 88  # first-fit decreasing: [44, 43], [39, 36], [33]
    rows = micro_batch_rows(batch.batch["attention_mask"], 1, budget)
    assert rows == [[2, 4], [0, 1], [3]]

    results = {}
    settings = {**ACTOR_SETTINGS, "loss_avg_mode": "seq_mean_token_mean"}  # per-sequence normalisers too
    for padding_free, micro_batch_size, max_tokens in ((False, 2, None), (True, 1, budget)):
        model = training_model(str(tiny_vl_path))
        actor = policy_actor(
            model,
            torch.optim.SGD(model.parameters(), lr=1.0),
            **settings,
            padding_free=padding_free,
            max_tokens_per_micro_batch=max_tokens,
        )
        metrics = actor.update_policy(batch, len(batch), micro_batch_size, 1, TEMPERATURE).metrics
        results[padding_free] = (_unique_state(model), metrics)
    (state, metrics), (expected_state, expected_metrics) = results[True], results[False]
    for name, tensor in expected_state.items():
        torch.testing.assert_close(state[name], tensor, atol=1e-6, rtol=0, msg=name)
    for name in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss", "grad_norm"):
        assert metrics[name] == pytest.approx(expected_metrics[name], rel=1e-5, abs=1e-7), name
    assert expected_metrics["grad_norm"] > ACTOR_SETTINGS["max_grad_norm"]  # clipping was part of it
    # Padded, the micro-batches compute 5 x 47 positions, 195 of them valid; packed, only those 195.
    assert expected_metrics["padding_ratio"] == pytest.approx(40 / 235) and metrics["padding_ratio"] == 0.0


def test_token_budget_log_probs_and_values_come_back_in_row_order(tiny_vl_path, mixed_training_batch):
    batch = mixed_training_batch
    mask = batch.batch["response_mask"].bool()
    budget = 2 * int(batch.batch["attention_mask"].sum(-1).max())
    model = training_model(str(tiny_vl_path))
    by_count, _ = policy_actor(model).compute_log_probs(batch, 2, TEMPERATURE)
    by_budget, entropy = policy_actor(model, max_tokens_per_micro_batch=budget).compute_log_probs(
        batch, 2, TEMPERATURE, with_entropy=True
    )
    torch.testing.assert_close(by_budget[mask], by_count[mask], atol=1e-5, rtol=0)
    assert entropy.shape == by_count.shape

    critic_model = training_model(str(tiny_vl_path), role="critic")
    values = value_critic(critic_model).compute_values(batch, len(batch))
    budget_values = value_critic(critic_model, max_tokens_per_micro_batch=budget).compute_values(batch, 1)
    torch.testing.assert_close(budget_values[mask], values[mask], atol=1e-5, rtol=0)


def test_no_grad_passes_take_their_own_token_budget(tiny_vl_path, mixed_training_batch):
    """``max_tokens_per_micro_batch_for_experience`` forms the log-prob and value passes' micro-batches
    (first-fit decreasing over the lengths 36, 39, 44, 33, 43: a budget of 88 gives [44, 43], [39, 36],
    [33]), the update's budget still forms the update's; null falls back to the update's budget. The
    outputs do not depend on the split."""
    from mmrl.workers.forward import role_micro_batches

    batch, mask = mixed_training_batch, mixed_training_batch.batch["response_mask"].bool()
    model = training_model(str(tiny_vl_path))
    own = policy_actor(model, max_tokens_per_micro_batch=50, max_tokens_per_micro_batch_for_experience=88)
    shared = policy_actor(model, max_tokens_per_micro_batch=50)
    assert [len(m) for m in role_micro_batches(own, batch, 1)[0]] == [2, 2, 1]
    assert [len(m) for m in role_micro_batches(shared, batch, 1)[0]] == [1, 1, 1, 1, 1]
    by_own, _ = own.compute_log_probs(batch, 1, TEMPERATURE)
    torch.testing.assert_close(by_own[mask], shared.compute_log_probs(batch, 1, TEMPERATURE)[0][mask], atol=1e-5, rtol=0)  # fmt: skip
    critic = value_critic(
        training_model(str(tiny_vl_path), role="critic"),
        max_tokens_per_micro_batch=50,
        max_tokens_per_micro_batch_for_experience=88,
    )
    assert [len(m) for m in role_micro_batches(critic, batch, 1)[0]] == [2, 2, 1]


def _budget_rank_job(rank: int, world_size: int, model_path: str, data: DataProto, budget: int) -> dict:
    """A sharded packed update with a token budget, where the ranks need different micro-batch counts."""
    from torch.distributed.device_mesh import init_device_mesh

    from mmrl.workers.fsdp_engine import apply_fsdp2

    shard = data.chunk(world_size)[rank]
    model = apply_fsdp2(
        training_model(model_path), init_device_mesh("cpu", (world_size,)), torch.float32, torch.float32
    )
    actor = policy_actor(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        **ACTOR_SETTINGS,
        max_tokens_per_micro_batch=budget,
    )
    own_groups = len(token_budget_groups(shard.batch["attention_mask"].sum(-1).tolist(), budget))
    log_probs, _ = actor.compute_log_probs(shard, 1, TEMPERATURE)
    metrics = actor.update_policy(shard, len(shard), 1, 1, TEMPERATURE).metrics
    return {
        "own_groups": own_groups,
        "log_probs": log_probs,
        "state": dict(iter_full_state_dict(model)),
        "metrics": metrics,
    }


@pytest.mark.distributed
def test_two_ranks_with_unequal_micro_batch_counts_equal_one_rank(tiny_vl_path, mixed_training_batch):
    # Rank 0 gets the two longest rows, rank 1 the two shortest: unbalanced on purpose.
    batch = mixed_training_batch[:4]
    seq_lengths = batch.batch["attention_mask"].sum(-1)
    batch = batch.reorder(torch.argsort(seq_lengths, descending=True))
    budget = int(seq_lengths.sort().values[:2].sum())  # rank 1's two rows fit; rank 0's two do not
    results = run_on_ranks(_budget_rank_job, 2, str(tiny_vl_path), batch, budget)
    assert [result["own_groups"] for result in results] == [2, 1]  # rank 1 splits its group to match

    model = training_model(str(tiny_vl_path))
    actor = policy_actor(model, torch.optim.SGD(model.parameters(), lr=1.0), **ACTOR_SETTINGS)
    log_probs, _ = actor.compute_log_probs(batch, len(batch), TEMPERATURE)
    metrics = actor.update_policy(batch, len(batch), len(batch), 1, TEMPERATURE).metrics
    mask = batch.batch["response_mask"].bool()
    sharded = torch.cat([result["log_probs"] for result in results])
    torch.testing.assert_close(sharded[mask], log_probs[mask], atol=1e-5, rtol=0)
    for name, tensor in _unique_state(model).items():
        torch.testing.assert_close(results[0]["state"][name], tensor, atol=1e-6, rtol=0, msg=name)
    assert results[1]["metrics"]["pg_loss"] == pytest.approx(metrics["pg_loss"], rel=1e-5)


# ---------------------------------------------------------------- grouping and balancing


def test_token_budget_groups_first_fit_decreasing_by_hand():
    lengths = [5, 3, 9, 2, 2, 12, 1]
    # Longest first: 12 alone (over budget), 9 (+1), 5 (+3 +2), then the last 2 opens a fourth group.
    assert token_budget_groups(lengths, 10) == [[5], [2, 6], [0, 1, 3], [4]]
    assert token_budget_groups(lengths, 100) == [[0, 1, 2, 3, 4, 5, 6]]
    # Raising the count splits the heaviest splittable group; every group stays within the budget.
    assert split_groups([[5], [2, 6], [0, 1, 3], [4]], lengths, 6) == [[5], [4], [2], [6], [0], [1, 3]]
    with pytest.raises(ValueError, match="cannot form 8 non-empty micro-batches from 7 rows"):
        split_groups([[0, 1, 2, 3, 4, 5, 6]], lengths, 8)
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        token_budget_groups(lengths, 0)


def test_balance_by_length_by_hand():
    # Optimal splits with equal counts: 8+5+4+1 = 7+6+3+2 = 18, and 100+5 / 90+10.
    assert balance_by_length([8, 7, 6, 5, 4, 3, 2, 1], 2) == [[1, 2, 4, 7], [0, 3, 5, 6]]
    parts = balance_by_length([100, 90, 10, 5], 2)
    assert sorted(sum([100, 90, 10, 5][row] for row in part) for part in parts) == [100, 105]
    # the driver's consecutive chunks would give 190 / 15
    with pytest.raises(ValueError, match="5 rows do not split into 2 parts of equal size"):
        balance_by_length([1, 2, 3, 4, 5], 2)


def test_balance_by_length_properties_on_random_lengths():
    rng = np.random.default_rng(0)
    for num_parts, rows_per_part in ((2, 8), (4, 16), (8, 3), (3, 1)):
        lengths = rng.integers(4, 2048, num_parts * rows_per_part).tolist()
        parts = balance_by_length(lengths, num_parts)
        assert sorted(sum(parts, [])) == list(range(len(lengths)))  # a partition of the rows
        assert all(len(part) == rows_per_part for part in parts)  # equal counts (FSDP ranks)
        sums = [sum(lengths[row] for row in part) for part in parts]
        assert max(sums) <= sum(lengths) / num_parts + max(lengths)  # the differencing bound


def test_balance_batch_reorders_and_restores(batches):
    batch = batches["mixed"][:4]
    balanced, restore = balance_batch(batch, 2)
    sums = [int(chunk.batch["attention_mask"].sum()) for chunk in balanced.chunk(2)]
    lengths = batch.batch["attention_mask"].sum(-1).tolist()
    assert abs(sums[0] - sums[1]) <= max(lengths) and sorted(balanced.non_tensor_batch["uid"]) == sorted(
        batch.non_tensor_batch["uid"]
    )
    restored = balanced.reorder(restore)
    assert torch.equal(restored.batch["input_ids"], batch.batch["input_ids"])
    assert list(restored.non_tensor_batch["uid"]) == list(batch.non_tensor_batch["uid"])


def test_padding_counts_by_hand():
    lengths = [3, 2, 4]  # valid tokens of rows of 4 columns
    assert padding_counts(lengths, [0, 1], 4, padding_free=False) == (8, 3)
    assert padding_counts(lengths, [0, 1], 4, padding_free=True) == (5, 0)
    assert padding_counts(lengths, [2], 4, padding_free=False) == (4, 0)


# ---------------------------------------------------------------- position ids once per prompt


def _with_repeated_prompts(batch: DataProto) -> DataProto:
    """Each row twice, the copy with a shorter response: n responses of one prompt, as a rollout makes."""
    copy = DataProto.from_dict(
        tensors={key: value.clone() for key, value in batch.batch.items()},
        non_tensors={key: value.copy() for key, value in batch.non_tensor_batch.items()},
    )
    response_mask = copy.batch["response_mask"]
    response_mask[:, 1:] = 0  # one response token in every copy
    width = response_mask.shape[1]
    copy.batch["attention_mask"][:, -width:] = response_mask
    both = DataProto.concat([batch, copy])
    return both.reorder(torch.arange(2 * len(batch)).view(2, -1).t().flatten())  # [a, a', b, b', ...]


@pytest.mark.parametrize(
    "kind", ["image", "video", "mixed", "audio", "qwen3_video", "qwen3_mixed", "omni3_audio"]
)
def test_position_ids_once_per_prompt_equal_the_models_numbering_of_each_row(kind, batches, model_paths):
    """The ``position_ids`` column (get_rope_index once per distinct prompt, responses numbered on from
    the prompt's largest id) equals the model's own numbering of every whole row, and a forward pass
    reading it computes the same log-probs as one that numbers rows itself."""
    from mmrl.workers.forward import add_position_ids

    model = training_model(str(_model_path(kind, model_paths)))
    batch = _with_repeated_prompts(batches[kind])
    with_column = add_position_ids(
        model,
        DataProto.from_dict(tensors=dict(batch.batch.items()), non_tensors=dict(batch.non_tensor_batch)),
    )
    column = with_column.batch["position_ids"]
    assert column.shape[0] == len(batch) and column.shape[-1] == batch.batch["input_ids"].shape[1]
    tensors = batch.batch
    valid = tensors["attention_mask"].bool()
    expected = packed_position_ids(
        model,
        tensors["input_ids"],
        tensors["attention_mask"],
        list(batch.non_tensor_batch["multi_modal_inputs"]),
        tensors["mm_token_type_ids"] if "mm_token_type_ids" in tensors.keys() else None,
    )
    torch.testing.assert_close(model_layout(column)[..., valid].unsqueeze(-2), expected, atol=0, rtol=0)

    with torch.no_grad():
        own = _head_outputs(model, batch, padding_free=True)
        from_column = response_head_outputs(
            model, *forward_arguments(batch), padding_free=True, position_ids=column
        )
    response_valid = tensors["response_mask"].bool()
    torch.testing.assert_close(from_column[response_valid], own[response_valid], atol=0, rtol=0)


# ---------------------------------------------------------------- on-policy updates


@pytest.mark.parametrize("micro_batch_size", [5, 2])
def test_on_policy_update_without_old_log_probs_equals_the_two_pass_update(
    micro_batch_size, tiny_vl_path, mixed_training_batch
):
    """On-policy (no ``old_log_probs``) the update takes its own log-probs (detached) as the old ones: the same
    step, the same metrics (ratio 1: nothing clipped, ppo_kl 0) as computing them in a separate pass
    first, and it returns those log-probs and entropies in row order."""
    batch = mixed_training_batch
    results = {}
    for on_policy in (False, True):
        model = training_model(str(tiny_vl_path))
        actor = policy_actor(model, torch.optim.SGD(model.parameters(), lr=1.0), **ACTOR_SETTINGS)
        data = batch
        if not on_policy:
            log_probs, entropies = actor.compute_log_probs(batch, len(batch), TEMPERATURE, with_entropy=True)
            columns = {**dict(batch.batch.items()), "old_log_probs": log_probs}
            data = DataProto.from_dict(tensors=columns, non_tensors=dict(batch.non_tensor_batch))
            results["two_pass_outputs"] = (log_probs, entropies)
        else:
            data = batch.select(
                batch_keys=[key for key in batch.batch.keys() if key != "old_log_probs"],
                non_tensor_keys=list(batch.non_tensor_batch),
            )
        update = actor.update_policy(data, len(batch), micro_batch_size, 1, TEMPERATURE, on_policy=on_policy)
        results[on_policy] = (_unique_state(model), update)
    (state, update), (expected_state, expected) = results[True], results[False]
    for name, tensor in expected_state.items():
        torch.testing.assert_close(state[name], tensor, atol=1e-6, rtol=0, msg=name)
    for name in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss", "grad_norm"):
        assert update.metrics[name] == pytest.approx(expected.metrics[name], rel=1e-5, abs=1e-7), name
    assert update.metrics["pg_clipfrac"] == 0.0 and abs(update.metrics["ppo_kl"]) < 1e-7
    assert expected.log_probs is None
    log_probs, entropies = results["two_pass_outputs"]
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(update.log_probs[mask], log_probs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(update.entropies[mask], entropies[mask], atol=1e-5, rtol=0)


def test_on_policy_update_needs_one_optimizer_step(tiny_vl_path, mixed_training_batch):
    batch = mixed_training_batch.select(
        batch_keys=[key for key in mixed_training_batch.batch.keys() if key != "old_log_probs"],
        non_tensor_keys=["multi_modal_inputs"],
    )
    model = training_model(str(tiny_vl_path))
    actor = policy_actor(model, torch.optim.SGD(model.parameters(), lr=1.0), **ACTOR_SETTINGS)
    with pytest.raises(ValueError, match="no old_log_probs.*ppo_epochs=2"):
        actor.update_policy(batch, len(batch), 2, 2, TEMPERATURE, on_policy=True)
    with pytest.raises(ValueError, match="5 rows for mini-batches of 2"):
        actor.update_policy(batch, 2, 2, 1, TEMPERATURE, on_policy=True)


# ---------------------------------------------------------------- a prompt once for its n responses


def _shared_outputs(model, batch: DataProto, share_prompts: bool):
    """Log-probs [K] of the valid response tokens and the gradients of their sum, packed with or without
    shared prompts."""
    from mmrl.models.inputs import response_token_outputs

    tensors = batch.batch
    model.zero_grad(set_to_none=True)
    logits, response_valid = response_token_outputs(
        model, *forward_arguments(batch), padding_free=True, share_prompts=share_prompts
    )
    log_probs = log_probs_from_logits(logits / TEMPERATURE, tensors["responses"][response_valid])
    log_probs.sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return log_probs.detach(), grads


@pytest.mark.parametrize(
    "kind", ["image", "video", "mixed", "audio", "qwen3_image", "qwen3_video", "qwen3_mixed", "omni3_audio"]
)
def test_shared_prompts_equal_one_packed_sequence_per_row(kind, batches, model_paths):
    """Rows repeating a prompt (two responses each) packed with the prompt once: the same log-probs and
    gradients as packing every row whole, with each prompt's tokens and media computed once."""
    from mmrl.models.inputs import build_shared_prefix_inputs, prompt_groups

    batch = _with_repeated_prompts(batches[kind])
    model = training_model(str(_model_path(kind, model_paths)))
    whole, whole_grads = _shared_outputs(model, batch, share_prompts=False)
    shared, shared_grads = _shared_outputs(model, batch, share_prompts=True)
    torch.testing.assert_close(shared, whole, atol=1e-5, rtol=0)
    assert shared_grads.keys() == whole_grads.keys()
    for name, grad in whole_grads.items():
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)

    tensors = batch.batch
    response_width = tensors["responses"].shape[1]
    inputs, _, _ = build_shared_prefix_inputs(model, *forward_arguments(batch))
    prompt_mask = tensors["attention_mask"][:, :-response_width]
    firsts = prompt_groups(
        tensors["prompts"], prompt_mask, list(batch.non_tensor_batch["multi_modal_inputs"])
    )
    distinct = sorted(set(firsts))
    # every row's copy joins it; in the mixed batch the two text-only rows ask the same question too
    assert distinct == ([0, 2, 4, 8] if kind.endswith("mixed") else list(range(0, len(batch), 2)))
    prompt_tokens = prompt_mask[distinct].sum()  # each distinct prompt once
    assert inputs["input_ids"].shape[1] == prompt_tokens + tensors["response_mask"].sum()
    original = concat_multi_modal_inputs(list(batches[kind].non_tensor_batch["multi_modal_inputs"]))
    for key in ("pixel_values", "pixel_values_videos", "input_features"):  # each medium once
        if key in original:
            assert torch.equal(inputs[key], original[key]), key


def _with_padding_column(batch: DataProto) -> DataProto:
    """``batch`` with one more response column, padding in every row: the same valid tokens."""
    tensors = dict(batch.batch.items())
    rows = len(batch)
    pad = torch.zeros(rows, 1, dtype=torch.long)
    for key in ("responses", "response_mask", "input_ids", "attention_mask", "mm_token_type_ids"):
        if key in tensors:
            tensors[key] = torch.cat([tensors[key], pad], dim=1)
    return DataProto.from_dict(tensors=tensors, non_tensors=dict(batch.non_tensor_batch))


def _attention_rows(model) -> list:
    """What the first decoder layer's attention gets as ``packed_sequences``, one entry per call."""
    seen = []
    model.get_decoder().layers[0].self_attn.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("packed_sequences")), with_kwargs=True
    )
    return seen


@pytest.mark.parametrize("share_prompts", [False, True])
def test_an_unpadded_micro_batch_runs_dense_and_equals_its_packed_row(
    vl_processor, tiny_vl_path, share_prompts
):
    """A micro-batch without a padding token (and no prompt shared by two rows) runs as the dense
    batch it is, no packed row reaching attention, and its log-probs and gradients equal those of the
    same rows packed (one padding column added, so that they are packed); rows sharing a prompt
    still share it."""
    from mmrl.models.attention import PackedSequences, SharedPrefixSequences

    # equal prompt text, equal image size, other pixels: no padding anywhere, three distinct prompts
    batch = build_batch(vl_processor, ({"image": (56, 56)},) * 3, (3, 3, 3), seed=0)
    assert bool(batch.batch["attention_mask"].all())
    model = training_model(str(tiny_vl_path))
    seen = _attention_rows(model)
    dense, dense_grads = _shared_outputs(model, batch, share_prompts)
    assert seen == [None]  # the dense batch: transformers' causal sdpa, no packed row
    packed, packed_grads = _shared_outputs(model, _with_padding_column(batch), share_prompts)
    assert isinstance(seen[1], SharedPrefixSequences if share_prompts else PackedSequences)
    torch.testing.assert_close(dense, packed, atol=1e-5, rtol=0)
    assert dense_grads.keys() == packed_grads.keys()
    for name, grad in packed_grads.items():
        torch.testing.assert_close(dense_grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)
    if share_prompts:  # two rows with one prompt (an equal copy of the image): packed, the prompt once
        media = list(batch.non_tensor_batch["multi_modal_inputs"])
        batch.non_tensor_batch["multi_modal_inputs"] = np.array([media[0], dict(media[0]), media[2]])
        _shared_outputs(model, batch, share_prompts)
        assert isinstance(seen[2], SharedPrefixSequences)


class _AttentionCalls(TorchDispatchMode):
    """Counts the sdpa kernels dispatched in the block."""

    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += "scaled_dot_product" in func.overloadpacket.__name__
        return func(*args, **(kwargs or {}))


def _self_attending(*lengths: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    starts = np.cumsum([0, *lengths[:-1]]).tolist()
    return [(start, length, [(start, length)]) for start, length in zip(starts, lengths)]


@pytest.mark.parametrize(
    ("packed", "segments", "sdpa_calls"),
    [
        (False, _self_attending(5, 5, 5), 1),  # one run, the whole row
        (False, _self_attending(3, 3, 2, 4, 4, 4), 3),  # runs of 2, 1 and 3 equal lengths
        (True, _self_attending(3, 3, 2, 4, 4, 4), 3),  # the same as a PackedSequences row
        (True, _self_attending(4, 6, 5), 3),  # ragged: one sdpa call per sequence
        (False, [*_self_attending(4, 3, 3), (10, 2, [(0, 4), (10, 2)])], 3),  # a shared prompt: buckets
    ],
    ids=["one run", "runs", "packed runs", "packed ragged", "shared prompt"],
)
def test_packed_attention_on_back_to_back_segments_equals_each_segment_alone(packed, segments, sdpa_calls):
    """Segments attending to themselves run one sdpa call per run of equal lengths on views of the row
    (split once); with a shared prompt, back-to-back self-attending segments are views too, one call per
    bucket of equally shaped segments: outputs and gradients equal causal attention over each segment's keys alone, with the value laid out as a
    decoder's projection leaves it (heads transposed, not contiguous)."""
    from mmrl.models.attention import (
        PackedSequences,
        SharedPrefixSequences,
        bottom_right_causal_mask,
        shared_prefix_attention,
        varlen_attention,
    )

    heads, kv_heads, head_dim = 4, 2, 8
    tokens = sum(length for _, length, _ in segments)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, heads, tokens, head_dim, generator=generator, requires_grad=True)
    key = torch.randn(1, kv_heads, tokens, head_dim, generator=generator, requires_grad=True)
    value_rows = torch.randn(1, tokens, kv_heads * head_dim, generator=generator, requires_grad=True)
    value = value_rows.view(1, tokens, kv_heads, head_dim).transpose(1, 2)  # [1, H_kv, T, D], strided
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, heads // kv_heads
    with _AttentionCalls() as calls:
        if packed:
            lengths = [length for _, length, _ in segments]
            sequences = PackedSequences.from_lengths(lengths, "cpu")
            output = varlen_attention(module, query, key, value, sequences, head_dim**-0.5)  # [1, T, H, D]
        else:
            sequences = SharedPrefixSequences.from_segments(segments, "cpu")
            output = shared_prefix_attention(module, query, key, value, sequences, head_dim**-0.5)
    assert calls.count == sdpa_calls
    upstream = torch.randn(output.shape, generator=generator)
    grads = torch.autograd.grad((output * upstream).sum(), (query, key, value_rows))

    expected = torch.empty(tokens, heads, head_dim)
    for start, length, ranges in segments:
        keys = torch.cat([torch.arange(first, first + count) for first, count in ranges])
        k, v = (x[0][:, keys].repeat_interleave(heads // kv_heads, 0) for x in (key, value))
        scores = query[0, :, start : start + length] @ k.transpose(-1, -2) * head_dim**-0.5
        mask = bottom_right_causal_mask(length, len(keys), "cpu")
        weights = scores.masked_fill(~mask, -torch.inf).softmax(-1)
        expected[start : start + length] = (weights @ v).transpose(0, 1)
    expected_grads = torch.autograd.grad((expected.unsqueeze(0) * upstream).sum(), (query, key, value_rows))
    torch.testing.assert_close(output, expected.unsqueeze(0), atol=1e-5, rtol=1e-5)
    for grad, reference in zip(grads, expected_grads):
        torch.testing.assert_close(grad, reference, atol=1e-5, rtol=1e-5)


def test_prompts_with_equal_tokens_but_other_images_are_not_shared(vl_processor):
    from mmrl.models.inputs import prompt_groups

    batch = build_batch(vl_processor, ({"image": (56, 56)},) * 3, (2, 2, 2), seed=0)
    prompts, mask = (
        batch.batch["prompts"],
        batch.batch["attention_mask"][:, : batch.batch["prompts"].shape[1]],
    )
    assert torch.equal(prompts[0], prompts[1])  # same text, same image size: same token ids
    media = list(batch.non_tensor_batch["multi_modal_inputs"])
    assert prompt_groups(prompts, mask, media) == [0, 1, 2]  # different pixels
    same_image = [media[0], dict(media[0]), media[2]]  # an equal copy counts as the same prompt
    assert prompt_groups(prompts, mask, same_image) == [0, 0, 2]


def _reference_flash_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal
):
    """flash-attn's documented varlen semantics in plain torch ([T, H, D] layout, GQA, causal aligned to
    the bottom-right of each segment), standing in for the CUDA kernel this machine lacks."""
    from mmrl.models.attention import bottom_right_causal_mask

    assert causal and dropout_p == 0.0
    outputs = []
    for index in range(len(cu_seqlens_q) - 1):
        qs = q[cu_seqlens_q[index] : cu_seqlens_q[index + 1]].transpose(0, 1)  # [H, q, D]
        ks = k[cu_seqlens_k[index] : cu_seqlens_k[index + 1]].transpose(0, 1)
        vs = v[cu_seqlens_k[index] : cu_seqlens_k[index + 1]].transpose(0, 1)
        repeat = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(repeat, 0), vs.repeat_interleave(repeat, 0)
        mask = bottom_right_causal_mask(qs.shape[1], ks.shape[1], qs.device)
        scores = (qs @ ks.transpose(-1, -2)) * softmax_scale
        outputs.append((scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vs).transpose(0, 1))
    return torch.cat(outputs)


def test_flash_attn_arguments_of_packed_and_shared_prefix_rows(monkeypatch, batches, tiny_vl_path):
    """The flash-attn branch (CUDA only) gets the right gathered keys and boundaries: with a torch
    stand-in of ``flash_attn_varlen_func`` it computes what the sdpa branch computes, for whole packed
    rows and for rows sharing their prompt."""
    from mmrl.models import attention

    batch = _with_repeated_prompts(batches["image"])
    model = training_model(str(tiny_vl_path))
    expected = {share: _shared_outputs(model, batch, share)[0] for share in (False, True)}
    monkeypatch.setattr(
        attention, "_varlen_kernel", lambda query, dropout, torch_varlen: _reference_flash_varlen
    )
    for share, log_probs in expected.items():
        torch.testing.assert_close(_shared_outputs(model, batch, share)[0], log_probs, atol=1e-5, rtol=0)


def _reference_torch_varlen(new_signature: bool):
    """torch's ``varlen_attn`` as documented, in plain torch ([T, H, D]): 2.11+ takes ``window_size``
    ((-1, 0) = causal, bottom-right aligned), ``scale`` and ``enable_gqa`` (fewer key/value heads refused
    without it); 2.10 takes ``is_causal`` and neither of the others (equal head counts, scale
    head_dim ** -0.5). Each call is recorded."""
    calls = []

    def check(q, k, cu_q, cu_k, max_q, max_k):
        assert cu_q.dtype == cu_k.dtype == torch.int32 and q.dim() == k.dim() == 3
        assert max_q == int((cu_q[1:] - cu_q[:-1]).max()) and max_k == int((cu_k[1:] - cu_k[:-1]).max())

    def attend(q, k, v, cu_q, cu_k, scale):
        return _reference_flash_varlen(q, k, v, cu_q, cu_k, None, None, 0.0, scale, True)

    if new_signature:

        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):  # fmt: skip
            check(q, k, cu_q, cu_k, max_q, max_k)
            assert tuple(window_size) == (-1, 0) and (enable_gqa or q.shape[1] == k.shape[1])
            calls.append({"gqa": enable_gqa, "scale": scale})
            return attend(q, k, v, cu_q, cu_k, q.shape[-1] ** -0.5 if scale is None else scale)
    else:

        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
            check(q, k, cu_q, cu_k, max_q, max_k)
            assert is_causal and q.shape[1] == k.shape[1]
            calls.append({"gqa": False, "scale": None})
            return attend(q, k, v, cu_q, cu_k, q.shape[-1] ** -0.5)

    return varlen_attn, calls


@pytest.mark.parametrize("new_signature", [True, False], ids=["torch 2.11+", "torch 2.10"])
def test_torch_varlen_kernel_arguments_of_packed_and_shared_prefix_rows(
    monkeypatch, batches, tiny_vl_path, new_signature
):
    """Without flash-attn, packed attention on CUDA runs torch's own varlen kernel: with a stand-in of
    ``varlen_attn`` that follows torch's documented signature of each release (causal by
    ``window_size`` or ``is_causal``, grouped-query heads by ``enable_gqa`` or repeated, the scale passed
    or folded into the query), the adapter computes what the sdpa path computes, in one call per layer."""
    import torch.nn.attention.varlen as torch_varlen

    from mmrl.models import attention

    batch = _with_repeated_prompts(batches["image"])
    model = training_model(str(tiny_vl_path))
    expected = {share: _shared_outputs(model, batch, share)[0] for share in (False, True)}
    stand_in, calls = _reference_torch_varlen(new_signature)
    monkeypatch.setattr(torch_varlen, "varlen_attn", stand_in)
    attention._torch_varlen_func.cache_clear()
    try:
        kernel = attention._torch_varlen_func()
        monkeypatch.setattr(attention, "_varlen_kernel", lambda query, dropout, torch_varlen: kernel)
        for share, log_probs in expected.items():
            torch.testing.assert_close(_shared_outputs(model, batch, share)[0], log_probs, atol=1e-5, rtol=0)
    finally:
        attention._torch_varlen_func.cache_clear()  # later tests see this torch's own kernel
    layers = model.config.get_text_config().num_hidden_layers
    grouped = (
        model.config.get_text_config().num_key_value_heads
        < model.config.get_text_config().num_attention_heads
    )
    assert len(calls) >= 2 * layers  # one call per layer and pass (forward; backward reruns none of it)
    assert all(call["gqa"] == (grouped and new_signature) for call in calls)
    assert all((call["scale"] is not None) == new_signature for call in calls)
    with pytest.raises(ValueError, match="without dropout"):
        kernel(*[torch.zeros(1)] * 7, 0.1, None, True)


def test_varlen_kernel_serves_cuda_half_precision_only():
    """CPU or fp32 tensors take the sdpa path (neither varlen kernel runs there)."""
    from mmrl.models import attention

    for torch_varlen in (False, True):
        assert (
            attention._varlen_kernel(torch.zeros(1, 2, 3, 8, dtype=torch.bfloat16), 0.0, torch_varlen) is None
        )
        assert attention._varlen_kernel(torch.zeros(1, 2, 3, 8), 0.0, torch_varlen) is None


@pytest.mark.parametrize("kernel", ["sdpa", "torch_varlen"])
def test_packed_attention_key_picks_the_attention_function_the_decoder_calls(
    monkeypatch, tiny_vl_path, kernel
):
    """``worker.*.model.packed_attention`` reaches the decoder: ``torch_varlen`` makes its attention calls
    ask for torch's kernel, ``sdpa`` does not (recorded at the kernel choice, on a packed forward)."""
    from mmrl.models import attention
    from mmrl.models.loading import load_model
    from mmrl.models.prepare import prepare_for_training

    model = prepare_for_training(load_model(str(tiny_vl_path)), packing=True, packed_attention=kernel)
    assert attention.packed_attention_enabled(model)
    asked = []
    monkeypatch.setattr(
        attention, "_varlen_kernel", lambda query, dropout, torch_varlen: asked.append(torch_varlen)
    )
    packed = attention.PackedSequences.from_lengths([3, 2], "cpu")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1]]), packed_sequences=packed)
    layers = model.config.get_text_config().num_hidden_layers
    assert asked == [kernel == "torch_varlen"] * layers


BROKEN_FLASH_ATTN = (
    "raise ImportError('/site-packages/flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined symbol: "
    "_ZN3c104cuda9SetDeviceEab')\n"
)  # what flash-attn compiled against another torch says on import


@pytest.mark.parametrize(
    ("init", "loads"),
    [(BROKEN_FLASH_ATTN, False), ("def flash_attn_varlen_func(*args, **kwargs): ...\n", True)],
    ids=["broken install", "working install"],
)
def test_a_broken_flash_attn_install_falls_back_to_sdpa_with_one_warning(
    tmp_path, monkeypatch, caplog, init, loads
):
    """A flash_attn package that fails to import (undefined symbol) is treated as absent: attention
    uses sdpa and says so once per process; a package that imports is used."""
    from mmrl.models import attention

    (tmp_path / "flash_attn").mkdir()
    (tmp_path / "flash_attn" / "__init__.py").write_text(init)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    attention._flash_attn_varlen_func.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="mmrl.models.attention"):
            assert [attention.flash_attn_available() for _ in range(3)] == [loads] * 3
    finally:
        attention._flash_attn_varlen_func.cache_clear()  # later tests see this machine's flash-attn again
        sys.modules.pop("flash_attn", None)
    warnings = [record.getMessage() for record in caplog.records]
    if loads:
        assert warnings == []
    else:
        assert len(warnings) == 1, warnings
        assert "flash-attn is installed but does not load (ImportError: " in warnings[0]
        assert "undefined symbol" in warnings[0] and "uses torch sdpa instead" in warnings[0]
