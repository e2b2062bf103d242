"""Test reward that fails on purpose: raises ``ValueError`` on every sample whose ground truth is
``fail_on_answer`` (passed through ``worker.reward.reward_function_kwargs``), scores 0 otherwise."""

from __future__ import annotations

from typing import Any

REWARD_NAME = "raising"
REWARD_TYPE = "sequential"


def compute_score(reward_input: dict[str, Any], fail_on_answer: str) -> dict[str, float]:
    if reward_input["ground_truth"] == fail_on_answer:
        raise ValueError(f"refusing to score a sample whose answer is {fail_on_answer!r}")
    return {"overall": 0.0}
