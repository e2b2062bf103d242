"""R1-V reward: reasoning in ``<think>...</think>``, then the answer in ``<answer>...</answer>``.

Use with ``worker.reward.reward_function=./reward_functions/r1v.py:compute_score`` and the
``format_prompts/r1v.jinja`` prompt. Scores per response (EasyR1's r1v.py rules):

- ``format``: 1.0 if the whole response is ``<think>...</think>`` then ``<answer>...</answer>``
  (whitespace allowed between and around them), else 0.0.
- ``accuracy``: 1.0 if the content of the first ``<answer>...</answer>`` (the whole response when
  there is none) equals the ground truth after normalisation, else 0.0. The grader is the same as in
  ``math.py`` (strings after LaTeX clean-up, numbers within 1e-6), copied here so this file stands alone.
- ``overall = (1 - format_weight) * accuracy + format_weight * format`` (``format_weight=0.5``).

Differences from EasyR1's file: leading/trailing whitespace is ignored by the format check, and an
answer spanning several lines is still found (EasyR1 falls back to the whole response there).
"""

from __future__ import annotations

import re
from typing import Any

REWARD_NAME = "r1v"
REWARD_TYPE = "sequential"

_FORMAT_PATTERN = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)
_ANSWER_PATTERN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER_PATTERN = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_THOUSANDS_PATTERN = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")
_LATEX_FRACTION = re.compile(r"(?P<sign>[-+]?)\\frac\{(?P<numerator>[^{}]+)\}\{(?P<denominator>[^{}]+)\}")
_SLASH_FRACTION = re.compile(r"(?P<sign>)\(?(?P<numerator>[^/()]+)\)?/\(?(?P<denominator>[^/()]+)\)?")
_NUMERIC_TOLERANCE = 1e-6


def normalize_answer(answer: str) -> str:
    """Canonical string form of a short math answer (the same rules as in math.py)."""
    text = str(answer).strip()
    text = re.sub(r"\\(text|textbf|mathrm|mbox)\{([^{}]*)\}", r"\2", text)
    text = re.sub(r"\\[dt]frac", r"\\frac", text)
    text = re.sub(r"\\frac\s*(\d)", r"\\frac{\1}", text)  # "\frac12" -> "\frac{1}2"
    text = re.sub(r"\\frac(\{[^{}]*\})\s*(\d)", r"\\frac\1{\2}", text)  # "\frac{1}2" -> "\frac{1}{2}"
    for token in (
        "\\left",
        "\\right",
        "\\!",
        "\\,",
        "\\;",
        "\\:",
        "$",
        "^\\circ",
        "^{\\circ}",
        "°",
        "\\%",
        "%",
    ):
        text = text.replace(token, "")
    text = re.sub(r"\s+", "", text)
    text = re.sub(r"^[a-zA-Z]=", "", text)  # "x=5" -> "5"
    return text.rstrip(".")


def parse_number(text: str) -> float | None:
    """Value of a normalised answer that is a plain number or a simple fraction, else None."""
    if _THOUSANDS_PATTERN.fullmatch(text):
        text = text.replace(",", "")
    if _NUMBER_PATTERN.fullmatch(text):
        return float(text)
    fraction = _LATEX_FRACTION.fullmatch(text) or _SLASH_FRACTION.fullmatch(text)
    if fraction is None:
        return None
    numerator, denominator = fraction["numerator"], fraction["denominator"]
    if not (_NUMBER_PATTERN.fullmatch(numerator) and _NUMBER_PATTERN.fullmatch(denominator)):
        return None
    if float(denominator) == 0:
        return None
    value = float(numerator) / float(denominator)
    return -value if fraction["sign"] == "-" else value


def grade_answer(given: str | None, ground_truth: Any) -> bool:
    """True when ``given`` and ``ground_truth`` are the same answer after normalisation."""
    if given is None:
        return False
    given_text, truth_text = normalize_answer(given), normalize_answer(str(ground_truth))
    if not given_text:
        return False
    if given_text == truth_text:
        return True
    given_value, truth_value = parse_number(given_text), parse_number(truth_text)
    if given_value is None or truth_value is None:
        return False
    return abs(given_value - truth_value) <= _NUMERIC_TOLERANCE * max(1.0, abs(truth_value))


def format_reward(response: str) -> float:
    return 1.0 if _FORMAT_PATTERN.fullmatch(response.strip()) else 0.0


def accuracy_reward(response: str, ground_truth: Any) -> float:
    answer_match = _ANSWER_PATTERN.search(response)
    given_answer = answer_match.group(1) if answer_match else response
    return 1.0 if grade_answer(given_answer.strip(), str(ground_truth).strip()) else 0.0


def compute_score(reward_input: dict[str, Any], format_weight: float = 0.5) -> dict[str, float]:
    """Scores one ``{"response", "ground_truth", ...}`` dict; see the module docstring."""
    if not isinstance(reward_input, dict):
        raise ValueError('r1v.py scores one sample at a time: keep REWARD_TYPE = "sequential".')
    format_score = format_reward(reward_input["response"])
    accuracy_score = accuracy_reward(reward_input["response"], reward_input["ground_truth"])
    return {
        "overall": (1 - format_weight) * accuracy_score + format_weight * format_score,
        "format": format_score,
        "accuracy": accuracy_score,
    }
