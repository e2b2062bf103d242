"""Config merging (defaults ← YAML ← CLI), validation and every user-error path."""

from __future__ import annotations

import dataclasses
import difflib
import glob
import importlib.util
import os
import re
import sys
import textwrap

import _warm_start as warm
import pytest
import yaml

from mmrl.config import PPOConfig, split_dataset_spec, split_function_spec
from mmrl.config.loading import ConfigError, config_to_yaml, load_config, schema_keys
from mmrl.data.config import DataConfig
from mmrl.trainer.step_plan import StepPlan

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def run_files(tmp_path):
    """Files a valid run points at: data, model folder, reward file, template."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"problem": "1+1?", "answer": "2"}\n')
    model = write_model_config(tmp_path / "model", heads=28, kv_heads=4)  # Qwen2.5-VL-7B's decoder
    reward = tmp_path / "reward.py"
    reward.write_text("def compute_score(inputs):\n    return [{'overall': 1.0} for _ in inputs]\n")
    template = tmp_path / "t.jinja"
    template.write_text("{{ content }}")
    return {
        "data": str(data),
        "model": str(model),
        "reward": f"{reward}:compute_score",
        "template": str(template),
    }


def write_model_config(folder, heads: int, kv_heads: int):
    """A Qwen2.5-VL config.json (no weights) whose text decoder has ``heads`` / ``kv_heads`` heads."""
    from transformers import AutoConfig

    text = {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "hidden_size": 128 * heads}
    AutoConfig.for_model("qwen2_5_vl", text_config=text).save_pretrained(folder)
    return folder


def valid_args(files, *extra):
    return [
        f"data.train_files={files['data']}",
        f"worker.actor.model.model_path={files['model']}",
        f"worker.reward.reward_function={files['reward']}",
        "data.rollout_batch_size=8",
        "worker.actor.global_batch_size=4",
        "worker.actor.micro_batch_size_per_device_for_update=2",
        "trainer.n_gpus_per_node=2",
        *extra,
    ]


def errors_of(args) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(args)
    return info.value.errors


def test_command_line_overrides_merge_in_order(run_files):
    """The command line's overrides merge as one layer (one copy of the tree, not one per override):
    a later override of a key still wins, a dict-valued one merges with the keys set before it."""
    cfg = load_config(
        valid_args(
            run_files,
            "worker.rollout.n=3",
            "worker.rollout.temperature=0.5",
            "worker.rollout.n=5",
            "worker.reward.reward_function_kwargs.a=1",
            "worker.reward.reward_function_kwargs={b: 2}",
        )
    )
    assert (cfg.worker.rollout.n, cfg.worker.rollout.temperature) == (5, 0.5)
    assert cfg.worker.reward.reward_function_kwargs == {"a": 1, "b": 2}


def test_defaults_merge_yaml_then_cli(tmp_path, run_files):
    config_file = tmp_path / "run.yaml"
    config_file.write_text("worker:\n  rollout:\n    n: 4\n    temperature: 0.7\ntrainer:\n  max_steps: 9\n")
    cfg = load_config([f"config={config_file}", *valid_args(run_files, "worker.rollout.n=6")])
    assert cfg.worker.rollout.n == 6  # CLI beats YAML
    assert cfg.worker.rollout.temperature == 0.7  # YAML beats default
    assert cfg.worker.rollout.top_p == 1.0  # default kept
    assert cfg.trainer.max_steps == 9
    assert isinstance(cfg, PPOConfig)


def test_config_is_frozen_after_load(run_files):
    cfg = load_config(valid_args(run_files))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.worker.actor.global_batch_size = 1  # type: ignore[misc]


def test_relative_paths_become_absolute(tmp_path, run_files, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(
        valid_args(
            run_files,
            "data.train_files=train.jsonl@train",
            "worker.reward.reward_function=reward.py",
            "data.format_prompt=t.jinja",
        )
    )
    assert cfg.data.train_files == f"{tmp_path}/train.jsonl@train"
    assert cfg.worker.reward.reward_function == f"{tmp_path}/reward.py:main"  # EasyR1's default name
    assert cfg.data.format_prompt == f"{tmp_path}/t.jinja"


def test_printed_config_is_what_runs(tmp_path, run_files):
    cfg = load_config(valid_args(run_files, "worker.rollout.val_override_config.temperature=0"))
    printed = tmp_path / "printed.yaml"
    printed.write_text(config_to_yaml(cfg))
    assert load_config([f"config={printed}"]) == cfg


def test_unknown_keys_all_reported_with_suggestions(run_files):
    errors = errors_of(
        valid_args(run_files, "data.max_pixel=3", "worker.rollout.tempreature=1", "trainer.zzz=1")
    )
    assert len(errors) == 3
    assert "unknown key 'data.max_pixel'" in errors[0] and "'data.max_pixels'" in errors[0]
    assert "'worker.rollout.temperature'" in errors[1]
    assert "examples/config.yaml" in errors[2]


def test_unknown_section_key_in_yaml_names_the_file(tmp_path, run_files):
    config_file = tmp_path / "bad.yaml"
    config_file.write_text("worker:\n  actr:\n    global_batch_size: 4\n")
    (error,) = errors_of([f"config={config_file}", *valid_args(run_files)])
    assert "worker.actr" in error and "bad.yaml" in error and "worker.actor" in error


def test_free_form_dicts_accept_any_key(run_files):
    cfg = load_config(valid_args(run_files, "worker.reward.reward_function_kwargs.format_weight=0.3"))
    assert cfg.worker.reward.reward_function_kwargs == {"format_weight": 0.3}


def test_type_error_names_the_key(run_files):
    (error,) = errors_of(valid_args(run_files, "data.max_pixels=lots"))
    assert "data.max_pixels" in error and "lots" in error


def test_malformed_argument_and_missing_or_broken_yaml(tmp_path):
    assert "not of the form key=value" in errors_of(["worker.rollout.n"])[0]
    assert "does not exist" in errors_of([f"config={tmp_path}/nope.yaml"])[0]
    broken = tmp_path / "broken.yaml"
    broken.write_text("data: [unclosed\n")
    assert "not valid YAML" in errors_of([f"config={broken}"])[0]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["data.rollout_batch_size=6"], "must be a multiple of worker.actor.global_batch_size=4"),
        (["worker.rollout.n=1"], "set worker.rollout.n >= 2"),
        (
            ["trainer.n_gpus_per_node=3"],
            "must divide evenly over trainer.nnodes × trainer.n_gpus_per_node = 3",
        ),
        (["worker.actor.micro_batch_size_per_device_for_update=3"], "not a multiple of"),
        (["worker.rollout.tensor_parallel_size=4"], "tensor_parallel_size=4 must divide"),
        (["worker.rollout.top_p=1.5"], "top_p=1.5 must be in (0, 1]"),
        (["worker.rollout.temperature=-1"], "temperature=-1.0 must be >= 0"),
        (["worker.rollout.val_override_config.tempreature=0"], "not a sampling key"),
        (["worker.rollout.max_model_len=100"], "shorter than data.max_prompt_length"),
        (
            ["worker.rollout.name=vllm", "data.max_prompt_length=8192"],
            "worker.rollout.max_num_batched_tokens=8192 is below the vLLM context (8704 tokens",
        ),
        (["algorithm.adv_estimator=grp"], "did you mean 'grpo'"),
        (["worker.actor.loss_avg_mode=token_means"], "token_mean"),
        (["worker.rollout.name=sglang"], "is not one of vllm, hf"),
        (["trainer.logger=[console,tensorbord]"], "did you mean 'tensorboard'"),
        (["data.min_pixels=100", "data.max_pixels=10"], "exceeds data.max_pixels"),
        (["data.max_response_length=0"], "data.max_response_length=0 must be > 0"),
        (["data.min_video_frames=0"], "data.min_video_frames=0 must be > 0"),
        (["data.video_total_pixels=0"], "data.video_total_pixels=0 must be > 0 (or null"),
        (["trainer.cpus_per_worker=0"], "trainer.cpus_per_worker=0.0 must be > 0 (CPUs per"),
        (["data.preprocess_num_workers=0"], "data.preprocess_num_workers=0 must be >= 1"),
        (["algorithm.kl_type=adaptive", "algorithm.use_kl_loss=true"], "use_kl_loss=false"),
        (["worker.actor.clip_ratio_dual=1.0"], "must be > 1"),
        (
            ["worker.actor.clip_ratio_low=1.0"],
            "worker.actor.clip_ratio_low=1.0 must lie in (0, 1) for loss_type=ppo",
        ),
        (
            ["worker.actor.loss_type=gspo", "worker.actor.clip_ratio_low=0"],
            "must lie in (0, 1) for loss_type=gspo",
        ),
        (
            ["worker.actor.loss_type=cispo", "worker.actor.clip_ratio_low=1.5"],
            "must lie in [0, 1] (0: weight >= 1",
        ),
        (["worker.actor.clip_ratio_high=0"], "worker.actor.clip_ratio_high=0.0 must be > 0"),
        (["worker.actor.loss_type=sapo", "worker.actor.clip_ratio_high=0.3"], "loss_type=sapo has no clip"),
        (["worker.actor.tau_negative=0"], "worker.actor.tau_negative=0.0 must be > 0"),
        (
            ["worker.actor.loss_type=kl_cov", "worker.actor.clip_ratio_low=0.2"],
            "loss_type=kl_cov has no ratio",
        ),
        (["worker.actor.kl_cov_ratio=0"], "worker.actor.kl_cov_ratio=0.0 must lie in (0, 1]"),
        (["worker.actor.clip_cov_lb=5"], "clip_cov_lb=5.0 must be below clip_cov_ub=5.0"),
        (["worker.actor.entropy_top_k=-1"], "worker.actor.entropy_top_k=-1 must be >= 0"),
        (
            ["worker.actor.adaptive_entropy.enabled=true", "worker.actor.adaptive_entropy.max_ent_coef=-1"],
            "need 0 <= min_ent_coef <= max_ent_coef",
        ),
        (
            ["worker.actor.adaptive_entropy.enabled=true", "worker.actor.entropy_coeff=0.1"],
            "worker.actor.entropy_coeff=0.1 is the adaptive coefficient's start",
        ),
        (
            ["worker.actor.adaptive_entropy.enabled=true", "worker.actor.adaptive_entropy.delta_ent_coef=0"],
            "worker.actor.adaptive_entropy.delta_ent_coef=0.0 must be > 0",
        ),
        (
            ["worker.actor.collapse_recovery.enabled=true", "worker.actor.collapse_recovery.top_k=1"],
            "worker.actor.collapse_recovery.top_k=1 must be >= 2",
        ),
        (
            [
                "worker.actor.collapse_recovery.enabled=true",
                "worker.actor.collapse_recovery.all_equal_share=0",
            ],
            "worker.actor.collapse_recovery.all_equal_share=0.0 must be in (0, 1]",
        ),
        (
            ["worker.actor.collapse_recovery.enabled=true", "worker.actor.collapse_recovery.coeff=0"],
            "worker.actor.collapse_recovery.coeff=0.0 must be > 0",
        ),
        (
            ["worker.actor.collapse_recovery.enabled=true", "worker.actor.collapse_recovery.patience=0"],
            "worker.actor.collapse_recovery.patience=0 must be >= 1",
        ),
        (
            ["worker.actor.kl_step_control.enabled=true", "worker.actor.kl_step_control.factor=1"],
            "worker.actor.kl_step_control.factor=1.0 must be > 1",
        ),
        (
            ["worker.actor.kl_step_control.enabled=true", "worker.actor.kl_step_control.min_scale=0"],
            "worker.actor.kl_step_control.min_scale=0.0 must be in (0, 1]",
        ),
        (
            [
                "worker.actor.kl_step_control.enabled=true",
                "worker.actor.global_batch_size=8",
                "data.rollout_batch_size=8",
            ],
            "makes one optimizer step per training step: lower global_batch_size, raise ppo_epochs",
        ),
        (
            ["worker.actor.moe.aux_loss_coef=-0.1"],
            "worker.actor.moe.aux_loss_coef=-0.1 must be >= 0",
        ),
        (
            ["worker.actor.moe.routing_replay=true", "worker.rollout.name=vllm"],
            "worker.actor.moe.routing_replay=true needs worker.rollout.name=hf",
        ),
        (
            ["worker.actor.moe.routing_replay=true", "worker.rollout.name=hf"],
            "worker.actor.moe.routing_replay=true needs worker.actor.share_prompts=false",
        ),
        (
            ["worker.reward.overlong_buffer_length=512"],
            "overlong_buffer_length=512 must lie in [0, data.max_response_length=512)",
        ),
        (["worker.reward.overlong_penalty_factor=-1"], "overlong_penalty_factor=-1.0 must be >= 0"),
        (["worker.actor.log_prob_chunk_tokens=-1"], "worker.actor.log_prob_chunk_tokens=-1 must be >= 0"),
        (
            ["worker.actor.max_tokens_per_micro_batch_for_experience=0"],
            "worker.actor.max_tokens_per_micro_batch_for_experience=0 must be > 0",
        ),
        (
            ["worker.critic.max_tokens_per_micro_batch_for_experience=-5"],
            "worker.critic.max_tokens_per_micro_batch_for_experience=-5 must be > 0",
        ),
        (["worker.actor.model.packed_attention=flash"], "worker.actor.model.packed_attention"),
        (["worker.actor.ring_size=3"], "ulysses_size × worker.actor.ring_size = 3 must divide"),
        (["worker.actor.ulysses_size=0"], "worker.actor.ulysses_size=0 must be >= 1"),
        (
            ["worker.actor.ulysses_size=2", "worker.actor.padding_free=false"],
            "set worker.actor.padding_free=true",
        ),
        # 4 prompts x 5 responses per update, all on the one data-parallel share of 2 ranks; micro 3
        (
            ["worker.actor.ulysses_size=2", "worker.actor.micro_batch_size_per_device_for_update=3"],
            "20 responses per data-parallel share per update are not a multiple",
        ),
        # 3 prompts x 5 responses per critic update over 2 ranks (the actor's 4 x 5 divide)
        (
            [
                "algorithm.adv_estimator=gae",
                "data.rollout_batch_size=12",
                "worker.critic.global_batch_size=3",
            ],
            "15 responses per critic update must divide evenly over the critic's 2 data-parallel shares",
        ),
        (
            ["algorithm.adv_estimator=gae", "worker.critic.ring_size=4"],
            "worker.critic.ulysses_size × worker.critic.ring_size = 4 must divide",
        ),
        (["worker.actor.optim.strategy=sgd"], "worker.actor.optim.strategy='sgd' is not one of adamw"),
        (
            ["algorithm.online_filtering=true", "algorithm.adv_estimator=reinforce_plus_plus"],
            # the group estimators (a module of mmrl/algorithms may add more after these)
            "set algorithm.adv_estimator to one of ['grpo', 'grpo_passk', 'rloo'",
        ),
        (
            ["algorithm.online_filtering=true", "algorithm.adv_estimator=gae"],
            "or algorithm.online_filtering=false",
        ),
        (["algorithm.online_filtering=true", "worker.rollout.n=1"], "online_filtering needs groups"),
        (
            ["algorithm.online_filtering=true", "data.mini_rollout_batch_size=0"],
            "data.mini_rollout_batch_size=0 must be > 0",
        ),
        (
            ["algorithm.online_filtering=true", "algorithm.filter_low=0.6", "algorithm.filter_high=0.4"],
            "algorithm.filter_low=0.6 exceeds algorithm.filter_high=0.4",
        ),
        (
            ["algorithm.online_filtering=true", "trainer.max_try_make_batch=0"],
            "trainer.max_try_make_batch=0 must be >= 1",
        ),
        (["worker.critic.fsdp.mp_buffer_dtype=fp16"], "worker.critic.fsdp.mp_buffer_dtype='fp16' is not one"),
        (["algorithm.rollout_correction.rollout_is=seq"], "rollout_is='seq' is not one of token, sequence"),
        (["algorithm.rollout_correction.rollout_is_threshold=0"], "rollout_is_threshold=0.0 must be > 0"),
        (
            ["algorithm.rollout_correction.rollout_rs_threshold=0.9"],
            "rollout_rs_threshold=0.9 must be > 1 when rollout_rs_threshold_lower is null",
        ),
        (
            ["algorithm.rollout_correction.rollout_rs_threshold_lower=3"],
            "[rollout_rs_threshold_lower, rollout_rs_threshold] = [3.0, 2.0]; need 0 <= lower < upper",
        ),
        (
            ["trainer.async_mode=one_step_off", "trainer.save_freq=1"],
            "trainer.save_freq=1 saves after every step: the run would be synchronous",
        ),
        (
            ["trainer.async_mode=streem"],
            "trainer.async_mode='streem' is not one of sync, one_step_off, stream",
        ),
        (
            ["trainer.async_mode=stream", "worker.rollout.name=hf"],
            "trainer.async_mode=stream needs worker.rollout.placement=separate",
        ),
        (
            [
                "trainer.async_mode=stream",
                "worker.rollout.placement=separate",
                "worker.actor.moe.routing_replay=true",
            ],
            "trainer.async_mode=stream needs worker.actor.moe.routing_replay=false",
        ),
        (
            ["trainer.async_mode=stream", "trainer.max_staleness=0"],
            "trainer.max_staleness=0 must be >= 1",
        ),
        (
            ["worker.rollout.stream_chunk_tokens=0"],
            "worker.rollout.stream_chunk_tokens=0 must be >= 1 (tokens)",
        ),
        (
            ["worker.rollout.placement=apart"],
            "worker.rollout.placement='apart' is not one of colocated, separate",
        ),
        (["worker.rollout.num_workers=0"], "worker.rollout.num_workers=0 must be >= 1"),
        (["worker.rollout.push_timeout_s=0"], "worker.rollout.push_timeout_s=0.0 must be > 0 (seconds)"),
        (
            ["worker.rollout.placement=separate", "worker.rollout.tensor_parallel_size=2"],
            "worker.rollout.placement=separate does not support worker.rollout.tensor_parallel_size=2 yet",
        ),
        (["algorithm.off_policy=decoupld"], "algorithm.off_policy='decoupld' is not one of none, decoupled"),
        (
            ["algorithm.off_policy=decoupled", "algorithm.decoupled.behaviour_weight_cap=0.5"],
            "algorithm.decoupled.behaviour_weight_cap=0.5 must be >= 1",
        ),
        (
            ["algorithm.off_policy=decoupled", "algorithm.rollout_correction.rollout_is=token"],
            "algorithm.rollout_correction would weight it twice",
        ),
        (
            ["worker.actor.model.gradient_checkpointing_layers=-1"],
            "worker.actor.model.gradient_checkpointing_layers=-1 must be >= 0 (null: every decoder layer)",
        ),
        (
            [
                "worker.critic.model.enable_gradient_checkpointing=false",
                "worker.critic.model.gradient_checkpointing_layers=4",
            ],
            "worker.critic.model.gradient_checkpointing_layers=4 is set with "
            "worker.critic.model.enable_gradient_checkpointing=false: no layer recomputes",
        ),
    ],
)
def test_cross_field_rules(run_files, args, expected):
    errors = errors_of(valid_args(run_files, *args))
    assert any(expected in error for error in errors), errors


@pytest.mark.parametrize(
    ("loss_type", "clip_range", "printed"),
    [
        ("ppo", (0.2, 0.3), "ratio clipped to [1 - 0.2, 1 + 0.3]"),
        ("gspo", (3e-4, 4e-4), "ratio clipped to [1 - 0.0003, 1 + 0.0004]"),
        ("gspo_token", (3e-4, 4e-4), "ratio clipped to [1 - 0.0003, 1 + 0.0004]"),
        ("cispo", (1.0, 4.0), "ratio clipped to [1 - 1, 1 + 4]"),
        ("sapo", None, "no clip (soft gate, tau_positive=1.0, tau_negative=1.05)"),
        ("clip_cov", (0.2, 0.3), "ratio clipped to [1 - 0.2, 1 + 0.3]"),
        ("kl_cov", None, "no ratio clip (|log-ratio| x 1 on the 0.002 of the tokens with the highest"),
    ],
)
def test_null_clip_ratios_resolve_to_the_loss_default_and_are_printed(
    run_files, loss_type, clip_range, printed
):
    cfg = load_config(valid_args(run_files, f"worker.actor.loss_type={loss_type}"))
    assert (
        cfg.worker.actor.clip_ratio_low is None and cfg.worker.actor.clip_ratio_high is None
    )  # not written back
    assert cfg.worker.actor.clip_range == clip_range
    assert f"# worker.actor: loss_type={loss_type}: {printed}" in config_to_yaml(cfg)


def test_lora_reference_is_printed_as_the_actor_without_adapters(run_files):
    """With LoRA the reference is the actor's model under disabled adapters: the printed config says
    that worker.ref's own engine keys are unused (and says nothing without a reference)."""
    line = "# worker.ref: the actor's model with its LoRA adapters switched off"
    cfg = load_config(valid_args(run_files, "worker.actor.model.lora.rank=8", "algorithm.disable_kl=false"))
    assert line in config_to_yaml(cfg)
    cfg = load_config(valid_args(run_files, "worker.actor.model.lora.rank=8", "algorithm.disable_kl=true"))
    assert line not in config_to_yaml(cfg)
    assert line not in config_to_yaml(load_config(valid_args(run_files, "algorithm.disable_kl=false")))


def test_cispo_accepts_clip_ratio_low_zero_and_explicit_values_win(run_files):
    cfg = load_config(valid_args(run_files, "worker.actor.loss_type=cispo", "worker.actor.clip_ratio_low=0"))
    assert cfg.worker.actor.clip_range == (0.0, 4.0)
    cfg = load_config(
        valid_args(run_files, "worker.actor.loss_type=gspo", "worker.actor.clip_ratio_high=1e-3")
    )
    assert cfg.worker.actor.clip_range == (3e-4, 1e-3)


def test_overlong_buffer_below_the_maximum_length_is_valid(run_files):
    cfg = load_config(
        valid_args(run_files, "data.max_response_length=64", "worker.reward.overlong_buffer_length=63")
    )
    assert cfg.worker.reward.overlong_buffer_length == 63


def test_missing_paths_are_named(run_files, tmp_path):
    errors = errors_of(
        valid_args(
            run_files,
            f"data.train_files={tmp_path}/missing.jsonl",
            f"data.val_files={tmp_path}/val.parquet@test",
            f"worker.actor.model.model_path={tmp_path}/no_model",
            f"worker.reward.reward_function={tmp_path}/no_reward.py:f",
            f"data.format_prompt={tmp_path}/no.jinja",
        )
    )
    joined = "\n".join(errors)
    for name in ("missing.jsonl", "val.parquet", "no_model", "no_reward.py", "no.jinja"):
        assert name in joined
    assert len(errors) == 5


def test_sequence_parallel_sizes_load(run_files):
    cfg = load_config(valid_args(run_files, "worker.actor.ulysses_size=2"))
    assert cfg.worker.actor.sequence_parallel_size == 2
    cfg = load_config(valid_args(run_files, "worker.actor.ring_size=2"))
    assert cfg.worker.actor.sequence_parallel_size == 2 and cfg.worker.critic.sequence_parallel_size == 1


SEVEN_B_SIZES = "Sizes that work: 1, 2, 4, 7, 14, 28"
THREE_B_SIZES = "Sizes that work: 1, 2, 4, 8, 16"


@pytest.mark.parametrize(
    ("heads", "extra", "expected"),
    [
        # Qwen2.5-VL-7B: 28 query heads, 4 key/value heads
        ((28, 4), ["trainer.n_gpus_per_node=8", "worker.actor.ulysses_size=4"], None),
        ((28, 4), ["trainer.n_gpus_per_node=8", "worker.actor.ulysses_size=2"], None),
        (
            (28, 4),
            ["trainer.n_gpus_per_node=8", "worker.actor.ulysses_size=8"],
            "worker.actor.ulysses_size=8 does not divide the model's 28 attention heads (4 key/value heads)",
        ),
        (
            (28, 4),
            ["trainer.n_gpus_per_node=8", "worker.actor.ulysses_size=8"],
            f"{SEVEN_B_SIZES} (of those, 1, 2, 4 also divide the 8 processes)",
        ),
        # Qwen2.5-VL-3B: 16 / 2; at 8 the 2 key/value heads are repeated, which Ulysses allows
        ((16, 2), ["trainer.n_gpus_per_node=8", "worker.actor.ulysses_size=8"], None),
        (
            (16, 2),
            ["trainer.n_gpus_per_node=6", "worker.actor.ulysses_size=3"],
            "worker.actor.ulysses_size=3 does not divide the model's 16 attention heads (2 key/value heads)",
        ),
        (
            (16, 2),
            ["trainer.n_gpus_per_node=6", "worker.actor.ulysses_size=3"],
            f"{THREE_B_SIZES} (of those, 1, 2 also divide the 6 processes)",
        ),
        # the critic's size is checked against the model it trains (the actor's folder by default)
        (
            (28, 4),
            [
                "algorithm.adv_estimator=gae",
                "worker.critic.global_batch_size=4",
                "trainer.n_gpus_per_node=8",
                "worker.critic.ulysses_size=8",
            ],
            "worker.critic.ulysses_size=8 does not divide the model's 28 attention heads",
        ),
        (
            (28, 4),
            [
                "algorithm.adv_estimator=gae",
                "worker.critic.global_batch_size=4",
                "trainer.n_gpus_per_node=8",
                "worker.critic.ulysses_size=4",
            ],
            None,
        ),
    ],
)
def test_ulysses_size_must_divide_the_attention_heads(run_files, tmp_path, heads, extra, expected):
    model = write_model_config(tmp_path / "sized", *heads)
    args = valid_args(run_files, f"worker.actor.model.model_path={model}", "worker.rollout.n=8", *extra)
    if expected is None:
        load_config(args)
        return
    errors = errors_of(args)
    assert len(errors) == 1 and expected in errors[0], errors
    assert "worker.actor.ring_size" in errors[0] or "worker.critic.ring_size" in errors[0]


@pytest.fixture
def offline_hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_hub_model_ids_are_read_from_the_cache_or_named_with_the_fix(run_files, tmp_path, offline_hub_cache):
    from _models import build_hub_cache

    build_hub_cache(write_model_config(tmp_path / "seven_b", 28, 4), offline_hub_cache, "org/seven-b")
    args = valid_args(run_files, "worker.actor.model.model_path=org/seven-b", "trainer.n_gpus_per_node=8")
    cfg = load_config([*args, "worker.rollout.n=8", "worker.actor.ulysses_size=4"])
    assert cfg.worker.actor.model.model_path == "org/seven-b"  # the config keeps the id as given
    errors = errors_of([*args, "worker.rollout.n=8", "worker.actor.ulysses_size=8"])
    assert len(errors) == 1 and "does not divide the model's 28 attention heads" in errors[0]

    errors = errors_of(valid_args(run_files, "worker.actor.model.model_path=org/not-downloaded"))
    assert len(errors) == 1
    assert errors[0].startswith(
        "worker.actor.model.model_path: 'org/not-downloaded' is neither a local folder"
    )
    assert "hf download org/not-downloaded" in errors[0]


def test_required_keys():
    errors = errors_of([])
    joined = "\n".join(errors)
    assert "data.train_files is required" in joined
    assert "worker.actor.model.model_path is required" in joined
    assert "worker.reward.reward_function is required" in joined


def test_hub_ids_are_accepted_without_checking(run_files, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cfg = load_config(valid_args(run_files, "data.val_files=hiyouga/geometry3k@test"))
    assert cfg.data.val_files == "hiyouga/geometry3k@test"


def test_spec_splitting():
    assert split_dataset_spec("a/b.parquet@test") == ("a/b.parquet", "test")
    assert split_dataset_spec("a/b.parquet") == ("a/b.parquet", None)
    assert split_function_spec("r/m.py:score") == ("r/m.py", "score")
    assert split_function_spec("r/m.py") == ("r/m.py", "main")


def test_every_example_yaml_covers_and_validates():
    paths = sorted(glob.glob(os.path.join(REPO, "examples", "*.yaml")))
    assert paths, "examples/*.yaml missing"
    for path in paths:
        cfg = load_config([f"config={path}"], check_paths=False)
        assert isinstance(cfg, PPOConfig), path
    # the reference file shows every key of the schema
    with open(os.path.join(REPO, "examples", "config.yaml")) as handle:
        shown = yaml.safe_load(handle)

    def flatten(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict) and f"{prefix}{key}" not in free_form:
                yield from flatten(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}"

    free_form = {k for k in schema_keys() if k.endswith(("override_config", "kwargs"))}
    assert set(flatten(shown)) == set(schema_keys())
    # the launch scripts' key=value overrides name keys of the schema
    for path in sorted(glob.glob(os.path.join(REPO, "examples", "*.sh"))):
        with open(path) as handle:
            overrides = re.findall(r"(?:^|\s)((?:data|algorithm|worker|trainer)\.[\w.]+)=", handle.read())
        assert overrides, path
        unknown = [key for key in overrides if key not in schema_keys()]
        assert not unknown, f"{path}: keys the schema lacks: {unknown}"


def _example_config_script():
    spec = importlib.util.spec_from_file_location(
        "example_config", os.path.join(REPO, "scripts", "example_config.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _line(text: str, key: str) -> str:
    """The line of the (indented) leaf ``key`` in a rendered YAML text."""
    return next(line.strip() for line in text.splitlines() if line.strip().startswith(f"{key}: "))


def test_example_config_is_current_with_the_schema():
    """examples/config.yaml is what scripts/example_config.py renders from the schema: every key in
    schema order, each with the comment of its field, and the default of each key it sets otherwise."""
    with open(os.path.join(REPO, "examples", "config.yaml")) as handle:
        current = handle.read()
    rendered = _example_config_script().render(current)
    diff = "\n".join(difflib.unified_diff(current.splitlines(), rendered.splitlines(), lineterm=""))
    assert rendered == current, f"run python scripts/example_config.py:\n{diff}"
    assert _line(current, "max_prompt_length").endswith("(default: 512)")
    assert "default" not in _line(current, "prompt_key")  # set to its default: no note


def test_example_config_render_follows_the_schema():
    script = _example_config_script()
    stale = textwrap.dedent(
        """\
        # header kept
        data:
          max_prompt_length: 100  # an old comment
          removed_key: 3
        trainer:
          n_gpus_per_node: 2
        """
    )
    rendered = script.render(stale)
    assert rendered.startswith("# header kept\n\ndata:\n")
    _, comment = script.field_comments(DataConfig)["max_prompt_length"]
    assert _line(rendered, "max_prompt_length") == f"max_prompt_length: 100  # {comment} (default: 512)"
    assert "removed_key" not in rendered and "old comment" not in rendered
    shown = yaml.safe_load(rendered)
    assert shown["trainer"]["n_gpus_per_node"] == 2
    # keys the file lacked come with their defaults
    assert shown["data"] == dataclasses.asdict(DataConfig()) | {"max_prompt_length": 100}


def test_cli_user_error_exits_2_without_traceback(tmp_path):
    result = warm.run(
        [sys.executable, "-m", "mmrl.trainer.main", "data.max_pixel=3"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "did you mean 'data.max_pixels'" in result.stderr


def test_cli_dry_run_prints_resolved_config(run_files, tmp_path):
    args = valid_args(run_files)
    result = warm.run(
        [sys.executable, "-m", "mmrl.trainer.main", *args, "--dry-run"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout) == yaml.safe_load(config_to_yaml(load_config(args)))
    assert textwrap.dedent(result.stdout).startswith("data:")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ((), False),  # 4 of 8 prompts per optimizer step: two steps per rollout
        (("worker.actor.global_batch_size=8",), False),  # the KL reward penalty needs old log-probs first
        (("worker.actor.global_batch_size=8", "algorithm.use_kl_loss=true"), True),
        (("worker.actor.global_batch_size=8", "algorithm.disable_kl=true"), True),
        (
            ("worker.actor.global_batch_size=8", "algorithm.disable_kl=true", "worker.actor.ppo_epochs=2"),
            False,
        ),
        (
            (
                "worker.actor.global_batch_size=8",
                "algorithm.disable_kl=true",
                "worker.actor.skip_old_log_prob_on_policy=false",
            ),
            False,
        ),
    ],
)
def test_old_log_probs_come_from_the_update_only_when_it_is_on_policy(run_files, extra, expected):
    assert (
        StepPlan.for_step(load_config(valid_args(run_files, *extra)), 0).old_log_probs_from_update is expected
    )


def test_step_plan_follows_critic_warmup_and_scores_greedy_rollouts_at_temperature_one(run_files):
    config = load_config(
        valid_args(
            run_files,
            "worker.actor.global_batch_size=8",
            "algorithm.disable_kl=true",
            "algorithm.adv_estimator=gae",
            "worker.critic.global_batch_size=8",
            "worker.critic.micro_batch_size_per_device_for_update=2",
            "trainer.critic_warmup=2",
            "worker.rollout.temperature=0",
        )
    )
    warming, trained = StepPlan.for_step(config, 1), StepPlan.for_step(config, 2)
    assert not warming.update_actor and not warming.old_log_probs_from_update  # the separate pass runs
    assert trained.update_actor and trained.old_log_probs_from_update
    assert warming.use_critic and not warming.use_reference and not warming.greedy_baseline
    assert warming.temperature == trained.temperature == 1.0


def test_every_problem_is_reported_in_one_pass(tmp_path, run_files):
    """An unknown key, two ill-typed values and a bad choice: one ConfigError naming all four (and no
    rule about a rejected key, which would judge the default standing in for it)."""
    config_file = tmp_path / "run.yaml"
    config_file.write_text("data:\n  max_pixels: lots\nworker:\n  rollout:\n    tempreature: 0.5\n")
    errors = errors_of(
        [
            f"config={config_file}",
            *valid_args(run_files, "data.rollout_batch_size=many", "algorithm.kl_penalty=k4"),
        ]
    )
    assert len(errors) == 4, errors
    joined = "\n".join(errors)
    for expected in (
        "data.max_pixels",
        "lots",
        "worker.rollout.tempreature",
        "data.rollout_batch_size",
        "many",
    ):
        assert expected in joined
    assert "algorithm.kl_penalty='k4' is not one of" in joined


def test_cli_reports_every_problem_and_exits_2(tmp_path, run_files):
    result = warm.run(
        [
            sys.executable,
            "-m",
            "mmrl.trainer.main",
            *valid_args(run_files, "data.max_pixels=x", "trainer.zzz=1"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "data.max_pixels" in result.stderr and "trainer.zzz" in result.stderr


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("worker.critic.model.tokenizer_path=x", "the critic needs no tokenizer"),
        ("worker.critic.model.trust_remote_code=true", "applies to every load of the run"),
        ("worker.ref.offload.offload_optimizer=true", "has no optimizer"),
    ],
)
def test_removed_keys_say_why(run_files, key, expected):
    (error,) = errors_of(valid_args(run_files, key))
    assert key.split("=")[0] in error and expected in error


@pytest.mark.parametrize("role", ["ref", "critic"])
def test_every_fsdp_section_validates_its_dtypes(run_files, role):
    errors = errors_of(
        valid_args(
            run_files, f"worker.{role}.fsdp.torch_dtype=fp16", f"worker.{role}.fsdp.mp_param_dtype=half"
        )
    )
    assert len(errors) == 2
    assert errors[0].startswith(f"worker.{role}.fsdp.torch_dtype='fp16' is not one of auto, fp32, bf16")
    assert errors[1].startswith(f"worker.{role}.fsdp.mp_param_dtype='half' is not one of auto, fp32, bf16")


def test_critic_loss_avg_mode_error_names_key_value_and_choices(run_files):
    (error,) = errors_of(valid_args(run_files, "worker.critic.loss_avg_mode=seq_sum"))
    assert error.startswith(
        "worker.critic.loss_avg_mode='seq_sum' is not one of token_mean, seq_mean_token_mean"
    )


def _main_with_missing(monkeypatch, capsys, run_files, module: str) -> tuple[int, str]:
    """``main`` with the engine re-imported while ``module`` cannot be imported."""
    from mmrl.trainer.main import main

    monkeypatch.delitem(sys.modules, "mmrl.trainer.ray_trainer", raising=False)
    monkeypatch.setitem(sys.modules, module, None)  # `import module` raises ModuleNotFoundError
    code = main(valid_args(run_files))
    return code, capsys.readouterr().err


def test_missing_dependency_is_named_with_its_install_command(monkeypatch, capsys, run_files):
    code, err = _main_with_missing(monkeypatch, capsys, run_files, "torch")
    assert code == 2
    assert "needs the Python package 'torch', which is not installed: pip install torch" in err
    assert "training engine" not in err


def test_missing_engine_module_is_reported_as_such(monkeypatch, capsys, run_files):
    code, err = _main_with_missing(monkeypatch, capsys, run_files, "mmrl.trainer.ray_trainer")
    assert code == 3 and "training engine module 'mmrl.trainer.ray_trainer' is missing" in err


def test_incompatible_dependency_is_named(monkeypatch, capsys, run_files):
    from mmrl.trainer import main as main_module

    def failing_run(config):
        raise ModuleNotFoundError("No module named 'ray'", name="ray")

    import mmrl.trainer.preflight as preflight
    import mmrl.trainer.ray_trainer as ray_trainer

    monkeypatch.setattr(preflight, "preflight", lambda config: None)  # run_files' model has no tokenizer
    monkeypatch.setattr(ray_trainer, "run", failing_run)
    assert main_module.main(valid_args(run_files)) == 2
    assert "pip install 'ray[default]'" in capsys.readouterr().err
    error = ImportError("cannot import name 'X' from 'transformers'", name="transformers")
    assert main_module.report_import_error(error) == 2
    assert "cannot import name 'X' from 'transformers'; install the versions" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["worker.actor.model.lora.rank=-1"], "worker.actor.model.lora.rank=-1 must be >= 0"),
        (["worker.actor.model.lora.rank=8", "worker.actor.model.lora.alpha=0"], "lora.alpha=0 must be > 0"),
        (["worker.actor.model.lora.target_modules=' , '"], "lora.target_modules is empty"),
        (
            ["worker.actor.model.lora.exclude_modules='(visual'"],
            "lora.exclude_modules='(visual' is not a valid",
        ),
    ],
)
def test_lora_settings_are_checked_at_load(run_files, extra, expected):
    assert any(expected in error for error in errors_of(valid_args(run_files, *extra)))


def test_lora_without_peft_says_how_to_install_it(run_files, monkeypatch):
    from mmrl.models.lora import require_peft

    assert (
        load_config(valid_args(run_files, "worker.actor.model.lora.rank=8")).worker.actor.model.lora.rank == 8
    )
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    hint = 'pip install "mmrl[lora]"'
    assert any(hint in error for error in errors_of(valid_args(run_files, "worker.actor.model.lora.rank=8")))
    load_config(valid_args(run_files))  # rank 0 (full fine-tuning) needs no peft
    with pytest.raises(ImportError, match=re.escape(hint)):
        require_peft()


def test_val_only_needs_validation_files(run_files):
    assert errors_of(valid_args(run_files, "trainer.val_only=true")) == [
        "trainer.val_only=true validates and exits, but data.val_files is not set: set data.val_files "
        "(e.g. data/val.jsonl) or trainer.val_only=false"
    ]
    args = valid_args(run_files, "trainer.val_only=true", f"data.val_files={run_files['data']}")
    assert load_config(args).trainer.val_only


STAGES = (
    "trainer.stages=[{name: 8k, steps: 3, overrides: [data.max_response_length=8192]},"
    " {name: 16k, steps: 2, overrides: [data.max_response_length=16384, worker.rollout.n=16,"
    " worker.rollout.temperature=0.8, worker.actor.optim.lr=5.0e-7]}]"
)


def test_stages_are_the_config_with_their_overrides_over_one_step_count(run_files):
    from mmrl.trainer.stages import first_stage_to_run, plan_stages

    # a prompt (512) and a 16k response fit one vLLM scheduler step only with a budget that large
    budget = "worker.rollout.max_num_batched_tokens=16896"
    cfg = load_config(valid_args(run_files, STAGES, budget, "trainer.find_last_checkpoint=false"))
    first, second = plan_stages(cfg)
    assert (first.first_step, first.last_step, second.first_step, second.last_step) == (0, 3, 3, 5)
    assert first.schedule_steps == second.schedule_steps == 5
    assert (first.label, second.label) == ("stage 1/2 8k", "stage 2/2 16k")
    assert second.describe() == (
        "mmrl: stage 2/2 16k: steps 4-5 with data.max_response_length=16384, worker.rollout.n=16, "
        "worker.rollout.temperature=0.8, worker.actor.optim.lr=5.0e-7"
    )
    one, two = first.config, second.config
    assert (one.data.max_response_length, two.data.max_response_length) == (8192, 16384)
    assert (one.worker.rollout.n, two.worker.rollout.n) == (cfg.worker.rollout.n, 16)
    assert (two.worker.rollout.temperature, two.worker.actor.optim.lr) == (0.8, 5e-7)
    assert (one.trainer.max_steps, two.trainer.max_steps) == (3, 5)  # where each stage ends
    assert one.trainer.stages == two.trainer.stages == []
    # the first stage keeps the run's choices; the next ones continue from its checkpoint, unvalidated
    assert not one.trainer.find_last_checkpoint and two.trainer.find_last_checkpoint
    assert (one.trainer.val_before_train, two.trainer.val_before_train) == (True, False)
    # a run resumes in the stage its newest checkpoint falls in
    stages = [first, second]
    assert [first_stage_to_run(stages, step) for step in (None, 0, 2, 3, 4, 5)] == [0, 0, 0, 1, 1, 1]


def test_stage_errors_name_the_stage_and_the_key(run_files):
    stages = (
        "trainer.stages=[{name: a, steps: 0, overrides: [trainer.save_checkpoint_path=/x]},"
        " {steps: 2, overrides: [worker.rollout.n=1, worker.rollout.temprature=1]}]"
    )
    errors = errors_of(valid_args(run_files, stages))
    assert "trainer.stages[0] (a).steps=0 must be > 0 (training steps of the stage)" in errors
    assert "trainer.stages[0] (a): a stage cannot change ['trainer.save_checkpoint_path=/x']" in errors[1]
    assert any(e.startswith("trainer.stages[1]: ") and "set worker.rollout.n >= 2" in e for e in errors)
    assert any("unknown key 'worker.rollout.temprature' in its overrides" in e for e in errors), errors


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["worker.actor.model.encoding_cache_max_gb=0"], "encoding_cache_max_gb=0.0 must be > 0"),
        (
            ["worker.actor.model.encoding_cache_dir=enc", "worker.actor.model.lora.rank=8"],
            "encoding_cache_dir is set with worker.actor.model.lora.rank=8",
        ),
        (
            ["worker.actor.model.encoding_cache_dir=enc", "algorithm.disable_kl=true"],
            "encoding_cache_dir is set but no tower is frozen",
        ),
        (
            ["worker.rollout.reuse_encodings=true", "worker.rollout.name=hf"],
            "worker.rollout.reuse_encodings=true needs worker.rollout.name=vllm (got 'hf')",
        ),
        (
            ["worker.rollout.reuse_encodings=true"],
            "reuse_encodings=true needs a frozen tower without an adapter",
        ),
        (
            ["worker.actor.model.encoding_cache_dir=enc", "worker.actor.model.share_encodings=false"],
            "encoding_cache_dir is set with worker.actor.model.share_encodings=false",
        ),
        (
            [
                "worker.rollout.reuse_encodings=true",
                "worker.actor.model.freeze_vision_tower=true",
                "worker.rollout.multi_turn.enable=true",
            ],
            "reuse_encodings=true is for single-turn rollouts",
        ),
    ],
)
def test_encoding_cache_settings_are_checked_at_load(run_files, extra, expected):
    assert any(expected in error for error in errors_of(valid_args(run_files, *extra)))


def test_encoding_cache_dir_is_made_absolute(run_files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ("worker.actor.model.encoding_cache_dir=enc", "worker.actor.model.freeze_vision_tower=true")
    cfg = load_config(valid_args(run_files, *args))
    assert cfg.worker.actor.model.encoding_cache_dir == str(tmp_path / "enc")
