"""The helpers of the ``bench/`` scripts that parse and aggregate results (no timing is tested here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH_DIR))  # bench/ holds scripts, not a package

import harness  # noqa: E402


def _mmrl_line(step: int, step_s: float, gen_s: float, prompt_len: float, response_len: float) -> dict:
    return {
        "step": step,
        "timing_s/step": step_s,
        "timing_s/gen": gen_s,
        "prompt_length/mean": prompt_len,
        "response_length/mean": response_len,
    }


def test_mmrl_step_records_skip_validation_only_lines():
    records = [
        {"step": 0, "val/reward/accuracy": 0.25},  # validation before training: no step timing
        _mmrl_line(1, 2.0, 0.5, 40.0, 64.0),
    ]
    steps = harness.mmrl_step_records(records, responses_per_step=8)
    assert steps == [
        {"step": 1, "step_s": 2.0, "gen_s": 0.5, "prompt_tokens": 320.0, "response_tokens": 512.0}
    ]


def test_summarize_steps_medians_after_warmup():
    steps = [
        {"step": 1, "step_s": 100.0, "gen_s": 99.0, "prompt_tokens": 10, "response_tokens": 30},  # warm-up
        {"step": 2, "step_s": 2.0, "gen_s": 1.0, "prompt_tokens": 10, "response_tokens": 30},
        {"step": 3, "step_s": 4.0, "gen_s": 1.5, "prompt_tokens": 10, "response_tokens": 30},
        {"step": 4, "step_s": 3.0, "gen_s": 2.0, "prompt_tokens": 10, "response_tokens": 30},
    ]
    summary = harness.summarize_steps(steps, warmup=1)
    assert summary["timed_steps"] == 3
    assert summary["s_per_step"] == 3.0
    assert summary["gen_s"] == 1.5
    # rollout: 30 / gen s = 30, 20, 15 -> 20; training: 40 / (step - gen) s = 40, 16, 40 -> 40
    assert summary["rollout_tokens_per_s"] == pytest.approx(20.0)
    assert summary["train_tokens_per_s"] == pytest.approx(40.0)
    assert summary["tokens_per_s"] == pytest.approx(40 / 3.0)
    with pytest.raises(ValueError, match="no step after"):
        harness.summarize_steps(steps[:1], warmup=1)


def test_validation_and_time_to_target():
    records = [
        {"step": 0, "val_accuracy": 0.25, "_time_s": 10.0},
        {"step": 1, "step_s": 1.0},
        {"step": 2, "step_s": 2.0},
        {"step": 2, "val_accuracy": 0.8125, "_time_s": 20.0},
        {"step": 3, "step_s": 4.0},
    ]
    validations = harness.validation_records(records, "val_accuracy")
    assert [v["step"] for v in validations] == [0, 2]
    hit = harness.first_reaching(validations, 0.8)
    assert hit == {"step": 2, "accuracy": 0.8125, "time_s": 20.0}
    assert harness.first_reaching(validations, 0.9) is None
    assert harness.training_seconds_until(harness.trl_step_records(records), hit["step"]) == 3.0


def test_log_follower_waits_for_complete_lines(tmp_path):
    log = tmp_path / "metrics.jsonl"
    follower = harness._LogFollower(log)
    assert follower.new_records() == []  # not written yet
    log.write_text(json.dumps({"step": 1}) + "\n" + '{"step": ')
    assert follower.new_records() == [{"step": 1}]
    with open(log, "a") as handle:
        handle.write("2}\n")
    assert follower.new_records() == [{"step": 2}]


def test_markdown_table():
    assert harness.markdown_table(["a", "b"], [[1, "x"]]) == "| a | b |\n|---|---|\n| 1 | x |"


def test_mmrl_command_is_a_valid_config(tmp_path):
    """The overrides the benches pass are keys mmrl accepts, with the meanings intended."""
    from mmrl.config.loading import load_config

    model, data = tmp_path / "model", tmp_path / "data"
    model.mkdir()
    data.mkdir()
    for split in ("train", "val"):
        (data / f"{split}.jsonl").write_text("")
    job = harness.JobSettings(
        model=str(model), data_dir=str(data), prompts=8, n=4, response_length=64, force_length=True,
        micro_batch=16, lr=1e-4, steps=6, updates_per_rollout=2, val_every=5,
    )  # fmt: skip
    command, log = harness.mmrl_command(job, "vllm", tmp_path / "run")
    assert command[1:3] == ["-m", "mmrl.trainer.main"]
    assert log == tmp_path / "run" / "logs" / "metrics.jsonl"
    config = load_config(command[3:])
    assert config.responses_per_step == 32
    assert config.worker.actor.global_batch_size == 4  # two optimizer steps per rollout
    assert config.worker.rollout.ignore_eos and config.worker.rollout.name == "vllm"
    assert config.algorithm.disable_kl and config.trainer.world_size == 1
    assert config.trainer.val_freq == 5 and config.data.val_files.endswith("val.jsonl")
    assert config.worker.rollout.sampling_for_validation()["temperature"] == 0


def test_colocated_critic_command_is_a_gae_run_on_two_ranks(tmp_path):
    import colocated_critic

    from mmrl.config.loading import load_config

    model, data = tmp_path / "model", tmp_path / "data"
    model.mkdir()
    data.mkdir()
    (data / "train.jsonl").write_text("")
    command = colocated_critic.gae_command(str(model), str(data), tmp_path / "run", steps=3)
    config = load_config(command[3:])
    assert config.use_critic and config.trainer.world_size == 2 and config.trainer.max_steps == 3
    assert colocated_critic.format_table([]).count("|") == 16  # header and rule lines of 7 columns


def test_run_monitored_counts_processes_by_label_and_runs_in_cwd(tmp_path):
    child = "import time; time.sleep(1.5)"
    script = (
        f"import os, subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}]); print(os.getcwd())"
    )
    result = harness.run_monitored(
        [sys.executable, "-c", script],
        tmp_path / "log.jsonl",
        tmp_path / "out.txt",
        timeout_s=60,
        cwd=tmp_path,
    )
    assert result.returncode == 0
    assert (tmp_path / "out.txt").read_text().strip() == str(tmp_path)
    assert sum(result.process_counts.values()) == 2  # the script and its child, sampled while both ran


def test_trl_command_counts_rollouts():
    job = harness.JobSettings(
        model="m", data_dir="d", prompts=16, n=8, response_length=4, force_length=False,
        micro_batch=16, lr=5e-4, steps=60, updates_per_rollout=4, val_every=5,
    )  # fmt: skip
    command = harness.trl_command(job, Path("log.jsonl"), threads=2)
    assert "--steps=60" in command and "--updates_per_rollout=4" in command and "--val_every=5" in command
    assert "--force_length" not in command


def test_vs_trl_runner_order_alternates():
    import vs_trl

    assert vs_trl.runner_order(["hf", "vllm"], 0) == ["mmrl-hf", "trl", "mmrl-vllm"]
    assert vs_trl.runner_order(["hf", "vllm"], 1) == ["mmrl-vllm", "trl", "mmrl-hf"]
    assert vs_trl.runner_order(["hf"], 0) == ["mmrl-hf", "trl"]


def test_update_flops_by_hand():
    import gpu_mfu

    text = {"hidden_size": 4, "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 1, "vocab_size": 10}  # fmt: skip
    # head_dim 2, kv width 2. Per token and layer: q, o 2*4*4 each, k, v 2*4*2 each -> 96; MLP 2*3*4*8 = 192
    # attention of one sequence of 3 tokens: 2*2*4 * (1+2+3) = 96 per layer; head: 2*4*10 per response token
    expected_forward = 2 * (3 * (96 + 192) + 96) + 2 * 4 * 10 * 2
    assert gpu_mfu.forward_flops(text, [3], response_tokens=2) == expected_forward
    assert gpu_mfu.update_flops(text, [3], response_tokens=2) == 3 * expected_forward
    assert gpu_mfu.peak_tflops("NVIDIA H100 80GB HBM3", None) == 989.4
    assert gpu_mfu.peak_tflops("Some GPU", 100.0) == 100.0
    assert gpu_mfu.peak_tflops("Some GPU", None) is None


def test_cut_responses_masks_after_each_length():
    import cost_curves
    import torch

    from mmrl.protocol import DataProto

    responses = torch.tensor([[5, 6, 7], [8, 9, 10]])
    batch = DataProto.from_dict(
        tensors={
            "responses": responses.clone(),
            "response_mask": torch.ones(2, 3, dtype=torch.long),
            "input_ids": torch.cat([torch.tensor([[1], [2]]), responses], dim=1),
            "attention_mask": torch.ones(2, 4, dtype=torch.long),
        }
    )
    cut = cost_curves.cut_responses(batch, [1, 3], pad_token_id=0)
    assert cut.batch["response_mask"].tolist() == [[1, 0, 0], [1, 1, 1]]
    assert cut.batch["responses"].tolist() == [[5, 0, 0], [8, 9, 10]]
    assert cut.batch["attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert cut.batch["input_ids"].tolist() == [[1, 5, 0, 0], [2, 8, 9, 10]]


def test_scale_memory_batch_is_one_prompt_and_one_full_response(tiny_vl_path):
    import scale_memory

    batch = scale_memory._batch(tiny_vl_path, 5)
    tensors = batch.batch
    prompt_length = tensors["prompts"].shape[1]
    assert tensors["input_ids"].shape == (1, prompt_length + 5)
    assert tensors["attention_mask"].all() and tensors["response_mask"].sum() == 5
    assert tensors["input_ids"][:, -5:].equal(tensors["responses"])


def test_scale_memory_table_rows():
    import scale_memory

    side = {"peak_mb": 3505.2, "added_mb": 1192.4, "tokens_s": 43.1}
    rows = [{"phase": "log_prob", "length": 512, "before": side, "after": {**side, "added_mb": 695.0}}]
    table = scale_memory.format_table(rows)
    assert "| log_prob | 512 | 3505 | 3505 | 1192 | 695 | 43 | 43 |" in table
