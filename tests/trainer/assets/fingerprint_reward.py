"""Test reward: a dense, deterministic score that gives GRPO non-zero advantages on a random policy.

``overall`` = distinct characters of the response / 10, so the n responses of a prompt almost always
score differently and training really changes the weights. ``fingerprint`` = CRC-32 of the response
text / 2**32: its batch mean (a logged metric) identifies the generated texts, so two runs that log
the same ``val/reward/fingerprint`` generated the same validation responses.
"""

from __future__ import annotations

import zlib
from typing import Any

REWARD_NAME = "fingerprint"
REWARD_TYPE = "sequential"


def compute_score(reward_input: dict[str, Any]) -> dict[str, float]:
    response = reward_input["response"]
    return {
        "overall": len(set(response)) / 10,
        "fingerprint": zlib.crc32(response.encode("utf-8")) / 2**32,
    }
