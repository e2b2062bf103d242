"""Tests for mmrl.trainer.metrics on a hand-built batch; expected numbers are worked out in comments."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmrl.protocol import DataProto
from mmrl.trainer.metrics import (
    compute_data_metrics,
    compute_timing_metrics,
    reduce_metrics,
    saturation_metrics,
    timer,
)

PAD = 9.0  # written on padding positions; any statistic that reads it is wrong


def padded(rows: list[list[float]], width: int) -> torch.Tensor:
    """Right-pad each row with PAD to `width`. [B, width]"""
    return torch.tensor([row + [PAD] * (width - len(row)) for row in rows])


def hand_batch() -> DataProto:
    """3 responses of width R=4 after prompts of width P=3 (left-padded).

    prompt lengths 3, 2, 1; response lengths 2, 4 (no EOS: clipped), 1.
    """
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1]])
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    scores = torch.tensor([[0.0, 1.0, 0, 0], [0, 0, 0, 0.0], [0.5, 0, 0, 0]])  # sums 1.0, 0.0, 0.5
    # scores minus a per-token KL penalty: sums 0.8, -0.4, 0.5
    rewards = torch.tensor([[-0.1, 0.9, 0, 0], [0, 0, -0.2, -0.2], [0.5, 0, 0, 0]])
    advantages = padded([[1.0, 1.0], [-1.0] * 4, [0.5]], 4)
    returns = padded([[1.0, 2.0], [0.0, 0.0, 0.0, 1.0], [3.0]], 4)
    values = padded([[1.0, 2.0], [0.0, 0.0, 0.0, 1.0], [2.0]], 4)  # = returns except the last token
    return DataProto.from_dict(
        tensors={
            "prompts": torch.zeros(3, 3, dtype=torch.long),
            "responses": torch.zeros(3, 4, dtype=torch.long),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "response_mask": response_mask,
            "token_level_scores": scores,
            "token_level_rewards": rewards,
            "advantages": advantages,
            "returns": returns,
            "values": values,
        }
    )


def test_data_metrics_by_hand():
    metrics = compute_data_metrics(hand_batch(), use_critic=True)
    expected = {
        "critic/score/mean": 0.5,  # (1 + 0 + 0.5) / 3
        "critic/score/max": 1.0,
        "critic/score/min": 0.0,
        "critic/rewards/mean": 0.3,  # (0.8 - 0.4 + 0.5) / 3
        "critic/rewards/max": 0.8,
        "critic/rewards/min": -0.4,
        # 7 valid tokens: 2 x 1.0, 4 x -1.0, 1 x 0.5 -> -1.5 / 7
        "critic/advantages/mean": -1.5 / 7,
        "critic/advantages/max": 1.0,
        "critic/advantages/min": -1.0,
        "critic/returns/mean": 1.0,  # (1 + 2 + 0 + 0 + 0 + 1 + 3) / 7
        "critic/returns/max": 3.0,
        "critic/returns/min": 0.0,
        "critic/values/mean": 6 / 7,
        "critic/values/max": 2.0,
        "critic/values/min": 0.0,
        # returns - values = [0 x 6, 1]: unbiased var = (6 * (1/7)^2 + (6/7)^2) / 6 = 1/7
        # var(returns) = (0 + 1 + 1 + 1 + 1 + 0 + 4) / 6 = 4/3; 1 - (1/7) / (4/3 + 1e-5)
        "critic/vf_explained_var": 1 - (1 / 7) / (4 / 3 + 1e-5),
        "response_length/mean": 7 / 3,
        "response_length/max": 4.0,
        "response_length/min": 1.0,
        "response_length/clip_ratio": 1 / 3,  # only the second response fills the width
        "prompt_length/mean": 2.0,
        "prompt_length/max": 3.0,
        "prompt_length/min": 1.0,
    }
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key
        assert isinstance(metrics[key], float), key


def test_data_metrics_without_critic_and_with_explicit_length_limit():
    batch = hand_batch()
    metrics = compute_data_metrics(
        batch.select(batch_keys=[k for k in batch.batch.keys() if k != "values"]), False
    )
    assert not any(key.startswith("critic/values") or key == "critic/vf_explained_var" for key in metrics)
    # Responses padded only to the batch's longest one: with a limit of 5, the 4-token one was not cut.
    assert compute_data_metrics(batch, True, max_response_length=5)["response_length/clip_ratio"] == 0.0


def test_data_metrics_names_missing_columns():
    batch = hand_batch()
    batch.pop(batch_keys=["advantages", "values"])
    with pytest.raises(KeyError, match=r"\['advantages', 'values'\]"):
        compute_data_metrics(batch, use_critic=True)


def test_saturated_token_share_by_hand():
    # p of the sampled tokens: 0.995, 0.5 | 0.999, (padding at p = 1), 0.98 -> 2 of 4 valid tokens above 0.99
    probs = torch.tensor([[0.995, 0.5, 1.0], [0.999, 1.0, 0.98]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    batch = DataProto.from_dict(tensors={"old_log_probs": probs.log(), "response_mask": mask})
    assert saturation_metrics(batch) == {"actor/saturated_token_frac": 0.5}


def test_timing_metrics_and_throughput():
    timings = {"gen": 2.0, "old_log_prob": 0.5, "reward": 0.0, "step": 4.0}
    num_tokens = {"gen": 700, "old_log_prob": 1300, "reward": 7, "step": 1300}
    metrics = compute_timing_metrics(timings, num_tokens, num_devices=2)
    assert metrics == {
        "timing_s/gen": 2.0,
        "timing_s/old_log_prob": 0.5,
        "timing_s/reward": 0.0,
        "timing_s/step": 4.0,
        "throughput/gen_tokens_per_s": 350.0,  # 700 / 2
        "throughput/old_log_prob_tokens_per_s": 2600.0,  # 1300 / 0.5
        "throughput/tokens_per_s": 325.0,  # 1300 / 4
        "throughput/tokens_per_s_per_device": 162.5,  # 325 / 2
        # reward took 0 s: no throughput instead of an infinite one
    }


def test_reduce_metrics_means_over_dicts_that_have_the_key():
    reduced = reduce_metrics([{"a": 1, "b": torch.tensor(2.0)}, {"a": 3.0}, {"b": np.float32(4.0)}])
    assert reduced == {"a": 2.0, "b": 3.0}
    assert reduce_metrics([]) == {}
    with pytest.raises(ValueError, match="'loss' is a tensor of shape \\(2,\\)"):
        reduce_metrics([{"loss": torch.ones(2)}])


def test_timer_adds_up_pieces_and_records_on_error():
    ticks = iter([10.0, 12.5, 20.0, 21.0, 30.0, 30.25])
    clock = lambda: next(ticks)  # noqa: E731
    timings: dict[str, float] = {}
    with timer("gen", timings, clock=clock):
        pass
    with timer("gen", timings, clock=clock):
        pass
    assert timings == {"gen": 3.5}  # 2.5 + 1.0
    with pytest.raises(RuntimeError), timer("reward", timings, clock=clock):
        raise RuntimeError("reward worker died")
    assert timings["reward"] == 0.25


def test_timer_uses_a_real_clock_by_default():
    timings: dict[str, float] = {}
    with timer("step", timings):
        sum(range(1000))
    assert 0.0 <= timings["step"] < 1.0
