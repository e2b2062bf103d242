"""Read back what the real trackers wrote: tensorboard event files, a wandb offline run, an MLflow file
store. Shared by the logger unit tests and the trainer runs that log to every tracker."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse


def offline_tracker_env(root: Path) -> dict[str, str]:
    """Environment that keeps wandb and MLflow offline and every file they write under ``root`` (by
    default wandb writes to ~/.cache/wandb, ~/.config/wandb and ~/.local/share/wandb, MLflow an
    installation id to ~/.config/mlflow and telemetry over the network)."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",  # no wrapping of the (test) process's stdout and stderr
        "WANDB_CONFIG_DIR": str(root / "wandb-config"),
        "WANDB_CACHE_DIR": str(root / "wandb-cache"),
        "WANDB_DATA_DIR": str(root / "wandb-data"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MlflowLogger sets it for itself; the reader needs it too
        "XDG_CONFIG_HOME": str(root / "xdg-config"),
    }


# ---------------------------------------------------------------------------------------- tensorboard


def tensorboard_run(log_dir: Path) -> tuple[dict[str, dict[int, float]], dict[int, str]]:
    """(scalars as {tag: {step: value}}, the `val/generations` markdown tables as {step: text})."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir / "tensorboard"))
    events.Reload()
    scalars = {
        tag: {event.step: event.value for event in events.Scalars(tag)} for tag in events.Tags()["scalars"]
    }
    tables = {}
    if "val/generations/text_summary" in events.Tags()["tensors"]:
        for event in events.Tensors("val/generations/text_summary"):
            tables[event.step] = event.tensor_proto.string_val[0].decode()
    return scalars, tables


def markdown_rows(table: str) -> list[list[str]]:
    """The body rows of a `generations_markdown` table, as cells (escaped pipes stay in a cell)."""
    rows = []
    for line in table.splitlines()[2:]:
        cells = [cell.strip().replace("\\|", "|") for cell in line.strip("|").split(" | ")]
        rows.append(cells)
    return rows


# ------------------------------------------------------------------------------------- wandb (offline)

# A `.wandb` file is a LevelDB-style log: a 7-byte header (":W&B", magic 0xBEE1, version 0), then
# 32 KiB blocks of chunks, each `crc32 (4) | length (2) | type (1) | payload`; a record spans chunks
# FULL (1), or FIRST (2), MIDDLE (3)..., LAST (4). wandb 0.31 ships no Python reader of it any more.
_WANDB_BLOCK = 32768
_WANDB_CHUNK_HEADER = 7


def _wandb_records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    position, parts = 7, []
    while position + _WANDB_CHUNK_HEADER <= len(data):
        left_in_block = _WANDB_BLOCK - position % _WANDB_BLOCK
        if left_in_block < _WANDB_CHUNK_HEADER:  # the block's zero padding
            position += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + _WANDB_CHUNK_HEADER])
        if kind == 0:
            position += left_in_block
            continue
        start = position + _WANDB_CHUNK_HEADER
        payload, position = data[start : start + length], start + length
        if kind == 1:
            yield payload
        elif kind == 2:
            parts = [payload]
        else:
            parts.append(payload)
            if kind == 4:
                yield b"".join(parts)


def _offline_run_log(log_dir: Path) -> tuple[Path, Path]:
    run_dirs = sorted((log_dir / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1, f"expected one offline run in {log_dir / 'wandb'}, found {run_dirs}"
    (transaction_log,) = run_dirs[0].glob("run-*.wandb")
    return run_dirs[0], transaction_log


def wandb_offline_exit_code(log_dir: Path) -> int | None:
    """The exit code the one offline run under ``log_dir/wandb`` ended with (its `exit` record; the W&B
    app shows a non-zero one as Failed), None when the run recorded no end."""
    from wandb.proto import wandb_internal_pb2

    _, transaction_log = _offline_run_log(log_dir)
    for raw in _wandb_records(transaction_log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "exit":
            return record.exit.exit_code
    return None


def wandb_offline_run(log_dir: Path) -> tuple[dict[str, dict[int, Any]], dict[int, dict[str, Any]]]:
    """The one offline run under ``log_dir/wandb``: (history as {key: {step: value}}, the
    `val/generations` tables as {step: {"columns": [...], "data": [[...]]}})."""
    from wandb.proto import wandb_internal_pb2

    run_dir, transaction_log = _offline_run_log(log_dir)
    history: dict[str, dict[int, Any]] = {}
    tables: dict[int, dict[str, Any]] = {}
    for raw in _wandb_records(transaction_log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") != "history":
            continue
        step = record.history.step.num
        table_path = None
        for item in record.history.item:
            key = "/".join(item.nested_key) if item.nested_key else item.key
            if key == "val/generations/path":
                table_path = json.loads(item.value_json)
            elif not key.startswith(("_", "val/generations/")):
                history.setdefault(key, {})[step] = json.loads(item.value_json)
        if table_path is not None:
            tables[step] = json.loads((run_dir / "files" / table_path).read_text())
    return history, tables


# ------------------------------------------------------------------------------------ MLflow file store


def _mlflow_only_run(log_dir: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(log_dir / "mlruns").resolve().as_uri())
    runs = [
        run
        for experiment in client.search_experiments()
        for run in client.search_runs([experiment.experiment_id])
    ]
    assert len(runs) == 1, f"expected one MLflow run in {log_dir / 'mlruns'}, found {len(runs)}"
    return client, runs[0]


def mlflow_run_status(log_dir: Path) -> str:
    """The status (FINISHED, FAILED, RUNNING, ...) of the one run in the file store ``log_dir/mlruns``."""
    return _mlflow_only_run(log_dir)[1].info.status


def mlflow_run(log_dir: Path) -> tuple[dict[str, str], dict[str, dict[int, float]], dict[int, dict]]:
    """The one run in the file store ``log_dir/mlruns``: (params, metrics as {key: {step: value}}, the
    generations tables as {step: {"columns": [...], "data": [[...]]}})."""
    client, run = _mlflow_only_run(log_dir)
    metrics = {
        key: {point.step: point.value for point in client.get_metric_history(run.info.run_id, key)}
        for key in run.data.metrics
    }
    tables = {}
    artifact_root = Path(urlparse(run.info.artifact_uri).path)
    for artifact in client.list_artifacts(run.info.run_id, "generations"):
        step = int(Path(artifact.path).stem.removeprefix("step_"))
        tables[step] = json.loads((artifact_root / artifact.path).read_text())
    return dict(run.data.params), metrics, tables
