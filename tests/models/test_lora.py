"""LoRA on the policy: the adapted model computes what its merged weights compute, the reference is
the base model with the adapter switched off, an update trains the adapter alone, and the weights a
rollout engine receives are the merged ones under the plain model's names."""

from __future__ import annotations

import pytest
import torch
from _batches import ACTOR_SETTINGS, TEMPERATURE, add_training_columns, build_batch, policy_actor
from _models import training_model

from mmrl.models.lora import adapter_layers, adapters_disabled, apply_lora, lora_target_names
from mmrl.workers.fsdp_engine import build_optimizer
from mmrl.workers.weight_sync import iter_full_state_dict, load_into

RANK, ALPHA = 4, 8  # scale alpha / rank = 2
ROWS = ({"image": (56, 56)}, {}, {"image": (84, 56)}, {})
RESPONSE_LENGTHS = (5, 3, 6, 4)


@pytest.fixture(scope="module")
def batch(tiny_vl_path):
    from transformers import AutoProcessor

    raw = build_batch(AutoProcessor.from_pretrained(tiny_vl_path), ROWS, RESPONSE_LENGTHS, seed=3)
    return add_training_columns(raw, str(tiny_vl_path))


def lora_model(path, seed: int = 0, target_modules: str = "all-linear", exclude_modules: str | None = None):
    """The tiny model with an adapter whose B is non-zero (PEFT starts it at 0: a no-op adapter)."""
    model = training_model(path)
    apply_lora(model, RANK, ALPHA, target_modules, exclude_modules)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, layer in adapter_layers(model):
            weight = layer.lora_B["default"].weight
            weight.copy_(0.05 * torch.randn(weight.shape, generator=generator))
    return model


def test_targets_every_linear_layer_but_the_output_head(tiny_vl_path):
    model = training_model(tiny_vl_path)
    names = lora_target_names(model, "all-linear", None)
    assert "lm_head" not in names
    assert any(".visual." in name for name in names)  # the vision tower too, unless excluded
    assert "model.language_model.layers.0.self_attn.q_proj" in names
    text_only = lora_target_names(model, "all-linear", r".*visual.*")
    assert text_only == [name for name in names if ".visual." not in name]
    assert lora_target_names(model, "q_proj, v_proj", None) == [
        f"model.language_model.layers.{layer}.self_attn.{proj}"
        for layer in (0, 1)
        for proj in ("q_proj", "v_proj")
    ]
    with pytest.raises(
        ValueError, match=r"worker.actor.model.lora.target_modules: \['qproj'\] match no.*q_proj"
    ):
        lora_target_names(model, "q_proj,qproj", None)
    with pytest.raises(ValueError, match=r"\['lm_head'\] match no linear layer"):
        lora_target_names(model, "lm_head", None)
    with pytest.raises(ValueError, match="excludes every module"):
        lora_target_names(model, "qkv", r".*visual.*")


def test_lora_log_probs_equal_the_merged_models(tiny_vl_path, batch):
    model = lora_model(tiny_vl_path)
    merged_state = dict(iter_full_state_dict(model))
    plain = training_model(tiny_vl_path)
    assert set(merged_state) == set(dict(iter_full_state_dict(plain)))  # plain names, no adapter tensors
    layer = model.get_submodule("model.language_model.layers.1.mlp.down_proj")
    expected = layer.base_layer.weight + 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(merged_state["model.language_model.layers.1.mlp.down_proj.weight"], expected)
    load_into(plain, merged_state.items())

    lora_log_probs, _ = policy_actor(model).compute_log_probs(batch, 2, TEMPERATURE)
    merged_log_probs, _ = policy_actor(plain).compute_log_probs(batch, 2, TEMPERATURE)
    mask = batch.batch["response_mask"].bool()
    assert (lora_log_probs - merged_log_probs).abs()[mask].max() < 1e-5
    base_log_probs, _ = policy_actor(training_model(tiny_vl_path)).compute_log_probs(batch, 2, TEMPERATURE)
    assert (lora_log_probs - base_log_probs).abs()[mask].max() > 1e-2  # the adapter matters


def test_ref_is_the_base_model_under_disabled_adapters(tiny_vl_path, batch):
    model = lora_model(tiny_vl_path)
    actor = policy_actor(model)
    adapted, _ = actor.compute_log_probs(batch, 2, TEMPERATURE)
    with adapters_disabled(model):
        ref, _ = actor.compute_log_probs(batch, 2, TEMPERATURE)
    base, _ = policy_actor(training_model(tiny_vl_path)).compute_log_probs(batch, 2, TEMPERATURE)
    assert torch.equal(ref, base)
    again, _ = actor.compute_log_probs(batch, 2, TEMPERATURE)  # switched back on after the block
    assert torch.equal(again, adapted)
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


def test_an_update_trains_the_adapter_alone(tiny_vl_path, batch):
    model = training_model(tiny_vl_path)
    apply_lora(model, RANK, ALPHA, "all-linear", None)  # B = 0, as a run starts
    optimizer = build_optimizer(model.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    optimized = {id(param) for group in optimizer.param_groups for param in group["params"]}
    assert optimized == {id(param) for name, param in model.named_parameters() if name in trainable}
    before = {name: param.detach().clone() for name, param in model.named_parameters()}

    actor = policy_actor(model, optimizer, **ACTOR_SETTINGS)
    # two steps: with B = 0 the first step's gradient reaches B alone (dL/dA = B^T dL/d(xA^T B^T) = 0)
    assert actor.update_policy(batch, len(batch), 2, 2, TEMPERATURE).metrics["grad_norm"] > 0
    for name, param in model.named_parameters():
        if name in trainable:
            assert not torch.equal(param, before[name]), f"{name} did not train"  # vision tower's too
        else:
            assert torch.equal(param, before[name]), f"frozen {name} changed"


def test_glm4v_adapter_reaches_its_layers_and_equals_its_merged_weights(tiny_glm4v_path):
    """GLM-4.1V's linear layers (fused gate-up MLP, q/k/v with biases, the vision tower's qkv) take an
    adapter; the adapted model computes what its merged weights do, on image and video rows."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_glm4v_path)
    rows = ({"image": (56, 56)}, {}, {"video_frames": 4, "video_fps": 2.0}, {"image": (84, 56)})
    batch = build_batch(processor, rows, RESPONSE_LENGTHS, seed=3)
    names = lora_target_names(training_model(tiny_glm4v_path), "all-linear", None)
    for name in ("model.language_model.layers.0.mlp.gate_up_proj", "model.language_model.layers.1.self_attn.k_proj",
                 "model.visual.blocks.0.attn.qkv", "model.visual.merger.proj"):  # fmt: skip
        assert name in names, name
    model = lora_model(tiny_glm4v_path)
    plain = training_model(tiny_glm4v_path)
    load_into(plain, iter_full_state_dict(model))
    mask = batch.batch["response_mask"].bool()
    lora_log_probs, _ = policy_actor(model).compute_log_probs(batch, 2, TEMPERATURE)
    merged_log_probs, _ = policy_actor(plain).compute_log_probs(batch, 2, TEMPERATURE)
    assert (lora_log_probs - merged_log_probs).abs()[mask].max() < 1e-5
    base_log_probs, _ = policy_actor(training_model(tiny_glm4v_path)).compute_log_probs(batch, 2, TEMPERATURE)
    assert (lora_log_probs - base_log_probs).abs()[mask].max() > 1e-2  # the adapter matters


QWEN3_5_ADAPTED = (
    "layers.0.linear_attn.in_proj_qkv",
    "layers.0.linear_attn.out_proj",
    "layers.1.self_attn.q_proj",
)


@pytest.mark.parametrize(
    ("fixture", "adapted", "not_adapted"),
    [("tiny_qwen3_5_path", (*QWEN3_5_ADAPTED, "layers.0.mlp.gate_proj"), ()),
     # the MoE's shared expert is a dense MLP; its router and 3-D routed experts are no linear layers
     ("tiny_qwen3_5_moe_path", (*QWEN3_5_ADAPTED, "layers.0.mlp.shared_expert.gate_proj"),
      ("layers.0.mlp.gate", "layers.0.mlp.experts"))],
)  # fmt: skip
def test_qwen3_5_adapter_reaches_its_linear_attention_and_equals_its_merged_weights(
    request, fixture, adapted, not_adapted
):
    """Qwen3.5's gated delta net projections (dense and MoE) take an adapter like the attention and MLP
    layers; the adapted model computes what its merged weights do (packed rows, prompts not shared)."""
    from transformers import AutoProcessor

    tiny_qwen3_5_path = request.getfixturevalue(fixture)
    batch = build_batch(AutoProcessor.from_pretrained(tiny_qwen3_5_path), ROWS, RESPONSE_LENGTHS, seed=3)
    names = lora_target_names(training_model(tiny_qwen3_5_path), "all-linear", None)
    for name in adapted:
        assert f"model.language_model.{name}" in names, name
    for name in not_adapted:
        assert f"model.language_model.{name}" not in names, name
    model = lora_model(tiny_qwen3_5_path)
    plain = training_model(tiny_qwen3_5_path)
    load_into(plain, iter_full_state_dict(model))
    mask = batch.batch["response_mask"].bool()
    lora_log_probs, _ = policy_actor(model, share_prompts=False).compute_log_probs(batch, 2, TEMPERATURE)
    merged_log_probs, _ = policy_actor(plain, share_prompts=False).compute_log_probs(batch, 2, TEMPERATURE)
    assert (lora_log_probs - merged_log_probs).abs()[mask].max() < 1e-5
    base = training_model(tiny_qwen3_5_path)
    base_log_probs, _ = policy_actor(base, share_prompts=False).compute_log_probs(batch, 2, TEMPERATURE)
    assert (lora_log_probs - base_log_probs).abs()[mask].max() > 1e-2  # the adapter matters


def test_qwen3_omni_adapter_reaches_its_towers_and_equals_its_merged_weights(tiny_qwen3_omni_path):
    """Qwen3-Omni's linear layers (attention, the audio tower's, the vision tower's qkv) take an adapter,
    its fused experts (3-D parameters) and routers none; the adapted model computes what its merged
    weights do, on audio, image + audio and video-with-its-sound rows."""
    from transformers import AutoProcessor

    rows = (
        {"audio_s": 1.0},
        {},
        {"image": (64, 64), "audio_s": 0.5},
        {"video_frames": 4, "audio_s": 2.0, "audio_in_video": True},
    )
    batch = build_batch(AutoProcessor.from_pretrained(tiny_qwen3_omni_path), rows, RESPONSE_LENGTHS, seed=3)
    names = lora_target_names(training_model(tiny_qwen3_omni_path), "all-linear", None)
    for name in ("model.layers.0.self_attn.q_proj", "audio_tower.layers.0.self_attn.k_proj", "audio_tower.proj2",
                 "visual.blocks.0.attn.qkv"):  # fmt: skip
        assert name in names, name
    assert not any(
        ".mlp." in name and "visual" not in name for name in names
    )  # experts, routers: not nn.Linear
    model = lora_model(tiny_qwen3_omni_path)
    plain = training_model(tiny_qwen3_omni_path)
    load_into(plain, iter_full_state_dict(model))
    mask = batch.batch["response_mask"].bool()
    lora_log_probs, _ = policy_actor(model).compute_log_probs(batch, 2, TEMPERATURE)
    merged_log_probs, _ = policy_actor(plain).compute_log_probs(batch, 2, TEMPERATURE)
    assert (lora_log_probs - merged_log_probs).abs()[mask].max() < 1e-5
    base_log_probs, _ = policy_actor(training_model(tiny_qwen3_omni_path)).compute_log_probs(
        batch, 2, TEMPERATURE
    )
    assert (lora_log_probs - base_log_probs).abs()[mask].max() > 1e-2  # the adapter matters


def test_qwen3_vl_moe_adapter_reaches_its_attention_and_equals_its_merged_weights(tiny_qwen3_vl_moe_path):
    """Qwen3-VL MoE's attention and vision tower take an adapter; its routers and fused experts (3-D
    parameters) none, and stay trainable in full; the adapted model computes what its merged weights do
    on image and text rows."""
    from transformers import AutoProcessor

    path = tiny_qwen3_vl_moe_path
    batch = build_batch(AutoProcessor.from_pretrained(path), ROWS, RESPONSE_LENGTHS, seed=3)
    names = lora_target_names(training_model(path), "all-linear", None)
    for name in ("model.language_model.layers.0.self_attn.q_proj", "model.visual.blocks.0.attn.qkv"):
        assert name in names, name
    assert not any(".mlp.gate" in name or ".mlp.experts" in name for name in names)
    model = lora_model(path)
    plain = training_model(path)
    load_into(plain, iter_full_state_dict(model))
    mask = batch.batch["response_mask"].bool()
    lora_log_probs, _ = policy_actor(model).compute_log_probs(batch, 2, TEMPERATURE)
    merged_log_probs, _ = policy_actor(plain).compute_log_probs(batch, 2, TEMPERATURE)
    assert (lora_log_probs - merged_log_probs).abs()[mask].max() < 1e-5
    base_log_probs, _ = policy_actor(training_model(path)).compute_log_probs(batch, 2, TEMPERATURE)
    assert (lora_log_probs - base_log_probs).abs()[mask].max() > 1e-2  # the adapter matters
