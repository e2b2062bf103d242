"""The one interface every reward source implements: reward inputs in, one score dict per sample out.

A *reward source* scores a batch of responses: the rule file (:mod:`mmrl.rewards.rule`), a generative
judge, a reward model, a code sandbox. Its ``score`` takes the batch's reward inputs, one dict per
response with

- ``response`` (decoded text), ``response_length`` (tokens), ``ground_truth``,
- the row's other dataset columns (``problem``, ``data_source``, ...),
- ``media`` (a :class:`mmrl.data.processing.PromptMedia`: the prompt's encoded images, videos and
  audio, or None) when the source's ``needs_media`` is true; sources that do not need them never
  receive them (they are not shipped to the reward workers at all then),

and returns, in order, one :data:`SourceResult` per input:

- a score dict ``{"overall": float, <sub-score>: float, ...}`` (finite real numbers; ``overall`` is the
  source's score, the one :mod:`mmrl.rewards.compose` weights), or
- a :class:`SampleFailure` naming why this one sample has no score ("HTTP 503 after 4 tries",
  "wall time 10 s exceeded", "unparseable judge answer 'maybe'"). The composition scores it with the
  source's ``failure_score``, counts it (``reward/<source>/failed``) and names source, sample and
  reason in the log; a failure of the *source* itself (its server is gone, its config is wrong) is an
  exception, :class:`RewardSourceError`, which stops the run with one message.

A source must not hang: it bounds its own waits (timeouts) and returns. ``close`` releases what it
holds (connections, processes, a model's memory); it is called once when the run ends.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, Union, runtime_checkable

from mmrl.errors import UserInputError

__all__ = [
    "RewardSource",
    "RewardSourceError",
    "SampleFailure",
    "SourceResult",
    "check_source_results",
]


@dataclass(frozen=True)
class SampleFailure:
    """One sample a source could not score, and why (a short phrase; never a secret such as a key)."""

    reason: str


SourceResult = Union[dict[str, float], SampleFailure]  # noqa: UP007 - a runtime alias, read on py3.10


class RewardSourceError(UserInputError, RuntimeError):
    """A reward source failed as a whole (bad config, unreachable server, malformed results); the message
    names the source and, where there is one, the sample. Takes only the message, so it pickles."""


@runtime_checkable
class RewardSource(Protocol):
    """What the composition calls; see the module docstring for the contract."""

    name: str  # the source's name in metrics (``reward/<name>/<key>``) and messages
    needs_media: bool  # true: each input carries ``media`` (the prompt's PromptMedia or None)

    def score(self, inputs: Sequence[Mapping[str, Any]]) -> list[SourceResult]: ...

    def close(self) -> None: ...


def check_source_results(name: str, results: Any, num_inputs: int) -> list[SourceResult]:
    """``results`` of source ``name`` for ``num_inputs`` inputs, checked: a list of that length whose
    entries are :class:`SampleFailure` or dicts of finite real numbers with ``overall`` (converted to
    float). Raises :class:`RewardSourceError` naming the source and the sample."""
    if not isinstance(results, (list, tuple)):
        raise RewardSourceError(
            f"reward source '{name}' returned {type(results).__name__}; expected a list of {num_inputs} "
            "results (score dicts or SampleFailure), one per input, in order"
        )
    if len(results) != num_inputs:
        raise RewardSourceError(
            f"reward source '{name}' returned {len(results)} results for {num_inputs} inputs; expected "
            "one per input, in order"
        )
    return [_checked_result(name, result, index) for index, result in enumerate(results)]


def _checked_result(name: str, result: Any, index: int) -> SourceResult:
    if isinstance(result, SampleFailure):
        if not result.reason:
            raise RewardSourceError(f"reward source '{name}' failed sample {index} without a reason")
        return result
    if not isinstance(result, Mapping) or "overall" not in result:
        raise RewardSourceError(
            f"reward source '{name}' returned {result!r:.120} for sample {index}; expected a score dict "
            "with 'overall' or a SampleFailure(reason)"
        )
    checked = {}
    for key, value in result.items():
        number = _real(value)
        if not isinstance(key, str) or number is None or not math.isfinite(number):
            raise RewardSourceError(
                f"reward source '{name}' returned {key!r} = {value!r:.80} for sample {index}; score keys "
                "are strings and scores finite real numbers"
            )
        checked[key] = number
    return checked


def _real(value: Any) -> float | None:
    if isinstance(value, numbers.Real):
        return float(value)
    if getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) else None
    return None
