"""A LoRA checkpoint holds the adapter and its optimizer state, resumes to the same training, merges
into base + (alpha / r) B @ A, and exports an adapter that PEFT loads to the same log-probs."""

from __future__ import annotations

import json

import pytest
import torch
from _batches import ACTOR_SETTINGS, TEMPERATURE, add_training_columns, build_batch, policy_actor
from _models import training_model
from torch.distributed.checkpoint import FileSystemReader

from mmrl.checkpoint.merger import export_adapter, merge_checkpoint
from mmrl.checkpoint.state import adapter_info, load_train_state, save_train_state
from mmrl.models.loading import load_model
from mmrl.models.lora import adapter_layers, apply_lora
from mmrl.workers.fsdp_engine import build_optimizer

RANK, ALPHA = 4, 8
ROWS = ({"image": (56, 56)}, {}, {"image": (84, 56)}, {})
RESPONSE_LENGTHS = (5, 3, 6, 4)


@pytest.fixture(scope="module")
def batch(tiny_vl_path):
    from transformers import AutoProcessor

    raw = build_batch(AutoProcessor.from_pretrained(tiny_vl_path), ROWS, RESPONSE_LENGTHS, seed=4)
    return add_training_columns(raw, str(tiny_vl_path))


def _lora_actor(path, seed: int):
    torch.manual_seed(seed)  # PEFT draws A at random
    model = training_model(path)
    apply_lora(model, RANK, ALPHA, "all-linear", r".*visual.*")
    optimizer = build_optimizer(model.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)
    return policy_actor(model, optimizer, **ACTOR_SETTINGS)


def _step(actor, batch) -> None:
    actor.update_policy(batch, len(batch), 2, 1, TEMPERATURE)


def _adapter_state(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}


@pytest.fixture(scope="module")
def saved(tiny_vl_path, batch, tmp_path_factory):
    """Two steps, a save, then a third step: the uninterrupted run the resumed one must match."""
    actor = _lora_actor(tiny_vl_path, seed=0)
    _step(actor, batch)
    _step(actor, batch)
    directory = tmp_path_factory.mktemp("lora-ckpt") / "actor"
    modules = [name for name, _ in adapter_layers(actor.module)]
    info = adapter_info(RANK, ALPHA, modules, str(tiny_vl_path))
    save_train_state(directory, actor.module, actor.optimizer, hf_source_dir=str(tiny_vl_path), adapter=info)
    at_save = _adapter_state(actor.module)
    _step(actor, batch)
    return {"dir": directory, "at_save": at_save, "after": _adapter_state(actor.module), "modules": modules}


def test_checkpoint_holds_the_adapter_alone(saved):
    model_keys = set(FileSystemReader(str(saved["dir"] / "model")).read_metadata().state_dict_metadata)
    assert model_keys == set(saved["at_save"])  # lora_A / lora_B only: no base weights
    optimizer_keys = FileSystemReader(str(saved["dir"] / "optimizer")).read_metadata().state_dict_metadata
    assert {
        key.split(".", 1)[1].rsplit(".", 1)[0] for key in optimizer_keys if key.startswith("state.")
    } == set(saved["at_save"])
    info = json.loads((saved["dir"] / "mmrl_state.json").read_text())
    assert info["lora"]["rank"] == RANK and sorted(info["lora"]["modules"]) == sorted(saved["modules"])
    assert not any(".visual." in name for name in info["lora"]["modules"])


def test_resume_continues_exactly(tiny_vl_path, batch, saved):
    actor = _lora_actor(tiny_vl_path, seed=1)  # another random A: the load must replace it
    load_train_state(saved["dir"], actor.module, actor.optimizer)
    for name, tensor in _adapter_state(actor.module).items():
        assert torch.equal(tensor, saved["at_save"][name]), name
    _step(actor, batch)
    for name, tensor in _adapter_state(actor.module).items():
        assert torch.equal(tensor, saved["after"][name]), name


def test_a_full_model_refuses_a_lora_checkpoint(tiny_vl_path, saved):
    with pytest.raises(ValueError, match="holds a LoRA adapter on 14 modules"):
        load_train_state(saved["dir"], training_model(tiny_vl_path))


def test_merge_adds_the_scaled_adapter_to_the_base(tiny_vl_path, saved, tmp_path):
    from safetensors.torch import load_file

    target = merge_checkpoint(saved["dir"], tmp_path / "merged")
    merged = load_file(str(target / "model.safetensors"))
    base = load_model(str(tiny_vl_path)).state_dict()
    name = "model.language_model.layers.0.self_attn.q_proj"
    a, b = (
        saved["at_save"][f"{name}.lora_A.default.weight"],
        saved["at_save"][f"{name}.lora_B.default.weight"],
    )
    expected = base[f"{name}.weight"] + (ALPHA / RANK) * b @ a
    torch.testing.assert_close(merged["model.layers.0.self_attn.q_proj.weight"], expected, rtol=0, atol=1e-7)
    torch.testing.assert_close(
        merged["visual.blocks.0.attn.qkv.weight"], base["model.visual.blocks.0.attn.qkv.weight"]
    )
    assert (target / "tokenizer.json").is_file()


def test_exported_adapter_loads_in_peft_with_the_same_log_probs(tiny_vl_path, batch, saved, tmp_path):
    from peft import PeftModel

    from mmrl.models.prepare import prepare_for_training

    target = export_adapter(saved["dir"], tmp_path / "adapter")
    assert {path.name for path in target.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    peft_model = PeftModel.from_pretrained(load_model(str(tiny_vl_path)), str(target))
    model = prepare_for_training(peft_model.merge_and_unload(), packing=True, score_tokens=True)
    trained = _lora_actor(tiny_vl_path, seed=2)
    load_train_state(saved["dir"], trained.module)
    expected, _ = trained.compute_log_probs(batch, 2, TEMPERATURE)
    log_probs, _ = policy_actor(model).compute_log_probs(batch, 2, TEMPERATURE)
    mask = batch.batch["response_mask"].bool()
    assert (log_probs - expected).abs()[mask].max() < 1e-5
