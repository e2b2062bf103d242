"""Test reward that never returns on the sample whose ground truth is ``hang_on_answer`` (passed
through ``worker.reward.reward_function_kwargs``), scores 0 otherwise: the run must stop at
``worker.reward.timeout_s`` naming that sample. ``hang_marker``: a file touched when the hang begins,
so that the test can time how long the run takes to stop."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

REWARD_NAME = "hanging"
REWARD_TYPE = "sequential"


def compute_score(reward_input: dict[str, Any], hang_on_answer: str, hang_marker: str) -> dict[str, float]:
    if reward_input["ground_truth"] == hang_on_answer:
        Path(hang_marker).touch()
    while reward_input["ground_truth"] == hang_on_answer:
        time.sleep(1)
    return {"overall": 0.0}
