"""Judge answers → scores in [0, 1]; None when the answer cannot be read (the judge then scores the
sample with ``unparseable_score`` and counts it).

- ``yes_no``: the first whole word ``yes`` (1.0) or ``no`` (0.0), any case, punctuation and special
  tokens ignored: "Yes.", "**No**, the shape is red".
- ``number``: the last number in the answer (``7``, ``7.5``, ``-1``, ``8/10`` reads 8), divided by
  ``number_max`` and clipped to [0, 1]: "Score: 7" with ``number_max=10`` → 0.7.
- ``rubric``: every ``k/m`` in the answer is one rubric item with ``k`` points of ``m``; the score is
  the sum of points over the sum of maxima: "accuracy: 2/2, reasoning: 1/3" → 3/5 = 0.6.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_SPECIAL_TOKEN = re.compile(r"<\|[^|]*\|>|</?s>")
_WORD = re.compile(r"[a-z]+")
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_FRACTION = re.compile(rf"({_NUMBER})\s*/\s*({_NUMBER})")
_LAST_NUMBER = re.compile(rf"({_NUMBER})(?:\s*/\s*{_NUMBER})?(?!.*\d)", re.DOTALL)


def parse_yes_no(answer: str, number_max: float = 10.0) -> float | None:
    for word in _WORD.findall(_SPECIAL_TOKEN.sub(" ", answer).lower()):
        if word in ("yes", "no"):
            return 1.0 if word == "yes" else 0.0
    return None


def parse_number(answer: str, number_max: float = 10.0) -> float | None:
    match = _LAST_NUMBER.search(_SPECIAL_TOKEN.sub(" ", answer))
    if match is None:
        return None
    return min(1.0, max(0.0, float(match.group(1)) / number_max))


def parse_rubric(answer: str, number_max: float = 10.0) -> float | None:
    items = [(float(points), float(maximum)) for points, maximum in _FRACTION.findall(answer)]
    total = sum(maximum for _, maximum in items)
    if not items or total <= 0:
        return None
    return min(1.0, max(0.0, sum(points for points, _ in items) / total))


PARSERS: dict[str, Callable[[str, float], float | None]] = {
    "yes_no": parse_yes_no,
    "number": parse_number,
    "rubric": parse_rubric,
}
