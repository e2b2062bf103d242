"""Test reward that never returns on the sample whose ground truth is ``hang_on_answer`` (passed
through ``worker.reward.reward_function_kwargs``), scores 0 otherwise: the run must stop at
``worker.reward.timeout_s`` naming that sample."""

from __future__ import annotations

import time
from typing import Any

REWARD_NAME = "hanging"
REWARD_TYPE = "sequential"


def compute_score(reward_input: dict[str, Any], hang_on_answer: str) -> dict[str, float]:
    while reward_input["ground_truth"] == hang_on_answer:
        time.sleep(1)
    return {"overall": 0.0}
