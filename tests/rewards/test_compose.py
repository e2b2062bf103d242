"""Composition of reward sources: one source alone is unchanged, several are prefixed and weighted, the
rule file may combine them itself, failures are named, sources run side by side."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from mmrl.config import RewardConfig
from mmrl.rewards.compose import CompositeReward, RuleSource, WeightedSource, build_composite
from mmrl.rewards.rule import load_reward_function
from mmrl.rewards.source import RewardSourceError, SampleFailure

SHAPES = Path(__file__).parents[2] / "reward_functions" / "shapes.py"
INPUTS = [
    {"response": response, "response_length": 1, "ground_truth": "red", "sample_index": index}
    for index, response in enumerate(["red", "blue", "red circle"])
]


class Scripted:
    """A source returning fixed results (and recording the thread and the inputs it saw)."""

    def __init__(self, name, results, needs_media=False, barrier=None):
        self.name, self.results, self.needs_media, self.barrier = name, results, needs_media, barrier
        self.seen, self.threads, self.closed = None, set(), False

    def score(self, inputs):
        self.seen = inputs
        self.threads.add(threading.get_ident())
        if self.barrier is not None:  # passes only once every source sharing it is scoring at once
            self.barrier.wait()
        return list(self.results)

    def close(self):
        self.closed = True


def _rule(**kwargs):
    return RuleSource(load_reward_function(f"{SHAPES}:compute_score", kwargs))


def test_one_rule_source_returns_the_rule_files_scores_unchanged():
    alone = CompositeReward([WeightedSource(_rule())]).score(INPUTS)
    assert alone == load_reward_function(f"{SHAPES}:compute_score")(INPUTS)
    assert alone[0] == {"overall": 1.0, "format": 1.0, "accuracy": 1.0}  # no prefix, no extra key
    halved = CompositeReward([WeightedSource(_rule(), weight=0.5)]).score(INPUTS)
    assert [s["overall"] for s in halved] == [0.5, 0.0, 0.5]


def test_several_sources_are_prefixed_and_weighted():
    judge = Scripted("judge", [{"overall": 0.5, "unparseable": 0.0}] * 3)
    sources = [WeightedSource(_rule(), weight=1.0), WeightedSource(judge, weight=2.0)]
    reward = CompositeReward(sources, "weighted_sum")
    scores = reward.score(INPUTS)
    assert scores[1] == {
        "rule/overall": 0.0,
        "rule/format": 1.0,
        "rule/accuracy": 0.0,
        "rule/failed": 0.0,
        "judge/overall": 0.5,
        "judge/unparseable": 0.0,
        "judge/failed": 0.0,
        "overall": 1.0 * 0.0 + 2.0 * 0.5,
    }
    assert [s["overall"] for s in scores] == [2.0, 1.0, 2.0]
    assert set(reward.seconds) == {"rule", "judge"}


def test_a_weight_of_zero_logs_a_source_without_training_on_it():
    judge = Scripted("judge", [{"overall": 1.0}, {"overall": 0.0}, {"overall": 1.0}])
    scores = CompositeReward([WeightedSource(_rule(), weight=0.0), WeightedSource(judge)]).score(INPUTS)
    assert [s["overall"] for s in scores] == [1.0, 0.0, 1.0]
    assert [s["rule/accuracy"] for s in scores] == [1.0, 0.0, 1.0]


def test_sources_run_side_by_side():
    # in sequence the first source would wait at the barrier alone and break it after 10 s
    barrier = threading.Barrier(3, timeout=10)
    sources = [Scripted(name, [{"overall": 1.0}] * 3, barrier=barrier) for name in ("a", "b", "c")]
    scores = CompositeReward([WeightedSource(s) for s in sources]).score(INPUTS)
    assert [s["overall"] for s in scores] == [3.0, 3.0, 3.0] and not barrier.broken
    assert len(set.union(*(s.threads for s in sources))) == 3


def test_only_sources_that_see_media_get_them():
    seeing, blind = Scripted("judge", [{"overall": 1.0}] * 3, True), Scripted("other", [{"overall": 1.0}] * 3)
    with_media = [{**sample, "media": object()} for sample in INPUTS]
    CompositeReward([WeightedSource(seeing), WeightedSource(blind)]).score(with_media)
    assert all("media" in s for s in seeing.seen) and not any("media" in s for s in blind.seen)


def test_a_failed_sample_scores_the_failure_score_and_is_named(capsys):
    judge = Scripted("judge", [{"overall": 1.0}, SampleFailure("HTTP 503 (after 5 tries)"), {"overall": 1.0}])
    reward = CompositeReward([WeightedSource(_rule()), WeightedSource(judge, failure_score=-1.0)])
    scores = reward.score(INPUTS)
    assert scores[1]["judge/failed"] == 1.0 and scores[1]["judge/overall"] == -1.0
    assert scores[1]["overall"] == 0.0 + -1.0
    log = capsys.readouterr().err
    assert "reward source 'judge' failed on 1 of 3 samples: sample 1 (dataset row 1, response 'blue')" in log
    assert "HTTP 503 (after 5 tries)" in log


def test_too_many_failures_stop_the_run_naming_source_samples_and_key():
    judge = Scripted("judge", [SampleFailure("connection failed")] * 2 + [{"overall": 1.0}])
    reward = CompositeReward([WeightedSource(_rule()), WeightedSource(judge, max_failed_fraction=0.5)])
    with pytest.raises(RewardSourceError) as err:
        reward.score(INPUTS)
    message = str(err.value)
    assert "reward source 'judge' failed on 2 of 3 samples: sample 0 (dataset row 0" in message
    assert "worker.reward.judge.max_failed_fraction" in message


def test_the_rule_function_may_combine_the_sources_itself(tmp_path):
    combiner = tmp_path / "combine.py"
    combiner.write_text(
        "def main(inputs):\n"
        "    return [{'overall': x['source_scores']['judge']['overall'] * (x['response'] == 'red'),"
        " 'judge_seen': x['source_scores']['judge']['overall']} for x in inputs]\n"
    )
    judge = Scripted("judge", [{"overall": 0.8}] * 3)
    rule = RuleSource(load_reward_function(str(combiner)))
    scores = CompositeReward([WeightedSource(rule), WeightedSource(judge)], "rule_function").score(INPUTS)
    assert [s["overall"] for s in scores] == [0.8, 0.0, 0.0]
    assert scores[0]["rule/judge_seen"] == 0.8 and scores[0]["judge/overall"] == 0.8
    assert "source_scores" not in judge.seen[0]


def test_malformed_results_and_configs_are_named():
    with pytest.raises(RewardSourceError, match="reward source 'judge' returned 2 results for 3 inputs"):
        CompositeReward([WeightedSource(Scripted("judge", [{"overall": 1.0}] * 2))]).score(INPUTS)
    with pytest.raises(RewardSourceError, match="no reward source configured"):
        CompositeReward([])
    with pytest.raises(RewardSourceError, match="combine=rule_function needs worker.reward.reward_function"):
        CompositeReward([WeightedSource(Scripted("judge", []))], "rule_function")


def test_build_composite_reads_the_sections_and_close_reaches_every_source():
    config = RewardConfig(reward_function=f"{SHAPES}:compute_score")
    reward = build_composite(config, load_reward_function(config.reward_function))
    assert reward.names == ["rule"] and not reward.needs_media
    judge = Scripted("judge", [])
    composite = CompositeReward([WeightedSource(_rule()), WeightedSource(judge)])
    composite.close()
    assert judge.closed
