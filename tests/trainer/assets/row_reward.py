"""Test reward: ``fingerprint_reward.py``'s scores plus ``rows``, a record of the dataset rows trained.

``rows`` = 2**sample_index (the prompt's row in the training file). A step's logged ``reward/rows`` is
its batch mean, so ``reward/rows * responses / n`` (n responses per prompt) is the sum of 2**row over
the step's prompts: exact in a double for files of under 53 rows, its set bits the rows the step
trained. A prompt trained twice in one step carries into another bit, so the bit count is off.
``trained_rows`` in tests/_trainer_run.py reads it back.
"""

from __future__ import annotations

import zlib
from typing import Any

REWARD_NAME = "rows"
REWARD_TYPE = "sequential"


def compute_score(reward_input: dict[str, Any]) -> dict[str, float]:
    response = reward_input["response"]
    return {
        "overall": len(set(response)) / 10,
        "fingerprint": zlib.crc32(response.encode("utf-8")) / 2**32,
        "rows": float(2 ** int(reward_input["sample_index"])),
    }
