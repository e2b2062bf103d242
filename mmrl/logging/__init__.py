"""Metric and sample logging: `build_loggers(trainer.logger, ...)` → `Tracker`."""

from mmrl.logging.console import ConsoleLogger
from mmrl.logging.loggers import (
    GENERATION_COLUMNS,
    LOGGER_NAMES,
    JsonlLogger,
    MlflowLogger,
    SwanlabLogger,
    TensorboardLogger,
    Tracker,
    WandbLogger,
    build_loggers,
)

__all__ = [
    "GENERATION_COLUMNS",
    "LOGGER_NAMES",
    "ConsoleLogger",
    "JsonlLogger",
    "MlflowLogger",
    "SwanlabLogger",
    "TensorboardLogger",
    "Tracker",
    "WandbLogger",
    "build_loggers",
]
