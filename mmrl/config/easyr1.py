"""EasyR1's config keys and values that mmrl spells differently, and what each becomes.

mmrl's key names follow EasyR1's (``hiyouga/EasyR1``) wherever the meaning is the same, so most of an
EasyR1 job needs nothing from here. This module holds the rest, as tables that docs/config.md reproduces:

- :data:`RENAMED`: an EasyR1 key whose mmrl key has another name, same meaning;
- :data:`VALUES`: an EasyR1 value (or null) that mmrl spells differently, same meaning;
- :data:`NO_EFFECT`: an EasyR1 key for a mechanism mmrl does not have (the FSDP1 wrapper, a separate
  rollout engine), accepted at the values where mmrl behaves the same and refused at the others, with
  what to do instead;
- :data:`DYNAMIC_BATCHING`: EasyR1's ``dynamic_batching`` switch, which becomes mmrl's token budget.

Every translation is reported as a note (``python -m mmrl.trainer.main`` prints them above the
resolved config), so the printed config is what runs and what changed on the way is visible. Nothing is
dropped silently: a key is translated, accepted with the reason it changes nothing, or refused with a
message naming the replacement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

ROLES = ("actor", "ref", "critic")
TRAINED_ROLES = ("actor", "critic")

RENAMED: dict[str, str] = {
    "data.image_dir": "data.media_dir",  # base folder of relative media paths (videos too in mmrl)
    "data.filter_overlong_prompts_workers": "data.preprocess_num_workers",  # processes measuring prompts
}

_LOSS_AVG_MODES = {"token": "token_mean", "seq": "seq_mean_token_mean"}
VALUES: dict[str, dict[Any, Any]] = {
    "worker.actor.loss_type": {"default": "ppo"},  # EasyR1's clipped-ratio PPO loss
    "worker.actor.loss_avg_mode": _LOSS_AVG_MODES,
    "worker.critic.loss_avg_mode": _LOSS_AVG_MODES,
    "trainer.logger": {"file": "jsonl"},  # each entry of the list
    "worker.reward.reward_function": {None: ""},  # unset (then required, as in EasyR1's trainer)
    **{f"worker.{role}.fsdp.torch_dtype": {None: "auto"} for role in ROLES},  # fp32 trained, bf16 reference
    **{f"worker.{role}.optim.min_lr_ratio": {None: 0.0} for role in TRAINED_ROLES},  # EasyR1 reads None as 0
}

# why each value translation keeps the meaning (shown in the notes and docs/config.md)
VALUE_REASONS: dict[str, str] = {
    "worker.actor.loss_type": "EasyR1's `default` loss is the clipped-ratio PPO loss, mmrl's `ppo`",
    "loss_avg_mode": (
        "token: mean over all response tokens; seq: mean over sequences of each sequence's token mean "
        "(mmrl leaves rows without response tokens out of the count of sequences)"
    ),
    "trainer.logger": (
        "EasyR1's `file` logger appends {step, metrics} JSON lines under the checkpoint folder; mmrl's "
        "`jsonl` writes <save_checkpoint_path>/logs/metrics.jsonl and generations.jsonl (metric names "
        "flat, `actor/kl` not nested)"
    ),
    "worker.reward.reward_function": "no reward function given",
    "torch_dtype": "null: fp32 weights for a trained model, bf16 for the frozen reference (on GPU)",
    "min_lr_ratio": "EasyR1 reads null as 0.0",
}


@dataclass(frozen=True)
class NoEffect:
    """An EasyR1 key for a mechanism mmrl lacks: accepted where mmrl behaves the same, else refused."""

    accepts: Callable[[Any], bool]  # the values at which mmrl already behaves as EasyR1 would
    why: str  # why those values change nothing in mmrl
    instead: str  # what to do for the other values


def _always(_: Any) -> bool:
    return True


NO_EFFECT: dict[str, NoEffect] = {
    "worker.hybrid_engine": NoEffect(
        lambda v: v is True,
        "mmrl always runs the actor, rollout and reference in the same processes",
        "remove it: mmrl has no separate rollout workers",
    ),
    **{
        f"worker.{role}.strategy": NoEffect(
            lambda v: v == "fsdp",
            "mmrl trains every model with FSDP2",
            "remove it: fsdp is the only strategy",
        )
        for role in ROLES
    },
    **{
        f"worker.{role}.fsdp.fsdp_size": NoEffect(
            lambda v: v is None or v <= 0,
            "-1 shards each model over all processes, as mmrl always does",
            "remove it: mmrl has no hybrid (replicated) sharding; every model is sharded over all processes",
        )
        for role in ROLES
    },
    **{
        f"worker.{role}.fsdp.use_orig_params": NoEffect(
            _always,
            "FSDP2 shards each parameter as itself: FSDP1's flat-parameter switch has no counterpart "
            "and no effect on the numbers",
            "",
        )
        for role in ROLES
    },
    **{
        f"worker.{role}.fsdp.enable_rank0_init": NoEffect(
            _always,
            "mmrl always does what true asks: rank 0 reads the weights, the other ranks start on the "
            "meta device and receive their shards from it (host memory at load time, not what is trained)",
            "",
        )
        for role in ROLES
    },
    "worker.ref.offload.offload_optimizer": NoEffect(
        lambda v: v is False,
        "false: the frozen reference model has no optimizer",
        "remove it: the frozen reference model has no optimizer "
        "(worker.ref.offload.offload_params offloads its weights)",
    ),
    "worker.critic.model.tokenizer_path": NoEffect(
        lambda v: v is None,
        "null: the critic needs no tokenizer",
        "remove it: the critic needs no tokenizer (the run's is worker.actor.model.tokenizer_path)",
    ),
    "worker.critic.model.lora": NoEffect(
        lambda v: isinstance(v, dict) and not v.get("rank"),
        "rank 0: no adapter, the critic trains all its weights as in mmrl",
        "remove it: the critic trains all its weights (LoRA is the actor's: worker.actor.model.lora)",
    ),
    "worker.actor.use_torch_compile": NoEffect(
        _always,
        "EasyR1 compiles its log-prob function for speed; the values are the same (mmrl compiles whole "
        "decoder layers, for every pass, with worker.actor.model.compile_layers=true)",
        "",
    ),
    "worker.rollout.disable_log_stats": NoEffect(
        _always, "vLLM's periodic stats lines; mmrl logs its own rollout metrics", ""
    ),
    "trainer.save_model_only": NoEffect(
        lambda v: v is False,
        "false: checkpoints hold the model, optimizer and loader state, as mmrl's always do",
        "mmrl checkpoints always hold the optimizer and loader state so that a run resumes exactly; "
        "for a model-only copy merge one: python -m mmrl.checkpoint.merger --local_dir "
        "<checkpoint>/global_step_N/actor (trainer.save_limit bounds the disk used)",
    ),
    "trainer.ray_timeline": NoEffect(
        lambda v: v is None,
        "null: no Ray timeline file",
        "remove it and dump the timeline of the running job with `ray timeline --address <head>:6379`",
    ),
}

# EasyR1 packs micro-batches up to micro_batch_size × padded sequence length tokens (dp_actor.py,
# dp_critic.py: `micro_batch_size_per_device_for_update * input_ids.size(-1)`, padded to
# max_prompt_length + max_response_length); mmrl has one budget per role for all of its passes
DYNAMIC_BATCHING = {f"worker.{role}.dynamic_batching": role for role in TRAINED_ROLES}

REFUSED_VALUES: dict[str, dict[Any, str]] = {
    "algorithm.kl_penalty": {
        "full": "mmrl has no full-vocabulary KL; use algorithm.kl_penalty=low_var_kl (k3) or kl (k1)"
    },
}


def _pop(layer: DictConfig, key: str) -> tuple[bool, Any]:
    """Remove ``key`` (dotted) from ``layer``; ``(found, plain value)``."""
    *parents, leaf = key.split(".")
    node: Any = layer
    for name in parents:
        if not isinstance(node, DictConfig) or name not in node:
            return False, None
        node = node._get_node(name)
    if not isinstance(node, DictConfig) or leaf not in node:
        return False, None
    value = node._get_node(leaf)
    plain = OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value._value()
    del node[leaf]
    return True, plain


def _translate_value(key: str, value: Any, notes: list[str], errors: list[str]) -> tuple[bool, Any]:
    """(changed, mmrl value) for an EasyR1 value of an mmrl key."""
    refused = REFUSED_VALUES.get(key, {})
    if isinstance(value, str) and value in refused:
        errors.append(f"{key}={value} (EasyR1) is not supported: {refused[value]}")
        return True, None  # removed from the layer by the caller: the default stands in, unjudged
    table = VALUES.get(key)
    if table is None:
        return False, value
    reason = VALUE_REASONS.get(key) or VALUE_REASONS[key.rsplit(".", 1)[-1]]
    if key == "trainer.logger":
        names = [value] if isinstance(value, str) else value
        if not isinstance(names, list):
            return False, value
        mapped = [table.get(name, name) for name in names]
        if mapped == value:
            return False, value
        notes.append(f"{key}: EasyR1 {value} → {mapped} ({reason})")
        return True, mapped
    if not isinstance(value, (str, type(None))) or value not in table:
        return False, value
    notes.append(f"{key}: EasyR1 {value!r} → {table[value]!r} ({reason})")
    return True, table[value]


def translate_layer(layer: DictConfig, source: str, derived: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Rewrite one config layer (YAML file or command-line key) from EasyR1's spelling to mmrl's, in
    place. EasyR1's ``dynamic_batching`` values go to ``derived`` (they need the merged config, see
    :func:`apply_derived`). Returns (notes, errors)."""
    notes: list[str] = []
    errors: list[str] = []
    for old, new in RENAMED.items():
        found, value = _pop(layer, old)
        if found:
            OmegaConf.update(layer, new, value, force_add=True)
            notes.append(f"{old} (EasyR1) = {value!r} → {new}")
    for key, rule in NO_EFFECT.items():
        found, value = _pop(layer, key)
        if not found:
            continue
        if rule.accepts(value):
            notes.append(f"{key} = {value!r} (EasyR1) accepted, nothing to set: {rule.why}")
        else:
            errors.append(f"{key}={value!r} in {source} (EasyR1) is not supported: {rule.instead}")
    for key in DYNAMIC_BATCHING:
        found, value = _pop(layer, key)
        if found:
            derived[key] = value
    for key in (*VALUES, *REFUSED_VALUES):
        value = OmegaConf.select(layer, key, default="<absent>", throw_on_missing=False)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value)
        if value == "<absent>":
            continue
        num_errors = len(errors)
        changed, new_value = _translate_value(key, value, notes, errors)
        if len(errors) > num_errors:
            _pop(layer, key)
        elif changed:
            OmegaConf.update(layer, key, new_value, force_add=True, merge=False)
    return notes, errors


def apply_derived(plain: DictConfig, derived: dict[str, Any]) -> list[str]:
    """EasyR1's ``dynamic_batching: true`` → mmrl's ``max_tokens_per_micro_batch`` when that is null:
    the token budget EasyR1 packs micro-batches to (update micro-batch size × prompt + response
    length); false → null (micro-batches by count). A budget set in mmrl's key wins. Returns notes."""
    notes = []
    for key, role in DYNAMIC_BATCHING.items():
        if key not in derived:
            continue
        section = plain.worker[role]
        budget_key = f"worker.{role}.max_tokens_per_micro_batch"
        if section.max_tokens_per_micro_batch is not None:
            notes.append(f"{key} (EasyR1) = {derived[key]}: {budget_key} is set and wins")
        elif derived[key]:
            context = plain.data.max_prompt_length + plain.data.max_response_length
            section.max_tokens_per_micro_batch = section.micro_batch_size_per_device_for_update * context
            notes.append(
                f"{key} (EasyR1) = true → {budget_key} = {section.max_tokens_per_micro_batch} "
                f"(micro_batch_size_per_device_for_update × (max_prompt_length + max_response_length), "
                "EasyR1's token budget per micro-batch)"
            )
        else:
            notes.append(f"{key} (EasyR1) = false → {budget_key} = null (micro-batches by count)")
    return notes
