"""Format reward for code answers, to weigh beside the sandbox's `code` source.

Use with ``worker.reward.reward_function=./reward_functions/code_format.py:compute_score`` and
``worker.reward.code.enable=true`` (see ``examples/code_sandbox.yaml``); the ``format_prompts/code.jinja``
prompt asks for this shape. Scores per response:

- ``format``: 1.0 if any ``<think>`` is closed by ``</think>`` and a fenced ```` ```python ```` block
  follows it (the block the `code` source runs), else 0.0.
- ``overall = format``. The `code` source scores correctness by running the block against the row's
  tests; give this file a small weight beside it (``worker.reward.rule.weight``).

The file is self-contained (standard library only) so it can be copied and edited freely.
"""

from __future__ import annotations

import re
from typing import Any

REWARD_NAME = "code_format"
REWARD_TYPE = "batch"

_PYTHON_BLOCK = re.compile(r"```[ \t]*(python|py|python3)?[^\n]*\n.*?```", re.DOTALL | re.IGNORECASE)


def format_score(response: str) -> float:
    """1.0 when thinking (if any) is closed and a fenced Python block follows it."""
    if "<think>" in response:
        _, closed, response = response.partition("</think>")
        if not closed:
            return 0.0
    return 1.0 if _PYTHON_BLOCK.search(response) else 0.0


def compute_score(reward_inputs: list[dict[str, Any]]) -> list[dict[str, float]]:
    scores = []
    for reward_input in reward_inputs:
        score = format_score(str(reward_input["response"]))
        scores.append({"overall": score, "format": score})
    return scores
