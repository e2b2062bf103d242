"""Shapes reward: one-word answers about synthetic images ("What colour is the shape?" -> ``red``,
"How many circles?" -> ``3``).

Use with ``worker.reward.reward_function=./reward_functions/shapes.py:compute_score``. A response is
normalised first: special tokens such as ``<|im_end|>`` or ``</s>`` are dropped, text is lower-cased,
punctuation becomes spaces, and number words ``zero`` .. ``ten`` become digits. Scores per response:

- ``accuracy``: 1.0 if the normalised response starts with the normalised ground truth word(s)
  (``"Red."`` and ``"red circle"`` match ``red``; ``"three"`` matches ``3``), else 0.0.
- ``format``: 1.0 if the normalised response has between 1 and ``max_words`` words (default 3): a short
  answer rather than a sentence, else 0.0.
- ``overall = (1 - format_weight) * accuracy + format_weight * format``; ``format_weight`` defaults
  to 0.0, so ``overall = accuracy``.

A multi-turn trajectory (``worker.rollout.multi_turn``: the sample has a ``trajectory`` record) is
scored on its last model turn, the answer after the tool calls; a last turn that still calls a tool
scores 0.

The file is self-contained (standard library only) so it can be copied and edited freely.
"""

from __future__ import annotations

import re
from typing import Any

REWARD_NAME = "shapes"
REWARD_TYPE = "batch"

_SPECIAL_TOKEN_PATTERN = re.compile(r"<\|[^|]*\|>|</?s>")
_NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
_DIGIT_OF_WORD = {word: str(value) for value, word in enumerate(_NUMBER_WORDS)}


def normalize_words(text: Any) -> list[str]:
    """Lower-cased words of ``text`` without special tokens or punctuation, number words as digits."""
    text = _SPECIAL_TOKEN_PATTERN.sub(" ", str(text)).lower()
    words = re.sub(r"[^\w\s]|_", " ", text).split()
    return [_DIGIT_OF_WORD.get(word, word) for word in words]


def accuracy_reward(response: str, ground_truth: Any) -> float:
    response_words, truth_words = normalize_words(response), normalize_words(ground_truth)
    if not response_words or not truth_words:
        return 0.0
    return 1.0 if response_words[: len(truth_words)] == truth_words else 0.0


def format_reward(response: str, max_words: int = 3) -> float:
    return 1.0 if 1 <= len(normalize_words(response)) <= max_words else 0.0


def answer_text(reward_input: dict[str, Any]) -> str:
    """The response, or a trajectory's last model turn (its record's last turn text: the loop records
    no observation after the last model turn)."""
    record = reward_input.get("trajectory")
    texts = getattr(record, "turn_texts", None)
    return str(texts[-1]) if texts else str(reward_input["response"])


def compute_score(
    reward_inputs: list[dict[str, Any]], format_weight: float = 0.0, max_words: int = 3
) -> list[dict[str, float]]:
    """Scores a batch of ``{"response", "ground_truth", ...}`` dicts; see the module docstring."""
    if not isinstance(reward_inputs, list):
        raise ValueError('shapes.py scores whole batches: keep REWARD_TYPE = "batch".')
    scores = []
    for reward_input in reward_inputs:
        response = answer_text(reward_input)
        accuracy_score = accuracy_reward(response, reward_input["ground_truth"])
        format_score = format_reward(response, max_words)
        scores.append(
            {
                "overall": (1 - format_weight) * accuracy_score + format_weight * format_score,
                "format": format_score,
                "accuracy": accuracy_score,
            }
        )
    return scores
