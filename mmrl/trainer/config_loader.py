"""Load a :class:`PPOConfig`: dataclass defaults ← YAML file ← ``key=value`` arguments, then one
validation pass.

Every user mistake becomes a :class:`ConfigError` listing all problems of the config at once (unknown
keys, every value of the wrong type, every violated rule), each naming the key, what was found and what
to do; the command line turns it into exit code 2 without a traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import typing
from collections.abc import Iterator, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mmrl.config import (
    CHOICES,
    DATA_FILE_SUFFIXES,
    DATA_FORMATS,
    SAMPLING_KEYS,
    PPOConfig,
    split_dataset_spec,
    split_function_spec,
    unsupported_data_file,
)
from mmrl.errors import UserInputError
from mmrl.trainer.easyr1 import apply_derived, translate_layer

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")  # `owner/name`, as on the Hugging Face hub
GROUP_ESTIMATORS = (
    "grpo",
    "grpo_passk",
    "rloo",
)  # advantages relative to the other responses of the same prompt
# keys that EasyR1 (or an earlier mmrl) has and this schema leaves out on purpose: why, and what to use
REMOVED_KEYS = {
    "worker.critic.model.trust_remote_code": (
        "worker.actor.model.trust_remote_code applies to every load of the run, the critic's included"
    ),
}  # EasyR1's other keys without an mmrl counterpart: mmrl/trainer/easyr1.py (NO_EFFECT)
# a hint names a key only when it is this close: a typo (a few characters) or the same words reordered;
# a different key sharing most letters (mini_rollout_batch_size ~ rollout_batch_size) is no typo
MAX_TYPO_EDITS = 2


class ConfigError(UserInputError, ValueError):
    """One or more user errors in the configuration; ``errors`` holds one message per problem."""

    def __init__(self, errors: Sequence[str]):
        self.errors = list(errors)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {e}" for e in self.errors))


# ---------------------------------------------------------------------------------------------
# schema walking
# ---------------------------------------------------------------------------------------------


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def schema_keys(cls: type = PPOConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the tree (leaves and free-form dicts), e.g. ``worker.rollout.n``."""
    keys = []
    for name, hint in _field_types(cls).items():
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(hint):
            keys.extend(schema_keys(hint, key + "."))
        else:
            keys.append(key)
    return keys


def _unknown_keys(user: Any, cls: type, prefix: str = "") -> Iterator[tuple[str, list[str]]]:
    """Yield ``(dotted_key, valid_sibling_names)`` for every user key that the schema lacks."""
    if not isinstance(user, DictConfig):
        return
    fields = _field_types(cls)
    for name in user.keys():
        key = f"{prefix}{name}"
        if name not in fields:
            yield key, list(fields)
            continue
        hint = fields[name]
        if dataclasses.is_dataclass(hint):
            yield from _unknown_keys(user[name], hint, key + ".")


def _edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions)."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def _is_typo_of(name: str, candidate: str) -> bool:
    if sorted(name.split("_")) == sorted(candidate.split("_")):
        return True
    return _edit_distance(name, candidate) <= min(MAX_TYPO_EDITS, max(1, len(candidate) // 4))


def _suggest(key: str, siblings: list[str]) -> str:
    """The fix for an unknown key: the removed-key table first, then the same name in another
    section, then a typo of a key of its own section; never a merely similar key."""
    if key in REMOVED_KEYS:
        return f"remove it: {REMOVED_KEYS[key]}"
    section, _, leaf = key.rpartition(".")
    typos = sorted(
        (name for name in siblings if _is_typo_of(leaf, name)), key=lambda n: _edit_distance(leaf, n)
    )
    if typos:
        return f"did you mean '{section + '.' if section else ''}{typos[0]}'?"
    elsewhere = [other for other in schema_keys() if other.rsplit(".", 1)[-1] == leaf and other != key]
    if elsewhere:
        return f"'{leaf}' belongs to another section: did you mean '{elsewhere[0]}'?"
    where = f"section '{section}'" if section else "the top level"
    return f"{where} has no such key (its keys: {', '.join(siblings)}); see examples/config.yaml"


# ---------------------------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------------------------


def parse_cli(argv: Sequence[str]) -> tuple[str | None, list[str], list[str]]:
    """Split ``config=x.yaml a.b=c ...`` into the YAML path, the ``key=value`` overrides and one error
    per malformed argument."""
    config_path, overrides, errors = None, [], []
    for arg in argv:
        if "=" not in arg or arg.startswith("="):
            errors.append(f"argument '{arg}' is not of the form key=value (e.g. worker.rollout.n=8)")
        elif arg.startswith("config="):
            config_path = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    return config_path, overrides, errors


def _load_yaml(path: str) -> DictConfig:
    if not os.path.isfile(path):
        raise ConfigError([f"config file '{path}' does not exist (cwd: {os.getcwd()})"])
    try:
        loaded = OmegaConf.load(path)
    except Exception as err:  # yaml.YAMLError and friends: report, don't trace
        raise ConfigError([f"config file '{path}' is not valid YAML: {err}"]) from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(
            [f"config file '{path}' must hold a mapping of sections, found {type(loaded).__name__}"]
        )
    return loaded


def _leaves(user: DictConfig, cls: type, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted_key, value)`` of every schema leaf (a free-form dict counts as one) set in ``user``;
    keys the schema lacks are skipped (see :func:`_unknown_keys`)."""
    fields = _field_types(cls)
    for name in user.keys():
        if name not in fields:
            continue
        key, hint = f"{prefix}{name}", fields[name]
        node = user._get_node(name)
        if dataclasses.is_dataclass(hint) and isinstance(node, DictConfig) and not node._is_none():
            yield from _leaves(node, hint, key + ".")
        else:
            yield key, node


@functools.cache
def _schema() -> DictConfig:
    """``PPOConfig``'s defaults as a typed OmegaConf tree, built once (~50 ms): only ever read, as the
    first config of ``OmegaConf.merge``, which copies it."""
    return OmegaConf.structured(PPOConfig)


def _merge(layers: list[tuple[str, DictConfig]]) -> tuple[DictConfig, list[str], set[str]]:
    """The schema with every layer merged over it, one leaf at a time, so that each unknown key and
    each ill-typed value is reported (and left at its previous value) while the rest merges.

    Returns (merged config, error messages, the keys those messages are about).
    """
    merged: DictConfig = _schema()  # OmegaConf.merge copies its first config: the schema stays as built
    errors, bad_keys = [], set()
    # consecutive layers of one source (the command line's overrides) merge as one: each merge copies
    # the whole tree, so a merge per override made most of a run's config loading
    groups: list[tuple[str, list[DictConfig]]] = []
    for source, layer in layers:
        if groups and groups[-1][0] == source:
            groups[-1][1].append(layer)
        else:
            groups.append((source, [layer]))
    for source, group in groups:
        leaves = []
        for layer in group:
            for key, siblings in _unknown_keys(layer, PPOConfig):
                errors.append(f"unknown key '{key}' in {source}: {_suggest(key, siblings)}")
                bad_keys.add(key)
            leaves += _leaves(layer, PPOConfig)
        combined = OmegaConf.create()
        for key, node in leaves:  # in order: a later override of a key wins, as merged one by one
            OmegaConf.update(combined, key, node, force_add=True)
        try:  # one merge per source; leaf by leaf only to find errors
            merged = OmegaConf.merge(merged, combined)
            continue
        except OmegaConfBaseException:
            pass
        for key, node in leaves:
            single = OmegaConf.create()
            OmegaConf.update(single, key, node, force_add=True)
            try:
                merged = OmegaConf.merge(merged, single)
            except OmegaConfBaseException as err:
                errors.append(f"'{key}' from {source}: {str(err).splitlines()[0]}")
                bad_keys.add(key)
    return merged, errors, bad_keys


def _absolute(path: str | None) -> str | None:
    return os.path.abspath(path) if path else path


def _resolve_paths(cfg: DictConfig) -> None:
    """Make local paths absolute (against the launch directory) so every Ray process agrees."""

    def dataset_specs(value: str) -> str:
        specs = []
        for spec in filter(None, (s.strip() for s in value.split(","))):
            path, split = split_dataset_spec(spec)
            if os.path.exists(path):
                path = os.path.abspath(path)
            specs.append(path if split is None else f"{path}@{split}")
        return ",".join(specs)

    cfg.data.train_files = dataset_specs(cfg.data.train_files)
    cfg.data.val_files = dataset_specs(cfg.data.val_files)
    cfg.data.format_prompt = _absolute(cfg.data.format_prompt)
    cfg.data.override_chat_template = _absolute(cfg.data.override_chat_template)
    cfg.data.media_dir = _absolute(cfg.data.media_dir)
    for model, keys in (
        (cfg.worker.actor.model, ("model_path", "tokenizer_path")),
        (cfg.worker.critic.model, ("model_path",)),
    ):
        for key in keys:
            if model[key] and os.path.exists(model[key]):
                model[key] = os.path.abspath(model[key])
    if cfg.worker.reward.reward_function:
        path, name = split_function_spec(cfg.worker.reward.reward_function)
        cfg.worker.reward.reward_function = f"{os.path.abspath(path)}:{name}"
    judge, reward_model = cfg.worker.reward.judge, cfg.worker.reward.reward_model
    for section, key in (
        (judge, "prompt_template"),
        (judge, "cache_path"),
        (reward_model, "prompt_template"),
    ):
        section[key] = _absolute(section[key])
    for section in (judge.serve, reward_model):
        if section.model_path and os.path.exists(section.model_path):
            section.model_path = os.path.abspath(section.model_path)
    cfg.trainer.save_checkpoint_path = _absolute(cfg.trainer.save_checkpoint_path)
    cfg.trainer.load_checkpoint_path = _absolute(cfg.trainer.load_checkpoint_path)
    cfg.worker.actor.model.encoding_cache_dir = _absolute(cfg.worker.actor.model.encoding_cache_dir)


def load_config(
    argv: Sequence[str] = (), check_paths: bool = True, notes: list[str] | None = None
) -> PPOConfig:
    """Build the run's config from command-line style arguments (``config=x.yaml a.b=c ...``).

    EasyR1's spellings are translated first (:mod:`mmrl.trainer.easyr1`); each translation is appended
    to ``notes`` when given. Raises :class:`ConfigError` naming every problem. ``check_paths=False``
    skips the checks that files exist (for tooling that only inspects a config).
    """
    config_path, overrides, errors = parse_cli(argv)
    layers = []
    if config_path:
        layers.append((f"'{config_path}'", _load_yaml(config_path)))
    for override in overrides:
        try:
            layers.append(("the command line", OmegaConf.from_dotlist([override])))
        except OmegaConfBaseException as err:
            errors.append(f"command line '{override}': {str(err).splitlines()[0]}")
    notes = [] if notes is None else notes
    derived: dict[str, Any] = {}
    for source, layer in layers:
        layer_notes, layer_errors = translate_layer(layer, source, derived)
        notes += layer_notes
        errors += layer_errors
    merged, merge_errors, bad_keys = _merge(layers)
    errors += merge_errors
    # frozen dataclasses make the typed tree read-only: resolve paths on a plain copy, then re-type it
    plain = OmegaConf.create(OmegaConf.to_container(merged))
    notes += apply_derived(plain, derived)
    _resolve_paths(plain)
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(_schema(), plain))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        raise ConfigError([*errors, f"'{key}': {str(err).splitlines()[0]}"]) from None
    # a rule about a rejected key would judge the default that stands in for it: leave those out
    errors += [
        error
        for error in validate_config(cfg, check_paths=check_paths)
        if not any(re.search(rf"\b{re.escape(key)}\b", error) for key in bad_keys)
    ]
    if errors:
        raise ConfigError(errors)
    stage_configs(cfg, check_paths)  # every stage's config is valid too, before anything starts
    return cfg


# keys a stage may not change: they hold the schedule together (one checkpoint folder, one step count)
STAGE_FIXED_KEYS = (
    "trainer.stages",
    "trainer.max_steps",
    "trainer.total_epochs",
    "trainer.save_checkpoint_path",
    "trainer.load_checkpoint_path",
    "trainer.find_last_checkpoint",
    "trainer.project_name",
    "trainer.experiment_name",
)


def stage_configs(cfg: PPOConfig, check_paths: bool = True) -> list[PPOConfig]:
    """The config of each stage of ``trainer.stages`` (empty without a schedule): ``cfg`` with the
    stage's overrides, ``trainer.max_steps`` at the stage's last step, and, after the first stage,
    ``find_last_checkpoint`` on (it continues from the previous stage's checkpoint) and no validation
    at its start (the previous stage validated at its end). Raises :class:`ConfigError` naming the
    stage and the key."""
    import tempfile

    if not cfg.trainer.stages:
        return []
    errors, configs, last_step = [], [], 0
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as base:
        base.write(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        base.flush()
        for index, stage in enumerate(cfg.trainer.stages):
            where = f"trainer.stages[{index}]" + (f" ({stage.name})" if stage.name else "")
            if stage.steps <= 0:
                errors.append(f"{where}.steps={stage.steps} must be > 0 (training steps of the stage)")
            fixed = [o for o in stage.overrides if o.split("=", 1)[0].strip() in STAGE_FIXED_KEYS]
            if fixed:
                errors.append(f"{where}: a stage cannot change {fixed} (the schedule's own keys)")
                continue
            last_step += max(stage.steps, 0)
            forced = [f"trainer.max_steps={max(last_step, 1)}", "trainer.stages=[]"]
            if index > 0:
                forced += ["trainer.find_last_checkpoint=true", "trainer.val_before_train=false"]
            try:
                args = [f"config={base.name}", *stage.overrides, *forced]
                configs.append(load_config(args, check_paths=check_paths))
            except ConfigError as err:
                errors += [f"{where}: {e.replace('the command line', 'its overrides')}" for e in err.errors]
    if errors:
        raise ConfigError(errors)
    return configs


def config_to_yaml(cfg: PPOConfig) -> str:
    """The config as YAML, then the values derived from it that a run uses, as comments."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg)) + "".join(
        f"# {line}\n" for line in derived_values(cfg)
    )


def derived_values(cfg: PPOConfig) -> list[str]:
    """Lines stating the values the run derives from null keys (properties of the config tree)."""
    actor = cfg.worker.actor
    if actor.loss_type not in CHOICES[(type(actor), "loss_type")]:
        return []  # reported by validation
    clip_range = actor.clip_range
    if actor.loss_type == "kl_cov":
        clip = (
            f"no ratio clip (|log-ratio| x {actor.kl_cov_coef:g} on the {actor.kl_cov_ratio:g} of the tokens "
            "with the highest covariance)"
        )
    elif clip_range is None:
        clip = f"no clip (soft gate, tau_positive={actor.tau_positive}, tau_negative={actor.tau_negative})"
    else:
        clip = f"ratio clipped to [1 - {clip_range[0]:g}, 1 + {clip_range[1]:g}]"
    lines = [f"worker.actor: loss_type={actor.loss_type}: {clip}"]
    if actor.model.lora.rank > 0 and cfg.algorithm.use_reference:
        lines.append(
            "worker.ref: the actor's model with its LoRA adapters switched off (no copy of the weights; "
            "worker.ref.fsdp and worker.ref.offload are unused, the actor's settings apply)"
        )
    return lines


# ---------------------------------------------------------------------------------------------
# validation: every cross-field rule, in one place
# ---------------------------------------------------------------------------------------------


def _choice(errors: list[str], key: str, value: str, valid: Sequence[str]) -> None:
    if value not in valid:
        close = difflib.get_close_matches(str(value), list(valid), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        errors.append(f"{key}='{value}' is not one of {', '.join(valid)}{hint}")


def _check_dataset(errors: list[str], key: str, value: str) -> None:
    for spec in filter(None, (s.strip() for s in value.split(","))):
        path, _ = split_dataset_spec(spec)
        if os.path.exists(path):
            problem = unsupported_data_file(path)
            if problem:
                errors.append(f"{key}: {problem}")
            continue
        if HUB_ID.match(path) and not path.endswith(DATA_FILE_SUFFIXES):
            continue  # a hub dataset id: only the loader can tell whether it is reachable
        errors.append(f"{key}: '{path}' does not exist ({DATA_FORMATS})")


def _check_model_path(errors: list[str], key: str, value: str | None, required: bool) -> str | None:
    """The folder holding ``value``'s config (a hub id is resolved through the Hugging Face cache,
    without its weights), or None after recording why there is none."""
    from mmrl.models.loading import ModelPathError, resolve_model_path

    if not value:
        if required:
            errors.append(f"{key} is required (a Hugging Face model folder or hub id)")
        return None
    try:
        return resolve_model_path(value, key, without_weights=True)
    except ModelPathError as error:
        errors.append(str(error))
        return None


def _check_ulysses_heads(errors: list[str], cfg: PPOConfig, role: str, folder: str) -> None:
    """Ulysses gives each rank ``heads / ulysses_size`` of the text decoder's attention heads: the size
    must divide the heads. Key/value heads it does not divide are repeated to one per query head
    (more memory, still exact), so they set no rule; ring attention splits tokens, not heads."""
    from mmrl.models.loading import attention_heads

    size = getattr(cfg.worker, role).ulysses_size
    if size <= 1:
        return
    try:
        heads, kv_heads = attention_heads(folder, cfg.worker.actor.model.trust_remote_code)
    except (OSError, ValueError) as error:
        errors.append(
            f"worker.{role}.ulysses_size={size} needs the model's attention heads, but its config in "
            f"{folder} cannot be read: {str(error).splitlines()[0]}"
        )
        return
    if heads % size == 0:
        return
    world = cfg.trainer.world_size
    fitting = [n for n in range(1, heads + 1) if heads % n == 0]
    usable = [n for n in fitting if world % n == 0]
    errors.append(
        f"worker.{role}.ulysses_size={size} does not divide the model's {heads} attention heads "
        f"({kv_heads} key/value heads) in {folder}: Ulysses gives each rank heads / ulysses_size of them. "
        f"Sizes that work: {', '.join(map(str, fitting))} (of those, {', '.join(map(str, usable))} also "
        f"divide the {world} processes); or split sequences with worker.{role}.ring_size instead"
    )


def _check_choices(errors: list[str], node: Any, prefix: str = "") -> None:
    """Every key declared in ``config.CHOICES``, in every section of its class (a list: each entry)."""
    for f in dataclasses.fields(node):
        key, value = f"{prefix}{f.name}", getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            _check_choices(errors, value, key + ".")
        elif (type(node), f.name) in CHOICES and value is not None:  # null: the documented default
            for item in value if isinstance(value, list) else [value]:
                _choice(errors, key, item, CHOICES[type(node), f.name])


def _check_batches(errors: list[str], cfg: PPOConfig) -> None:
    data, actor, rollout, trainer = cfg.data, cfg.worker.actor, cfg.worker.rollout, cfg.trainer
    world = trainer.world_size
    if data.rollout_batch_size % actor.global_batch_size:
        errors.append(
            f"data.rollout_batch_size={data.rollout_batch_size} must be a multiple of "
            f"worker.actor.global_batch_size={actor.global_batch_size} (each step runs whole mini-batches)"
        )
    sp_size = actor.sequence_parallel_size  # its own errors come from _check_sequence_parallel
    dp_size = world // sp_size if sp_size > 0 and world % sp_size == 0 else world
    where = (
        f"the {dp_size} data-parallel shares (trainer.nnodes × trainer.n_gpus_per_node = {world} processes "
        f"/ sequence-parallel size {actor.sequence_parallel_size})"
        if actor.sequence_parallel_size > 1
        else f"trainer.nnodes × trainer.n_gpus_per_node = {world} processes"
    )
    if cfg.responses_per_update % dp_size:
        errors.append(
            f"worker.actor.global_batch_size × worker.rollout.n = {cfg.responses_per_update} responses per update "
            f"must divide evenly over {where}"
        )
    else:
        per_device = cfg.responses_per_update // dp_size
        if per_device % actor.micro_batch_size_per_device_for_update:
            errors.append(
                f"{per_device} responses per data-parallel share per update are not a multiple of "
                f"worker.actor.micro_batch_size_per_device_for_update={actor.micro_batch_size_per_device_for_update}"
            )
    if world % rollout.tensor_parallel_size:
        errors.append(
            f"worker.rollout.tensor_parallel_size={rollout.tensor_parallel_size} must divide the "
            f"{world} training processes"
        )
    if cfg.use_critic and cfg.data.rollout_batch_size % cfg.worker.critic.global_batch_size:
        errors.append(
            f"data.rollout_batch_size={data.rollout_batch_size} must be a multiple of "
            f"worker.critic.global_batch_size={cfg.worker.critic.global_batch_size}"
        )
    if not cfg.use_critic:
        return
    critic = cfg.worker.critic
    critic_sp = critic.sequence_parallel_size  # the critic's layout may differ from the actor's
    critic_dp = world // critic_sp if critic_sp > 0 and world % critic_sp == 0 else world
    if (critic.global_batch_size * rollout.n) % critic_dp:
        errors.append(
            f"worker.critic.global_batch_size × worker.rollout.n = {critic.global_batch_size * rollout.n} "
            f"responses per critic update must divide evenly over the critic's {critic_dp} data-parallel "
            f"shares ({world} processes / its sequence-parallel size {critic_sp})"
        )


def _check_sequence_parallel(errors: list[str], cfg: PPOConfig) -> None:
    world = cfg.trainer.world_size
    for role in ("actor", "critic"):
        role_cfg = getattr(cfg.worker, role)
        if role == "critic" and not cfg.use_critic:
            continue
        for key in ("ulysses_size", "ring_size"):
            if getattr(role_cfg, key) < 1:
                errors.append(f"worker.{role}.{key}={getattr(role_cfg, key)} must be >= 1")
        size = role_cfg.sequence_parallel_size
        if min(role_cfg.ulysses_size, role_cfg.ring_size) < 1 or size == 1:
            continue
        if world % size:
            errors.append(
                f"worker.{role}.ulysses_size × worker.{role}.ring_size = {size} must divide trainer.nnodes × "
                f"trainer.n_gpus_per_node = {world} processes (each data-parallel share uses {size} of them)"
            )
        if not role_cfg.padding_free:
            errors.append(
                f"worker.{role}.ulysses_size/ring_size > 1 split packed rows: set worker.{role}.padding_free=true"
            )


def _check_positive(errors: list[str], cfg: PPOConfig) -> None:
    positive = {
        "data.max_prompt_length": cfg.data.max_prompt_length,
        "data.max_response_length": cfg.data.max_response_length,
        "data.rollout_batch_size": cfg.data.rollout_batch_size,
        "worker.actor.global_batch_size": cfg.worker.actor.global_batch_size,
        "worker.actor.micro_batch_size_per_device_for_update": cfg.worker.actor.micro_batch_size_per_device_for_update,
        "worker.actor.micro_batch_size_per_device_for_experience": cfg.worker.actor.micro_batch_size_per_device_for_experience,
        "worker.actor.ppo_epochs": cfg.worker.actor.ppo_epochs,
        "worker.actor.optim.lr": cfg.worker.actor.optim.lr,
        "worker.rollout.n": cfg.worker.rollout.n,
        "worker.rollout.tensor_parallel_size": cfg.worker.rollout.tensor_parallel_size,
        "worker.reward.num_workers": cfg.worker.reward.num_workers,
        "worker.reward.timeout_s": cfg.worker.reward.timeout_s,
        "trainer.total_epochs": cfg.trainer.total_epochs,
        "trainer.nnodes": cfg.trainer.nnodes,
        "trainer.n_gpus_per_node": cfg.trainer.n_gpus_per_node,
    }
    for key, value in positive.items():
        if value <= 0:
            errors.append(f"{key}={value} must be > 0")
    for role in ("actor", "critic"):
        budget = getattr(cfg.worker, role).max_tokens_per_micro_batch
        if budget is not None and budget <= 0:
            errors.append(
                f"worker.{role}.max_tokens_per_micro_batch={budget} must be > 0 (packed tokens per forward "
                "pass; a longer sequence gets a micro-batch of its own), or null to count responses"
            )
    if cfg.trainer.max_steps is not None and cfg.trainer.max_steps <= 0:
        errors.append(f"trainer.max_steps={cfg.trainer.max_steps} must be > 0 (or null for total_epochs)")
    cpus = cfg.trainer.cpus_per_worker
    if cpus is not None and cpus <= 0:
        errors.append(f"trainer.cpus_per_worker={cpus} must be > 0 (CPUs per training process), or null")
    min_pixels, max_pixels = cfg.data.min_pixels, cfg.data.max_pixels
    for key, value in (("data.min_pixels", min_pixels), ("data.max_pixels", max_pixels)):
        if value is not None and value <= 0:
            errors.append(f"{key}={value} must be > 0 (or null for no bound)")
    if min_pixels is not None and max_pixels is not None and min_pixels > max_pixels:
        errors.append(f"data.min_pixels={min_pixels} exceeds data.max_pixels={max_pixels}")
    actor = cfg.worker.actor
    if actor.log_prob_chunk_tokens < 0:
        errors.append(
            f"worker.actor.log_prob_chunk_tokens={actor.log_prob_chunk_tokens} must be >= 0 (tokens per "
            "chunk of the log-prob head; 0 = unchunked)"
        )
    if actor.clip_ratio_dual <= 1:
        errors.append(
            f"worker.actor.clip_ratio_dual={actor.clip_ratio_dual} must be > 1 (dual-clip constant c)"
        )


def _check_policy_loss(errors: list[str], cfg: PPOConfig) -> None:
    """Clip ratios that mean something for ``loss_type`` (null: the loss's default), SAPO temperatures."""
    actor = cfg.worker.actor
    low, high, loss = actor.clip_ratio_low, actor.clip_ratio_high, actor.loss_type
    if loss == "sapo" and (low is not None or high is not None):
        errors.append(
            "worker.actor.clip_ratio_low/clip_ratio_high: loss_type=sapo has no clip (a soft gate, tuned by "
            "tau_positive/tau_negative); set them to null"
        )
    if loss == "kl_cov" and (low is not None or high is not None):
        errors.append(
            "worker.actor.clip_ratio_low/clip_ratio_high: loss_type=kl_cov has no ratio clip (a KL penalty "
            "on the high-covariance tokens, tuned by kl_cov_ratio/kl_cov_coef); set them to null"
        )
    if high is not None and high <= 0:
        errors.append(f"worker.actor.clip_ratio_high={high} must be > 0 (the ratio's upper bound is 1 + it)")
    if low is not None and loss == "cispo" and not 0 <= low <= 1:
        errors.append(
            f"worker.actor.clip_ratio_low={low}: cispo bounds its weight below by 1 - clip_ratio_low, so it "
            "must lie in [0, 1] (0: weight >= 1; 1: no lower bound)"
        )
    elif low is not None and loss in ("ppo", "gspo", "gspo_token", "clip_cov") and not 0 < low < 1:
        errors.append(
            f"worker.actor.clip_ratio_low={low} must lie in (0, 1) for loss_type={loss}: the ratio is "
            "clipped below at 1 - clip_ratio_low, which must stay positive (null: the loss's default)"
        )
    for key in ("tau_positive", "tau_negative"):
        if getattr(actor, key) <= 0:
            errors.append(f"worker.actor.{key}={getattr(actor, key)} must be > 0 (SAPO gate temperature)")
    for key in ("clip_cov_ratio", "kl_cov_ratio"):
        if not 0 < getattr(actor, key) <= 1:
            errors.append(
                f"worker.actor.{key}={getattr(actor, key)} must lie in (0, 1] (a fraction of the tokens)"
            )
    if actor.clip_cov_lb >= actor.clip_cov_ub:
        errors.append(
            f"worker.actor.clip_cov_lb={actor.clip_cov_lb} must be below clip_cov_ub={actor.clip_cov_ub} "
            "(clip_cov draws tokens whose covariance lies between them)"
        )
    if actor.kl_cov_coef < 0:
        errors.append(f"worker.actor.kl_cov_coef={actor.kl_cov_coef} must be >= 0")


def _check_entropy(errors: list[str], cfg: PPOConfig) -> None:
    """The entropy bonus, its top-k measure and the adaptive control's bounds."""
    actor = cfg.worker.actor
    adaptive = actor.adaptive_entropy
    key = "worker.actor.adaptive_entropy"
    if actor.entropy_top_k < 0:
        errors.append(
            f"worker.actor.entropy_top_k={actor.entropy_top_k} must be >= 0 (0: the whole vocabulary)"
        )
    if not adaptive.enabled:
        return
    if adaptive.target_entropy <= 0:
        errors.append(f"{key}.target_entropy={adaptive.target_entropy} must be > 0 (nats per token)")
    if adaptive.delta_ent_coef <= 0:
        errors.append(f"{key}.delta_ent_coef={adaptive.delta_ent_coef} must be > 0")
    if not 0 <= adaptive.min_ent_coef <= adaptive.max_ent_coef:
        errors.append(
            f"{key}: need 0 <= min_ent_coef <= max_ent_coef; found {adaptive.min_ent_coef} and "
            f"{adaptive.max_ent_coef}"
        )
    elif not adaptive.min_ent_coef <= actor.entropy_coeff <= adaptive.max_ent_coef:
        errors.append(
            f"worker.actor.entropy_coeff={actor.entropy_coeff} is the adaptive coefficient's start: it must "
            f"lie in [{key}.min_ent_coef, max_ent_coef] = [{adaptive.min_ent_coef}, {adaptive.max_ent_coef}]"
        )


def _check_overlong(errors: list[str], cfg: PPOConfig) -> None:
    reward, max_length = cfg.worker.reward, cfg.data.max_response_length
    if not 0 <= reward.overlong_buffer_length < max_length:
        errors.append(
            f"worker.reward.overlong_buffer_length={reward.overlong_buffer_length} must lie in [0, "
            f"data.max_response_length={max_length}): the punishment starts that many tokens before the "
            "maximum length (0 = off)"
        )
    if reward.overlong_penalty_factor < 0:
        errors.append(
            f"worker.reward.overlong_penalty_factor={reward.overlong_penalty_factor} must be >= 0 "
            "(the punishment of a response reaching data.max_response_length)"
        )


def _check_media(errors: list[str], cfg: PPOConfig) -> None:
    data = cfg.data
    positive = {
        "data.video_fps": data.video_fps,
        "data.max_video_frames": data.max_video_frames,
        "data.min_video_frames": data.min_video_frames,
        "data.video_min_pixels": data.video_min_pixels,
        "data.max_audio_seconds": data.max_audio_seconds,
    }
    for key, value in positive.items():
        if value <= 0:
            errors.append(f"{key}={value} must be > 0")
    if data.num_video_frames is not None and data.num_video_frames <= 0:
        errors.append(
            f"data.num_video_frames={data.num_video_frames} must be > 0 (or null to sample by video_fps)"
        )
    if data.num_video_frames is not None and data.num_video_frames > data.max_video_frames > 0:
        # the sampling caps the count at max_video_frames: 1,024 frames asked with the default 64 would
        # silently give every video 64 frames
        errors.append(
            f"data.num_video_frames={data.num_video_frames} exceeds data.max_video_frames="
            f"{data.max_video_frames}, which caps every video's frames: raise data.max_video_frames to "
            f"{data.num_video_frames}"
        )
    if data.video_total_pixels is not None and data.video_total_pixels <= 0:
        errors.append(
            f"data.video_total_pixels={data.video_total_pixels} must be > 0 (or null for qwen-vl-utils' budget)"
        )
    if data.video_min_pixels > data.video_max_pixels:
        errors.append(
            f"data.video_min_pixels={data.video_min_pixels} exceeds data.video_max_pixels={data.video_max_pixels}"
        )
    if data.preprocess_num_workers is not None and data.preprocess_num_workers < 1:
        errors.append(
            f"data.preprocess_num_workers={data.preprocess_num_workers} must be >= 1 (or null for the driver's CPUs)"
        )


def _check_rollout(errors: list[str], cfg: PPOConfig) -> None:
    rollout = cfg.worker.rollout
    if rollout.temperature < 0:
        errors.append(f"worker.rollout.temperature={rollout.temperature} must be >= 0 (0 = greedy)")
    if not 0 < rollout.top_p <= 1:
        errors.append(f"worker.rollout.top_p={rollout.top_p} must be in (0, 1]")
    if rollout.top_k == 0 or rollout.top_k < -1:
        errors.append(f"worker.rollout.top_k={rollout.top_k} must be -1 (off) or >= 1")
    for key in rollout.val_override_config:
        if key not in SAMPLING_KEYS:
            errors.append(
                f"worker.rollout.val_override_config.{key} is not a sampling key; valid: {', '.join(SAMPLING_KEYS)}"
            )
    context = cfg.data.max_prompt_length + cfg.data.max_response_length
    if rollout.max_model_len is not None and rollout.max_model_len < context:
        errors.append(
            f"worker.rollout.max_model_len={rollout.max_model_len} is shorter than data.max_prompt_length + "
            f"data.max_response_length = {context}"
        )
    engine_context = rollout.max_model_len or context
    if (
        rollout.name == "vllm"
        and not rollout.enable_chunked_prefill
        and rollout.max_num_batched_tokens < engine_context
    ):
        # vLLM refuses it at engine start: a prompt must fit one scheduler step (a long video does not)
        errors.append(
            f"worker.rollout.max_num_batched_tokens={rollout.max_num_batched_tokens} is below the vLLM context "
            f"({engine_context} tokens: worker.rollout.max_model_len, or data.max_prompt_length + "
            f"data.max_response_length), which vLLM refuses without chunked prefill: raise "
            f"worker.rollout.max_num_batched_tokens to {engine_context} or set "
            "worker.rollout.enable_chunked_prefill=true"
        )
    if not 0 < rollout.gpu_memory_utilization <= 1:
        errors.append(
            f"worker.rollout.gpu_memory_utilization={rollout.gpu_memory_utilization} must be in (0, 1]"
        )
    _check_multi_turn(errors, rollout.multi_turn)
    if rollout.multi_turn.enable and rollout.name == "vllm" and rollout.tensor_parallel_size > 1:
        errors.append(
            "worker.rollout.multi_turn needs worker.rollout.tensor_parallel_size=1 with the vllm rollout "
            "(the ranks of one engine would have to agree on every turn of every trajectory)"
        )


def _check_multi_turn(errors: list[str], multi_turn: Any) -> None:
    if not multi_turn.enable:
        return
    key = "worker.rollout.multi_turn"
    if bool(multi_turn.tools) == bool(multi_turn.environment):
        errors.append(
            f"{key}.enable=true needs either {key}.tools (tool files) or {key}.environment (path.py:Class)"
        )
    for path in multi_turn.tools:
        if not os.path.isfile(path):
            errors.append(f"{key}.tools: '{path}' is not a file")
    if multi_turn.environment and ":" not in multi_turn.environment:
        errors.append(f"{key}.environment='{multi_turn.environment}' must be path.py:ClassName")
    if multi_turn.max_turns < 1:
        errors.append(f"{key}.max_turns={multi_turn.max_turns} must be >= 1")
    if (
        multi_turn.tool_timeout <= 0
        or multi_turn.max_concurrency < 1
        or multi_turn.max_observation_tokens < 32
    ):
        errors.append(f"{key}: tool_timeout must be > 0, max_concurrency >= 1, max_observation_tokens >= 32")


def _check_algorithm(errors: list[str], cfg: PPOConfig) -> None:
    algo = cfg.algorithm
    if algo.adv_estimator in GROUP_ESTIMATORS and cfg.worker.rollout.n < 2:
        errors.append(
            f"algorithm.adv_estimator={algo.adv_estimator} compares the responses of a prompt: "
            f"set worker.rollout.n >= 2 (found {cfg.worker.rollout.n})"
        )
    if algo.online_filtering:
        _check_online_filtering(errors, cfg)
    if algo.kl_type == "adaptive" and algo.use_kl_loss:
        errors.append("algorithm.kl_type=adaptive steers the reward penalty: set algorithm.use_kl_loss=false")
    if algo.kl_coef < 0:
        errors.append(f"algorithm.kl_coef={algo.kl_coef} must be >= 0")
    if not 0 <= algo.gamma <= 1 or not 0 <= algo.lam <= 1:
        errors.append(f"algorithm.gamma={algo.gamma} and algorithm.lam={algo.lam} must lie in [0, 1]")
    _check_rollout_correction(errors, cfg)


def _check_rollout_correction(errors: list[str], cfg: PPOConfig) -> None:
    """Thresholds that bound something: a positive truncation, rejection bounds with lower < upper."""
    correction, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    if correction.rollout_is_threshold <= 0:
        errors.append(
            f"{key}.rollout_is_threshold={correction.rollout_is_threshold} must be > 0 (the importance "
            "weight's upper bound; typically 1.5-5)"
        )
    upper, lower = correction.rollout_rs_threshold, correction.rollout_rs_threshold_lower
    if upper <= 0 or (lower is not None and not 0 <= lower < upper):
        errors.append(
            f"{key}: rejection keeps ratios in [rollout_rs_threshold_lower, rollout_rs_threshold] = "
            f"[{lower}, {upper}]; need 0 <= lower < upper and upper > 0 (lower null = 1 / upper)"
        )
    elif lower is None and upper <= 1:
        errors.append(
            f"{key}.rollout_rs_threshold={upper} must be > 1 when rollout_rs_threshold_lower is null "
            "(the lower bound is then 1 / it, which must lie below it)"
        )


def _check_lora(errors: list[str], cfg: PPOConfig) -> None:
    """LoRA settings that are wrong whatever the model; target names are checked against the model's
    modules where it is built (mmrl.models.lora.lora_target_names)."""
    import importlib.util

    from mmrl.models.lora import PEFT_HINT

    lora, key = cfg.worker.actor.model.lora, "worker.actor.model.lora"
    if lora.rank < 0:
        errors.append(f"{key}.rank={lora.rank} must be >= 0 (0 = full fine-tuning)")
    if lora.alpha <= 0:
        errors.append(f"{key}.alpha={lora.alpha} must be > 0: the adapter's update is (alpha / rank) * B @ A")
    if not lora.target_modules.strip(" ,"):
        errors.append(f"{key}.target_modules is empty: all-linear, or module names such as q_proj,v_proj")
    if lora.exclude_modules is not None:
        try:
            re.compile(lora.exclude_modules)
        except re.error as error:
            errors.append(f"{key}.exclude_modules={lora.exclude_modules!r} is not a valid regex: {error}")
    if lora.rank > 0 and importlib.util.find_spec("peft") is None:
        errors.append(PEFT_HINT)


def _check_encoding_cache(errors: list[str], cfg: PPOConfig) -> None:
    """The disk cache holds frozen towers' encodings: some tower must be frozen and free of adapters."""
    model, key = cfg.worker.actor.model, "worker.actor.model"
    if model.encoding_cache_max_gb <= 0:
        errors.append(f"{key}.encoding_cache_max_gb={model.encoding_cache_max_gb} must be > 0")
    if model.encoding_cache_dir is None:
        return
    if not model.share_encodings:
        errors.append(
            f"{key}.encoding_cache_dir is set with {key}.share_encodings=false: the disk keeps shared "
            "encodings only; unset one of them"
        )
    elif model.lora.rank > 0:
        errors.append(
            f"{key}.encoding_cache_dir is set with {key}.lora.rank={model.lora.rank}: an adapter may reach "
            "into the vision tower, so no encoding is cached; unset encoding_cache_dir"
        )
    elif not model.freeze_vision_tower and not cfg.algorithm.use_reference:
        errors.append(
            f"{key}.encoding_cache_dir is set but no tower is frozen: set {key}.freeze_vision_tower=true "
            "(or use a reference model, algorithm.disable_kl=false), or unset encoding_cache_dir"
        )


def _check_reused_encodings(errors: list[str], cfg: PPOConfig) -> None:
    """The rollout takes the actor's encodings only from a frozen tower, into vLLM, one turn a prompt."""
    rollout, key = cfg.worker.rollout, "worker.rollout.reuse_encodings"
    if not rollout.reuse_encodings:
        return
    model = cfg.worker.actor.model
    if rollout.name != "vllm":
        errors.append(f"{key}=true needs worker.rollout.name=vllm (got {rollout.name!r}); unset it")
    if not model.freeze_vision_tower or model.lora.rank > 0 or not model.share_encodings:
        errors.append(
            f"{key}=true needs a frozen tower without an adapter, its encodings shared: set "
            "worker.actor.model.freeze_vision_tower=true, lora.rank=0 and share_encodings=true, or unset it"
        )
    if rollout.multi_turn.enable:
        errors.append(f"{key}=true is for single-turn rollouts (worker.rollout.multi_turn is on); unset it")


def _check_online_filtering(errors: list[str], cfg: PPOConfig) -> None:
    algo, data = cfg.algorithm, cfg.data
    if algo.adv_estimator not in GROUP_ESTIMATORS:
        errors.append(
            f"algorithm.online_filtering drops prompt groups whose responses score alike, which only "
            f"matters to a group estimator: set algorithm.adv_estimator to one of {list(GROUP_ESTIMATORS)} "
            f"(found {algo.adv_estimator}) or algorithm.online_filtering=false"
        )
    if cfg.worker.rollout.n < 2:
        errors.append(
            f"algorithm.online_filtering needs groups of responses: set worker.rollout.n >= 2 "
            f"(found {cfg.worker.rollout.n})"
        )
    if data.mini_rollout_batch_size is not None and data.mini_rollout_batch_size <= 0:
        errors.append(
            f"data.mini_rollout_batch_size={data.mini_rollout_batch_size} must be > 0 (prompts generated "
            "per round), or null for data.rollout_batch_size"
        )
    if algo.filter_low > algo.filter_high:
        errors.append(
            f"algorithm.filter_low={algo.filter_low} exceeds algorithm.filter_high={algo.filter_high}: "
            "no group could be kept"
        )
    if cfg.trainer.max_try_make_batch == 0 or cfg.trainer.max_try_make_batch < -1:
        errors.append(
            f"trainer.max_try_make_batch={cfg.trainer.max_try_make_batch} must be >= 1 (generation rounds "
            "per step), or -1 for no limit"
        )


def _check_paths(errors: list[str], cfg: PPOConfig) -> None:
    data = cfg.data
    if not data.train_files:
        errors.append("data.train_files is required (e.g. data.train_files=data/train.jsonl)")
    _check_dataset(errors, "data.train_files", data.train_files)
    _check_dataset(errors, "data.val_files", data.val_files)
    if cfg.trainer.val_only and not data.val_files:
        errors.append(
            "trainer.val_only=true validates and exits, but data.val_files is not set: set "
            "data.val_files (e.g. data/val.jsonl) or trainer.val_only=false"
        )
    if data.format_prompt and not os.path.isfile(data.format_prompt):
        errors.append(f"data.format_prompt: template '{data.format_prompt}' does not exist")
    if data.override_chat_template and not os.path.isfile(data.override_chat_template):
        errors.append(f"data.override_chat_template: template '{data.override_chat_template}' does not exist")
    if data.media_dir and not os.path.isdir(data.media_dir):
        errors.append(f"data.media_dir: folder '{data.media_dir}' does not exist")
    actor_model = cfg.worker.actor.model
    actor_folder = _check_model_path(errors, "worker.actor.model.model_path", actor_model.model_path, True)
    _check_model_path(errors, "worker.actor.model.tokenizer_path", actor_model.tokenizer_path, False)
    if actor_folder is not None:
        _check_ulysses_heads(errors, cfg, "actor", actor_folder)
    if cfg.use_critic:
        critic_key = "worker.critic.model.model_path"
        critic_path = cfg.worker.critic.model.model_path
        critic_folder = (
            _check_model_path(errors, critic_key, critic_path, False) if critic_path else actor_folder
        )
        if critic_folder is not None:
            _check_ulysses_heads(errors, cfg, "critic", critic_folder)
    reward = cfg.worker.reward.reward_function
    judge, reward_model = cfg.worker.reward.judge, cfg.worker.reward.reward_model
    code = cfg.worker.reward.code
    if not reward and not judge.enable and not reward_model.model_path and not code.enable:
        errors.append(
            "worker.reward.reward_function is required (e.g. ./reward_functions/math.py:compute_score), "
            "unless worker.reward.judge.enable=true, worker.reward.reward_model.model_path is set or "
            "worker.reward.code.enable=true"
        )
    elif reward:
        path, _ = split_function_spec(reward)
        if not os.path.isfile(path):
            errors.append(f"worker.reward.reward_function: file '{path}' does not exist")
    for key, template in (
        ("worker.reward.judge.prompt_template", judge.prompt_template if judge.enable else None),
        ("worker.reward.reward_model.prompt_template", reward_model.prompt_template),
    ):
        if template and not os.path.isfile(template):
            errors.append(f"{key}: file '{template}' does not exist")
    if judge.enable and judge.serve.model_path:
        _check_model_path(errors, "worker.reward.judge.serve.model_path", judge.serve.model_path, False)
    if reward_model.model_path:
        _check_model_path(errors, "worker.reward.reward_model.model_path", reward_model.model_path, False)
    if cfg.trainer.load_checkpoint_path and not os.path.isdir(cfg.trainer.load_checkpoint_path):
        errors.append(
            f"trainer.load_checkpoint_path: folder '{cfg.trainer.load_checkpoint_path}' does not exist"
        )


def _check_code(errors: list[str], cfg: PPOConfig, check_paths: bool) -> None:
    """worker.reward.code: limits that let a program run, and the sandbox's paths (when enabled)."""
    code = cfg.worker.reward.code
    if not code.enable:
        return
    sandbox, prefix = code.sandbox, "worker.reward.code.sandbox."
    for name in (
        "max_concurrency",
        "cpu_time_s",
        "wall_time_s",
        "memory_bytes",
        "file_size_bytes",
        "disk_bytes",
    ):
        if getattr(sandbox, name) <= 0:
            errors.append(f"{prefix}{name}={getattr(sandbox, name)} must be > 0")
    for name, least in (("max_processes", 1), ("max_open_files", 8), ("max_output_bytes", 1)):
        if getattr(sandbox, name) < least:
            errors.append(f"{prefix}{name}={getattr(sandbox, name)} must be >= {least}")
    if code.max_test_cases < 0:
        errors.append(
            f"worker.reward.code.max_test_cases={code.max_test_cases} must be >= 0 (0 = every case)"
        )
    if not code.test_cases_key:
        errors.append("worker.reward.code.test_cases_key is empty: name the column holding the test cases")
    if not check_paths:
        return
    if sandbox.python is not None and not os.path.isfile(sandbox.python):
        errors.append(f"{prefix}python: interpreter '{sandbox.python}' does not exist")
    for path in sandbox.read_only_paths:
        if not os.path.exists(path):
            errors.append(f"{prefix}read_only_paths: '{path}' does not exist")


def _check_reward_sources(errors: list[str], cfg: PPOConfig) -> None:
    """The judge can be reached, the sources' numbers make sense, a combining rule file exists."""
    reward = cfg.worker.reward
    judge = reward.judge
    if judge.enable and not judge.base_url and not judge.serve.model_path:
        errors.append(
            "worker.reward.judge.enable=true needs an endpoint: worker.reward.judge.base_url (e.g. "
            "http://127.0.0.1:8000/v1), or worker.reward.judge.serve.model_path for mmrl to serve one"
        )
    if judge.enable and judge.serve.model_path and cfg.trainer.nnodes > 1 and judge.serve.host != "node":
        errors.append(
            f"worker.reward.judge.serve.host={judge.serve.host} with trainer.nnodes={cfg.trainer.nnodes}: reward "
            f"workers on the other machines cannot reach the served judge; set worker.reward.judge.serve.host="
            f"node (its node's address, reachable by anyone on the network: keep the cluster's network private)"
        )
    if judge.enable and judge.base_url and not judge.serve.model_path and not judge.model:
        errors.append(
            "worker.reward.judge.model is required with base_url: the model name the endpoint serves"
        )
    if reward.combine == "rule_function" and not reward.reward_function:
        errors.append(
            "worker.reward.combine=rule_function combines in the rule file: set worker.reward.reward_function"
        )
    sections = {"rule": reward.rule, "judge": judge, "reward_model": reward.reward_model, "code": reward.code}
    for name, section in sections.items():
        if not 0 <= section.max_failed_fraction <= 1:
            errors.append(
                f"worker.reward.{name}.max_failed_fraction={section.max_failed_fraction} must lie in [0, 1]"
            )
    positive = {
        "worker.reward.judge.number_max": judge.number_max,
        "worker.reward.judge.max_tokens": judge.max_tokens,
        "worker.reward.judge.video_frames": judge.video_frames,
        "worker.reward.judge.max_concurrency": judge.max_concurrency,
        "worker.reward.judge.timeout_s": judge.timeout_s,
        "worker.reward.judge.serve.startup_timeout_s": judge.serve.startup_timeout_s,
        "worker.reward.reward_model.batch_size": reward.reward_model.batch_size,
        "worker.reward.reward_model.max_length": reward.reward_model.max_length,
    }
    errors.extend(f"{key}={value} must be > 0" for key, value in positive.items() if value <= 0)
    for key, value in (("judge.max_retries", judge.max_retries), ("judge.backoff_s", judge.backoff_s)):
        if value < 0:
            errors.append(f"worker.reward.{key}={value} must be >= 0")


def validate_config(cfg: PPOConfig, check_paths: bool = True) -> list[str]:
    """All cross-field rules of a run; returns one message per violated rule (empty when valid)."""
    errors: list[str] = []
    _check_positive(errors, cfg)
    _check_media(errors, cfg)
    _check_batches(errors, cfg)
    _check_sequence_parallel(errors, cfg)
    _check_rollout(errors, cfg)
    _check_algorithm(errors, cfg)
    _check_lora(errors, cfg)
    _check_encoding_cache(errors, cfg)
    _check_reused_encodings(errors, cfg)
    _check_policy_loss(errors, cfg)
    _check_entropy(errors, cfg)
    _check_overlong(errors, cfg)
    _check_code(errors, cfg, check_paths)
    _check_reward_sources(errors, cfg)
    _check_choices(errors, cfg)
    if check_paths:
        _check_paths(errors, cfg)
    return errors
