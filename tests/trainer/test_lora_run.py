"""A LoRA run of the trainer: two FSDP2 workers train the actor's adapter, the reference is the same
model with the adapter switched off, the rollout gets the merged weights after every update, and the
checkpoint holds the adapter alone and merges into a Hugging Face folder."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from _trainer_run import REPO_ROOT, run_main, small_run_overrides
from torch.distributed.checkpoint import FileSystemReader


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_lora_run_trains_the_adapter_against_the_base_reference(tiny_vl_path, shapes_data_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    save_dir = tmp_path / "run"
    overrides = small_run_overrides(tiny_vl_path, shapes_data_dir, save_dir) + [
        "worker.actor.model.lora.rank=4",
        "worker.actor.model.lora.alpha=32",
        "worker.actor.model.lora.target_modules=q_proj,v_proj,qkv",
        "worker.actor.model.lora.exclude_modules=null",
        "algorithm.use_kl_loss=true",
        "algorithm.kl_coef=0.1",
        "worker.rollout.name=hf",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "trainer.save_freq=2",
    ]
    rows = [row for row in run_main(overrides, save_dir) if "actor/grad_norm" in row]
    assert len(rows) == 2
    assert all(row["rollout/log_prob_gap_max"] < 1e-5 for row in rows)  # merged weights pushed each step
    # step 1: the adapter starts as a no-op (B = 0), so policy and reference are the same model, exactly
    assert rows[0]["actor/kl_loss"] == 0.0 and rows[1]["actor/kl_loss"] > 0.0

    actor_dir = save_dir / "global_step_2" / "actor"
    keys = set(FileSystemReader(str(actor_dir / "model")).read_metadata().state_dict_metadata)
    assert keys and all(".lora_A." in key or ".lora_B." in key for key in keys)
    assert any(".visual." in key for key in keys)  # exclude_modules=null: the vision tower's qkv too
    assert json.loads((actor_dir / "mmrl_state.json").read_text())["lora"]["rank"] == 4

    merged_dir = tmp_path / "merged"
    subprocess.run(
        [
            sys.executable,
            "scripts/model_merger.py",
            "--local_dir",
            str(actor_dir),
            "--target_dir",
            str(merged_dir),
        ],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    merged = AutoModelForImageTextToText.from_pretrained(merged_dir, dtype=torch.float32).state_dict()
    base = AutoModelForImageTextToText.from_pretrained(tiny_vl_path, dtype=torch.float32).state_dict()
    changed = {key for key in base if not torch.equal(base[key], merged[key])}
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in changed
    assert "model.visual.blocks.0.attn.qkv.weight" in changed
    assert all(key.endswith(("q_proj.weight", "v_proj.weight", "qkv.weight")) for key in changed)
