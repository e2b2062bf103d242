"""Command line: ``python -m mmrl.trainer.main config=x.yaml key=value ... [--dry-run]``.

Loads and validates the config (exit code 2 with every problem listed, no traceback, on a user
error; also when a package the training engine imports is missing, naming it and its pip command),
prints it — the printed config is exactly the one that runs — then starts training.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from mmrl.trainer.config_loader import ConfigError, config_to_yaml, load_config

USAGE = """usage: python -m mmrl.trainer.main config=path/to/config.yaml [section.key=value ...] [--dry-run]

  config=FILE   YAML file merged over the defaults (see examples/config.yaml for every key)
  a.b.c=VALUE   override one key, e.g. worker.rollout.n=8 trainer.max_steps=100
  --dry-run     validate and print the resolved config, then exit
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in args):
        print(USAGE)
        return 0
    dry_run = "--dry-run" in args
    args = [arg for arg in args if arg != "--dry-run"]
    notes: list[str] = []
    try:
        config = load_config(args, notes=notes)
    except ConfigError as err:
        print(f"mmrl: {err}", file=sys.stderr)
        return 2
    if notes:  # EasyR1 spellings translated: what changed on the way to the printed config
        print("# translated from EasyR1 (see the README's table):\n" + "\n".join(f"#   {n}" for n in notes))
    print(config_to_yaml(config), flush=True)
    if dry_run:
        return 0
    try:
        from mmrl.trainer.ray_trainer import run
    except ImportError as err:
        return report_import_error(err)
    try:
        return run(config)
    except ModuleNotFoundError as err:  # a dependency the engine imports as it starts (ray, ...)
        if is_mmrl_module(err.name):
            raise  # a bug in mmrl, not the environment: keep the traceback
        return report_import_error(err)


# import names whose pip package is named differently
PIP_PACKAGES = {"PIL": "pillow", "yaml": "pyyaml", "ray": "'ray[default]'", "google": "protobuf"}


def is_mmrl_module(name: str | None) -> bool:
    return name is not None and (name == "mmrl" or name.startswith("mmrl."))


def report_import_error(err: ImportError) -> int:
    """A failed import, for people: a missing mmrl engine module (exit 3), a missing package with the
    command that installs it, or a package lacking what mmrl imports from it (exit 2). No traceback."""
    if is_mmrl_module(err.name):
        print(
            f"mmrl: the training engine module '{err.name}' is missing from this installation; "
            "reinstall mmrl (pip install -e .)",
            file=sys.stderr,
        )
        return 3
    if isinstance(err, ModuleNotFoundError) and err.name:
        top = err.name.split(".")[0]
        print(
            f"mmrl: training needs the Python package '{top}', which is not installed: "
            f"pip install {PIP_PACKAGES.get(top, top)} (or pip install -e . for every dependency of mmrl)",
            file=sys.stderr,
        )
        return 2
    print(
        f"mmrl: {err}; install the versions that pyproject.toml asks for (pip install -e .)", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    sys.exit(main())
