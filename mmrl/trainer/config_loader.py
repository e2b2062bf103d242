"""Kept so that ``mmrl.trainer.config_loader`` imports keep working: the loader is
:mod:`mmrl.config.loading`, each rule the ``check`` of its section in :mod:`mmrl.config`."""

from mmrl.config.loading import (
    STAGE_FIXED_KEYS,
    ConfigError,
    config_to_yaml,
    derived_values,
    load_config,
    parse_cli,
    schema_keys,
    stage_configs,
    validate_config,
)

__all__ = [
    "STAGE_FIXED_KEYS",
    "ConfigError",
    "config_to_yaml",
    "derived_values",
    "load_config",
    "parse_cli",
    "schema_keys",
    "stage_configs",
    "validate_config",
]
