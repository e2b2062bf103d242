"""Experiment trackers behind one `Tracker`, chosen by name in `trainer.logger`.

- `console`: progress lines on stdout (`mmrl.logging.console`).
- `jsonl`: `<log_dir>/metrics.jsonl`, one `{"step": n, **metrics}` object per call, and
  `<log_dir>/generations.jsonl`, one `{"step": n, **sample}` object per sample. Files are appended to
  (a resumed run continues them; keep the last line of a step when reading) and flushed after every
  line, so a killed run keeps its history. Non-finite values are written as `null`.
- `tensorboard`: event files in `<log_dir>/tensorboard`; generations as a markdown table of text.
- `wandb`, `mlflow`, `swanlab`: imported only when selected, from the `loggers` extra
  (`pip install 'mmrl[loggers]'`). wandb follows `WANDB_MODE` (`offline`: a local run in
  `<log_dir>/wandb`), swanlab `SWANLAB_MODE`, as those libraries document. mlflow follows
  `MLFLOW_TRACKING_URI`; unset, it writes a local file store in `<log_dir>/mlruns`.

Generation samples are dicts with `prompt`, `response`, `ground_truth` and `score` (other keys are kept
by the jsonl backend only).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from mmrl.logging.console import ConsoleLogger

__all__ = [
    "LOGGER_NAMES",
    "GENERATION_COLUMNS",
    "Backend",
    "Tracker",
    "build_loggers",
    "JsonlLogger",
    "TensorboardLogger",
    "WandbLogger",
    "MlflowLogger",
    "SwanlabLogger",
    "flatten_config",
]

LOGGER_NAMES = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "swanlab")
GENERATION_COLUMNS = ("prompt", "response", "ground_truth", "score")

# logger name → (module imported at build time, pip package that provides it)
_REQUIRED_MODULES = {
    "tensorboard": ("torch.utils.tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "swanlab": ("swanlab", "swanlab"),
}


class Backend(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None: ...

    def finish(self, failed: bool = False) -> None: ...


class Tracker:
    """Fans every call out to the selected backends, after turning metric values into floats."""

    def __init__(self, backends: dict[str, Backend]) -> None:
        self.backends = dict(backends)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """`metrics` values may be Python numbers, NumPy scalars or one-element tensors."""
        clean = {key: _to_float(key, value) for key, value in metrics.items()}
        for backend in self.backends.values():
            backend.log(clean, step)

    def log_generations(self, samples: Sequence[dict[str, Any]], step: int) -> None:
        """Validation samples: dicts with `prompt`, `response`, `ground_truth`, `score`."""
        if not samples:
            return
        clean = [{key: _to_plain(value) for key, value in sample.items()} for sample in samples]
        for backend in self.backends.values():
            backend.log_generations(clean, step)

    def finish(self, failed: bool = False) -> None:
        """Close every backend (each is tried even if another fails); later calls do nothing.
        ``failed``: training stopped with an error; the hosted trackers mark the run failed (wandb: exit
        code 1, MLflow: status FAILED), the console says so."""
        backends, self.backends = self.backends, {}
        errors = []
        for name, backend in backends.items():
            try:
                backend.finish(failed)
            except Exception as error:  # the other backends must still close their files
                errors.append((name, error))
        if errors:
            name, error = errors[0]
            raise RuntimeError(f"Logger {name!r} failed to finish: {error}") from error

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.finish()


def build_loggers(
    names: Sequence[str],
    project_name: str,
    experiment_name: str,
    log_dir: str,
    config_dict: dict[str, Any] | None,
    total_steps: int | None,
    start_step: int = 0,
    label: str = "",
) -> Tracker:
    """A `Tracker` over the backends named in `names` (any of `LOGGER_NAMES`, duplicates ignored).

    `log_dir` holds the jsonl files, tensorboard events and the wandb/swanlab local folders;
    `config_dict` is the run's config as nested plain dicts (hyperparameters for the trackers);
    `total_steps` and `start_step` (the step a resumed run starts after) drive the console ETA;
    `label` prefixes the console's progress line (a multi-stage run's stage).
    Every optional package is checked before any backend starts, so a missing one fails fast with the
    pip command that fixes it.
    """
    unknown = [name for name in names if name not in LOGGER_NAMES]
    if unknown:
        raise ValueError(f"trainer.logger: unknown loggers {unknown}; choose from {list(LOGGER_NAMES)}.")
    selected = list(dict.fromkeys(names))
    for name in selected:
        if name in _REQUIRED_MODULES:
            _import_for_logger(name)
    config_dict = dict(config_dict or {})
    if set(selected) - {"console"}:
        os.makedirs(log_dir, exist_ok=True)

    backends: dict[str, Backend] = {}
    for name in selected:
        if name == "console":
            backends[name] = ConsoleLogger(total_steps, start_step=start_step, label=label)
        elif name == "jsonl":
            backends[name] = JsonlLogger(log_dir)
        elif name == "tensorboard":
            backends[name] = TensorboardLogger(os.path.join(log_dir, "tensorboard"), config_dict)
        elif name == "wandb":
            backends[name] = WandbLogger(project_name, experiment_name, log_dir, config_dict)
        elif name == "mlflow":
            backends[name] = MlflowLogger(project_name, experiment_name, log_dir, config_dict)
        elif name == "swanlab":
            backends[name] = SwanlabLogger(project_name, experiment_name, log_dir, config_dict)
    return Tracker(backends)


def _import_for_logger(name: str) -> Any:
    module_name, pip_package = _REQUIRED_MODULES[name]
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(
            f"trainer.logger includes {name!r}, but importing {module_name!r} failed ({error}). "
            f"Install it with `pip install {pip_package}` (or all trackers with "
            f"`pip install 'mmrl[loggers]'`), or remove {name!r} from trainer.logger."
        ) from error


# ---------------------------------------------------------------------------------------------- files


class JsonlLogger:
    """Appends metrics and generations to JSON-lines files in `log_dir` (see module docstring)."""

    def __init__(self, log_dir: str) -> None:
        os.makedirs(log_dir, exist_ok=True)
        self.metrics_path = os.path.join(log_dir, "metrics.jsonl")
        self.generations_path = os.path.join(log_dir, "generations.jsonl")
        self._metrics_file = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in finish
        self._generations_file = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = {
            "step": step,
            **{key: value if math.isfinite(value) else None for key, value in metrics.items()},
        }
        self._metrics_file.write(json.dumps(record, allow_nan=False) + "\n")
        self._metrics_file.flush()

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        if self._generations_file is None:
            self._generations_file = open(self.generations_path, "a", encoding="utf-8")  # noqa: SIM115
        for sample in samples:
            line = json.dumps({"step": step, **sample}, ensure_ascii=False, default=str)
            self._generations_file.write(line + "\n")
        self._generations_file.flush()

    def finish(self, failed: bool = False) -> None:
        self._metrics_file.close()
        if self._generations_file is not None:
            self._generations_file.close()


class TensorboardLogger:
    """Scalars and generation tables in tensorboard event files under `log_dir`."""

    def __init__(self, log_dir: str, config_dict: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir)
        if config_dict:
            config_text = json.dumps(config_dict, indent=2, default=str)
            self._writer.add_text("config", f"```\n{config_text}\n```", global_step=0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        # The writer's own flush runs every 2 minutes; a killed run would lose those steps.
        self._writer.flush()

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        self._writer.add_text("val/generations", generations_markdown(samples), global_step=step)
        self._writer.flush()

    def finish(self, failed: bool = False) -> None:
        self._writer.close()


def generations_markdown(samples: list[dict[str, Any]]) -> str:
    """A markdown table with one row per sample and the `GENERATION_COLUMNS` as columns."""

    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\r", "").replace("\n", "<br>")

    header = "| " + " | ".join(GENERATION_COLUMNS) + " |"
    rule = "|" + "---|" * len(GENERATION_COLUMNS)
    rows = [
        "| " + " | ".join(cell(sample.get(col, "")) for col in GENERATION_COLUMNS) + " |"
        for sample in samples
    ]
    return "\n".join([header, rule, *rows])


# --------------------------------------------------------------------------------------- hosted trackers


class WandbLogger:
    """Weights & Biases: `wandb.init(project, name, config, dir)`, `run.log(metrics, step=)`."""

    def __init__(
        self, project_name: str, experiment_name: str, log_dir: str, config_dict: dict[str, Any]
    ) -> None:
        self._wandb = _import_for_logger("wandb")
        self._run = self._wandb.init(
            project=project_name, name=experiment_name, config=config_dict, dir=log_dir
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        # wandb.Table fixes each column's type from the first row and rejects a later row of another
        # type (a ground truth that is a string in one sample and a list in the next): text as str.
        rows = [
            [
                _text_cell(sample.get("prompt")),
                _text_cell(sample.get("response")),
                _text_cell(sample.get("ground_truth")),
                sample.get("score"),
            ]
            for sample in samples
        ]
        table = self._wandb.Table(columns=list(GENERATION_COLUMNS), data=rows)
        self._run.log({"val/generations": table}, step=step)

    def finish(self, failed: bool = False) -> None:
        self._run.finish(exit_code=1 if failed else 0)  # a non-zero exit code: the run shows as failed
        # wandb 0.31's finish() can return before its service process (wandb-core) has written the
        # run's last records (seen offline); teardown waits for them and stops that process, which
        # wandb otherwise leaves to an exit hook that multiprocessing setups may skip.
        self._wandb.teardown()


class MlflowLogger:
    """MLflow: experiment = project, run = experiment name; the config as flattened params; each
    validation's generations as a table artifact `generations/step_<step>.json`.

    Without `MLFLOW_TRACKING_URI` the run goes to a file store in `<log_dir>/mlruns` (read it with
    `mlflow ui --backend-store-uri <log_dir>/mlruns`), not to MLflow's own default, a `mlflow.db` in
    the working directory that needs the full `mlflow` package. Metric and param names keep only the
    characters MLflow accepts (others become `_`); params go in chunks of 100 with values cut to 250
    characters, the limits of older MLflow servers and AzureML.
    """

    _MAX_PARAMS_PER_CALL = 100
    _MAX_PARAM_CHARS = 250

    def __init__(
        self, project_name: str, experiment_name: str, log_dir: str, config_dict: dict[str, Any]
    ) -> None:
        self._mlflow = _import_for_logger("mlflow")
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3.17 (at least) refuses a file store unless this opt-in is set; mmrl chose the
            # store, so it opts in (a value the user set is kept).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            self._mlflow.set_tracking_uri(Path(log_dir, "mlruns").resolve().as_uri())
        self._mlflow.set_experiment(project_name)
        self._mlflow.start_run(run_name=experiment_name)
        params = [
            (_mlflow_key(key), str(value)[: self._MAX_PARAM_CHARS])
            for key, value in flatten_config(config_dict).items()
        ]
        for start in range(0, len(params), self._MAX_PARAMS_PER_CALL):
            self._mlflow.log_params(dict(params[start : start + self._MAX_PARAMS_PER_CALL]))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._mlflow.log_metrics({_mlflow_key(key): value for key, value in metrics.items()}, step=step)

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        """`{"columns": [...], "data": [[...], ...]}`, the JSON layout of `mlflow.log_table`, written
        without the pandas that `log_table` needs (mlflow-skinny does not install it)."""
        table = {
            "columns": list(GENERATION_COLUMNS),
            "data": [[sample.get(col) for col in GENERATION_COLUMNS] for sample in samples],
        }
        text = json.dumps(table, ensure_ascii=False, default=str)
        self._mlflow.log_text(text, artifact_file=f"generations/step_{step:08d}.json")

    def finish(self, failed: bool = False) -> None:
        self._mlflow.end_run(status="FAILED" if failed else "FINISHED")


def _mlflow_key(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", key)


class SwanlabLogger:
    """SwanLab: `swanlab.init(project, experiment_name, config, logdir)`, `swanlab.log(data, step=)`."""

    def __init__(
        self, project_name: str, experiment_name: str, log_dir: str, config_dict: dict[str, Any]
    ) -> None:
        self._swanlab = _import_for_logger("swanlab")
        swanlab_dir = os.path.join(log_dir, "swanlog")
        os.makedirs(swanlab_dir, exist_ok=True)  # swanlab requires an existing logdir
        self._swanlab.init(
            project=project_name, experiment_name=experiment_name, config=config_dict, logdir=swanlab_dir
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._swanlab.log(metrics, step=step)

    def log_generations(self, samples: list[dict[str, Any]], step: int) -> None:
        texts = []
        for sample in samples:
            text = "\n\n".join(f"{column}: {sample.get(column)}" for column in GENERATION_COLUMNS[:3])
            texts.append(self._swanlab.Text(text, caption=f"score {sample.get('score')}"))
        self._swanlab.log({"val/generations": texts}, step=step)

    def finish(self, failed: bool = False) -> None:
        self._swanlab.finish()  # not marked failed: swanlab is not installed here to check its API


# ---------------------------------------------------------------------------------------------- values


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}, "c": [1, 2]}` → `{"a.b": 1, "c": [1, 2]}` (lists stay values)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_config(value, prefix=f"{name}."))
        else:
            flat[name] = value
    return flat


def _to_float(key: str, value: Any) -> float:
    """A metric value → float; errors name the metric."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"Metric {key!r} is a tensor of shape {tuple(value.shape)}; log a scalar (e.g. .mean())."
            )
        return value.item()
    try:
        return float(value)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"Metric {key!r} must be a number, got {type(value).__name__} {value!r:.80}. "
            "Log text through log_generations instead."
        ) from error


def _text_cell(value: Any) -> str | None:
    return None if value is None else str(value)


def _to_plain(value: Any) -> Any:
    """Tensors and NumPy values in generation samples → Python numbers and lists."""
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    return value
