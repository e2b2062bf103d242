"""Several reward sources, one reward: each source scores the batch, the composition combines them.

- One source alone (the usual rule-file run): its score dicts are the reward, keys unprefixed, its
  ``overall`` times its weight; nothing else happens (no threads, no extra keys), so a rule-only run
  costs what it did before sources existed.
- Several sources: they score the batch concurrently (one thread each; a judge waits on the network,
  a reward model on its device, the rule file on the CPU). Each sample's reward dict holds every
  source's keys as ``<source>/<key>`` (logged ``reward/<source>/<key>``), ``<source>/failed`` (1 when
  that source could not score it), and ``overall``:
  ``weighted_sum``: ``sum(weight_s * overall_s)``;
  ``rule_function``: the rule file runs after the others, each input holding ``source_scores``
  (``{source: {key: score}}``), and its ``overall`` is the reward (it combines them itself).

A sample a source failed on (:class:`~mmrl.rewards.source.SampleFailure`) scores the source's
``failure_score`` and is reported with the source, the sample and the reason; when more than
``max_failed_fraction`` of a batch failed in one source the run stops with that report.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmrl.rewards.source import (
    RewardSource,
    RewardSourceError,
    SampleFailure,
    SourceResult,
    check_source_results,
)

if TYPE_CHECKING:
    from mmrl.config import RewardConfig, RewardSourceConfig
    from mmrl.rewards.rule import RewardFunction

COMBINES = ("weighted_sum", "rule_function")
SOURCE_SCORES_KEY = "source_scores"  # what a combining rule function finds in each input
_FAILURES_SHOWN = 3  # failures named per source and batch in the log


@dataclass(frozen=True)
class WeightedSource:
    """A source and its part in the reward (a :class:`~mmrl.config.RewardSourceConfig`'s values)."""

    source: RewardSource
    weight: float = 1.0
    failure_score: float = 0.0
    max_failed_fraction: float = 1.0

    @classmethod
    def of(cls, source: RewardSource, config: RewardSourceConfig) -> WeightedSource:
        return cls(source, config.weight, config.failure_score, config.max_failed_fraction)


class RuleSource:
    """The user's reward file as a source (``rule``); its errors stay :class:`RewardFunctionError`."""

    name = "rule"
    needs_media = False

    def __init__(self, function: RewardFunction):
        self.function = function

    def score(self, inputs: Sequence[Mapping[str, Any]]) -> list[SourceResult]:
        return list(self.function(list(inputs)))

    def close(self) -> None:
        pass


class CompositeReward:
    """Scores reward inputs with every source and combines them (see the module docstring)."""

    def __init__(self, sources: Sequence[WeightedSource], combine: str = "weighted_sum"):
        if not sources:
            raise RewardSourceError(
                "no reward source configured: set worker.reward.reward_function, or enable "
                "worker.reward.judge / worker.reward.reward_model"
            )
        names = [weighted.source.name for weighted in sources]
        if len(set(names)) != len(names):
            raise RewardSourceError(f"reward sources need distinct names, found {names}")
        if combine not in COMBINES:
            raise RewardSourceError(f"worker.reward.combine={combine!r}; expected one of {list(COMBINES)}")
        self.combiner = None
        if combine == "rule_function":
            self.combiner = next((w for w in sources if w.source.name == RuleSource.name), None)
            if self.combiner is None:
                raise RewardSourceError(
                    "worker.reward.combine=rule_function needs worker.reward.reward_function"
                )
        self.sources = [w for w in sources if w is not self.combiner]
        self.seconds: dict[str, float] = {}  # each source's wall time on the last batch

    @property
    def needs_media(self) -> bool:
        return any(w.source.needs_media for w in self.sources)

    @property
    def names(self) -> list[str]:
        return [w.source.name for w in self.sources] + ([self.combiner.source.name] if self.combiner else [])

    def score(self, inputs: list[dict[str, Any]]) -> list[dict[str, float]]:
        if len(self.sources) == 1 and self.combiner is None:
            return self._single(inputs)
        plain = [{k: v for k, v in sample.items() if k != "media"} for sample in inputs]
        per_source = self._run_all(inputs, plain)
        rewards: list[dict[str, float]] = [{} for _ in inputs]
        for weighted in self.sources:
            for reward, score in zip(rewards, per_source[weighted.source.name]):
                reward.update({f"{weighted.source.name}/{key}": value for key, value in score.items()})
        if self.combiner is None:
            for index, reward in enumerate(rewards):
                reward["overall"] = sum(
                    w.weight * per_source[w.source.name][index]["overall"] for w in self.sources
                )
            return rewards
        combiner_inputs = [
            {**sample, SOURCE_SCORES_KEY: {name: scores[index] for name, scores in per_source.items()}}
            for index, sample in enumerate(plain)
        ]
        combined = self._scored(self.combiner, combiner_inputs)
        for reward, score in zip(rewards, combined):
            reward.update({f"{self.combiner.source.name}/{key}": value for key, value in score.items()})
            reward["overall"] = score["overall"]
        return rewards

    def close(self) -> None:
        for weighted in self.sources + ([self.combiner] if self.combiner else []):
            weighted.source.close()

    def _single(self, inputs: list[dict[str, Any]]) -> list[dict[str, float]]:
        weighted = self.sources[0]
        scores = self._scored(weighted, inputs, with_failed_key=False)
        if weighted.weight == 1.0:
            return scores
        return [{**score, "overall": weighted.weight * score["overall"]} for score in scores]

    def _run_all(
        self, inputs: list[dict[str, Any]], plain: list[dict[str, Any]]
    ) -> dict[str, list[dict[str, float]]]:
        with ThreadPoolExecutor(len(self.sources), "reward-source") as pool:
            futures = {
                w.source.name: pool.submit(self._scored, w, inputs if w.source.needs_media else plain)
                for w in self.sources
            }
            return {name: future.result() for name, future in futures.items()}

    def _scored(
        self, weighted: WeightedSource, inputs: list[dict[str, Any]], with_failed_key: bool = True
    ) -> list[dict[str, float]]:
        """One source's score dicts, its failures replaced by its failure score (and reported)."""
        name = weighted.source.name
        start = time.perf_counter()
        try:
            results = check_source_results(name, weighted.source.score(inputs), len(inputs))
        finally:
            self.seconds[name] = time.perf_counter() - start
        failures = [(i, r.reason) for i, r in enumerate(results) if isinstance(r, SampleFailure)]
        if failures:
            report_failures(name, failures, inputs, weighted.max_failed_fraction)
        scores = []
        for result in results:
            failed = isinstance(result, SampleFailure)
            score = {"overall": weighted.failure_score} if failed else dict(result)
            if with_failed_key:
                score["failed"] = float(failed)
            scores.append(score)
        return scores


def report_failures(
    name: str, failures: list[tuple[int, str]], inputs: Sequence[Mapping[str, Any]], max_fraction: float
) -> None:
    """Names source, samples and reasons: a warning line, or :class:`RewardSourceError` when more than
    ``max_fraction`` of the batch failed."""
    shown = "; ".join(
        f"sample {i} ({describe_sample(inputs[i])}): {reason}" for i, reason in failures[:_FAILURES_SHOWN]
    )
    more = f"; and {len(failures) - _FAILURES_SHOWN} more" if len(failures) > _FAILURES_SHOWN else ""
    summary = f"reward source '{name}' failed on {len(failures)} of {len(inputs)} samples: {shown}{more}"
    if len(failures) > max_fraction * len(inputs):
        raise RewardSourceError(
            f"{summary}. That is more than max_failed_fraction={max_fraction:g} of the batch "
            f"(worker.reward.{name}.max_failed_fraction)"
        )
    print(f"mmrl: {summary} (scored with its failure_score)", file=sys.stderr, flush=True)


def describe_sample(sample: Mapping[str, Any]) -> str:
    """Where a sample comes from, in a few words: its dataset index and the start of its response."""
    where = f"dataset row {sample['sample_index']}, " if sample.get("sample_index") is not None else ""
    return f"{where}response {str(sample.get('response', ''))[:40]!r}"


def build_composite(
    config: RewardConfig,
    rule: RewardFunction | None,
    judge_url: str | None = None,
    judge_model: str | None = None,
    judge_cache_path: str | None = None,
    prompt_key: str = "problem",
) -> CompositeReward:
    """The sources ``config`` enables, weighted: the rule file (``rule``, already loaded), the judge (at
    ``judge_url``: ``judge.base_url`` or the server mmrl started), the reward model, the code sandbox."""
    sources = []
    if rule is not None:
        sources.append(WeightedSource.of(RuleSource(rule), config.rule))
    judge = config.judge
    if judge.enable:
        from mmrl.rewards.judge import build_judge

        url = judge_url or judge.base_url
        model = judge_model or judge.model
        cache_path = judge.cache_path or judge_cache_path
        sources.append(WeightedSource.of(build_judge(judge, url, model, cache_path, prompt_key), judge))
    if config.reward_model.model_path:
        from mmrl.rewards.reward_model import build_reward_model

        model_source = build_reward_model(config.reward_model, prompt_key)
        sources.append(WeightedSource.of(model_source, config.reward_model))
    if config.code.enable:
        from mmrl.rewards.code import build_code_source

        sources.append(WeightedSource.of(build_code_source(config.code), config.code))
    return CompositeReward(sources, config.combine)
