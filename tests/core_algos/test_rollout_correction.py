"""Rollout correction (``core_algos.rollout_correction_weights``) against values worked out by hand.

Two responses; ``log rho = old - rollout`` per token:
row 0: ``[ln 3, 0, -ln 2]`` (3 tokens, ratios 3, 1, 0.5; product 1.5; geometric mean 1.5^(1/3) = 1.145)
row 1: ``[ln 1.5, ln 1.5, pad, pad]`` (2 tokens; product 2.25; geometric mean 1.5).
"""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.config import RolloutCorrectionConfig
from mmrl.core_algos import rollout_correction_weights

LOG_RHO = torch.tensor([[math.log(3), 0.0, -math.log(2), 0.0], [math.log(1.5), math.log(1.5), 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
ROLLOUT = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.7, -1.2, 0.0, 0.0]])
OLD = (ROLLOUT + LOG_RHO) * MASK  # padding holds 0 in both, as the batch columns do


def weights(**options) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return rollout_correction_weights(OLD, ROLLOUT, MASK, RolloutCorrectionConfig(**options))


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        # token TIS: each ratio capped at 2
        ({"rollout_is": "token", "rollout_is_threshold": 2.0}, [[2.0, 1.0, 0.5, 0], [1.5, 1.5, 0, 0]]),
        # sequence TIS: the product on every token, capped at 2
        ({"rollout_is": "sequence", "rollout_is_threshold": 2.0}, [[1.5, 1.5, 1.5, 0], [2.0, 2.0, 0, 0]]),
        # token rejection in [1/2, 2] (bounds included): the ratio-3 token goes
        ({"rollout_rs": "token", "rollout_rs_threshold": 2.0}, [[0.0, 1.0, 1.0, 0], [1.0, 1.0, 0, 0]]),
        # sequence rejection in [1/2, 2]: row 1 (2.25) goes whole
        ({"rollout_rs": "sequence", "rollout_rs_threshold": 2.0}, [[1.0, 1.0, 1.0, 0], [0.0, 0.0, 0, 0]]),
        # geometric rejection in [1/1.2, 1.2]: row 0 (1.145) stays, row 1 (1.5) goes
        ({"rollout_rs": "geometric", "rollout_rs_threshold": 1.2}, [[1.0, 1.0, 1.0, 0], [0.0, 0.0, 0, 0]]),
        # explicit lower bound 0.6: the ratio-0.5 token goes too
        (
            {"rollout_rs": "token", "rollout_rs_threshold": 2.5, "rollout_rs_threshold_lower": 0.6},
            [[0.0, 1.0, 0.0, 0], [1.0, 1.0, 0, 0]],
        ),
        # token TIS and geometric rejection together: row 1's capped weights are rejected
        (
            {"rollout_is": "token", "rollout_is_threshold": 2.0, "rollout_rs": "geometric", "rollout_rs_threshold": 1.2},
            [[2.0, 1.0, 0.5, 0], [0.0, 0.0, 0, 0]],
        ),
        ({}, [[1.0, 1.0, 1.0, 0], [1.0, 1.0, 0, 0]]),  # neither: the plain loss
    ],
)  # fmt: skip
def test_weights_are_the_hand_worked_ones(options, expected):
    result, _ = weights(**options)
    torch.testing.assert_close(result, torch.tensor(expected), atol=1e-6, rtol=1e-6)


def test_diagnostics_name_what_was_truncated_and_masked():
    _, diagnostics = weights(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="sequence", rollout_rs_threshold=2.0
    )
    torch.testing.assert_close(
        diagnostics["rollout_is_weight"], torch.tensor([[2.0, 1, 0.5, 0], [1.5, 1.5, 0, 0]])
    )
    assert diagnostics["rollout_is_truncated"].tolist() == [[1, 0, 0, 0], [0, 0, 0, 0]]
    assert diagnostics["rollout_rs_masked"].tolist() == [[0, 0, 0, 0], [1, 1, 0, 0]]
    # k1 = log pi_rollout - log pi_old = -log rho; k3 = rho - 1 - log rho
    torch.testing.assert_close(diagnostics["rollout_kl_k1"], -LOG_RHO * MASK)
    k3 = [[2 - math.log(3), 0.0, -0.5 + math.log(2), 0], [0.5 - math.log(1.5)] * 2 + [0, 0]]
    torch.testing.assert_close(diagnostics["rollout_kl_k3"], torch.tensor(k3), atol=1e-6, rtol=1e-6)


def test_a_long_response_cannot_overflow_the_sequence_weight():
    # 4,000 tokens 0.1 nats apart: the product e^400 overflows float32; clamped to e^20 before exp
    old, rollout, mask = torch.full((1, 4000), -1.0), torch.full((1, 4000), -1.1), torch.ones(1, 4000)
    result, diagnostics = rollout_correction_weights(
        old, rollout, mask, RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold=5.0)
    )
    assert torch.isfinite(result).all() and result.max() == 5.0
    assert diagnostics["rollout_is_truncated"].all()
    geometric, _ = rollout_correction_weights(
        old, rollout, mask, RolloutCorrectionConfig(rollout_rs="geometric", rollout_rs_threshold=1.2)
    )
    assert geometric.all()  # the geometric mean e^0.1 = 1.105 is inside [1/1.2, 1.2]: length-fair


def test_unknown_levels_and_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="expected one of"):
        weights(rollout_is="geometric")  # geometric is a rejection level only
    with pytest.raises(ValueError, match="0 <= lower < upper"):
        weights(rollout_rs="token", rollout_rs_threshold=2.0, rollout_rs_threshold_lower=2.0)
