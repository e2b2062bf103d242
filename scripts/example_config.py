"""Render ``examples/config.yaml`` from the config schema: every key of ``PPOConfig``, in schema order,
with the comment written next to its field, and its default wherever the example sets another value.

    python scripts/example_config.py           # rewrite the file
    python scripts/example_config.py --check   # exit 1 with a diff when the file is not current

The file's values (a real GRPO run) and its opening comment lines are kept; only keys, comments and
default notes come from the schema, so the file cannot drift from it (tests/trainer/test_config.py
checks that it is current). A key the schema lacks is dropped; a key the file lacks gets its default.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import io
import sys
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "config.yaml"
sys.path.insert(0, str(REPO))  # run as a script from a checkout, installed or not


def field_comments(cls: type) -> dict[str, tuple[list[str], str]]:
    """``{field: (comment lines above it, comment after it)}`` as written in the source of ``cls`` and
    of the dataclasses it derives from."""
    found = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            found |= _own_field_comments(klass)
    return found


def _own_field_comments(cls: type) -> dict[str, tuple[list[str], str]]:
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments = {
        token.start[0]: token.string.lstrip("#").strip()
        for token in tokenize.generate_tokens(io.StringIO(source).readline)
        if token.type == tokenize.COMMENT
    }
    found = {}
    for node in ast.parse(source).body[0].body:
        if not isinstance(node, ast.AnnAssign):
            continue
        after = " ".join(comments[row] for row in range(node.lineno, node.end_lineno + 1) if row in comments)
        above, row = [], node.lineno - 1
        while row >= 1 and lines[row - 1].strip().startswith("#"):
            above.insert(0, comments[row])
            row -= 1
        found[node.target.id] = (above, after)
    return found


def _flow(value: Any) -> str:
    """One-line YAML of ``value``, as the file writes it (``null``, ``1.0e-06``, ``[a, b]``, ``{}``)."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6)
    return text.removesuffix("\n...\n").strip()


def _render(cls: type, values: dict[str, Any], defaults: dict[str, Any], depth: int) -> list[str]:
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    out = []
    for field in dataclasses.fields(cls):
        above, after = comments.get(field.name, ([], ""))
        indent = "  " * depth
        section = dataclasses.is_dataclass(hints[field.name])
        if section and depth == 0:
            out.append("")  # a blank line before each top-level section
        out += [f"{indent}# {line}" for line in above]
        if section:
            out.append(f"{indent}{field.name}:" + (f"  # {after}" if after else ""))
            sub_values = values.get(field.name) or {}
            out += _render(hints[field.name], sub_values, defaults[field.name], depth + 1)
            continue
        default = defaults[field.name]
        value = values.get(field.name, default)
        if yaml.safe_load(_flow(value)) != yaml.safe_load(_flow(default)):
            after = f"{after} (default: {_flow(default)})".strip()
        out.append(f"{indent}{field.name}: {_flow(value)}" + (f"  # {after}" if after else ""))
    return out


def render(current: str) -> str:
    """The file as the schema has it, keeping ``current``'s values and its opening comment lines."""
    from omegaconf import OmegaConf

    from mmrl.config import PPOConfig

    header = []
    for line in current.splitlines():
        if line and not line.startswith("#"):
            break
        header.append(line)
    while header and not header[-1]:
        header.pop()
    values = yaml.safe_load(current) or {}
    defaults = OmegaConf.to_container(OmegaConf.structured(PPOConfig()))
    return "\n".join([*header, *_render(PPOConfig, values, defaults, 0)]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report a stale file instead of writing it")
    args = parser.parse_args()
    current = EXAMPLE.read_text()
    wanted = render(current)
    diff = "\n".join(
        difflib.unified_diff(
            current.splitlines(), wanted.splitlines(), "examples/config.yaml", "rendered", lineterm=""
        )
    )
    if args.check:
        if diff:
            sys.exit(f"examples/config.yaml is not current; run python scripts/example_config.py\n{diff}")
        return
    EXAMPLE.write_text(wanted)
    print(diff or "[example_config] examples/config.yaml was current")


if __name__ == "__main__":
    main()
