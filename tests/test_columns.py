"""The batch column schema (mmrl.columns): every column name the library uses is listed, and batches
are checked against the listed dtypes and widths (the trainer checks every step's batch; the
end-to-end trainer tests run that check)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from mmrl.columns import COLUMNS, check_batch, column
from mmrl.protocol import DataProto

LIBRARY = Path(__file__).resolve().parents[1] / "mmrl"
# attribute names whose string subscripts are batch columns (data.batch["x"], data.non_tensor_batch["x"])
COLUMN_CONTAINERS = {"batch", "non_tensor_batch"}
COLUMN_KEYWORDS = {"batch_keys", "non_tensor_keys"}  # DataProto.select(batch_keys=[...])
COLUMN_DICT_KEYWORDS = {"tensors", "non_tensors"}  # DataProto.from_dict(tensors={...})
# a name in those places that is no batch column: the row index an on-policy update adds to its own copy
NOT_COLUMNS = {"_row"}


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def used_column_names() -> dict[str, list[str]]:
    """Every string the library uses as a batch column name, with where (file:line)."""
    used: dict[str, list[str]] = {}

    def add(name: str | None, path: Path, node: ast.AST) -> None:
        if name is not None and name not in NOT_COLUMNS:
            used.setdefault(name, []).append(f"{path.relative_to(LIBRARY.parent)}:{node.lineno}")

    for path in sorted(LIBRARY.rglob("*.py")):
        if path.name == "columns.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute):
                if node.value.attr in COLUMN_CONTAINERS:
                    add(_string(node.slice), path, node)
            elif isinstance(node, ast.Compare) and isinstance(node.comparators[0], ast.Call):
                # "x" in data.batch.keys() / "x" in data.non_tensor_batch
                call = node.comparators[0].func
                container = call.value if isinstance(call, ast.Attribute) else None
                if isinstance(container, ast.Attribute) and container.attr in COLUMN_CONTAINERS:
                    add(_string(node.left), path, node)
            elif isinstance(node, ast.Call):
                for keyword in node.keywords:
                    if keyword.arg in COLUMN_KEYWORDS and isinstance(keyword.value, (ast.List, ast.Tuple)):
                        for element in keyword.value.elts:
                            add(_string(element), path, element)
                    if keyword.arg in COLUMN_DICT_KEYWORDS and isinstance(keyword.value, ast.Dict):
                        for key in keyword.value.keys:
                            add(_string(key) if key is not None else None, path, keyword.value)
    return used


def test_every_column_name_the_library_uses_is_listed():
    used = used_column_names()
    assert {"input_ids", "old_log_probs", "uid", "token_level_scores"} <= set(used)  # the scan sees them
    unlisted = {name: places for name, places in used.items() if name not in COLUMNS}
    assert not unlisted, f"columns used but not listed in mmrl/columns.py: {unlisted}"


def test_every_listed_column_has_a_producer_and_a_consumer():
    for spec in COLUMNS.values():
        assert spec.producer and spec.consumers and spec.meaning, spec.name
    assert column("advantages") == "advantages"
    with pytest.raises(KeyError, match="not a batch column"):
        column("advantage")


def _training_batch() -> DataProto:
    rows, prompt, response = 2, 3, 4
    return DataProto.from_dict(
        tensors={
            "prompts": torch.ones(rows, prompt, dtype=torch.long),
            "responses": torch.ones(rows, response, dtype=torch.long),
            "input_ids": torch.ones(rows, prompt + response, dtype=torch.long),
            "attention_mask": torch.ones(rows, prompt + response, dtype=torch.long),
            "position_ids": torch.zeros(rows, 3, prompt + response, dtype=torch.long),
            "response_mask": torch.ones(rows, response, dtype=torch.long),
            "old_log_probs": torch.zeros(rows, response),
            "reward_baselines": torch.zeros(rows),
        },
        non_tensors={"uid": ["a", "a"], "data_source": ["x", "x"]},  # data_source: the file's own column
    )


def test_a_conforming_batch_passes():
    assert check_batch(_training_batch()) == []


def test_schema_problems_are_named():
    batch = _training_batch()
    batch.batch["old_log_probs"] = batch.batch["old_log_probs"].double()
    batch.batch["advantages"] = torch.zeros(2, 5)  # R is 4
    batch.batch["mystery"] = torch.zeros(2)
    batch.meta_info["temperature"] = 0.7
    problems = check_batch(batch)
    assert any("old_log_probs: dtype torch.float64" in problem for problem in problems)
    assert any("advantages: shape (2, 5)" in problem for problem in problems)
    assert any("'mystery' is not listed" in problem for problem in problems)
    assert any("meta_info carries ['temperature']" in problem for problem in problems)
    assert len(problems) == 4
    strict = check_batch(_training_batch(), allow_unlisted_objects=False)
    assert strict == ["object column 'data_source' is not listed"]


def test_the_prompt_dim_of_a_column_is_read_from_its_listed_layout():
    from mmrl.columns import COLUMNS

    assert COLUMNS["input_ids"].prompt_dim(2) == 1 and COLUMNS["prompts"].prompt_dim(2) == 1
    assert COLUMNS["position_ids"].prompt_dim(3) == 2 and COLUMNS["position_ids"].prompt_dim(2) == 1
    assert COLUMNS["routed_experts"].prompt_dim(4) == 1
    assert COLUMNS["responses"].prompt_dim(2) is None and COLUMNS["uid"].prompt_dim(1) is None
