"""Command line: ``python -m mmrl.trainer.main config=x.yaml key=value ... [--dry-run]``.

Loads and validates the config (exit code 2 with every problem listed, no traceback, on a user
error), prints it — the printed config is exactly the one that runs — then starts training.
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
    try:
        config = load_config(args)
    except ConfigError as err:
        print(f"mmrl: {err}", file=sys.stderr)
        return 2
    print(config_to_yaml(config), flush=True)
    if dry_run:
        return 0
    try:
        from mmrl.trainer.ray_trainer import run
    except ImportError:
        print("mmrl: the training engine is not built yet (issue 'Training engine')", file=sys.stderr)
        return 3
    return run(config)


if __name__ == "__main__":
    sys.exit(main())
