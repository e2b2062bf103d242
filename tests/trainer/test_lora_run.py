"""A LoRA run of the trainer: two FSDP2 workers train the actor's adapter, the reference is the same
model with the adapter switched off, the rollout gets the merged weights after every update, and the
checkpoint holds the adapter alone and merges into a Hugging Face folder.

The run is also the trainer's multi-turn run (``worker.rollout.multi_turn`` with the demo's tool file,
``examples/tools/zoom_center.py``, which returns an image): the tiny model is first taught the call
format (a few seconds of supervised steps), so the rollouts call the tool and see its image
mid-trajectory; the metrics show the calls and the step trains on the model's tokens."""

from __future__ import annotations

import json
import sys

import _warm_start as warm
import pytest
import torch
from _trainer_run import REPO_ROOT, ZOOM_CENTER_TOOL, run_main, small_run_overrides
from torch.distributed.checkpoint import FileSystemReader

TOOL_FILE = ZOOM_CENTER_TOOL


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_lora_run_trains_the_adapter_against_the_base_reference_on_tool_trajectories(
    tool_calling_vl_path, shapes_data_dir, tmp_path
):
    from transformers import AutoModelForImageTextToText

    save_dir = tmp_path / "run"
    overrides = small_run_overrides(tool_calling_vl_path, shapes_data_dir, save_dir) + [
        "data.max_prompt_length=320",  # the tool's schema in the system prompt
        "data.max_response_length=96",  # a call (34 tokens), the tool turn with its image, the answer
        "worker.rollout.multi_turn.enable=true",
        f"worker.rollout.multi_turn.tools=[{TOOL_FILE}]",
        "worker.rollout.multi_turn.max_turns=2",
        # each trajectory's next turn as soon as its own call returned: the parity below holds for the
        # turns sampled in other batches than lockstep's
        "worker.rollout.multi_turn.turn_schedule=as_ready",
        "worker.actor.model.lora.rank=4",
        "worker.actor.model.lora.alpha=32",
        "worker.actor.model.lora.target_modules=q_proj,v_proj,qkv",
        "worker.actor.model.lora.exclude_modules=null",
        "worker.actor.optim.lr=0.002",  # the taught call survives the update (0.02 garbled every call)
        "algorithm.use_kl_loss=true",
        "algorithm.kl_coef=0.1",
        "worker.rollout.name=hf",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "trainer.save_freq=2",
    ]
    lines = run_main(overrides, save_dir)
    rows = [row for row in lines if "actor/grad_norm" in row]
    assert len(rows) == 2
    assert lines[-1]["val/agent/turns/mean"] >= 1  # the final validation's trajectories are logged
    # merged weights pushed each step (a stale push shows in step 2's gap); the trajectories' log-probs (tool
    # images mid-way, ~300-token prompts) as trained, within the prepacked rollout's tolerance
    # (tests/workers/rollout/test_hf_rollout.py): measured 4.5e-6 to 1.2e-5; 64-token prompts stay < 1e-5
    assert all(row["rollout/log_prob_gap_max"] < 1e-4 for row in rows)
    for row in rows:  # the rollouts called the tool, saw its image (observation tokens) and trained
        assert row.get("agent/tool_calls/zoom", 0) > 0 and row["agent/observation_tokens/mean"] > 0, row
        assert row["agent/turns/max"] == 2 and row["agent/errors/raised"] == 0
        assert 0 < row["response_length/model_tokens/mean"] < row["response_length/mean"]
        assert row["actor/grad_norm"] > 0
    # step 1: the adapter starts as a no-op (B = 0), so policy and reference are the same model, exactly
    assert rows[0]["actor/kl_loss"] == 0.0 and rows[1]["actor/kl_loss"] > 0.0

    actor_dir = save_dir / "global_step_2" / "actor"
    keys = set(FileSystemReader(str(actor_dir / "model")).read_metadata().state_dict_metadata)
    assert keys and all(".lora_A." in key or ".lora_B." in key for key in keys)
    assert any(".visual." in key for key in keys)  # exclude_modules=null: the vision tower's qkv too
    assert json.loads((actor_dir / "mmrl_state.json").read_text())["lora"]["rank"] == 4

    merged_dir = tmp_path / "merged"
    warm.run(
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
    base = AutoModelForImageTextToText.from_pretrained(tool_calling_vl_path, dtype=torch.float32).state_dict()
    changed = {key for key in base if not torch.equal(base[key], merged[key])}
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in changed
    assert "model.visual.blocks.0.attn.qkv.weight" in changed
    assert all(key.endswith(("q_proj.weight", "v_proj.weight", "qkv.weight")) for key in changed)
