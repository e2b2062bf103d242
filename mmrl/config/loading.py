"""Load a :class:`PPOConfig`: dataclass defaults ← YAML file ← ``key=value`` arguments (EasyR1's spellings
translated first, :mod:`mmrl.config.easyr1`), then one validation pass (each section's ``check``).

Every user mistake becomes a :class:`ConfigError` listing all problems of the config at once (unknown
keys, every value of the wrong type, every violated rule), each naming the key, what was found and what
to do; the command line turns it into exit code 2 without a traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import typing
from collections.abc import Iterator, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mmrl.algorithms import POLICY_LOSSES
from mmrl.config.easyr1 import apply_derived, translate_layer
from mmrl.config.reward import split_function_spec
from mmrl.config.schema import PPOConfig
from mmrl.data.config import split_dataset_spec
from mmrl.errors import UserInputError

# keys that EasyR1 (or an earlier mmrl) has and this schema leaves out on purpose: why, and what to use
REMOVED_KEYS = {
    "worker.critic.model.trust_remote_code": (
        "worker.actor.model.trust_remote_code applies to every load of the run, the critic's included"
    ),
}  # EasyR1's other keys without an mmrl counterpart: mmrl/config/easyr1.py (NO_EFFECT)


# a hint names a key only when it is this close: a typo (a few characters) or the same words reordered;
# a different key sharing most letters (mini_rollout_batch_size ~ rollout_batch_size) is no typo
MAX_TYPO_EDITS = 2


class ConfigError(UserInputError, ValueError):
    """One or more user errors in the configuration; ``errors`` holds one message per problem."""

    def __init__(self, errors: Sequence[str]):
        self.errors = list(errors)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {e}" for e in self.errors))


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

    EasyR1's spellings are translated first (:mod:`mmrl.config.easyr1`); each translation is appended
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
    if actor.loss_type not in POLICY_LOSSES:
        return []  # reported by validation
    clip = POLICY_LOSSES[actor.loss_type].summary(actor)
    lines = [f"worker.actor: loss_type={actor.loss_type}: {clip}"]
    if actor.model.lora.rank > 0 and cfg.algorithm.use_reference:
        lines.append(
            "worker.ref: the actor's model with its LoRA adapters switched off (no copy of the weights; "
            "worker.ref.fsdp and worker.ref.offload are unused, the actor's settings apply)"
        )
    return lines


def validate_config(cfg: PPOConfig, check_paths: bool = True) -> list[str]:
    """All rules of a run (each section's ``check``); returns one message per violated rule (empty when
    valid)."""
    return cfg.check(check_paths)
