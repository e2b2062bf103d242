"""The config contract: every key of the tree is read by the library, and every accepted choice is
declared once (``config.CHOICES``), implemented, and exercised by some test.

Reads are found statically (``tests/_config_reads.py`` states what counts as reading a key); choices
are "exercised" when a test module outside the config tests names the value as a string literal
(``"gspo"``) or as the value of a ``key=value`` literal (``"worker.actor.loss_type=gspo"``,
``"trainer.logger=[console,jsonl]"``). That is a per-value check: a value shared by several keys (the
dtypes, the actor's and the critic's ``loss_avg_mode``) needs one test that uses it, so each such key
also gets a test of its own where it is wired (see the critic's modes in tests/workers).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

from _config_reads import read_keys, schema_leaves, unread_keys

from mmrl.config import CHOICES, PPOConfig

REPO = Path(__file__).resolve().parents[2]
# checking a value is not using it: the loader and the file checks do not count as readers, nor does a
# section's `check` (or a `check_*`/`_check_*` function) in the modules that define the tree
NOT_READERS = ("mmrl/config/loading.py", "mmrl/config/files.py")
SCHEMA_MODULES = ("mmrl/config/", "mmrl/data/config.py", "mmrl/algorithms/")
# keys read by something the static pass cannot see, each with the reason (keep this short)
READ_ELSEWHERE: dict[str, str] = {}
# tests that name every choice only to check validation: they do not exercise the choices
CONFIG_TESTS = (
    "tests/trainer/test_config.py",
    "tests/trainer/test_config_contract.py",
    "tests/trainer/test_easyr1_compat.py",  # EasyR1 spellings resolve: loading only, nothing runs
    "tests/_config_reads.py",
)


class _WithoutChecks(ast.NodeTransformer):
    def visit_FunctionDef(self, node: ast.FunctionDef) -> ast.AST:
        if node.name == "check" or node.name.startswith(("check_", "_check")):
            return ast.Pass()
        return self.generic_visit(node)


def library_sources() -> dict[str, str]:
    sources = {}
    for path in sorted((REPO / "mmrl").rglob("*.py")):
        relative = str(path.relative_to(REPO))
        if relative in NOT_READERS:
            continue
        text = path.read_text()
        if relative.startswith(SCHEMA_MODULES):
            text = ast.unparse(_WithoutChecks().visit(ast.parse(text)))
        sources[".".join(path.relative_to(REPO).with_suffix("").parts)] = text
    return sources


def test_a_sections_check_is_not_a_read():
    """``mmrl/config/reward.py`` checks ``worker.reward.judge.number_max`` > 0 beside the field; the
    check is left out of the pass, the judge's parser still reads it."""
    module = library_sources()["mmrl.config.reward"]
    assert "def check(" not in module and "_check_reward_sources" not in module
    assert "worker.reward.judge.number_max" not in unread_keys(PPOConfig, library_sources())


# ---------------------------------------------------------------- every key is read


def test_every_config_key_is_read_by_the_library():
    unread = [key for key in unread_keys(PPOConfig, library_sources()) if key not in READ_ELSEWHERE]
    assert not unread, (
        f"config keys that no library code reads (wire them, remove them, or, if something the static "
        f"pass cannot see reads them, list them in READ_ELSEWHERE with the reason): {unread}"
    )


def test_allow_list_names_real_keys_that_the_pass_misses():
    read = read_keys(PPOConfig, library_sources())
    stale = [key for key in READ_ELSEWHERE if key in read or key not in set(schema_leaves(PPOConfig))]
    assert not stale, f"READ_ELSEWHERE entries that are read after all or no longer exist: {stale}"


# A synthetic tree: the same section class (Offload) under two roles, read in different ways.
@dataclasses.dataclass(frozen=True)
class Offload:
    params: bool = False
    optimizer: bool = False


@dataclasses.dataclass(frozen=True)
class Role:
    lr: float = 1.0
    ring: int = 1
    ulysses: int = 1
    offload: Offload = dataclasses.field(default_factory=Offload)

    @property
    def sp_size(self) -> int:
        return self.ring * self.ulysses


@dataclasses.dataclass(frozen=True)
class Root:
    actor: Role = dataclasses.field(default_factory=Role)
    ref: Role = dataclasses.field(default_factory=Role)


SYNTHETIC_LIBRARY = """
def park(offload: Offload, model):           # reads both keys of whatever section it is handed
    return offload.params, offload.optimizer


def park_params(offload: Offload, model):    # reads one
    return offload.params


class Worker:
    def __init__(self, config: Root):
        self.config = config
        role = config.actor
        park(role.offload, None)
        self.groups = role.sp_size             # a property: reads ring and ulysses of the actor

    def ref_pass(self):
        park_params(model=None, offload=self.config.ref.offload)
        return getattr(self.config.ref, "lr")
"""


def test_the_read_check_catches_a_key_read_in_one_section_but_not_in_another():
    """``offload.optimizer`` is read in the actor's section and not in the ref's: the ref's is
    reported (a search for the name alone would find it read). So are the keys nothing reads."""
    schema = inspect.getsource(Role)  # the definition module: where the property's reads are found
    unread = unread_keys(Root, {"synthetic_config": schema, "synthetic": SYNTHETIC_LIBRARY})
    assert unread == ["actor.lr", "ref.ring", "ref.ulysses", "ref.offload.optimizer"]
    # reading it makes the report go away
    wired = SYNTHETIC_LIBRARY.replace("park_params(model", "park(model")
    assert unread_keys(Root, {"synthetic_config": schema, "synthetic": wired}) == [
        "actor.lr",
        "ref.ring",
        "ref.ulysses",
    ]


@dataclasses.dataclass(frozen=True)
class LossKnobs:
    clip: float = 0.2
    tau: float = 1.0


@dataclasses.dataclass(frozen=True)
class Policy(LossKnobs):  # the loss knobs sit at exactly one place: under `policy`
    lr: float = 1.0


@dataclasses.dataclass(frozen=True)
class Tree:
    policy: Policy = dataclasses.field(default_factory=Policy)
    ref: Role = dataclasses.field(default_factory=Role)


REGISTRY_LIBRARY = """
LOSSES = {}

def clipped(x, options: LossKnobs):   # reached only through LOSSES[name]: not followable by name
    return x * options.clip

def step(config: Tree):
    return LOSSES["clipped"](1.0, config.policy) + config.policy.lr
"""


def test_a_section_class_at_one_place_counts_its_reads_wherever_the_function_is_called_from():
    """Rule 6: ``LossKnobs`` is a base of ``Policy`` only, so ``options.clip`` in a function reached
    through a registry is ``policy.clip``; ``Role`` sits under ``ref`` here and under nothing else, but
    nothing reads it."""
    unread = unread_keys(Tree, {"synthetic": REGISTRY_LIBRARY})
    assert unread == [
        "policy.tau",
        "ref.lr",
        "ref.ring",
        "ref.ulysses",
        "ref.offload.params",
        "ref.offload.optimizer",
    ]
    untyped = REGISTRY_LIBRARY.replace("options: LossKnobs", "options")  # no annotation: not a read
    assert "policy.clip" in unread_keys(Tree, {"synthetic": untyped})


# ---------------------------------------------------------------- every choice is declared, implemented, tested


def _keys_of(cls: type, field_name: str, node: type = PPOConfig, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(node):
        hint = type(getattr(node(), f.name))
        if dataclasses.is_dataclass(hint):
            keys += _keys_of(cls, field_name, hint, f"{prefix}{f.name}.")
        elif node is cls and f.name == field_name:
            keys.append(prefix + f.name)
    return keys


def test_every_declared_choice_is_a_key_of_the_tree_with_a_valid_default():
    for (cls, field_name), values in CHOICES.items():
        assert _keys_of(cls, field_name), f"CHOICES names {cls.__name__}.{field_name}, not in the tree"
        default = getattr(cls(), field_name)
        for item in default if isinstance(default, list) else [default]:
            assert item is None or item in values, (cls.__name__, field_name, item)


def test_choices_agree_with_the_code_that_implements_them():
    from mmrl import config, core_algos
    from mmrl.logging.loggers import LOGGER_NAMES
    from mmrl.rewards import compose, parsers, reward_model
    from mmrl.workers import fsdp_engine

    implemented = {
        (config.AlgorithmConfig, "adv_estimator"): core_algos.ADV_ESTIMATORS,
        (config.AlgorithmConfig, "kl_penalty"): core_algos.KL_ESTIMATORS,
        (config.AlgorithmConfig, "kl_type"): core_algos.KL_CONTROLLER_TYPES,
        (config.ActorConfig, "loss_type"): core_algos.POLICY_LOSSES,
        (config.ActorConfig, "loss_avg_mode"): core_algos.LOSS_AGG_MODES,
        (config.CriticConfig, "loss_avg_mode"): core_algos.LOSS_AGG_MODES,
        (config.OptimConfig, "strategy"): fsdp_engine.OPTIMIZERS,
        (config.OptimConfig, "lr_scheduler_type"): fsdp_engine.SCHEDULER_TYPES,
        (config.TrainerConfig, "logger"): LOGGER_NAMES,
        (config.RewardConfig, "combine"): compose.COMBINES,
        (config.JudgeConfig, "parser"): tuple(parsers.PARSERS),
        (config.RewardModelConfig, "head"): reward_model.HEADS,
        (config.RewardModelConfig, "normalize"): reward_model.NORMALIZATIONS,
    }
    for key, names in implemented.items():
        assert set(CHOICES[key]) == set(names), key
    for key in [k for k in CHOICES if k[1].endswith("dtype")]:
        for name in CHOICES[key]:
            fsdp_engine.resolve_dtype(name, "cpu")  # every dtype name resolves


def _test_literals() -> set[str]:
    """String literals of the test modules outside the config tests, and the values of ``key=value``
    literals among them (list values split into their entries)."""
    literals: set[str] = set()
    for path in sorted((REPO / "tests").rglob("*.py")):
        if str(path.relative_to(REPO)) in CONFIG_TESTS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                literals.add(node.value)
                if "=" in node.value:
                    value = node.value.rsplit("=", 1)[1].strip().strip("[]")
                    literals.update(item.strip() for item in value.split(","))
    return literals


def unexercised_choices(choices: dict, literals: set[str]) -> list[str]:
    return [
        f"{cls.__name__}.{field_name}={value}"
        for (cls, field_name), values in choices.items()
        for value in values
        if value not in literals
    ]


def test_every_accepted_choice_is_exercised_by_some_test():
    missing = unexercised_choices(CHOICES, _test_literals())
    assert not missing, f"accepted values that no test outside the config tests uses: {missing}"


def test_the_choice_check_catches_a_value_no_test_uses():
    literals = _test_literals()
    extended = {**CHOICES, (Role, "strategy"): ("adamw", "lion_that_nobody_tests")}
    assert unexercised_choices(extended, literals) == ["Role.strategy=lion_that_nobody_tests"]
