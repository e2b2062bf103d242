"""The real job's shapes through the whole stack on this CPU machine: a Qwen2.5-VL with the 3B model's
widths and its 151,936-token vocabulary (2 decoder layers, 2 vision blocks, random weights), 448-pixel
JPEG images and 32-token responses (``bench/scale_smoke.py`` runs 1,024, the length its memory table
is about; here the image's ~290-token prompt and 32 response tokens still give every sequence two of
the head's 256-token chunks: 81 s instead of 106 s at 128 tokens), one GRPO step (generation, the
update that makes the AdamW moments, the weight sync after it: every phase whose memory is bounded;
the bench's second step adds nothing the small-width runs do not test) of an FSDP2 worker with bf16
compute (the dtype of a GPU job; fp32 on a CPU that emulates bf16, where two bf16 steps take over 14
minutes) and the chunked log-prob head. ``bench/scale.py``
reports the same run's peak memory per worker and phase; here the run must finish, train and stay
within its memory bounds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _trainer_run import run_main

from mmrl.demo.synthetic import write_photo_dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench/ holds scripts, not a package
from scale_smoke import native_bf16, real_shape_overrides  # noqa: E402

RESPONSE_TOKENS = 32


@pytest.mark.slow(seconds=300)
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_a_grpo_step_at_the_3b_widths_and_real_vocabulary(real_width_vl_path, tmp_path):
    data_dir = write_photo_dataset(tmp_path / "photos", n=2, size=448)
    save_dir = tmp_path / "run"
    overrides = real_shape_overrides(
        real_width_vl_path, data_dir, save_dir, response_tokens=RESPONSE_TOKENS, steps=1
    )
    assert "worker.actor.log_prob_chunk_tokens=256" in overrides
    rows = run_main(overrides, save_dir, timeout_s=850)
    steps = [row for row in rows if "actor/pg_loss" in row]
    assert [row["step"] for row in steps] == [1]
    for row in steps:
        assert row["response_length/mean"] == RESPONSE_TOKENS  # every response ran to its end
        assert row["prompt_length/mean"] > 256  # the image's 256 placeholders and the question
        assert row["actor/grad_norm"] > 0
        # the trainer's and the rollout's log-probs of the same tokens agree (bf16: to its rounding)
        assert row["rollout/log_prob_gap_mean"] < (0.1 if native_bf16() else 1e-3)
        # peak resident set per phase: the worker holds the fp32 weights, gradients and AdamW moments
        # (0.55B parameters: 8.8 GB), the bf16 rollout copy (1.1 GB) and, in the update, the gathered bf16
        # weights and their gradients (2.2 GB); the head's fp32 logits and log-softmax are bounded by
        # its 256-token chunks
        for phase in ("gen", "update_actor", "sync"):
            # (fp32 compute: the gathered weights, gradients and rollout copy twice as large, 3.3 GB more)
            bound = 14 if native_bf16() else 17.5
            assert 0.5 < row[f"memory/{phase}_peak_gib"] < bound, (phase, row[f"memory/{phase}_peak_gib"])
    # the updated weights were pushed to the rollout (their parity is tested at small widths)
    assert "timing_s/sync" in steps[0]
    # trainer.save_freq=0: no checkpoint, not even at the end (it would write 7.3 GB: 15 s here)
    assert sorted(path.name for path in save_dir.iterdir()) == ["logs"]
