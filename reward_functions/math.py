"""Math reward: a reasoning block, then a final answer in ``\\boxed{...}``.

Use with ``worker.reward.reward_function=./reward_functions/math.py:compute_score`` and the
``format_prompts/math.jinja`` prompt. Scores per response (same rules as EasyR1's math.py):

- ``format``: 1.0 if the response reads ``<think>...</think>`` followed by text containing
  ``\\boxed{...}`` (spaces around ``<``, ``>`` and ``/`` are ignored first), else 0.0.
- ``accuracy``: 1.0 if the content of the last ``\\boxed{...}`` (nested braces allowed) equals the
  ground truth after normalisation, else 0.0. Normalisation drops spaces, ``$``, ``\\left``/``\\right``,
  ``\\text{}`` wrappers, degree signs, a leading ``x =``, and reads ``\\dfrac``/``\\tfrac`` as ``\\frac``;
  numbers (``0.5``, ``\\frac{1}{2}``, ``1/2``, ``2.0``, ``1,000``, ``50\\%`` read as 50) are equal when they
  differ by at most 1e-6 (relative for large values). No symbolic algebra: ``\\sqrt{2}/2`` and
  ``\\frac{\\sqrt{2}}{2}`` differ. Install ``mathruler`` and use EasyR1's file for sympy-based grading.
- ``overall = (1 - format_weight) * accuracy + format_weight * format`` (``format_weight=0.1``).

The file is self-contained (standard library only) so it can be copied and edited freely.
"""

from __future__ import annotations

import re
from typing import Any

REWARD_NAME = "math"
REWARD_TYPE = "batch"

_FORMAT_PATTERN = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
_NUMBER_PATTERN = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_THOUSANDS_PATTERN = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")
_LATEX_FRACTION = re.compile(r"(?P<sign>[-+]?)\\frac\{(?P<numerator>[^{}]+)\}\{(?P<denominator>[^{}]+)\}")
_SLASH_FRACTION = re.compile(r"(?P<sign>)\(?(?P<numerator>[^/()]+)\)?/\(?(?P<denominator>[^/()]+)\)?")
_NUMERIC_TOLERANCE = 1e-6


def extract_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text``, braces balanced; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    content_start = start + len("\\boxed{")
    for index in range(content_start - 1, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[content_start:index]
    return None  # unclosed brace: the response was cut off


def normalize_answer(answer: str) -> str:
    """Canonical string form of a short math answer (see the module docstring for the rules)."""
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
    return 1.0 if _FORMAT_PATTERN.fullmatch(response) else 0.0


def accuracy_reward(response: str, ground_truth: Any) -> float:
    return 1.0 if grade_answer(extract_boxed_content(response), ground_truth) else 0.0


def compute_score(reward_inputs: list[dict[str, Any]], format_weight: float = 0.1) -> list[dict[str, float]]:
    """Scores a batch of ``{"response", "ground_truth", ...}`` dicts; see the module docstring."""
    if not isinstance(reward_inputs, list):
        raise ValueError('math.py scores whole batches: keep REWARD_TYPE = "batch".')
    scores = []
    for reward_input in reward_inputs:
        # Some models (e.g. Qwen2.5-VL-32B) write "< think >" or "</ think>": drop the spaces.
        response = re.sub(r"\s*(<|>|/)\s*", r"\1", reward_input["response"])
        format_score = format_reward(response)
        accuracy_score = accuracy_reward(response, reward_input["ground_truth"])
        scores.append(
            {
                "overall": (1 - format_weight) * accuracy_score + format_weight * format_score,
                "format": format_score,
                "accuracy": accuracy_score,
            }
        )
    return scores
