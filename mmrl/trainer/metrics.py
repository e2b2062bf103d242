"""Step metrics: pure functions from a training batch and phase timings to `{name: float}`.

Metric names are `group/name[/statistic]`; the group is the dashboard section. Names follow EasyR1's where
the meaning is the same, so its users' dashboards and comparisons carry over.

- `critic/score/{mean,max,min}`: per-response sum of `token_level_scores` (the reward function's score);
  `critic/rewards/...`: the same for `token_level_rewards` (after the in-reward KL penalty);
  `critic/advantages/...`, `critic/returns/...`, `critic/values/...`: over valid response tokens;
  `critic/vf_explained_var` (GAE only). Written by `compute_data_metrics`.
- `response_length/{mean,max,min,clip_ratio}`, `prompt_length/{mean,max,min}`: in tokens, padding
  excluded; a multi-turn trajectory's response length counts its observation tokens too, and
  `response_length/model_tokens/{mean,max,min}` the model's own. Written by `compute_data_metrics`.
- `timing_s/<phase>`: wall-clock seconds of a phase (`timer`, `compute_timing_metrics`).
- `throughput/<phase>_tokens_per_s`, and for the whole step `throughput/tokens_per_s` and
  `throughput/tokens_per_s_per_device` (`compute_timing_metrics`).
- `actor/...`, `critic/...` losses, KL, entropy, grad norm and learning rate: written by the workers.
- `actor/saturated_token_frac`: share of response tokens the policy sampled at p > 0.99 (its old
  log-probs; `saturation_metrics`); with `rollout/all_equal_group_frac` and
  `rollout/steps_since_mixed_group` (the trainer's collapse gate) the signs of a collapse
  (docs/recipes.md).
- `reward/<key>`: mean of every score key the reward function returns (`mmrl.rewards`).
- `val/...`: the same names computed on the validation set, written by the trainer.

All functions return plain Python floats, ready for any logger.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from mmrl.agent.metrics import trajectory_metrics
from mmrl.protocol import DataProto

__all__ = ["compute_data_metrics", "compute_timing_metrics", "reduce_metrics", "timer"]

_DATA_KEYS = (
    "responses",
    "response_mask",
    "attention_mask",
    "token_level_scores",
    "token_level_rewards",
    "advantages",
    "returns",
)


SATURATED_LOG_PROB = math.log(0.99)


def saturation_metrics(batch: DataProto) -> dict[str, float]:
    """``actor/saturated_token_frac``: the share of valid response tokens whose sampled token had
    probability > 0.99 under the policy that sampled it (``old_log_probs``). It rises towards 1 as the
    policy settles on one answer, where the policy gradient of those tokens (``1 - p``) vanishes."""
    mask = batch.batch["response_mask"].bool()
    saturated = batch.batch["old_log_probs"][mask] > SATURATED_LOG_PROB
    return {"actor/saturated_token_frac": float(saturated.float().mean()) if mask.any() else 0.0}


def compute_data_metrics(
    batch: DataProto, use_critic: bool, max_response_length: int | None = None
) -> dict[str, float]:
    """Score, reward, advantage, return, value and length statistics of one training batch.

    Sequence-level statistics (score, rewards, lengths) are over the B responses; token-level ones
    (advantages, returns, values) over the valid response tokens, `response_mask == 1`.

    `response_length/clip_ratio` is the fraction of responses with `max_response_length` valid tokens,
    i.e. cut by the length limit before an EOS (`response_mask` covers the EOS, so a finished response
    is shorter). `max_response_length` defaults to the response width R, right for rollouts that pad
    to the limit; pass the limit when responses are padded only to the longest one. A response whose
    EOS lands exactly on the last allowed slot is counted as clipped: the mask cannot tell them apart.

    `critic/vf_explained_var` = 1 - Var(returns - values) / (Var(returns) + 1e-5), only with a critic.
    """
    missing = [key for key in _DATA_KEYS + (("values",) if use_critic else ()) if key not in batch.batch]
    if missing:
        raise KeyError(
            f"compute_data_metrics: the batch has no columns {missing}; it has {sorted(batch.batch.keys())}. "
            "Call it after advantages are computed (and values, when use_critic=True)."
        )
    response_width = batch.batch["responses"].shape[-1]
    response_mask = batch.batch["response_mask"].bool()  # [B, R]
    prompt_mask = batch.batch["attention_mask"][:, :-response_width]  # [B, P]
    # the response's valid tokens: the model's, and a trajectory's observation tokens (its mask's holes)
    response_length = batch.batch["attention_mask"][:, -response_width:].sum(-1).float()  # [B]
    prompt_length = prompt_mask.sum(-1).float()  # [B]
    length_limit = response_width if max_response_length is None else max_response_length

    metrics = {
        **_stats("critic/score", batch.batch["token_level_scores"].sum(-1)),
        **_stats("critic/rewards", batch.batch["token_level_rewards"].sum(-1)),
        **_stats("critic/advantages", batch.batch["advantages"][response_mask]),
        **_stats("critic/returns", batch.batch["returns"][response_mask]),
        **_stats("response_length", response_length),
        "response_length/clip_ratio": (response_length >= length_limit).float().mean().item(),
        **_stats("prompt_length", prompt_length),
    }
    if "response_turns" in batch.batch.keys():  # trajectories: how much of the response the model wrote
        metrics.update(_stats("response_length/model_tokens", response_mask.sum(-1)))
        metrics.update(trajectory_metrics(batch.non_tensor_batch.get("trajectory", ())))
    if use_critic:
        valid_values = batch.batch["values"][response_mask]
        valid_returns = batch.batch["returns"][response_mask]
        metrics.update(_stats("critic/values", valid_values))
        explained = 1.0 - torch.var(valid_returns - valid_values) / (torch.var(valid_returns) + 1e-5)
        metrics["critic/vf_explained_var"] = explained.item()
    return metrics


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """`{prefix}/mean, /max, /min` of a 1-D tensor; NaN when it is empty (e.g. no valid tokens)."""
    values = values.detach().float()
    if values.numel() == 0:
        return {f"{prefix}/{name}": math.nan for name in ("mean", "max", "min")}
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def compute_timing_metrics(
    timings: dict[str, float], num_tokens: dict[str, int], num_devices: int = 1
) -> dict[str, float]:
    """Phase durations and token throughputs.

    `timings` maps a phase name (`gen`, `reward`, `old_log_prob`, `update_actor`, ..., and `step` for the
    whole step) to seconds; `num_tokens` maps a phase to the tokens it processed (response tokens for
    generation, prompt + response tokens for training passes). Returns

    - `timing_s/<phase>` = seconds, for every timed phase;
    - `throughput/<phase>_tokens_per_s` = tokens / seconds, for phases in both dicts;
    - for the phase `step`, `throughput/tokens_per_s` instead, and
      `throughput/tokens_per_s_per_device` = tokens / seconds / num_devices.

    Phases that took no measurable time get no throughput rather than an infinite one.
    """
    metrics = {f"timing_s/{phase}": float(seconds) for phase, seconds in timings.items()}
    for phase, tokens in num_tokens.items():
        seconds = timings.get(phase)
        if seconds is None or seconds <= 0:
            continue
        tokens_per_s = float(tokens) / seconds
        if phase == "step":
            metrics["throughput/tokens_per_s"] = tokens_per_s
            metrics["throughput/tokens_per_s_per_device"] = tokens_per_s / num_devices
        else:
            metrics[f"throughput/{phase}_tokens_per_s"] = tokens_per_s
    return metrics


def reduce_metrics(metrics_list: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Mean of each key over the dicts that contain it (e.g. the micro-batches of an update).

    Values may be Python numbers, NumPy scalars or one-element tensors.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for metrics in metrics_list:
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + _as_float(key, value)
            counts[key] = counts.get(key, 0) + 1
    return {key: sums[key] / counts[key] for key in sums}


def _as_float(key: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"reduce_metrics: metric {key!r} is a tensor of shape {tuple(value.shape)}; "
                "metrics must be scalars (call .mean() first)."
            )
        return value.item()
    return float(value)


@contextmanager
def timer(
    name: str, timings: dict[str, float], clock: Callable[[], float] = time.perf_counter
) -> Iterator[None]:
    """`with timer("gen", timings): ...` adds the block's wall-clock seconds to `timings[name]`.

    Adding (rather than overwriting) makes a phase timed in several pieces sum up; start each step with
    a fresh dict. The time is recorded even when the block raises.
    """
    start = clock()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + (clock() - start)
