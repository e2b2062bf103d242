"""Test reward with many uninformative groups: ``overall`` = 1 for about a quarter of the response texts
(CRC-32 divisible by 4), else 0. A group of 4 responses then scores all 0 about a third of the time,
so online filtering has groups to drop, deterministically for a given rollout seed."""

from __future__ import annotations

import zlib
from typing import Any

REWARD_NAME = "coarse"
REWARD_TYPE = "sequential"


def compute_score(reward_input: dict[str, Any]) -> dict[str, float]:
    crc = zlib.crc32(reward_input["response"].encode("utf-8"))
    return {"overall": float(crc % 4 == 0), "crc_mod_4": float(crc % 4)}
