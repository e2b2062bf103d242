"""A Qwen3.5 run of the trainer (2 steps, two FSDP2 workers, the transformers rollout, prompts not
shared: the linear-attention layers run each packed sequence alone); the checkpoint merges into a
Hugging Face folder that loads back with every tensor trained."""

from __future__ import annotations

import pytest
import torch
from _trainer_run import merged_and_base, run_main, small_run_overrides


@pytest.mark.slow(seconds=80)
@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_qwen3_5_trains_two_steps_with_parity_and_merges(tiny_qwen3_5_path, shapes_data_dir, tmp_path):

    save_dir = tmp_path / "run"
    overrides = small_run_overrides(tiny_qwen3_5_path, shapes_data_dir, save_dir) + [
        "worker.rollout.name=hf",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
        "trainer.save_freq=2",
    ]
    rows = [row for row in run_main(overrides, save_dir) if "actor/grad_norm" in row]
    assert len(rows) == 2
    for row in rows:
        assert row["rollout/log_prob_gap_max"] < 1e-4  # rollout (cached recurrence) and trainer agree
        assert row["actor/grad_norm"] > 0

    merged_dir = tmp_path / "merged"
    merged, base = merged_and_base(save_dir / "global_step_2" / "actor", merged_dir, tiny_qwen3_5_path)
    assert merged.keys() == base.keys()
    for key in (
        "layers.0.linear_attn.in_proj_qkv.weight",
        "layers.0.linear_attn.A_log",
        "layers.1.self_attn.q_proj.weight",
    ):
        name = f"model.language_model.{key}"
        assert not torch.equal(merged[name], base[name]), name
