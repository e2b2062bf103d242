"""Test reward with many uninformative groups: ``overall`` = 1 for about a quarter of the response texts
(CRC-32 divisible by 4), else 0. A group of 4 responses then scores all 0 about a third of the time,
so online filtering has groups to drop, deterministically for a given rollout seed. ``rows`` records the
dataset rows trained, as ``row_reward.py`` does (2**sample_index; ``trained_rows`` in tests/_trainer_run.py)."""

from __future__ import annotations

import zlib
from typing import Any

REWARD_NAME = "coarse"
REWARD_TYPE = "sequential"


def compute_score(reward_input: dict[str, Any]) -> dict[str, float]:
    crc = zlib.crc32(reward_input["response"].encode("utf-8"))
    return {
        "overall": float(crc % 4 == 0),
        "crc_mod_4": float(crc % 4),
        "rows": float(2 ** int(reward_input["sample_index"])),
    }
