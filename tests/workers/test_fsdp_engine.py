"""The FSDP2 training engine: model loading, forward inputs, sharded log-probs/updates, weight sync.

Distributed checks run the tiny Qwen2.5-VL on 2 gloo ranks (spawned processes, one thread each) once
per module (`two_rank_results`) and compare with the same computation in this process on the
unsharded model. The batch has 2 image rows (different image sizes) and 2 text rows, so with 2 ranks
the second rank never calls the vision tower: the case that hangs a naively sharded model.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from _batches import ACTOR_SETTINGS as SHARED_ACTOR_SETTINGS
from _batches import policy_actor, value_critic
from _models import training_model
from PIL import Image

from mmrl.config import FSDPConfig
from mmrl.core_algos import log_probs_from_logits
from mmrl.demo.ranks import run_on_ranks
from mmrl.models.inputs import build_forward_inputs, concat_multi_modal_inputs, response_head_outputs
from mmrl.models.loading import (
    decoder_layers,
    freeze_vision_tower,
    is_multimodal,
    load_model,
    tower_modules,
    vision_modules,
)
from mmrl.protocol import DataProto
from mmrl.workers.fsdp_engine import (
    PhaseOffload,
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm,
    load_fsdp_params,
    load_optimizer,
    lr_factor,
    offload_fsdp_params,
    offload_optimizer,
    resolve_dtype,
    storage_dtype,
)
from mmrl.workers.weight_sync import checkpoint_key_mapping, iter_full_state_dict, load_into

TEMPERATURE = 0.7
RESPONSE_LENGTHS = (5, 3, 6, 2)  # valid tokens per row; the response width is 6
IMAGE_SIZES = ((56, 56), (84, 56), None, None)  # (width, height) per row; None = text-only row
# Loss settings of the split-invariance checks: every term of the policy loss is active.
# max_grad_norm 0.5 is below the step's gradient norm, so clipping is part of what must agree
# The ranks score tokens in the head, 3 at a time; the one-rank references from the whole logits.
ACTOR_SETTINGS = {**SHARED_ACTOR_SETTINGS, "max_response_length": 6, "log_prob_chunk_tokens": 3}
UNCHUNKED = {"log_prob_chunk_tokens": 0}
SGD_LR = 1.0  # plain SGD: the weight change is the gradient itself (Adam's first step is ~sign(grad))
CRITIC_CLIP = 0.2


# ---------------------------------------------------------------- batches


def _image(size: tuple[int, int], seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _encode_prompt(processor, image_size: tuple[int, int] | None, seed: int) -> dict:
    content = [{"type": "text", "text": "What colour is the shape?"}]
    if image_size is not None:
        content.insert(0, {"type": "image"})
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = [_image(image_size, seed)] if image_size is not None else None
    return dict(processor(text=[prompt], images=images, return_tensors="pt"))


def build_batch(
    processor, image_sizes=IMAGE_SIZES, response_lengths=RESPONSE_LENGTHS, seed: int = 0
) -> DataProto:
    """Left-padded prompts + right-padded random responses, as the rollout would hand them over."""
    generator = torch.Generator().manual_seed(seed)
    encoded = [_encode_prompt(processor, size, seed + row) for row, size in enumerate(image_sizes)]
    prompt_width = max(item["input_ids"].shape[1] for item in encoded)
    response_width = max(response_lengths)
    pad_id = processor.tokenizer.pad_token_id
    rows = len(encoded)
    prompts = torch.full((rows, prompt_width), pad_id)
    prompt_mask = torch.zeros(rows, prompt_width, dtype=torch.long)
    prompt_types = torch.zeros(rows, prompt_width, dtype=torch.long)
    for row, item in enumerate(encoded):
        length = item["input_ids"].shape[1]
        prompts[row, prompt_width - length :] = item["input_ids"][0]
        prompt_mask[row, prompt_width - length :] = 1
        prompt_types[row, prompt_width - length :] = item["mm_token_type_ids"][0]
    response_mask = (torch.arange(response_width) < torch.tensor(response_lengths)[:, None]).long()
    # Ordinary BPE tokens only: a sampled image placeholder would break re-scoring.
    responses = torch.randint(50, 300, (rows, response_width), generator=generator)
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad_id))
    media = [{k: v for k, v in item.items() if k in ("pixel_values", "image_grid_thw")} for item in encoded]
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "response_mask": response_mask,
            "mm_token_type_ids": torch.cat([prompt_types, torch.zeros_like(responses)], dim=1),
        },
        non_tensors={"multi_modal_inputs": media, "uid": [f"p{row // 2}" for row in range(rows)]},
    )


def add_training_columns(batch: DataProto, model_path: Path, seed: int = 1) -> DataProto:
    """``old_log_probs`` near the model's own (so some ratios clip), ``ref_log_probs``, advantages,
    critic ``values`` and ``returns``."""
    generator = torch.Generator().manual_seed(seed)
    log_probs, _ = policy_actor(training_model(str(model_path))).compute_log_probs(batch, 4, TEMPERATURE)
    mask = batch.batch["response_mask"].float()
    shape = log_probs.shape
    columns = {
        "old_log_probs": log_probs + 0.3 * torch.randn(shape, generator=generator),
        "ref_log_probs": log_probs + 0.5 * torch.randn(shape, generator=generator),
        "advantages": torch.randn(shape[0], 1, generator=generator) * mask,
        "values": 0.1 * torch.randn(shape, generator=generator),
        "returns": torch.randn(shape[0], 1, generator=generator) * mask,
    }
    return batch.union(DataProto.from_dict(tensors=columns))


@pytest.fixture(scope="module")
def vl_processor(tiny_vl_path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vl_path)


@pytest.fixture(scope="module")
def vl_batch(tiny_vl_path, vl_processor) -> DataProto:
    return add_training_columns(build_batch(vl_processor), tiny_vl_path)


# ---------------------------------------------------------------- what each rank computes


def _sharded(
    model_path: str,
    mesh,
    role="actor",
    freeze=False,
    checkpointing=False,
    cpu_offload=False,
    param_dtype=torch.float32,
    unused_parameter=False,
    reshard_after_forward=True,
):
    from mmrl.workers.fsdp_engine import apply_fsdp2, enable_gradient_checkpointing

    model = training_model(model_path, role=role)
    if unused_parameter:  # in the root unit, reached by no forward (as an audio tower on text rows)
        model.register_parameter("unused_weight", torch.nn.Parameter(torch.zeros(8)))
    if freeze:
        freeze_vision_tower(model)
    if checkpointing:
        enable_gradient_checkpointing(model)
    return apply_fsdp2(
        model,
        mesh,
        param_dtype,
        torch.float32,
        cpu_offload=cpu_offload,
        reshard_after_forward=reshard_after_forward,
    )


def _response_log_prob_sum(model, batch: DataProto) -> torch.Tensor:
    """Sum of the valid response tokens' log-probs: a loss that reaches every parameter."""
    media = batch.non_tensor_batch["multi_modal_inputs"]
    logits = response_head_outputs(
        model,
        batch.batch["input_ids"],
        batch.batch["attention_mask"],
        batch.batch["responses"].shape[1],
        list(media),
        batch.batch["mm_token_type_ids"],
    )
    log_probs = log_probs_from_logits(logits / TEMPERATURE, batch.batch["responses"])
    return (log_probs * batch.batch["response_mask"]).sum()


def _full_state(model) -> dict[str, torch.Tensor]:
    return dict(iter_full_state_dict(model))


def _rank_job(rank: int, world_size: int, model_path: str, data: DataProto) -> dict:
    """Everything the 2-rank tests compare, from one start-up of the ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    shard = data.chunk(world_size)[rank]
    rows = len(shard)
    results: dict = {}

    model = _sharded(model_path, mesh)
    actor = policy_actor(model, **ACTOR_SETTINGS)
    results["log_probs"], results["entropy"] = actor.compute_log_probs(
        shard, 1, TEMPERATURE, with_entropy=True
    )
    results["gathered_after_no_grad"] = _gathered_parameters(model)
    results["state_dict"] = _full_state(model)
    results["bf16_sync"] = _bf16_sync(model)
    results["checkpoint_names"] = [name for name, _ in iter_full_state_dict(model, checkpoint_format=True)]

    # FSDP averages gradients over ranks: scaled by the world size they sum over all rows.
    (_response_log_prob_sum(model, shard) * world_size).backward()
    results["grads"] = {
        name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None
    }

    # The second variant also recomputes activations in backward (gradient checkpointing).
    for mode, micro_batch_size, checkpointing in (("token_mean", 1, False), ("seq_mean_token_mean", 2, True)):
        model = _sharded(model_path, mesh, checkpointing=checkpointing)
        optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
        actor = policy_actor(model, optimizer, **{**ACTOR_SETTINGS, "loss_avg_mode": mode})
        metrics = actor.update_policy(shard, rows, micro_batch_size, 1, TEMPERATURE).metrics
        results[f"update_{mode}"] = (_full_state(model), metrics)

    model = _sharded(model_path, mesh, freeze=True)
    optimizer = build_optimizer(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    policy_actor(model, optimizer, **ACTOR_SETTINGS).update_policy(shard, rows, 1, 1, TEMPERATURE)
    results["frozen_update"] = _full_state(model)
    results["bf16_optimizer"] = _bf16_optimizer_update(model_path, mesh, shard)

    critic_model = _sharded(model_path, mesh, role="critic", cpu_offload=True)
    critic = value_critic(
        critic_model,
        torch.optim.SGD(critic_model.parameters(), lr=SGD_LR),
        max_grad_norm=1e9,
        cliprange_value=CRITIC_CLIP,
    )
    results["values"] = critic.compute_values(shard, 1)
    metrics = critic.update_critic(shard, rows, 1, 1)
    # Between phases the worker parks shards and optimizer states on the host: no-ops on the CPU.
    offload_fsdp_params(critic_model)
    offload_optimizer(critic.optimizer)
    load_fsdp_params(critic_model, "cpu")
    load_optimizer(critic.optimizer, "cpu")
    results["critic_update"] = (_full_state(critic_model), metrics)
    return results


def _gathered_parameters(model) -> list[str]:
    """Parameters registered unsharded (FSDP2 swaps the sharded DTensor for the gathered tensor)."""
    from torch.distributed.tensor import DTensor

    return [name for name, parameter in model.named_parameters() if not isinstance(parameter, DTensor)]


def _bf16_sync(model) -> dict:
    """The weight push's tensors in bf16, and the dtype of every sharded tensor when it was gathered."""
    from unittest import mock

    from torch.distributed.tensor import DTensor

    gathered_dtypes = []
    full_tensor = DTensor.full_tensor

    def recording(self, *args, **kwargs):  # the real all-gather, its dtype noted
        gathered_dtypes.append(self.dtype)
        return full_tensor(self, *args, **kwargs)

    with mock.patch.object(DTensor, "full_tensor", recording):
        state = dict(iter_full_state_dict(model, dtype=torch.bfloat16))
    return {"state": state, "gathered_dtypes": set(gathered_dtypes), "gathers": len(gathered_dtypes)}


def _bf16_optimizer_update(model_path: str, mesh, shard: DataProto) -> dict:
    """The ``frozen_update`` step with ``adamw_bf16``, and its states before and after a distributed
    state-dict round trip (what checkpoint resume does)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.tensor import DTensor

    model = _sharded(model_path, mesh, freeze=True)
    optimizer = build_optimizer(
        model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, strategy="adamw_bf16"
    )
    policy_actor(model, optimizer, **ACTOR_SETTINGS).update_policy(shard, len(shard), 1, 1, TEMPERATURE)

    def kinds() -> set:
        return {
            (isinstance(state[key], DTensor), state[key].dtype)
            for state in optimizer.state.values()
            for key in ("exp_avg", "exp_avg_sq")
        }

    before = kinds()
    set_optimizer_state_dict(model, optimizer, get_optimizer_state_dict(model, optimizer))
    return {"state": _full_state(model), "kinds": before, "kinds_after_load": kinds()}


@pytest.fixture(scope="module")
def two_rank_results(tiny_vl_path, vl_batch) -> list[dict]:
    return run_on_ranks(_rank_job, 2, str(tiny_vl_path), vl_batch)


# ---------------------------------------------------------------- in-process references


def _unique_state(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in iter_full_state_dict(model)}


def _reference_update(model_path, batch, micro_batch_size, **overrides):
    """One unchunked update on one process (the 2-rank jobs chunk their log-prob heads)."""
    model = training_model(str(model_path))
    optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    actor = policy_actor(model, optimizer, **{**ACTOR_SETTINGS, **UNCHUNKED, **overrides})
    metrics = actor.update_policy(batch, len(batch), micro_batch_size, 1, TEMPERATURE).metrics
    return _unique_state(model), metrics


def _assert_states_close(actual: dict, expected: dict, atol: float) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=0, msg=name)


# ---------------------------------------------------------------- loading


def test_load_model_finds_towers_layers_and_auto_class(tiny_vl_path, tiny_omni_path, tiny_text_path):
    vl = load_model(str(tiny_vl_path))
    assert type(vl).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert [name for name, _ in tower_modules(vl)] == ["model.visual"]
    assert is_multimodal(vl) and len(decoder_layers(vl)) == 2

    # A full Omni folder: the thinker is loaded from it, with its vision and audio towers.
    omni = load_model(str(tiny_omni_path), override_config={"text_config": {"rms_norm_eps": 1e-5}})
    assert type(omni).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    assert [name for name, _ in tower_modules(omni)] == ["visual", "audio_tower"]
    assert omni.config.get_text_config().rms_norm_eps == 1e-5

    text = load_model(str(tiny_text_path), torch_dtype=torch.bfloat16)
    assert type(text).__name__ == "Qwen2ForCausalLM" and text.dtype == torch.bfloat16
    assert not is_multimodal(text) and vision_modules(text) == []
    with pytest.raises(ValueError, match="no vision or audio tower"):
        freeze_vision_tower(text)
    with pytest.raises(KeyError, match="override_config: .* no attribute 'rms_norm_epz'"):
        load_model(str(tiny_text_path), override_config={"rms_norm_epz": 1e-5})


def test_critic_has_an_untied_small_value_head(tiny_vl_path):
    critic = load_model(str(tiny_vl_path), role="critic")
    head = critic.lm_head
    assert tuple(head.weight.shape) == (1, 64) and torch.equal(head.bias, torch.zeros(1))
    assert 0 < head.weight.abs().max() < 0.02
    critic.tie_weights()  # what a later from_pretrained-style call would do: must not re-tie
    assert critic.lm_head is head and critic.get_input_embeddings().weight.shape[0] > 1
    # The same head on every load (ranks must agree before FSDP shards them).
    assert torch.equal(load_model(str(tiny_vl_path), role="critic").lm_head.weight, head.weight)


def test_checkpointing_some_layers_needs_layers_transformers_can_checkpoint_one_by_one(tiny_vl_path):
    from mmrl.workers.fsdp_engine import enable_gradient_checkpointing

    model = load_model(str(tiny_vl_path))
    enable_gradient_checkpointing(model, 1)
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [True, False]
    decoder_layers(model)[1] = torch.nn.Identity()  # as a remote-code layer of its own class
    with pytest.raises(
        ValueError, match="Identity, a decoder layer of .* unset gradient_checkpointing_layers"
    ):
        enable_gradient_checkpointing(model, 1)


def test_freeze_vision_tower_freezes_exactly_the_tower(tiny_vl_path):
    model = load_model(str(tiny_vl_path))
    frozen = freeze_vision_tower(model)
    tower = {id(p) for p in model.model.visual.parameters()}
    assert frozen == sum(p.numel() for p in model.model.visual.parameters())
    assert all(p.requires_grad == (id(p) not in tower) for p in model.parameters())


# ---------------------------------------------------------------- forward inputs


def test_concat_pads_audio_features_and_keeps_row_order():
    rows = [
        {"input_features": torch.ones(1, 2, 3), "feature_attention_mask": torch.ones(1, 3, dtype=torch.long)},
        {},
        {
            "input_features": torch.full((2, 2, 5), 2.0),
            "feature_attention_mask": torch.ones(2, 5, dtype=torch.long),
        },
    ]
    joined = concat_multi_modal_inputs(rows)
    assert joined["input_features"].shape == (3, 2, 5)
    assert joined["input_features"][0, :, 3:].abs().sum() == 0 and joined["input_features"][1:].eq(2).all()
    assert joined["feature_attention_mask"].sum(-1).tolist() == [3, 5, 5]


def test_mrope_positions_match_the_models_own_and_hand_derived(tiny_vl_path, vl_processor):
    model = load_model(str(tiny_vl_path)).eval()
    encoded = _encode_prompt(vl_processor, (84, 56), seed=0)  # 6 x 4 patches -> 3 x 2 merged tokens
    media = {key: encoded[key] for key in ("pixel_values", "image_grid_thw")}
    inputs = build_forward_inputs(model, encoded["input_ids"], encoded["attention_mask"], [media])
    positions = inputs["position_ids"][:, 0]  # [3, L]
    image = (encoded["input_ids"][0] == model.config.image_token_id).nonzero().flatten()
    start = int(image[0])
    # Text before the image counts 0, 1, ...; the image's 6 tokens take (t, h, w) = (s, s + i, s + j);
    # text after it continues from s + max(h, w) = s + 3.
    assert torch.equal(positions[:, :start], torch.arange(start).expand(3, -1))
    expected_image = [
        [start] * 6,
        [start + i for i in range(2) for _ in range(3)],
        [start + j for _ in range(2) for j in range(3)],
    ]
    assert positions[:, image].tolist() == expected_image
    assert positions[0, int(image[-1]) + 1] == start + 3
    with torch.no_grad():
        own = model(**encoded).logits  # the model computes its positions itself
        explicit = model(**inputs).logits
    torch.testing.assert_close(explicit, own, atol=0, rtol=0)


def _logits_own_vs_explicit(model, encoded: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits with positions left to the model, and with those of ``build_forward_inputs``."""
    token_keys = ("input_ids", "attention_mask", "mm_token_type_ids")
    media = {key: value for key, value in encoded.items() if key not in token_keys}
    inputs = build_forward_inputs(
        model, encoded["input_ids"], encoded["attention_mask"], [media], encoded.get("mm_token_type_ids")
    )
    with torch.no_grad():
        return model(**encoded).logits, model(**inputs).logits


def test_video_and_audio_positions_match_the_models_own(tiny_vl_path, tiny_omni_path, vl_processor):
    from transformers import AutoProcessor

    frames = np.random.default_rng(0).integers(0, 256, (4, 56, 56, 3), dtype=np.uint8)
    prompt = vl_processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]}],
        add_generation_prompt=True,
        tokenize=False,
    )
    video = dict(vl_processor(text=[prompt], videos=[frames], return_tensors="pt"))
    assert "second_per_grid_ts" in video  # used for the positions, not passed to the forward
    own, explicit = _logits_own_vs_explicit(load_model(str(tiny_vl_path)).eval(), video)
    torch.testing.assert_close(explicit, own, atol=0, rtol=0)

    omni_processor = AutoProcessor.from_pretrained(tiny_omni_path)
    content = [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "What is it?"}]
    prompt = omni_processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    audio = np.random.default_rng(1).standard_normal(8000).astype(np.float32)
    encoded = dict(
        omni_processor(text=[prompt], images=[_image((56, 56), 0)], audio=[audio], return_tensors="pt")
    )
    own, explicit = _logits_own_vs_explicit(load_model(str(tiny_omni_path)).eval(), encoded)
    torch.testing.assert_close(explicit, own, atol=0, rtol=0)


def test_left_padding_changes_no_logit(tiny_vl_path, tiny_text_path, vl_processor):
    for path in (tiny_vl_path, tiny_text_path):
        model = load_model(str(path)).eval()
        if path == tiny_vl_path:
            encoded = _encode_prompt(vl_processor, (56, 56), seed=0)
            media, token_types = (
                [{k: encoded[k] for k in ("pixel_values", "image_grid_thw")}],
                encoded["mm_token_type_ids"],
            )
        else:
            encoded = {
                "input_ids": torch.randint(50, 300, (1, 12)),
                "attention_mask": torch.ones(1, 12, dtype=torch.long),
            }
            media, token_types = None, None
        ids, mask = encoded["input_ids"], encoded["attention_mask"]
        pad = 5
        padded_ids = torch.cat([torch.zeros(1, pad, dtype=torch.long), ids], dim=1)
        padded_mask = torch.cat([torch.zeros(1, pad, dtype=torch.long), mask], dim=1)
        padded_types = (
            None
            if token_types is None
            else torch.cat([torch.zeros(1, pad, dtype=torch.long), token_types], 1)
        )
        with torch.no_grad():
            plain = model(**build_forward_inputs(model, ids, mask, media, token_types)).logits
            padded = model(**build_forward_inputs(model, padded_ids, padded_mask, media, padded_types)).logits
        torch.testing.assert_close(padded[:, pad:], plain, atol=1e-5, rtol=0)
        if media is None:  # text: positions are the valid-token count, not the column index
            positions = build_forward_inputs(model, padded_ids, padded_mask, None)["position_ids"]
            assert positions[0].tolist() == [0] * pad + list(range(12))


def test_response_head_outputs_are_the_positions_before_each_response_token(tiny_text_path):
    model = load_model(str(tiny_text_path)).eval()
    ids = torch.randint(50, 300, (2, 9))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits
        kept = response_head_outputs(model, ids, mask, response_length=4)
    torch.testing.assert_close(kept, full[:, 4:8], atol=1e-6, rtol=0)


# ---------------------------------------------------------------- engine pieces


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16 and resolve_dtype("fp32", "cuda") == torch.float32
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8", "cpu")


def test_storage_dtype_keeps_fp32_masters_and_stores_the_frozen_reference_in_bf16_on_gpu():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert storage_dtype("auto", cuda, trainable=False) == torch.bfloat16  # the reference, as EasyR1
    assert storage_dtype("auto", cpu, trainable=False) == torch.float32
    assert storage_dtype("auto", cuda, trainable=True) == torch.float32  # the actor's master weights
    assert storage_dtype("auto", cpu, trainable=True) == torch.float32
    assert storage_dtype("fp32", cuda, trainable=False) == torch.float32  # what the user set wins
    assert storage_dtype("bf16", cpu, trainable=True) == torch.bfloat16


def test_lr_schedule_warmup_constant_and_cosine():
    # Warm-up of 4 steps: 1/4, 2/4, 3/4, 4/4 of the peak, then the schedule proper.
    assert [lr_factor(s, 10, 4, "constant", 0.0) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cosine = [lr_factor(s, 10, 2, "cosine", 0.1) for s in range(2, 11)]
    assert cosine[0] == pytest.approx(1.0) and cosine[-1] == pytest.approx(0.1)
    assert cosine[4] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway: (1 + cos(pi / 2)) / 2 = 1/2
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=2.0)
    scheduler = build_lr_scheduler(optimizer, 10, 2, "cosine", 0.1)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.0 * lr_factor(3, 10, 2, "cosine", 0.1))
    restored = build_lr_scheduler(torch.optim.SGD([parameter], lr=2.0), 10, 2, "cosine", 0.1)
    restored.load_state_dict(scheduler.state_dict())
    assert restored.last_epoch == 3 and restored.get_last_lr() == scheduler.get_last_lr()


def test_clip_grad_norm_matches_torch_and_leaves_nonfinite_alone():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model(torch.randn(5, 4)).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])).item()
    norm = clip_grad_norm(model, max_norm=0.1)
    assert norm == pytest.approx(expected, rel=1e-6)
    for before, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, before * 0.1 / (expected + 1e-6))
    model[0].weight.grad[0, 0] = float("nan")
    kept = [p.grad.clone() for p in model.parameters()]
    assert math.isnan(clip_grad_norm(model, max_norm=0.1))
    assert all(torch.equal(a, b) for a, b in zip(kept[1:], [p.grad for p in model.parameters()][1:]))


def test_build_optimizer_takes_only_trainable_parameters(tiny_vl_path):
    model = load_model(str(tiny_vl_path))
    freeze_vision_tower(model)
    optimizer = build_optimizer(model.parameters(), lr=1e-3, betas=[0.9, 0.95], weight_decay=0.1)
    group = optimizer.param_groups[0]
    assert sum(p.numel() for p in group["params"]) == sum(
        p.numel() for p in model.parameters() if p.requires_grad
    )
    assert group["betas"] == (0.9, 0.95) and group["weight_decay"] == 0.1


def test_build_optimizer_fuses_on_cpu_and_steps_like_adamw_by_hand():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3, 4))
    optimizer = build_optimizer([weight], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5, strategy="adamw")
    assert optimizer.param_groups[0]["fused"] is True  # one kernel per tensor, not a loop of ops
    expected, m, v = weight.detach().clone(), torch.zeros(3, 4), torch.zeros(3, 4)
    for step in (1, 2, 3):
        grad = torch.randn(3, 4)
        weight.grad = grad.clone()
        optimizer.step()
        # AdamW (Loshchilov & Hutter): decoupled decay, then the bias-corrected Adam step.
        expected = expected * (1 - 0.1 * 0.5)
        m, v = 0.9 * m + 0.1 * grad, 0.99 * v + 0.01 * grad.square()
        m_hat, v_hat = m / (1 - 0.9**step), v / (1 - 0.99**step)
        expected = expected - 0.1 * m_hat / (v_hat.sqrt() + 1e-8)
        torch.testing.assert_close(weight.detach(), expected, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- single-process updates


def test_update_is_independent_of_micro_batch_size(tiny_vl_path, vl_batch):
    whole, whole_metrics = _reference_update(tiny_vl_path, vl_batch, micro_batch_size=4)
    split, split_metrics = _reference_update(tiny_vl_path, vl_batch, micro_batch_size=1)
    _assert_states_close(split, whole, atol=1e-6)
    for name in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss", "grad_norm"):
        assert split_metrics[name] == pytest.approx(whole_metrics[name], rel=1e-5, abs=1e-7), name
    assert whole_metrics["grad_norm"] > ACTOR_SETTINGS["max_grad_norm"]  # clipping was active
    assert 0 < whole_metrics["pg_clipfrac"] < 1 and whole_metrics["skipped_steps"] == 0


def test_one_step_changes_every_trainable_tensor_vision_tower_included(tiny_vl_path, vl_batch):
    model = training_model(str(tiny_vl_path))
    before = _unique_state(model)
    optimizer = build_optimizer(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    policy_actor(model, optimizer, **ACTOR_SETTINGS).update_policy(vl_batch, 4, 2, 1, TEMPERATURE)
    after = _unique_state(model)
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert unchanged == []
    assert any(name.startswith("model.visual.") for name in before)


def test_frozen_vision_tower_stays_unchanged(tiny_vl_path, vl_batch):
    model = training_model(str(tiny_vl_path))
    freeze_vision_tower(model)
    before = _unique_state(model)
    optimizer = build_optimizer(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    policy_actor(model, optimizer, **ACTOR_SETTINGS).update_policy(vl_batch, 4, 2, 1, TEMPERATURE)
    after = _unique_state(model)
    for name in before:
        assert torch.equal(before[name], after[name]) == name.startswith("model.visual."), name


def test_nonfinite_gradient_skips_the_step(tiny_vl_path, vl_processor):
    model = training_model(str(tiny_vl_path))
    batch = add_training_columns(
        build_batch(vl_processor, image_sizes=(None, None), response_lengths=(4, 2)), tiny_vl_path
    )
    batch.batch["advantages"][0, 0] = float("inf")  # inf * ratio: the gradient norm is NaN
    before = _unique_state(model)
    optimizer = build_optimizer(model.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    metrics = (
        policy_actor(model, optimizer, **ACTOR_SETTINGS).update_policy(batch, 2, 2, 1, TEMPERATURE).metrics
    )
    assert metrics["skipped_steps"] == 1 and math.isnan(metrics["grad_norm"])
    assert all(torch.equal(before[name], tensor) for name, tensor in _unique_state(model).items())


# ---------------------------------------------------------------- two ranks vs one


@pytest.mark.distributed
def test_two_rank_log_probs_and_grads_equal_one_rank(tiny_vl_path, vl_batch, two_rank_results):
    model = training_model(str(tiny_vl_path))
    actor = policy_actor(model, **{**ACTOR_SETTINGS, **UNCHUNKED})
    log_probs, entropy = actor.compute_log_probs(vl_batch, 4, TEMPERATURE, with_entropy=True)
    mask = vl_batch.batch["response_mask"].bool()
    sharded_log_probs = torch.cat([result["log_probs"] for result in two_rank_results])
    sharded_entropy = torch.cat([result["entropy"] for result in two_rank_results])
    torch.testing.assert_close(sharded_log_probs[mask], log_probs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(sharded_entropy[mask], entropy[mask], atol=1e-5, rtol=0)

    _response_log_prob_sum(model, vl_batch).backward()
    expected = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    grads = two_rank_results[0]["grads"]
    assert grads.keys() == expected.keys() and any(name.startswith("model.visual.") for name in grads)
    for name, grad in expected.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.distributed
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_two_rank_update_equals_one_rank(tiny_vl_path, vl_batch, two_rank_results, mode):
    expected, expected_metrics = _reference_update(
        tiny_vl_path, vl_batch, micro_batch_size=4, loss_avg_mode=mode
    )
    initial = two_rank_results[0]["state_dict"]
    for result in two_rank_results:
        state, metrics = result[f"update_{mode}"]
        _assert_states_close(state, expected, atol=1e-6)
        for name in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss", "grad_norm", "lr"):
            assert metrics[name] == pytest.approx(expected_metrics[name], rel=1e-5, abs=1e-7), name
    # Not vacuous: the step moved every tensor, and by more than the tolerance.
    state, _ = two_rank_results[0][f"update_{mode}"]
    assert all(not torch.equal(state[name], initial[name]) for name in initial)
    assert max((state[name] - initial[name]).abs().max().item() for name in initial) > 1e-3


@pytest.mark.distributed
def test_two_rank_frozen_tower_unchanged(two_rank_results):
    initial = two_rank_results[0]["state_dict"]
    updated = two_rank_results[0]["frozen_update"]
    for name in initial:
        assert torch.equal(initial[name], updated[name]) == name.startswith("model.visual."), name


@pytest.mark.distributed
def test_two_rank_adamw_bf16_first_step_equals_adamw_on_dtensor_shards(two_rank_results):
    # the first AdamW step computes both moments in float32 before storing them: bf16 storage changes
    # nothing yet, so the FSDP2 update equals the float32 AdamW one (frozen_update, same gradients)
    initial = two_rank_results[0]["state_dict"]
    for result in two_rank_results:
        bf16 = result["bf16_optimizer"]
        assert bf16["kinds"] == bf16["kinds_after_load"] == {(True, torch.bfloat16)}  # DTensor shards
        _assert_states_close(bf16["state"], result["frozen_update"], atol=1e-6)
    moved = two_rank_results[0]["bf16_optimizer"]["state"]
    assert max((moved[name] - initial[name]).abs().max().item() for name in initial) > 5e-4


@pytest.mark.distributed
def test_two_rank_critic_values_and_update_equal_one_rank(tiny_vl_path, vl_batch, two_rank_results):
    model = training_model(str(tiny_vl_path), role="critic")
    critic = value_critic(
        model, torch.optim.SGD(model.parameters(), lr=SGD_LR), max_grad_norm=1e9, cliprange_value=CRITIC_CLIP
    )
    values = critic.compute_values(vl_batch, 4)
    mask = vl_batch.batch["response_mask"].bool()
    sharded_values = torch.cat([result["values"] for result in two_rank_results])
    torch.testing.assert_close(sharded_values[mask], values[mask], atol=1e-6, rtol=0)
    head_before = model.lm_head.weight.detach().clone()
    metrics = critic.update_critic(vl_batch, 4, 4, 1)
    assert metrics["vf_loss"] > 0 and 0 <= metrics["vf_clipfrac"] <= 1
    assert not torch.equal(model.lm_head.weight, head_before)
    state, sharded_metrics = two_rank_results[0]["critic_update"]
    _assert_states_close(state, _unique_state(model), atol=1e-6)
    assert sharded_metrics["vf_loss"] == pytest.approx(metrics["vf_loss"], rel=1e-5)


# ---------------------------------------------------------------- the vision tower's own FSDP unit

MIXED_ORDER = [0, 2, 3, 1]  # rank 0: image row, text row; rank 1: text row, image row
TEXT_ORDER = [2, 3, 2, 3]  # text rows only, on both ranks
IMAGES_FIRST_ORDER = [0, 2, 1, 3]  # on both ranks an image row, then a text row: no rank calls the tower last
# name -> (rows, reduce_grads_once, kept for the backward, kept across micro-batches): the tower job's
# runs (an update per micro-batch of one row, the gradients reduced in each micro-batch or once, in the
# mini-batch's last; each unit's parameters gathered in its forward and again in its backward, or kept
# from forward to backward (fsdp.enable_full_shard=false), and kept from a micro-batch's backward to
# the next one's forward (keep_params_gathered))
TOWER_RUNS = {
    "mixed": (MIXED_ORDER, False, False, False),
    "text": (TEXT_ORDER, False, False, False),
    "mixed_reduced_once": (MIXED_ORDER, True, False, False),
    "images_first_reduced_once": (IMAGES_FIRST_ORDER, True, False, False),
    "mixed_gathered_once": (MIXED_ORDER, True, True, True),
    "images_first_gathered_once": (IMAGES_FIRST_ORDER, True, True, True),
    "mixed_kept_across": (MIXED_ORDER, False, False, True),
}
FIRST_LAYER = "model.language_model.layers.0"


def _recording_tower_collectives() -> list[tuple[str, str]]:
    """``(kind, unit)`` of every all-gather and reduce-scatter FSDP2 issues for a vision tower unit, and
    of every all-gather of the first decoder layer's, from now on in this process (the real
    collectives, noted as they start)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_module

    record: list[tuple[str, str]] = []
    unshard, reduce = group_module.FSDPParamGroup.unshard, group_module.foreach_reduce

    def recording_unshard(self, *args, **kwargs):
        gathers = not self.is_unsharded and self._all_gather_result is None
        if gathers and ("visual" in self._module_fqn or self._module_fqn == FIRST_LAYER):
            record.append(("all_gather", self._module_fqn))
        return unshard(self, *args, **kwargs)

    def recording_reduce(fsdp_params, *args, **kwargs):
        if any(param._param_fqn.startswith("model.visual.") for param in fsdp_params):
            record.append(("reduce_scatter", "model.visual"))  # the tower is one unit: one call
        return reduce(fsdp_params, *args, **kwargs)

    group_module.FSDPParamGroup.unshard = recording_unshard
    group_module.foreach_reduce = recording_reduce
    return record


def _tower_job(rank: int, world_size: int, model_path: str, batch: DataProto) -> dict:
    """A log-prob pass and an update for each of ``TOWER_RUNS`` (a batch whose image rows lie in
    different micro-batches on the two ranks, text rows only, ...), each noting the tower's collectives."""
    from torch.distributed.device_mesh import init_device_mesh

    from mmrl.models.encoding_cache import prompt_encodings
    from mmrl.workers.fsdp_engine import root_gathered
    from mmrl.workers.towers import tower_sync

    mesh = init_device_mesh("cpu", (world_size,))
    record = _recording_tower_collectives()
    results: dict = {}
    for name, (order, reduce_once, kept_for_backward, kept_across) in TOWER_RUNS.items():
        shard = batch[order].chunk(world_size)[rank]
        model = _sharded(model_path, mesh, checkpointing=True, reshard_after_forward=not kept_for_backward)
        optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
        actor = policy_actor(
            model,
            optimizer,
            **ACTOR_SETTINGS,
            reduce_grads_once=reduce_once,
            keep_params_gathered=kept_across,
            fsdp=FSDPConfig(enable_full_shard=not kept_for_backward),
        )
        del record[:]
        log_probs, _ = actor.compute_log_probs(shard, 1, TEMPERATURE)
        log_prob_collectives = [entry for entry in record if entry[1] != FIRST_LAYER]
        del record[:]
        metrics = actor.update_policy(shard, len(shard), 1, 1, TEMPERATURE).metrics
        results[name] = {
            "state": _full_state(model),
            "metrics": metrics,
            "log_probs": log_probs,
            "update_collectives": [entry for entry in record if entry[1] != FIRST_LAYER],
            "layer_gathers": record.count(("all_gather", FIRST_LAYER)),
            "gathered_after_update": _gathered_parameters(model),
            "log_prob_collectives": log_prob_collectives,
            "placeholders": tower_sync(model).placeholder_calls,
        }
    # the rollout's prompt encodings: the tower called outside the forward, by the ranks with images only
    shard = batch[MIXED_ORDER].chunk(world_size)[rank]
    model = _sharded(model_path, mesh)
    del record[:]
    with root_gathered(model), torch.no_grad():
        encodings = prompt_encodings(
            vision_modules(model), list(shard.non_tensor_batch["multi_modal_inputs"]), torch.device("cpu")
        )
    results["prompt_encodings"] = (encodings, list(record))
    return results


@pytest.fixture(scope="module")
def tower_results(tiny_vl_path, vl_batch) -> list[dict]:
    return run_on_ranks(_tower_job, 2, str(tiny_vl_path), vl_batch, timeout_s=300)


def test_tower_placeholder_runs_through_every_sharded_tower(
    tiny_vl_path, tiny_qwen3_vl_path, tiny_omni_path, tiny_glm4v_path, tiny_qwen3_5_path
):
    """The placeholder a rank without media feeds its tower: one merged token's patches through each
    family's vision tower (Qwen3-VL with its deepstack features, GLM-4.1V with its interpolated
    positions), every output finite, and its 0-times sum's gradient zero on every tower parameter."""
    from mmrl.parallel.encoders import takes_grid
    from mmrl.workers.towers import output_tensors, placeholder_inputs

    for path in (tiny_vl_path, tiny_qwen3_vl_path, tiny_omni_path, tiny_glm4v_path, tiny_qwen3_5_path):
        towers = [tower for _, tower in tower_modules(load_model(str(path))) if takes_grid(tower)]
        assert len(towers) == 1, path
        (tower,) = towers
        outputs = list(output_tensors(tower(*placeholder_inputs(tower))))
        assert outputs and all(bool(torch.isfinite(output).all()) for output in outputs), path
        (sum(output.float().sum() for output in outputs) * 0.0).backward()
        grads = [param.grad for param in tower.parameters() if param.requires_grad]
        assert grads and all(grad is not None and not grad.any() for grad in grads), path


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(TOWER_RUNS))
def test_tower_unit_update_equals_one_rank(tiny_vl_path, vl_batch, tower_results, name):
    """Image rows on one rank and text rows on the other in the same micro-batch, each rank's image in
    another micro-batch (the other rank runs the tower on its placeholder there), or no image at all;
    the gradients reduced in every micro-batch or once per step (``reduce_grads_once``), the tower's
    too when no rank calls it in the last micro-batch: the update, its metrics and the log-probs
    equal one process's on the whole batch."""
    batch = vl_batch[TOWER_RUNS[name][0]]
    expected, expected_metrics = _reference_update(tiny_vl_path, batch, micro_batch_size=4)
    model = training_model(str(tiny_vl_path))
    log_probs, _ = policy_actor(model, **{**ACTOR_SETTINGS, **UNCHUNKED}).compute_log_probs(
        batch, 4, TEMPERATURE
    )
    mask = batch.batch["response_mask"].bool()
    sharded = torch.cat([result[name]["log_probs"] for result in tower_results])
    torch.testing.assert_close(sharded[mask], log_probs[mask], atol=1e-5, rtol=0)
    for result in tower_results:
        _assert_states_close(result[name]["state"], expected, atol=1e-6)
        for metric in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "kl_loss", "grad_norm"):
            assert result[name]["metrics"][metric] == pytest.approx(
                expected_metrics[metric], rel=1e-5, abs=1e-7
            ), metric
    initial = _unique_state(training_model(str(tiny_vl_path)))
    state = tower_results[0][name]["state"]
    moved = {key for key in initial if not torch.equal(state[key], initial[key])}
    towers = {key for key in initial if key.startswith("model.visual.")}
    # text rows only: the tower gets no gradient and SGD leaves it as it is (as on one process)
    assert moved == (set(initial) - towers if name == "text" else set(initial))


@pytest.mark.distributed
def test_tower_unit_is_gathered_only_where_some_rank_has_media(tower_results):
    for rank, result in enumerate(tower_results):
        mixed, text = result["mixed"], result["text"]
        # two micro-batches, an image on one rank in each: one gather and one reduction of the tower
        # per micro-batch whatever the rank holds, and one placeholder per rank (its text row)
        assert (
            mixed["update_collectives"]
            == [
                ("all_gather", "model.visual"),
                ("reduce_scatter", "model.visual"),
            ]
            * 2
        ), rank
        assert mixed["placeholders"] == 2, rank  # one in the update, one in the log-prob pass
        assert mixed["log_prob_collectives"] == [("all_gather", "model.visual")], rank  # kept for the pass
        # text rows only: the tower is never gathered, cast or reduced, and no placeholder runs
        assert text["update_collectives"] == text["log_prob_collectives"] == [], rank
        assert text["placeholders"] == 0, rank
        # gradients reduced once per step: gathered once more before the model's first such update
        # (fsdp_engine._gathered_once), then per micro-batch with media; reduced once, in the last
        # micro-batch's backward, or after it when no rank called the tower there
        gather, reduce = ("all_gather", "model.visual"), ("reduce_scatter", "model.visual")
        assert result["mixed_reduced_once"]["update_collectives"] == [gather, gather, gather, reduce], rank
        assert result["images_first_reduced_once"]["update_collectives"] == [gather, gather, reduce], rank
        # and the parameters kept gathered through the step: the tower's first gather (in the first
        # micro-batch) serves the second too; kept from the first micro-batch, not called in the
        # second (text rows on both ranks), it is reduced (and resharded) after the last backward
        assert result["mixed_gathered_once"]["update_collectives"] == [gather, gather, reduce], rank
        assert result["images_first_gathered_once"]["update_collectives"] == [gather, gather, reduce], rank
        # kept across micro-batches alone, reduced in each: one gather, two reductions
        assert result["mixed_kept_across"]["update_collectives"] == [gather, reduce, reduce], rank


@pytest.mark.distributed
def test_parameters_kept_gathered_through_a_step_are_gathered_once_and_resharded_before_it(tower_results):
    """A decoder layer's gathers in an update of two micro-batches under gradient checkpointing: its
    forward and its backward in each (4), one more before the first update that reduces once
    (``_gathered_once``); kept from a micro-batch's backward to the next one's forward
    (``keep_params_gathered``), the second forward's gather saved (3); and kept from forward to backward
    too (``fsdp.enable_full_shard=false``), one in the step (and ``_gathered_once``'s). Every unit is
    resharded after the update (none left gathered across the optimizer step), and the update is the
    one of every other run (test_tower_unit_update_equals_one_rank)."""
    for rank, result in enumerate(tower_results):
        assert result["mixed"]["layer_gathers"] == 4, rank
        assert result["mixed_reduced_once"]["layer_gathers"] == 5, rank
        assert result["mixed_kept_across"]["layer_gathers"] == 3, rank
        assert result["mixed_gathered_once"]["layer_gathers"] == 2, rank
        assert result["images_first_gathered_once"]["layer_gathers"] == 2, rank
        for name in TOWER_RUNS:
            assert result[name]["gathered_after_update"] == [], (rank, name)


def _kept_gathered_epochs_job(rank: int, world_size: int, model_path: str, data: DataProto) -> dict:
    """Two epochs over the rows in micro-batches of one row (two optimizer steps), the parameters
    gathered per unit call or kept through each step: the state after each."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    shard = data.chunk(world_size)[rank]
    results = {}
    for kept in (False, True):
        model = _sharded(model_path, mesh, reshard_after_forward=not kept)
        optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
        fsdp = FSDPConfig(enable_full_shard=not kept)
        actor = policy_actor(model, optimizer, **ACTOR_SETTINGS, keep_params_gathered=kept, fsdp=fsdp)
        actor.update_policy(shard, len(shard), 1, 2, TEMPERATURE)
        results[kept] = _full_state(model)
    return results


@pytest.mark.distributed
def test_parameters_kept_gathered_never_outlive_an_optimizer_step(tiny_vl_path, vl_batch):
    """The second epoch's first forward runs on the weights the first epoch's step made: a gathered copy
    kept past that step would hold the old ones, and the second step would differ."""
    results = run_on_ranks(
        _kept_gathered_epochs_job, 2, str(tiny_vl_path), vl_batch[MIXED_ORDER], timeout_s=300
    )
    initial = _unique_state(training_model(str(tiny_vl_path)))
    for result in results:
        _assert_states_close(result[True], result[False], atol=1e-6)
        assert any(not torch.equal(result[True][key], initial[key]) for key in initial)


def _bf16_reduced_once_job(rank: int, world_size: int, model_path: str, data: DataProto) -> dict:
    """An update in micro-batches of one row with bf16 compute and fp32 reductions, its gradients
    reduced per micro-batch and once per step: the state and gradient norm of each."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    shard = data.chunk(world_size)[rank]
    results = {}
    for once in (False, True):
        model = _sharded(model_path, mesh, param_dtype=torch.bfloat16, unused_parameter=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LR)
        actor = policy_actor(model, optimizer, **ACTOR_SETTINGS, reduce_grads_once=once)
        metrics = actor.update_policy(shard, len(shard), 1, 1, TEMPERATURE).metrics
        results[once] = {"state": _full_state(model), "grad_norm": metrics["grad_norm"]}
    return results


@pytest.mark.distributed
def test_gradients_reduced_once_in_bf16_while_the_tower_was_never_called(tiny_vl_path, vl_batch):
    """Text rows only, so no rank has ever gathered the vision tower's unit, and bf16 compute, so FSDP2
    keeps the unreduced gradients in fp32 (it reads the unit's unsharded parameters, which only a
    gather makes: each unit is gathered once before the first such backward); the root holds a
    parameter no forward reaches (reduced as zeros, which FSDP2 makes in bf16: kept in fp32 with the
    rest of its unit): the update equals the one that reduces in every micro-batch."""
    results = run_on_ranks(_bf16_reduced_once_job, 2, str(tiny_vl_path), vl_batch[TEXT_ORDER], timeout_s=300)
    for result in results:
        every, once = result[False], result[True]
        assert once["grad_norm"] == pytest.approx(every["grad_norm"], rel=1e-5)
        _assert_states_close(once["state"], every["state"], atol=1e-6)


@pytest.mark.distributed
def test_tower_unit_encodes_prompts_outside_the_forward(tiny_vl_path, vl_batch, tower_results):
    """``root_gathered`` gathers the tower unit too: the rank with an image encodes it (the other has
    none and calls nothing), and the encoding is the unsharded tower's."""
    from mmrl.models.encoding_cache import prompt_encodings

    model = training_model(str(tiny_vl_path))
    rows = list(vl_batch[MIXED_ORDER].non_tensor_batch["multi_modal_inputs"])
    with torch.no_grad():
        expected = prompt_encodings(vision_modules(model), rows, torch.device("cpu"))
    sharded = [encoding for result in tower_results for encoding in result["prompt_encodings"][0]]
    assert [encoding is None for encoding in sharded] == [False, True, True, False]
    for got, want in zip(sharded, expected):
        if want is not None:
            torch.testing.assert_close(got["image"]["image_embeds"], want["image"]["image_embeds"])
    for result in tower_results:  # one explicit gather on each rank, no other collective of the tower
        assert result["prompt_encodings"][1] == [("all_gather", "model.visual")]


@pytest.mark.distributed
def test_full_state_dict_of_sharded_model_loads_into_a_fresh_model(
    tiny_vl_path, vl_processor, two_rank_results
):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForImageTextToText

    reference = load_model(str(tiny_vl_path)).eval()
    assert reference.lm_head.weight is reference.get_input_embeddings().weight
    # The unsharded state_dict, less the tied alias lm_head.weight (sent once, as the embedding).
    expected = {name: tensor for name, tensor in reference.state_dict().items() if name != "lm_head.weight"}
    for result in two_rank_results:  # every rank gets the full tensors
        _assert_states_close(result["state_dict"], expected, atol=0)
    # On-disk names: exactly the keys save_pretrained wrote.
    with safe_open(str(tiny_vl_path / "model.safetensors"), "pt") as stored:
        assert sorted(two_rank_results[0]["checkpoint_names"]) == sorted(stored.keys())
    assert checkpoint_key_mapping(reference)["model.language_model.layers.0.mlp.up_proj.weight"] == (
        "model.layers.0.mlp.up_proj.weight"
    )

    torch.manual_seed(123)
    fresh = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(tiny_vl_path)).eval()
    load_into(fresh, two_rank_results[1]["state_dict"].items())
    inputs = _encode_prompt(vl_processor, (56, 56), seed=3)
    with torch.no_grad():
        torch.testing.assert_close(fresh(**inputs).logits, reference(**inputs).logits, atol=0, rtol=0)
    with pytest.raises(KeyError, match="tensors were not given"):
        load_into(fresh, list(two_rank_results[1]["state_dict"].items())[:-1])


def test_fused_experts_are_pushed_as_the_tensors_their_files_hold(tiny_qwen3_omni_path):
    """Qwen3-Omni keeps each layer's experts fused in memory ([E, 2I, D] gate and up, [E, D, I] down) and
    saves one tensor per expert and projection: a push under on-disk names sends exactly the saved
    names and values (what vLLM's loader reads), and the manifest announces them in order."""
    from safetensors.torch import load_file

    from mmrl.workers.weight_sync import full_state_manifest

    model = load_model(str(tiny_qwen3_omni_path))
    pushed = dict(iter_full_state_dict(model, checkpoint_format=True))
    stored = {
        name.removeprefix("thinker."): tensor
        for name, tensor in load_file(tiny_qwen3_omni_path / "model.safetensors").items()
    }
    assert pushed.keys() == stored.keys()
    for name, tensor in stored.items():
        assert torch.equal(pushed[name], tensor), name
    fused = model.model.layers[0].mlp.experts.gate_up_proj  # [E, 2I, D]: gate rows, then up rows
    width = fused.shape[1] // 2
    assert torch.equal(pushed["model.layers.0.mlp.experts.1.up_proj.weight"], fused[1, width:])
    manifest = full_state_manifest(model, checkpoint_format=True)
    assert [(name, shape) for name, shape, _ in manifest] == [
        (name, tuple(t.shape)) for name, t in pushed.items()
    ]


@pytest.mark.distributed
def test_two_rank_no_grad_pass_leaves_no_unit_gathered(two_rank_results):
    # the root unit (tied embedding/head, vision tower, final norm) has no backward to reshard it after a
    # log-prob pass: it is resharded explicitly, so between phases every parameter is a shard
    for result in two_rank_results:
        assert result["gathered_after_no_grad"] == []


@pytest.mark.distributed
def test_two_rank_weight_push_gathers_shards_already_cast(two_rank_results):
    # fp32 masters to a bf16 engine: each shard is cast before the all-gather (half the bytes), and the
    # tensors pushed are the full fp32 ones cast to bf16
    for result in two_rank_results:
        sync = result["bf16_sync"]
        assert sync["gathered_dtypes"] == {torch.bfloat16} and sync["gathers"] == len(sync["state"])
        for name, tensor in result["state_dict"].items():
            assert sync["state"][name].dtype == torch.bfloat16, name
            assert torch.equal(sync["state"][name], tensor.to(torch.bfloat16)), name


def _rank0_build_job(rank: int, world_size: int, model_path: str) -> dict:
    """The worker's builder with rank 0's copy broadcast (rank 1 starts on the meta device) and with every
    rank reading the weights: actor (tied head, compiled decoder layers, the first recomputing its
    activations), critic (value head, CPU offload), actor with LoRA. Broadcast chunks of 1 MiB: the embedding travels in several, one across
    the shard boundary."""
    from torch.distributed.tensor import DTensor

    from mmrl.config import ActorModelConfig, LoraConfig
    from mmrl.models.token_scoring import EAGER_CHUNK_MATH, token_scoring_head
    from mmrl.workers import fsdp_engine
    from mmrl.workers.fsdp_workers import build_fsdp_model

    fsdp_engine.BROADCAST_CHUNK_BYTES = 1024**2

    results, digests, compiled, recomputing = {}, {}, {}, {}
    for label, role, lora in (("actor", "actor", None), ("critic", "critic", None), ("lora", "actor", 4)):
        for rank0_init in (True, False):
            torch.manual_seed(0)  # the adapter's initialisation
            model = build_fsdp_model(
                model_path,
                ActorModelConfig(
                    compile_layers=label == "actor",
                    compile_head=label == "actor",
                    gradient_checkpointing_layers=1 if label == "actor" else None,
                ),
                FSDPConfig(enable_cpu_offload=label == "critic"),
                role,
                torch.device("cpu"),
                trainable=True,
                trust_remote_code=False,
                padding_free=True,
                sequence_parallel=False,
                lora=LoraConfig(rank=lora) if lora else None,
                rank0_init=rank0_init,
                label_towers=lora is None,
            )
            digests[label, rank0_init] = [
                getattr(t, "_mmrl_weights_digest", None) for t in vision_modules(model)
            ]
            compiled[label, rank0_init] = [
                layer._compiled_call_impl is not None for layer in decoder_layers(model)
            ]
            head = token_scoring_head(model)  # none on the critic
            compiled[label, rank0_init].append(head is not None and head.chunk_math is not EAGER_CHUNK_MATH)
            recomputing[label, rank0_init] = [layer.gradient_checkpointing for layer in decoder_layers(model)]
            state = {  # adapters included
                name: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
                for name, tensor in model.state_dict().items()
            }
            buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
            results[label, rank0_init] = (state, buffers, _gathered_parameters(model))
    results["digests"], results["compiled"], results["recomputing"] = digests, compiled, recomputing
    return results


@pytest.mark.distributed
def test_two_rank_build_from_rank0_equals_every_rank_reading_the_weights(tiny_vl_path):
    results = run_on_ranks(_rank0_build_job, 2, str(tiny_vl_path))
    reference = load_model(str(tiny_vl_path)).state_dict()
    for label in ("actor", "critic", "lora"):
        for result in results:
            (state, buffers, gathered), (own_state, own_buffers, _) = (
                result[label, True],
                result[label, False],
            )
            assert gathered == []  # rank 1's meta parameters became real shards
            assert state.keys() == own_state.keys() and buffers.keys() == own_buffers.keys()
            for name, tensor in own_state.items():
                assert torch.equal(state[name], tensor), (label, name)
            for name, buffer in own_buffers.items():  # rotary frequencies are not in the state dict
                assert torch.equal(buffers[name], buffer), (label, name)
            if label == "actor":
                for name, tensor in state.items():
                    assert torch.equal(tensor, reference[name]), name
    # the towers' weight digests (mmrl.models.encoding_cache keys): rank 1's meta model gets rank 0's,
    # equal to every rank's own; actor and critic load the same tower
    digests = [result["digests"] for result in results]
    labelled = [digest for ranks in digests for key, digest in ranks.items() if key[0] != "lora"]
    assert len(labelled) == 8 and labelled[0][0] is not None and all(d == labelled[0] for d in labelled)
    assert all(ranks["lora", init] == [None] for ranks in digests for init in (True, False))
    # worker.actor.model.compile_layers and compile_head reach the built model: every decoder layer and
    # the log-prob head's chunk math compiled, sharded
    for result in results:
        for (label, _), layers in result["compiled"].items():
            assert layers == [label == "actor"] * len(layers) and layers, label
        # and gradient_checkpointing_layers: the actor's first decoder layer recomputes, the rest keep
        # their activations; without the count every layer recomputes
        for (label, _), layers in result["recomputing"].items():
            assert layers == (
                [True] + [False] * (len(layers) - 1) if label == "actor" else [True] * len(layers)
            )
    adapter = {name: tensor for name, tensor in results[1]["lora", True][0].items() if "lora_A" in name}
    assert adapter and all(tensor.abs().sum() > 0 for tensor in adapter.values())  # rank 0's random A


# ---------------------------------------------------------------- offload between phases


def test_phase_offload_parks_state_between_phases_and_changes_no_result():
    """Parameters and optimizer states sit in host memory between phases and on the device during one
    (on this CPU machine both are the host, so the moves are no-ops and ``offloaded`` is what shows);
    the steps equal those of a run that never offloads."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    inputs = torch.randn(8, 4, generator=torch.Generator().manual_seed(0)).to(device)
    weights = {}
    for offload_everything in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2).to(device)
        optimizer = build_optimizer(model.parameters(), lr=0.1, betas=(0.9, 0.99), weight_decay=0.01)
        offload = PhaseOffload(
            model, device, params=offload_everything, optimizer=optimizer, optimizer_state=offload_everything
        )
        offload.offload()
        for _ in range(2):
            if offload_everything:
                assert offload.offloaded
                assert all(p.device.type == "cpu" for p in model.parameters())
                moments = [t for state in optimizer.state.values() for k, t in state.items() if k != "step"]
                assert all(t.device.type == "cpu" for t in moments)
            with offload.loaded():
                assert not offload.offloaded and all(p.device == device for p in model.parameters())
                model(inputs).square().sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        assert offload.offloaded is offload_everything
        weights[offload_everything] = [p.detach().cpu() for p in model.parameters()]
    for offloaded, kept in zip(weights[True], weights[False]):
        torch.testing.assert_close(offloaded, kept, atol=0, rtol=0)
    with pytest.raises(ValueError, match="needs the optimizer"):
        PhaseOffload(model, device, params=False, optimizer_state=True)


def _critic_config(model_path: str, offload: bool, loss_avg_mode: str):
    from mmrl.config import (
        ActorConfig,
        ActorModelConfig,
        CriticConfig,
        DataConfig,
        OffloadConfig,
        PPOConfig,
        RolloutConfig,
        TrainerConfig,
        WorkerConfig,
    )

    critic = CriticConfig(
        global_batch_size=1,  # x rollout.n 4 = the 4 rows in one step
        micro_batch_size_per_device_for_update=2,
        loss_avg_mode=loss_avg_mode,
        cliprange_value=CRITIC_CLIP,
        offload=OffloadConfig(offload_params=offload, offload_optimizer=offload),
    )
    return PPOConfig(
        data=DataConfig(max_response_length=max(RESPONSE_LENGTHS)),
        worker=WorkerConfig(
            actor=ActorConfig(model=ActorModelConfig(model_path=model_path)),
            critic=critic,
            rollout=RolloutConfig(n=4),
        ),
        trainer=TrainerConfig(device="cpu", n_gpus_per_node=1),
    )


def _critic_role_job(rank: int, world_size: int, model_path: str, data: DataProto, runs: list) -> list:
    from mmrl.workers.fsdp_workers import CriticRole, setup_distributed

    device = setup_distributed()
    results = []
    for offload, mode in runs:
        config = _critic_config(model_path, offload, mode)
        worker = CriticRole(config, 1, device, sequence_parallel=None, model_path=model_path)
        offloaded = [worker.offload.offloaded]
        values = worker.compute_values(data).batch["values"]
        offloaded.append(worker.offload.offloaded)
        metrics = worker.update_critic(data).meta_info["metrics"]
        offloaded.append(worker.offload.offloaded)
        results.append(
            {
                "offloaded": offloaded,
                "values": values,
                "metrics": metrics,
                "state": _full_state(worker.critic.module),
            }
        )
    return results


@pytest.mark.distributed
def test_critic_role_offloads_between_phases_and_supports_every_loss_avg_mode(tiny_vl_path, vl_batch):
    """worker.critic.offload.* park the critic between its phases without changing a number; every
    worker.critic.loss_avg_mode trains, its vf_loss the mode's aggregate of the clipped value loss
    (hand-checked below from the values the worker computed before the step)."""
    from mmrl.core_algos import aggregate_loss, compute_value_loss

    modes = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
    runs = [(False, "token_mean"), *((True, mode) for mode in modes)]
    (results,) = run_on_ranks(_critic_role_job, 1, str(tiny_vl_path), vl_batch, runs, timeout_s=300)
    plain, offloaded = results[0], results[1]
    assert plain["offloaded"] == [False, False, False]
    assert offloaded["offloaded"] == [True, True, True]  # after start-up, after each phase
    torch.testing.assert_close(offloaded["values"], plain["values"], atol=0, rtol=0)
    _assert_states_close(offloaded["state"], plain["state"], atol=0)
    mask = vl_batch.batch["response_mask"]
    for (_, mode), result in zip(runs[1:], results[1:]):
        loss_mat, _ = compute_value_loss(
            result["values"], vl_batch.batch["returns"], vl_batch.batch["values"], mask, CRITIC_CLIP
        )
        expected = aggregate_loss(loss_mat, mask, mode, max_response_length=max(RESPONSE_LENGTHS))
        assert result["metrics"]["critic/vf_loss"] == pytest.approx(float(expected), rel=1e-4), mode
