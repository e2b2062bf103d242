"""EasyR1 jobs run unchanged: its example config and every launch script of its examples/ resolve after
only the model and data paths are changed, and each EasyR1 spelling mmrl does not share is translated
with the same meaning or refused naming the replacement (``mmrl/config/easyr1.py``).

The scripts are EasyR1's own files (tests/fixtures/easyr1, see SOURCE.md there). Bash itself reads
them, so line continuations, variables, quoting and globs mean what they mean to a user's shell.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from mmrl.config import easyr1
from mmrl.config.loading import ConfigError, _suggest, load_config, schema_keys
from mmrl.trainer.main import main

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "easyr1"
SCRIPTS = sorted(path.relative_to(FIXTURES).as_posix() for path in (FIXTURES / "examples").rglob("*.sh"))
# the launch command stands in for this shell function: it prints the arguments the shell passes
CAPTURE = 'python3() { [ "$1 $2" = "-m verl.trainer.main" ] && shift 2; printf "%s\\0" "$@"; }; source "$0"'
MODEL_KEY = "worker.actor.model.model_path"
DATA_KEYS = ("data.train_files", "data.val_files")


def launch_arguments(script: str) -> list[str]:
    """The ``key=value`` arguments ``script`` passes to ``python3 -m verl.trainer.main``."""
    out = subprocess.run(
        ["bash", "-c", CAPTURE, script], cwd=FIXTURES, capture_output=True, check=True, timeout=30
    ).stdout
    return out.decode().split("\0")[:-1]


def with_local_paths(args: list[str], model: Path, data: Path) -> list[str]:
    """``args`` with the model and dataset paths replaced, everything else as the script has it."""
    local = {MODEL_KEY: str(model), **dict.fromkeys(DATA_KEYS, str(data))}
    replaced = [
        f"{arg.split('=', 1)[0]}={local[arg.split('=', 1)[0]]}" if arg.split("=", 1)[0] in local else arg
        for arg in args
    ]
    given = {arg.split("=", 1)[0] for arg in args}
    return replaced + [f"{key}={value}" for key, value in local.items() if key not in given]


@pytest.fixture(scope="module")
def local_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("easyr1-data") / "rows.jsonl"
    path.write_text(json.dumps({"problem": "What is 1+1?", "answer": "2", "images": []}) + "\n")
    return path


@pytest.fixture(scope="module")
def forty_head_model(tiny_text_path, tmp_path_factory) -> Path:
    """Qwen3-14B's attention layout (40 query, 8 key/value heads) on the tiny text model's config: the
    dapo17k script splits heads over ulysses_size=8, which the config check verifies from config.json."""
    folder = tmp_path_factory.mktemp("qwen3-14b-heads")
    config = json.loads((tiny_text_path / "config.json").read_text())
    config.update(num_attention_heads=40, num_key_value_heads=8, hidden_size=40 * 16)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def resolve(argv: list[str], capsys, monkeypatch) -> dict:
    """Run ``mmrl.trainer.main --dry-run`` from EasyR1's folder; the printed config as a dict."""
    monkeypatch.chdir(FIXTURES)
    code = main([*argv, "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return OmegaConf.to_container(OmegaConf.create(out))


# what each script sets beyond EasyR1's config.yaml, read back from the printed config
EXPECTED = {
    "qwen2_5_vl_7b_geo3k_dapo.sh": {
        "algorithm.online_filtering": True,
        "algorithm.disable_kl": True,
        "data.mini_rollout_batch_size": 128,
        "worker.actor.clip_ratio_low": 0.2,
        "worker.actor.clip_ratio_high": 0.28,
    },
    "qwen3_14b_dapo17k_dapo.sh": {
        "algorithm.online_filtering": True,
        "algorithm.filter_key": "accuracy_normalized",
        "trainer.max_try_make_batch": 10,
        "worker.actor.ulysses_size": 8,
        "worker.actor.optim.strategy": "adamw_bf16",
        "worker.actor.fsdp.torch_dtype": "bf16",
        "worker.actor.clip_ratio_dual": 10.0,
        "worker.rollout.val_override_config": {"n": 16, "temperature": 1.0, "top_p": 0.7},
        "worker.reward.reward_function_kwargs.overlong_buffer_length": 4096,
        "worker.actor.max_tokens_per_micro_batch": 1 * (2048 + 20480),
    },
    "qwen2_5_vl_7b_geo3k_gspo.sh": {
        "worker.actor.loss_type": "gspo_token",
        "worker.actor.loss_avg_mode": "seq_mean_token_mean",
        "worker.actor.clip_ratio_low": 3e-4,
    },
    "qwen2_5_vl_7b_geo3k_sapo.sh": {"worker.actor.loss_type": "sapo", "algorithm.disable_kl": True},
    # needs worker.actor.clip_ratio_low=0 accepted for cispo (the loss helper's change to the loader)
    "qwen2_5_vl_7b_geo3k_cispo.sh": {"worker.actor.loss_type": "cispo", "worker.actor.clip_ratio_low": 0.0},
    "qwen3_4b_math_grpo_lora.sh": {"worker.actor.model.lora.rank": 64, "worker.actor.optim.lr": 1e-5},
    "qwen3_vl_4b_geo3k_grpo_lora.sh": {"worker.actor.model.lora.rank": 64},
    "qwen2_5_vl_7b_geo3k_reinforce.sh": {
        "algorithm.adv_estimator": "reinforce_plus_plus",
        "algorithm.kl_penalty": "kl",
        "algorithm.use_kl_loss": False,
    },
    "qwen2_5_vl_7b_geo3k_swanlab.sh": {"trainer.logger": ["console", "swanlab"]},
    "qwen2_5_vl_3b_android_gui_grpo.sh": {
        "trainer.logger": ["console", "wandb"],
        "worker.actor.optim.lr_scheduler_type": "constant",
        "worker.actor.max_tokens_per_micro_batch": 1 * (3072 + 64),
        "data.format_prompt": str(FIXTURES / "examples/format_prompt/android_gui.jinja"),
    },
    "qwen3_4b_math_grpo.sh": {"worker.actor.max_tokens_per_micro_batch": 1 * (2048 + 4096)},
    "qwen2_5_vl_7b_geo3k_grpo.sh": {
        # EasyR1's config.yaml: `file` logger, dynamic batching, its reward file
        "trainer.logger": ["jsonl", "wandb"],
        "worker.actor.max_tokens_per_micro_batch": 1 * (2048 + 2048),
        "worker.reward.reward_function": f"{FIXTURES / 'examples/reward_function/math.py'}:compute_score",
        "worker.actor.loss_type": "ppo",
    },
}


def lookup(config: dict, key: str):
    for part in key.split("."):
        config = config[part]
    return config


@pytest.mark.parametrize("script", SCRIPTS)
def test_easyr1_launch_script_resolves(
    script, tiny_vl_path, forty_head_model, local_data, capsys, monkeypatch
):
    args = launch_arguments(script)
    assert args[0] == "config=examples/config.yaml"
    model = forty_head_model if "ulysses" in " ".join(args) else tiny_vl_path
    config = resolve(with_local_paths(args, model, local_data), capsys, monkeypatch)
    for key, value in EXPECTED.get(Path(script).name, {}).items():
        assert lookup(config, key) == (pytest.approx(value) if isinstance(value, float) else value), key


def test_launch_arguments_follow_the_shell():
    args = launch_arguments("examples/qwen3_14b_dapo17k_dapo.sh")
    assert 'worker.rollout.val_override_config={"n":16,"temperature":1.0,"top_p":0.7}' in args
    assert args[args.index("config=examples/config.yaml") + 1 :][:2] == [
        "data.train_files=Saigyouji-Yuyuko1000/dapo17k@train",
        "data.val_files=Saigyouji-Yuyuko1000/dapo17k@test",
    ]
    assert "worker.actor.model.model_path=Qwen/Qwen3-14B-Base" in args  # ${MODEL_PATH}
    # unquoted in the script: the shell removes the single quotes
    assert "trainer.logger=[console,swanlab]" in launch_arguments("examples/qwen2_5_vl_7b_geo3k_swanlab.sh")


def test_easyr1_example_config_resolves_and_prints_its_translations(
    tiny_vl_path, local_data, capsys, monkeypatch
):
    monkeypatch.chdir(FIXTURES)
    argv = with_local_paths(["config=examples/config.yaml"], tiny_vl_path, local_data)
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    notes = out.split("\ndata:")[0]
    for translated in (
        "data.image_dir (EasyR1) = None → data.media_dir",
        "trainer.logger: EasyR1 ['file', 'wandb'] → ['jsonl', 'wandb']",
        "worker.actor.dynamic_batching (EasyR1) = true → worker.actor.max_tokens_per_micro_batch = 4096",
        "worker.actor.fsdp.enable_rank0_init = True (EasyR1) accepted",
        "trainer.save_model_only = False (EasyR1) accepted",
    ):
        assert translated in notes


# ---------------------------------------------------------------- each spelling, one at a time


def load(tiny_vl_path, local_data, *overrides: str):
    return load_config(
        [
            f"{MODEL_KEY}={tiny_vl_path}",
            f"data.train_files={local_data}",
            f"worker.reward.reward_function={FIXTURES / 'examples/reward_function/dapo.py'}:compute_score",
            *overrides,
        ]
    )


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("worker.actor.loss_type=default", "worker.actor.loss_type", "ppo"),
        ("worker.actor.loss_avg_mode=token", "worker.actor.loss_avg_mode", "token_mean"),
        ("worker.actor.loss_avg_mode=seq", "worker.actor.loss_avg_mode", "seq_mean_token_mean"),
        ("worker.critic.loss_avg_mode=seq", "worker.critic.loss_avg_mode", "seq_mean_token_mean"),
        ("trainer.logger=file", "trainer.logger", ["jsonl"]),
        ("trainer.logger=[console,file]", "trainer.logger", ["console", "jsonl"]),
        ("data.filter_overlong_prompts_workers=16", "data.preprocess_num_workers", 16),
        ("data.min_pixels=null", "data.min_pixels", None),
        ("data.max_pixels=null", "data.max_pixels", None),
        ("worker.actor.fsdp.torch_dtype=null", "worker.actor.fsdp.torch_dtype", "auto"),
        ("worker.ref.fsdp.torch_dtype=null", "worker.ref.fsdp.torch_dtype", "auto"),
        ("worker.actor.optim.min_lr_ratio=null", "worker.actor.optim.min_lr_ratio", 0.0),
        ("worker.actor.dynamic_batching=false", "worker.actor.max_tokens_per_micro_batch", None),
        ("worker.actor.strategy=fsdp", "worker.actor.max_tokens_per_micro_batch", None),
        ("trainer.ray_timeline=null", "trainer.max_steps", None),
        ("trainer.max_steps=null", "trainer.max_steps", None),
    ],
)
def test_easyr1_spelling_is_translated(override, key, expected, tiny_vl_path, local_data):
    config = OmegaConf.to_container(OmegaConf.structured(load(tiny_vl_path, local_data, override)))
    assert lookup(config, key) == expected


def test_easyr1_image_dir_becomes_media_dir(tiny_vl_path, local_data):
    config = load(tiny_vl_path, local_data, f"data.image_dir={local_data.parent}")
    assert config.data.media_dir == str(local_data.parent)


def test_dynamic_batching_keeps_an_explicit_budget(tiny_vl_path, local_data):
    config = load(
        tiny_vl_path,
        local_data,
        "worker.actor.dynamic_batching=true",
        "worker.actor.max_tokens_per_micro_batch=1000",
    )
    assert config.worker.actor.max_tokens_per_micro_batch == 1000
    config = load(
        tiny_vl_path,
        local_data,
        "worker.actor.dynamic_batching=true",
        "worker.actor.micro_batch_size_per_device_for_update=2",
    )
    assert config.worker.actor.max_tokens_per_micro_batch == 2 * (512 + 512)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.save_model_only=true", "python -m mmrl.checkpoint.merger --local_dir"),
        ("trainer.ray_timeline=timeline.json", "ray timeline --address"),
        ("worker.actor.strategy=megatron", "fsdp is the only strategy"),
        ("worker.hybrid_engine=false", "no separate rollout workers"),
        ("worker.actor.fsdp.fsdp_size=4", "no hybrid (replicated) sharding"),
        ("algorithm.kl_penalty=full", "use algorithm.kl_penalty=low_var_kl"),
        ("worker.critic.model.lora.rank=8", "LoRA is the actor's: worker.actor.model.lora"),
    ],
)
def test_easyr1_setting_without_counterpart_is_refused_with_the_replacement(
    override, message, tiny_vl_path, local_data
):
    with pytest.raises(ConfigError) as error:
        load(tiny_vl_path, local_data, override)
    assert len(error.value.errors) == 1 and message in error.value.errors[0], error.value.errors
    assert ".".join(override.split("=")[0].split(".")[:4]) in error.value.errors[0]


# ---------------------------------------------------------------- hints for unknown keys


@pytest.mark.parametrize(
    ("key", "wrong_hint"),
    [  # the hints mmrl gave before these EasyR1 keys existed in its schema (mmrl issue 15)
        ("data.mini_rollout_batch_size", "data.rollout_batch_size"),
        ("algorithm.filter_low", "algorithm.disable_kl"),
        ("worker.actor.model.lora", "worker.actor.model.model_path"),
        ("trainer.save_model_only", "trainer.val_only"),
    ],
)
def test_unknown_key_is_never_pointed_at_an_unrelated_key(key, wrong_hint):
    section, _, leaf = key.rpartition(".")
    siblings = [name for name in schema_siblings(section) if name != leaf]  # as if mmrl lacked the key
    hint = _suggest(key, siblings)
    assert "did you mean" not in hint and wrong_hint not in hint, hint
    assert f"section '{section}' has no such key" in hint


def schema_siblings(section: str) -> list[str]:
    return sorted({k[len(section) + 1 :].split(".")[0] for k in schema_keys() if k.startswith(section + ".")})


@pytest.mark.parametrize(
    ("key", "hint"),
    [
        ("worker.rollout.temprature", "did you mean 'worker.rollout.temperature'?"),  # typo
        ("data.batch_size_rollout", "did you mean 'data.rollout_batch_size'?"),  # words reordered
        ("worker.actor.rollout_batch_size", "did you mean 'data.rollout_batch_size'?"),  # other section
        ("worker.critic.model.trust_remote_code", "remove it: worker.actor.model.trust_remote_code applies"),
    ],
)
def test_unknown_key_hint_names_a_close_key(key, hint):
    section, _, _ = key.rpartition(".")
    assert hint in _suggest(key, schema_siblings(section))


def test_easyr1_keys_now_in_the_schema_are_accepted(tiny_vl_path, local_data):
    config = load(
        tiny_vl_path,
        local_data,
        "data.mini_rollout_batch_size=128",
        "algorithm.filter_low=0.1",
        "worker.actor.model.lora.rank=8",
        "trainer.save_model_only=false",
    )
    assert (config.data.mini_rollout_batch_size, config.algorithm.filter_low) == (128, 0.1)
    assert config.worker.actor.model.lora.rank == 8


def test_every_easyr1_key_is_known(tiny_vl_path, local_data, monkeypatch):
    """All of EasyR1's keys at their defaults (tests/fixtures/easyr1/defaults.yaml, every field of its
    dataclasses): each is an mmrl key or translated; the only refusals are a key with a replacement and
    an mmrl rule that EasyR1's rollout.n=1 default breaks for grpo."""
    monkeypatch.chdir(FIXTURES)
    notes: list[str] = []
    with pytest.raises(ConfigError) as error:
        load_config(
            [
                "config=defaults.yaml",
                "worker.reward.reward_function=./examples/reward_function/math.py:compute_score",
                *with_local_paths([], tiny_vl_path, local_data),
            ],
            notes=notes,
        )
    assert error.value.errors == [
        "unknown key 'worker.critic.model.trust_remote_code' in 'defaults.yaml': remove it: "
        "worker.actor.model.trust_remote_code applies to every load of the run, the critic's included",
        "algorithm.adv_estimator=grpo compares the responses of a prompt: set worker.rollout.n >= 2 (found 1)",
    ]
    # every EasyR1-only key is accounted for in a note (main prints them above the config)
    for key in (*easyr1.RENAMED, *easyr1.NO_EFFECT, *easyr1.DYNAMIC_BATCHING):
        if key != "worker.critic.model.trust_remote_code":
            assert any(note.startswith(key) for note in notes), key


def test_override_chat_template_path_is_resolved_and_checked(tiny_vl_path, local_data, monkeypatch):
    monkeypatch.chdir(FIXTURES)
    config = load(tiny_vl_path, local_data, "data.override_chat_template=examples/format_prompt/math.jinja")
    assert config.data.override_chat_template == str(FIXTURES / "examples/format_prompt/math.jinja")
    with pytest.raises(ConfigError, match="data.override_chat_template: template '.*missing.jinja' does not"):
        load(tiny_vl_path, local_data, "data.override_chat_template=missing.jinja")
