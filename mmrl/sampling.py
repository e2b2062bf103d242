"""Sampling settings of one generation: what a rollout backend and the agent loop's turn-level
interface (:mod:`mmrl.agent.backend`) both take. Plain values, no dependencies."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # responses per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_tokens: int = 512  # response width R
    seed: int = 1
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def override(self, **changes: Any) -> SamplingParams:
        return replace(self, **changes)
