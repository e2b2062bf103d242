# An EasyR1-style batch reward file (examples/reward_function/math.py), with the two functions it imports
# from `mathruler.grader` replaced by small stand-ins so the test needs no third-party package.
import re
from typing import Any

# Metadata
REWARD_NAME = "math"
REWARD_TYPE = "batch"


def extract_boxed_content(text: str) -> str:  # stand-in for mathruler.grader.extract_boxed_content
    match = re.search(r"\\boxed\{([^{}]*)\}", text)
    return match.group(1) if match else "None"


def grade_answer(given: str, ground_truth: str) -> bool:  # stand-in for mathruler.grader.grade_answer
    return given.strip() == ground_truth.strip()


def format_reward(response: str) -> float:
    pattern = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
    format_match = re.fullmatch(pattern, response)
    return 1.0 if format_match else 0.0


def accuracy_reward(response: str, ground_truth: str) -> float:
    answer = extract_boxed_content(response)
    return 1.0 if grade_answer(answer, ground_truth) else 0.0


def compute_score(reward_inputs: list[dict[str, Any]], format_weight: float = 0.1) -> list[dict[str, float]]:
    if not isinstance(reward_inputs, list):
        raise ValueError("Please use `reward_type=batch` for math reward function.")

    scores = []
    for reward_input in reward_inputs:
        response = re.sub(r"\s*(<|>|/)\s*", r"\1", reward_input["response"])  # handle qwen2.5vl-32b format
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
