"""Command line: ``python -m mmrl.trainer.main config=x.yaml key=value ... [--dry-run] [--debug]``.

Loads and validates the config, prints it (the printed config is exactly the one that runs), checks
the run's inputs before Ray starts (:mod:`mmrl.trainer.preflight`), then trains. Exit codes: 0 done;
1 training failed; 2 a user error (config, data, media, template, reward file, model folder, paths),
one message naming the file, row or key and what to do; 3 a broken mmrl installation. No traceback
unless ``--debug`` (or ``MMRL_DEBUG=1``).
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence

from mmrl.config.loading import config_to_yaml, load_config
from mmrl.errors import UserInputError
from mmrl.runtime.startup import collector_paused, freeze_heap

USAGE = """usage: python -m mmrl.trainer.main config=path/to/config.yaml [section.key=value ...] [--dry-run] [--debug]

  config=FILE   YAML file merged over the defaults (see examples/config.yaml for every key)
  a.b.c=VALUE   override one key, e.g. worker.rollout.n=8 trainer.max_steps=100
  --dry-run     validate and print the resolved config, then exit (the config only: data, model
                folder contents and the reward file are checked when a run starts, before Ray)
  --debug       show the traceback of an error (also MMRL_DEBUG=1)

exit codes: 0 done, 1 training failed, 2 a mistake in the inputs (the message names it), 3 broken install
"""
DEBUG_FLAG = "--debug"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in args):
        print(USAGE)
        return 0
    dry_run = "--dry-run" in args
    debug = DEBUG_FLAG in args or os.environ.get("MMRL_DEBUG", "").strip() not in ("", "0")
    args = [arg for arg in args if arg not in ("--dry-run", DEBUG_FLAG)]
    try:
        return _load_check_and_run(args, dry_run)
    except UserInputError as err:  # before Ray (config, preflight) or on the driver as the run starts
        return _report(err, 2, debug)
    except ImportError as err:  # a package the engine imports (ray, torch, ...) missing or too old
        if debug:
            raise
        return report_import_error(err)
    except Exception as err:  # a failure during training that the trainer did not turn into a message
        if debug:
            raise
        return _report(err, 1, debug, f"training failed with {type(err).__name__}: ")


def _load_check_and_run(args: list[str], dry_run: bool) -> int:
    with collector_paused():  # the imports of torch, transformers and Ray (mmrl.runtime.startup)
        notes: list[str] = []
        config = load_config(args, notes=notes)
        if notes:  # EasyR1 spellings translated: what changed on the way to the printed config
            print("# translated from EasyR1 (see docs/config.md):\n" + "\n".join(f"#   {n}" for n in notes))
        print(config_to_yaml(config), flush=True)
        if dry_run:
            return 0
        from mmrl.trainer.preflight import preflight

        preflight(config)
        from mmrl.trainer.ray_trainer import run

        freeze_heap()  # this process is the run's driver from here on (mmrl.runtime.startup)
    return run(config)


def _report(err: BaseException, code: int, debug: bool, prefix: str = "") -> int:
    if debug:
        traceback.print_exception(err)
    hint = "" if debug or code == 2 else f"\n(rerun with {DEBUG_FLAG} or MMRL_DEBUG=1 for the traceback)"
    print(f"mmrl: {prefix}{err}{hint}", file=sys.stderr, flush=True)
    return code


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
