"""The reward worker's side (mmrl/rewards/scorer.py): a batch's samples split among the workers, in
order; the scorer scores decoded responses with the run's sources."""

from __future__ import annotations

from pathlib import Path

from mmrl.config import PPOConfig, RewardConfig, WorkerConfig
from mmrl.rewards.scorer import RewardSamples, RewardScorer

REWARD_FUNCTIONS = Path(__file__).parents[2] / "reward_functions"


def _samples(count: int, media: bool = False) -> RewardSamples:
    return RewardSamples(
        texts=[f"r{i}" for i in range(count)],
        lengths=list(range(1, count + 1)),
        columns={"ground_truth": [f"g{i}" for i in range(count)], "data_source": ["shapes"] * count},
        media=[f"m{i}" for i in range(count)] if media else None,
    )


def test_samples_split_into_consecutive_even_slices_with_their_worker_index():
    parts = _samples(5, media=True).split(2)
    assert [index for index, _ in parts] == [0, 1]
    first, second = parts[0][1], parts[1][1]
    assert first.texts == ["r0", "r1", "r2"] and second.texts == ["r3", "r4"]
    assert first.lengths == [1, 2, 3] and second.lengths == [4, 5]
    assert second.columns == {"ground_truth": ["g3", "g4"], "data_source": ["shapes"] * 2}
    assert first.media == ["m0", "m1", "m2"] and second.media == ["m3", "m4"]
    # fewer responses than workers: the workers past them get nothing
    parts = _samples(2).split(3)
    assert [(index, part.texts, part.media) for index, part in parts] == [
        (0, ["r0"], None),
        (1, ["r1"], None),
    ]
    assert _samples(0).split(2) == []


def test_the_scorer_scores_decoded_responses_with_the_rule_file():
    # math.py: accuracy 1 for a boxed answer equal to the ground truth
    spec = f"{REWARD_FUNCTIONS / 'math.py'}:compute_score"
    scorer = RewardScorer(PPOConfig(worker=WorkerConfig(reward=RewardConfig(reward_function=spec))))
    samples = RewardSamples(
        texts=["<think>2 + 5</think> \\boxed{7}", "\\boxed{8}"],
        lengths=[9, 4],
        columns={"ground_truth": ["7", "7"]},
    )
    scored = scorer.score(samples)
    assert [score["accuracy"] for score in scored.scores] == [1.0, 0.0]
    assert scored.seconds == {}  # one source: no seconds per source
    assert "math.py" in scorer.progress()
