"""Reward scoring in Ray worker processes, launched asynchronously and overlapped with log-prob passes.

``RewardScorer`` is the plain object that turns a rollout batch into scores (decode → user function
→ token-level scores); ``RewardWorkers`` runs one or more of them as Ray actors and hands the driver
a handle to collect later. A user error inside the reward file reaches the driver as a
``RewardFunctionError`` naming the file and sample.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import numpy as np
import torch

from mmrl.columns import METRICS_META_KEY
from mmrl.config import PPOConfig
from mmrl.core_algos import overlong_penalty
from mmrl.data.processing import PROMPT_MEDIA
from mmrl.protocol import DataProto
from mmrl.rewards.rule import RewardFunctionError, build_reward_inputs, load_reward_function
from mmrl.rewards.source import RewardSourceError
from mmrl.runtime.startup import collector_paused

# object columns that are model inputs, not sample data: never handed to reward functions (nor sent)
MODEL_INPUT_COLUMNS = (
    "prompt_media",
    "multi_modal_inputs",
    "multi_modal_data",
    "raw_prompt_ids",
    "trajectory_media",
)
_CHAINED_LINE = "\n\nThe above exception was the direct cause of the following exception:"
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")  # Ray colours the process names in remote tracebacks
PROGRESS_GROUP = "progress"
PROGRESS_ANSWER_S = 10.0  # how long a timed-out scorer gets to say what it was scoring


def reward_error_message(error: RewardFunctionError, remote_text: str) -> str:
    """``error``'s message (file, function, sample), then the reward file's own traceback when ``error``
    was chained from the user's exception. Ray renders a remote error (``remote_text``) with the
    exceptions it was chained from first, so that traceback is the part before the chaining line."""
    if _CHAINED_LINE not in remote_text:
        return str(error)
    user_traceback = _ANSI_ESCAPE.sub("", remote_text.split(_CHAINED_LINE)[0]).strip()
    return f"{error}\n--- traceback in the reward function ---\n{user_traceback}"


def resolved_media(batch: DataProto) -> list[Any]:
    """Each row's PromptMedia (or None): Ray refs resolved in one ``ray.get``, rows sharing one ref
    sharing the object."""
    values = list(batch.non_tensor_batch.get(PROMPT_MEDIA, [None] * len(batch)))
    refs = {value.hex(): value for value in values if type(value).__name__ == "ObjectRef"}
    if not refs:
        return values
    import ray

    resolved = dict(zip(refs, ray.get(list(refs.values()))))
    return [resolved[value.hex()] if type(value).__name__ == "ObjectRef" else value for value in values]


def scores_to_token_level(overall: list[float], response_mask: torch.Tensor) -> torch.Tensor:
    """Outcome scores → ``[B, R]`` rewards, each on the response's last model token (the last 1 of
    ``response_mask``: a trajectory's mask has holes; position 0 for an empty response)."""
    token_level = torch.zeros(response_mask.shape, dtype=torch.float32)
    width = response_mask.shape[-1]
    # argmax finds the first maximum: over the reversed mask that is the last 1
    last = width - 1 - response_mask.flip(-1).long().argmax(-1)
    last = torch.where(response_mask.bool().any(-1), last, torch.zeros_like(last))
    token_level[torch.arange(len(overall)), last] = torch.tensor(overall, dtype=torch.float32)
    return token_level


def response_lengths(batch: DataProto) -> torch.Tensor:
    """``[B]`` valid response tokens: the model's, and a trajectory's observation tokens too (what
    counts against ``max_response_length``)."""
    if "response_turns" in batch.batch.keys():
        return (batch.batch["response_turns"] >= 0).sum(-1)
    return batch.batch["response_mask"].sum(-1)


class RewardScorer:
    """Decodes responses and scores them with the run's reward sources (:mod:`mmrl.rewards.compose`)."""

    def __init__(self, config: PPOConfig, judge_url: str | None = None, judge_model: str | None = None):
        """The run's reward sources (``config.worker.reward``) and tokenizer. With
        ``overlong_buffer_length`` > 0 DAPO's soft overlong punishment
        (:func:`~mmrl.core_algos.overlong_penalty` over ``data.max_response_length``) is added to every
        ``overall`` score and reported as the score ``overlong_penalty``. ``judge_url`` and
        ``judge_model`` name the judge mmrl serves (else ``judge.base_url`` and ``judge.model``)."""
        from mmrl.models.loading import resolve_model_path
        from mmrl.rewards.compose import build_composite

        model, reward = config.worker.actor.model, config.worker.reward
        # a hub id: resolved in this process (which may run on another node than the driver)
        folder = resolve_model_path(model.tokenizer_or_model_path, model.tokenizer_key, without_weights=True)
        with collector_paused():  # transformers' modules (mmrl.runtime.startup)
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=model.trust_remote_code)
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
        self.skip_special_tokens = reward.skip_special_tokens
        self.max_response_length = config.data.max_response_length
        self.overlong_buffer_length = reward.overlong_buffer_length
        self.overlong_penalty_factor = reward.overlong_penalty_factor

    def score(self, batch: DataProto) -> DataProto:
        response_mask = batch.batch["response_mask"]
        valid_lengths = response_lengths(batch)
        lengths = valid_lengths.tolist()
        responses = [row[:length].tolist() for row, length in zip(batch.batch["responses"], lengths)]
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=self.skip_special_tokens)
        columns = {k: v for k, v in batch.non_tensor_batch.items() if k not in MODEL_INPUT_COLUMNS}
        ground_truths = columns.pop("ground_truth", np.full(len(batch), None, dtype=object))
        inputs = build_reward_inputs(texts, lengths, ground_truths, columns)
        if self.reward.needs_media:
            for sample, media in zip(inputs, resolved_media(batch)):
                sample["media"] = media
        scores = self.reward.score(inputs)
        if self.overlong_buffer_length > 0:
            scores = self._punish_overlong(scores, valid_lengths)
        token_level = scores_to_token_level([s["overall"] for s in scores], response_mask)
        meta = {}
        if len(self.reward.names) > 1:  # a rule-only run returns exactly what it did before sources
            meta = {METRICS_META_KEY: {f"timing_s/reward_{k}": v for k, v in self.reward.seconds.items()}}
        return DataProto.from_dict(
            tensors={"token_level_scores": token_level},
            non_tensors={"reward_scores": scores, "response_text": texts},
            meta_info=meta,
        )

    def close(self) -> None:
        """Releases the sources' connections, caches and models."""
        self.reward.close()

    def progress(self) -> str:
        """The reward function and what its running call is scoring (answered while ``score`` runs:
        the actor has a concurrency group of its own for this call)."""
        if self.function is None or len(self.reward.names) > 1:
            return f"reward sources {self.reward.names} were scoring a batch"
        return f"{self.function} was scoring {self.function.in_progress or 'nothing yet'}"

    def _punish_overlong(
        self, scores: list[dict[str, float]], lengths: torch.Tensor
    ) -> list[dict[str, float]]:
        """``scores`` with the overlong penalty of each response (``lengths`` [B] tokens) added to
        ``overall`` and kept as ``overlong_penalty`` (logged like every score key)."""
        penalties = overlong_penalty(
            lengths, self.max_response_length, self.overlong_buffer_length, self.overlong_penalty_factor
        ).tolist()
        return [
            {**score, "overall": score["overall"] + penalty, "overlong_penalty": penalty}
            for score, penalty in zip(scores, penalties)
        ]


def _died(ref: Any) -> bool:
    """Whether the task behind ``ref`` failed because its worker process died."""
    import ray
    from ray.exceptions import RayActorError

    try:
        ray.get(ref, timeout=0)
    except RayActorError:
        return True
    except Exception:  # noqa: BLE001 - unfinished or failed otherwise
        return False
    return False


@dataclasses.dataclass
class PendingRewards:
    """What ``RewardWorkers.launch`` returns: Ray refs of the scored shards, in batch order."""

    refs: list[Any]
    pad_size: int


class RewardWorkers:
    """``num_workers`` Ray actors running :class:`RewardScorer`; the batch is split among them.
    ``transfers`` (a ``mmrl.single_controller.transfer.TransferCounter``) counts the shards and scores
    moved through Ray."""

    def __init__(
        self,
        num_workers: int,
        num_cpus: float,
        timeout_s: float,
        transfers: Any = None,
        num_gpus: float = 0.0,
        send_media: bool = False,
        **scorer_kwargs: Any,
    ):
        """``send_media``: each shard carries the rows' ``prompt_media`` refs (for sources that see the
        media); ``num_gpus``: per worker, for a reward model."""
        import ray

        # `progress` runs in a concurrency group of its own, so a hung `score` can still be asked what
        # it is scoring; the reward function then runs in a worker thread, not the main thread (a
        # signal-based timeout inside a reward file does not work; worker.reward.timeout_s does)
        remote_cls = ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, concurrency_groups={PROGRESS_GROUP: 1})(
            RewardScorer
        )
        self.actors = [remote_cls.remote(**scorer_kwargs) for _ in range(num_workers)]
        self.timeout_s = timeout_s
        self.transfers = transfers
        self.send_media = send_media
        self.metrics: dict[str, float] = {}

    def launch(self, batch: DataProto) -> PendingRewards:
        scoring_columns = [k for k in batch.non_tensor_batch if k not in MODEL_INPUT_COLUMNS]
        if self.send_media and PROMPT_MEDIA in batch.non_tensor_batch:
            scoring_columns.append(PROMPT_MEDIA)  # refs: the workers fetch the bytes from the object store
        tensors = ["responses", "response_mask"]
        tensors += ["response_turns"] if "response_turns" in batch.batch.keys() else []  # trajectories
        light = batch.select(batch_keys=tensors, non_tensor_keys=scoring_columns)
        padded, pad_size = light.pad_to_divisor(len(self.actors))
        shards = padded.chunk(len(self.actors))
        if self.transfers is not None:
            shards = [self.transfers.put(shard) for shard in shards]  # an argument ref reaches it resolved
        return PendingRewards(
            [actor.score.remote(shard) for actor, shard in zip(self.actors, shards)], pad_size
        )

    def collect(self, pending: PendingRewards) -> DataProto:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        try:
            shards = ray.get(pending.refs, timeout=self.timeout_s)
        except GetTimeoutError:
            raise RewardFunctionError(self._timeout_message(pending)) from None
        except RayTaskError as err:
            if isinstance(err.cause, RewardFunctionError):  # the scorer's own exception, unpickled
                raise RewardFunctionError(reward_error_message(err.cause, str(err))) from None
            if isinstance(err.cause, RewardSourceError):  # a judge, reward model or sandbox, by name
                raise RewardSourceError(str(err.cause)) from None
            raise
        except RayActorError as err:  # the process died (killed, out of memory): name the worker
            index = next((i for i, ref in enumerate(pending.refs) if _died(ref)), "?")
            self.shutdown()
            raise RewardFunctionError(
                f"reward worker {index} of {len(self.actors)} (RewardScorer) died while scoring: "
                f"{str(err).splitlines()[0]}"
            ) from None
        if self.transfers is not None:
            self.transfers.received(pending.refs)
        # each source's seconds on the slowest worker (they score their shards side by side), added up
        # over the collects of a step until take_metrics()
        slowest: dict[str, float] = {}
        for shard in shards:
            for key, value in shard.meta_info.pop(METRICS_META_KEY, {}).items():
                slowest[key] = max(value, slowest.get(key, 0.0))
        for key, value in slowest.items():
            self.metrics[key] = self.metrics.get(key, 0.0) + value
        return DataProto.concat(shards).unpad(pending.pad_size)

    def take_metrics(self) -> dict[str, float]:
        """Each reward source's seconds (``timing_s/reward_<source>``) since the last call; empty for a
        run with one source."""
        metrics, self.metrics = self.metrics, {}
        return metrics

    def _timeout_message(self, pending: PendingRewards) -> str:
        """Names what each unfinished worker was scoring, then kills the workers (a hung function
        would otherwise keep its process busy forever)."""
        import ray

        unfinished = [i for i, ref in enumerate(pending.refs) if not ray.wait([ref], timeout=0)[0]]
        lines = []
        for index in unfinished:
            actor = self.actors[index]
            try:
                answer = ray.get(
                    actor.progress.options(concurrency_group=PROGRESS_GROUP).remote(),
                    timeout=PROGRESS_ANSWER_S,
                )
            except Exception as err:  # noqa: BLE001 - the message matters more than why it has no answer
                answer = f"(no answer: {type(err).__name__})"
            lines.append(f"reward worker {index} of {len(self.actors)}: {answer}")
        self.shutdown()
        return (
            f"reward scoring did not finish within worker.reward.timeout_s={self.timeout_s:g} s; the reward "
            "workers were stopped. Raise the timeout, or fix the reward function where it hangs:\n"
            + "\n".join(lines)
        )

    def shutdown(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor)
