"""Reward scoring in Ray worker processes, launched asynchronously and overlapped with log-prob passes.

The driver's side of the reward workers. :class:`RewardWorkers` runs one or more
:class:`~mmrl.rewards.scorer.RewardScorer` as Ray actors (processes that import neither torch nor
transformers). ``launch`` decodes the responses with the run's tokenizer and hands the workers
:class:`~mmrl.rewards.scorer.RewardSamples`; ``collect`` places the scores on the tokens (with DAPO's
overlong punishment). A user error inside the reward file reaches the driver as a
``RewardFunctionError`` naming the file and sample.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from mmrl.config import PPOConfig
from mmrl.core_algos import overlong_penalty
from mmrl.data.processing import PROMPT_MEDIA
from mmrl.protocol import DataProto
from mmrl.rewards.rule import RewardFunctionError
from mmrl.rewards.scorer import RewardSamples, RewardScorer, RewardScores
from mmrl.rewards.source import RewardSourceError

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


def reward_samples(batch: DataProto, tokenizer: Any, skip_special_tokens: bool, media: bool) -> RewardSamples:
    """What the reward sources score of ``batch``: each response's valid tokens decoded, its length,
    the rows' object columns but the model inputs, and with ``media`` the rows' ``prompt_media``."""
    lengths = response_lengths(batch).tolist()
    responses = [row[:length].tolist() for row, length in zip(batch.batch["responses"], lengths)]
    texts = tokenizer.batch_decode(responses, skip_special_tokens=skip_special_tokens)
    columns = {k: list(v) for k, v in batch.non_tensor_batch.items() if k not in MODEL_INPUT_COLUMNS}
    rows_media = batch.non_tensor_batch.get(PROMPT_MEDIA) if media else None
    return RewardSamples(texts, lengths, columns, None if rows_media is None else list(rows_media))


def scored_batch(
    samples: RewardSamples, scores: list[dict[str, float]], response_mask: torch.Tensor, config: PPOConfig
) -> DataProto:
    """The reward phase's columns: ``token_level_scores`` (each response's ``overall`` on its last model
    token), ``reward_scores`` and ``response_text``. With ``worker.reward.overlong_buffer_length`` > 0
    DAPO's soft overlong punishment (:func:`~mmrl.core_algos.overlong_penalty` over
    ``data.max_response_length``) is added to every ``overall`` and reported as the score
    ``overlong_penalty``."""
    reward = config.worker.reward
    if reward.overlong_buffer_length > 0:
        penalties = overlong_penalty(
            torch.tensor(samples.lengths),
            config.data.max_response_length,
            reward.overlong_buffer_length,
            reward.overlong_penalty_factor,
        ).tolist()
        scores = [
            {**score, "overall": score["overall"] + penalty, "overlong_penalty": penalty}
            for score, penalty in zip(scores, penalties)
        ]
    return DataProto.from_dict(
        tensors={"token_level_scores": scores_to_token_level([s["overall"] for s in scores], response_mask)},
        non_tensors={"reward_scores": scores, "response_text": samples.texts},
    )


def score_in_process(scorer: RewardScorer, batch: DataProto, tokenizer: Any, config: PPOConfig) -> DataProto:
    """What the reward workers return for ``batch``, scored by ``scorer`` in this process (benches)."""
    samples = reward_samples(batch, tokenizer, config.worker.reward.skip_special_tokens, media=True)
    return scored_batch(samples, scorer.score(samples).scores, batch.batch["response_mask"], config)


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
class SentRewards:
    """A batch's samples and the Ray ref of each scored slice with the index of the worker scoring
    it, in batch order."""

    samples: RewardSamples
    refs: list[tuple[int, Any]]


@dataclasses.dataclass
class PendingRewards:
    """What ``RewardWorkers.launch`` returns: the samples being decoded and sent in the background
    (a future of :class:`SentRewards`) and the responses' mask ``collect`` places the scores with."""

    sent: Future
    response_mask: torch.Tensor


class RewardWorkers:
    """``worker.reward.num_workers`` Ray actors running :class:`~mmrl.rewards.scorer.RewardScorer`;
    each batch is split among them. ``transfers`` (a ``mmrl.single_controller.transfer.TransferCounter``)
    counts the slices and scores moved through Ray."""

    def __init__(
        self,
        config: PPOConfig,
        tokenizer: Any,
        transfers: Any = None,
        judge_url: str | None = None,
        judge_model: str | None = None,
    ):
        """``tokenizer`` decodes the responses; ``judge_url`` and ``judge_model`` name the judge mmrl
        serves. Sources that see the media (a judge, a reward model) get each row's ``prompt_media``
        refs, fetched by the workers from the object store."""
        import ray

        reward = config.worker.reward
        # `progress` runs in a concurrency group of its own, so a hung `score` can still be asked what
        # it is scoring; the reward function then runs in a worker thread, not the main thread (a
        # signal-based timeout inside a reward file does not work; worker.reward.timeout_s does)
        remote_cls = ray.remote(
            num_cpus=reward.num_cpus, num_gpus=reward.num_gpus, concurrency_groups={PROGRESS_GROUP: 1}
        )(RewardScorer)
        self.actors = [remote_cls.remote(config, judge_url, judge_model) for _ in range(reward.num_workers)]
        self.config, self.transfers = config, transfers
        self.timeout_s = reward.timeout_s
        self.send_media = reward.judge.enable or bool(reward.reward_model.model_path)
        self.metrics: dict[str, float] = {}
        # Decoding takes ~1 s for 1,024 responses of 4,096 tokens (Qwen's vocabulary): a thread of its
        # own does it, so the driver goes on to the log-prob passes at once. The thread has its own copy
        # of the tokenizer (a fast tokenizer must not decode in one thread while it encodes in another).
        self.tokenizer = copy.deepcopy(tokenizer)
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward-decode")

    def launch(self, batch: DataProto) -> PendingRewards:
        """Starts scoring ``batch``: its responses are decoded and sent in the background, in launch
        order (the columns are taken now: the caller may go on adding to ``batch``)."""
        tensors = ["responses", "response_mask"]
        tensors += ["response_turns"] if "response_turns" in batch.batch.keys() else []  # trajectories
        taken = batch.select(batch_keys=tensors)  # every object column: reward_samples picks
        return PendingRewards(self._sender.submit(self._send, taken), batch.batch["response_mask"])

    def _send(self, batch: DataProto) -> SentRewards:
        skip_special_tokens = self.config.worker.reward.skip_special_tokens
        samples = reward_samples(batch, self.tokenizer, skip_special_tokens, self.send_media)
        refs = []
        for index, part in samples.split(len(self.actors)):
            # an argument ref reaches the worker resolved
            sent = self.transfers.put(part) if self.transfers is not None else part
            refs.append((index, self.actors[index].score.remote(sent)))
        return SentRewards(samples, refs)

    def collect(self, pending: PendingRewards) -> DataProto:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        sent = pending.sent.result()
        refs = [ref for _, ref in sent.refs]
        try:
            parts: list[RewardScores] = ray.get(refs, timeout=self.timeout_s)
        except GetTimeoutError:
            raise RewardFunctionError(self._timeout_message(sent)) from None
        except RayTaskError as err:
            if isinstance(err.cause, RewardFunctionError):  # the scorer's own exception, unpickled
                raise RewardFunctionError(reward_error_message(err.cause, str(err))) from None
            if isinstance(err.cause, RewardSourceError):  # a judge, reward model or sandbox, by name
                raise RewardSourceError(str(err.cause)) from None
            raise
        except RayActorError as err:  # the process died (killed, out of memory): name the worker
            index = next((i for i, ref in sent.refs if _died(ref)), "?")
            self.shutdown()
            raise RewardFunctionError(
                f"reward worker {index} of {len(self.actors)} (RewardScorer) died while scoring: "
                f"{str(err).splitlines()[0]}"
            ) from None
        if self.transfers is not None:
            self.transfers.received(refs)
        # each source's seconds on the slowest worker (they score their slices side by side), added up
        # over the collects of a step until take_metrics()
        slowest: dict[str, float] = {}
        for part in parts:
            for name, seconds in part.seconds.items():
                slowest[name] = max(seconds, slowest.get(name, 0.0))
        for name, seconds in slowest.items():
            key = f"timing_s/reward_{name}"
            self.metrics[key] = self.metrics.get(key, 0.0) + seconds
        scores = [score for part in parts for score in part.scores]
        return scored_batch(sent.samples, scores, pending.response_mask, self.config)

    def take_metrics(self) -> dict[str, float]:
        """Each reward source's seconds (``timing_s/reward_<source>``) since the last call; empty for a
        run with one source."""
        metrics, self.metrics = self.metrics, {}
        return metrics

    def _timeout_message(self, sent: SentRewards) -> str:
        """Names what each unfinished worker was scoring, then kills the workers (a hung function
        would otherwise keep its process busy forever)."""
        import ray

        unfinished = [i for i, ref in sent.refs if not ray.wait([ref], timeout=0)[0]]
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

        self._sender.shutdown(wait=False, cancel_futures=True)
        for actor in self.actors:
            ray.kill(actor)
