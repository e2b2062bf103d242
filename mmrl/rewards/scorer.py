"""What a reward worker process runs: decoded responses in, one score dict per response out.

The driver (:mod:`mmrl.workers.reward_worker`) decodes the responses with the run's tokenizer and
sends :class:`RewardSamples`, plain Python values; it places the returned scores on the tokens itself.
So a reward worker imports neither torch nor transformers: it starts in about a second and holds
no tokenizer, only the reward sources it runs (a reward file or a source that needs torch imports it
when it is loaded). A multi-turn batch's ``trajectory`` records unpickle with their module, which
imports torch.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from mmrl.config import PPOConfig
from mmrl.rewards.compose import build_composite
from mmrl.rewards.rule import build_reward_inputs, load_reward_function


@dataclasses.dataclass
class RewardSamples:
    """The responses a reward worker scores, one entry per response in each list: the decoded
    ``texts``, their ``lengths`` in tokens (a trajectory's observation tokens included), the
    ``columns`` handed to the reward function (``ground_truth``, the data file's own columns, a
    trajectory's ``turn_rewards`` and ``trajectory``) and, for sources that see the media, each row's
    ``media`` (a ``PromptMedia``, a Ray ref to one, or None)."""

    texts: list[str]
    lengths: list[int]
    columns: dict[str, list[Any]]
    media: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.texts)

    def split(self, parts: int) -> list[tuple[int, RewardSamples]]:
        """Up to ``parts`` consecutive slices, in order, as even as can be (sizes differ by one at
        most), each with its index among the parts; an empty slice is left out."""
        size, extra = divmod(len(self), parts)
        slices, start = [], 0
        for index in range(parts):
            end = start + size + (index < extra)
            if end > start:
                slices.append((index, self.rows(start, end)))
            start = end
        return slices

    def rows(self, start: int, end: int) -> RewardSamples:
        return RewardSamples(
            self.texts[start:end],
            self.lengths[start:end],
            {name: values[start:end] for name, values in self.columns.items()},
            None if self.media is None else self.media[start:end],
        )


@dataclasses.dataclass
class RewardScores:
    """What :meth:`RewardScorer.score` returns: every score key of each response (``overall`` among
    them) and, for a run with several sources, each source's seconds on this batch."""

    scores: list[dict[str, float]]
    seconds: dict[str, float]


def resolved_media(media: list[Any]) -> list[Any]:
    """Each row's PromptMedia (or None): Ray refs resolved in one ``ray.get``, rows sharing one ref
    sharing the object."""
    refs = {value.hex(): value for value in media if type(value).__name__ == "ObjectRef"}
    if not refs:
        return media
    import ray

    resolved = dict(zip(refs, ray.get(list(refs.values()))))
    return [resolved[value.hex()] if type(value).__name__ == "ObjectRef" else value for value in media]


class RewardScorer:
    """Scores decoded responses with the run's reward sources (:mod:`mmrl.rewards.compose`)."""

    def __init__(self, config: PPOConfig, judge_url: str | None = None, judge_model: str | None = None):
        """The run's reward sources (``config.worker.reward``). ``judge_url`` and ``judge_model`` name
        the judge mmrl serves (else ``judge.base_url`` and ``judge.model``)."""
        reward = config.worker.reward
        self.function = None
        if reward.reward_function:
            self.function = load_reward_function(reward.reward_function, reward.reward_function_kwargs)
            if reward.reward_type is not None:  # overrides the file's REWARD_TYPE (old EasyR1 files lack it)
                self.function = dataclasses.replace(self.function, reward_type=reward.reward_type)
        self.reward = build_composite(
            reward,
            self.function,
            judge_url,
            judge_model,
            judge_cache_path=os.path.join(config.trainer.checkpoint_dir, "judge_cache.sqlite"),
            prompt_key=config.data.prompt_key,
        )

    def score(self, samples: RewardSamples) -> RewardScores:
        columns = dict(samples.columns)
        ground_truths = columns.pop("ground_truth", [None] * len(samples))
        inputs = build_reward_inputs(samples.texts, samples.lengths, ground_truths, columns)
        if self.reward.needs_media and samples.media is not None:
            for sample, media in zip(inputs, resolved_media(samples.media)):
                sample["media"] = media
        scores = self.reward.score(inputs)
        # a rule-only run reports no seconds per source (its step time is the reward's)
        seconds = dict(self.reward.seconds) if len(self.reward.names) > 1 else {}
        return RewardScores(scores, seconds)

    def close(self) -> None:
        """Releases the sources' connections, caches and models."""
        self.reward.close()

    def progress(self) -> str:
        """The reward function and what its running call is scoring (answered while ``score`` runs:
        the actor has a concurrency group of its own for this call)."""
        if self.function is None or len(self.reward.names) > 1:
            return f"reward sources {self.reward.names} were scoring a batch"
        return f"{self.function} was scoring {self.function.in_progress or 'nothing yet'}"
