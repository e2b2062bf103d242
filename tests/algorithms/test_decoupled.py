"""Decoupled PPO (``algorithm.off_policy=decoupled``, mmrl/algorithms/decoupled.py): its weights, loss
value and gradient worked out by hand on tiny tensors; plain PPO when behaviour == proximal."""

from __future__ import annotations

import math

import pytest
import torch

from mmrl.algorithms import OFF_POLICY_OBJECTIVES, off_policy_objective
from mmrl.config import AlgorithmConfig, DecoupledConfig, PolicyLossConfig, RolloutCorrectionConfig
from mmrl.core_algos import aggregate_loss, compute_policy_loss


def _loss(log_probs, proximal, behaviour, advantages, mask, decoupled: DecoupledConfig | None):
    """Token-mean policy loss (PPO, clip [0.8, 1.2]) with the decoupled weights (None: plain PPO)."""
    options = PolicyLossConfig(loss_type="ppo", clip_ratio_low=0.2, clip_ratio_high=0.2)
    loss, diagnostics = compute_policy_loss(proximal, log_probs, advantages, mask, options)
    extra = {}
    if decoupled is not None:
        algorithm = AlgorithmConfig(off_policy="decoupled", decoupled=decoupled)
        weights, extra = off_policy_objective("decoupled").load()(proximal, behaviour, mask, algorithm)
        loss = loss * weights
    return aggregate_loss(loss, mask, "token_mean"), {**diagnostics, **extra}


# one row of 4 response tokens and a padding position; A = +1 everywhere
# token:             0          1            2           3          pad
# pi_theta/pi_prox   1.0        1.5 (clip)   1.0         0.5        -
# pi_prox/pi_behav   2.0        0.5          8.0 (>cap)  1.0        -
LOG_RATIO = torch.tensor([[0.0, math.log(1.5), 0.0, math.log(0.5), 0.0]])
LOG_WEIGHT = torch.tensor([[math.log(2.0), math.log(0.5), math.log(8.0), 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1, 1, 0]])
ADVANTAGES = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]])
PROXIMAL = torch.tensor([[-1.0, -2.0, -0.5, -1.5, 0.0]])


def _inputs():
    log_probs = (PROXIMAL + LOG_RATIO).clone().requires_grad_(True)
    return log_probs, PROXIMAL, PROXIMAL - LOG_WEIGHT


def test_value_and_gradient_by_hand_with_the_cap_masking():
    # PPO per token with A = 1: -min(r, clip(r)) = -1, -1.2 (clipped, no gradient), -1, -0.5 (r < 0.8:
    # the unclipped branch is the min, so the gradient flows); weights 2, 0.5, 0 (8 > cap 5: masked), 1
    # loss = (2*-1 + 0.5*-1.2 + 0*-1 + 1*-0.5) / 4 = -3.1 / 4
    # d loss / d logp_t = -w_t r_t / 4 where the branch is unclipped: -2/4, 0, 0, -0.5/4
    log_probs, proximal, behaviour = _inputs()
    loss, diagnostics = _loss(log_probs, proximal, behaviour, ADVANTAGES, MASK, DecoupledConfig(5.0, "mask"))
    assert loss.item() == pytest.approx(-3.1 / 4)
    loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.5, 0.0, 0.0, -0.125, 0.0]]))
    torch.testing.assert_close(diagnostics["behaviour_weight"], torch.tensor([[2.0, 0.5, 8.0, 1.0, 0.0]]))
    torch.testing.assert_close(diagnostics["behaviour_over_cap"], torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]]))
    torch.testing.assert_close(diagnostics["behaviour_kl"], -LOG_WEIGHT * MASK)
    assert diagnostics["pg_clipfrac"][0, 1] == 1  # clipped around the proximal policy, not the behaviour


def test_truncating_at_the_cap_weights_the_token_by_the_cap():
    # token 2 now weighs 5 (the cap): loss (-2 - 0.6 - 5 - 0.5) / 4; its gradient -5 * 1 / 4
    log_probs, proximal, behaviour = _inputs()
    loss, _ = _loss(log_probs, proximal, behaviour, ADVANTAGES, MASK, DecoupledConfig(5.0, "truncate"))
    assert loss.item() == pytest.approx(-8.1 / 4)
    loss.backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-0.5, 0.0, -1.25, -0.125, 0.0]]))


def test_no_cap_keeps_every_weight():
    log_probs, proximal, behaviour = _inputs()
    loss, diagnostics = _loss(log_probs, proximal, behaviour, ADVANTAGES, MASK, DecoupledConfig(None))
    assert loss.item() == pytest.approx((-2 - 0.6 - 8 - 0.5) / 4)
    assert diagnostics["behaviour_over_cap"].sum() == 0


@pytest.mark.parametrize("over_cap", ["mask", "truncate"])
def test_equals_plain_ppo_when_behaviour_is_the_proximal_policy(over_cap):
    torch.manual_seed(0)
    proximal = torch.randn(3, 6) - 1.0
    advantages = torch.randn(3, 6)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] * 2 + [0] * 4])
    plain_logp = (proximal + 0.3 * torch.randn(3, 6)).requires_grad_(True)
    decoupled_logp = plain_logp.detach().clone().requires_grad_(True)
    plain, _ = _loss(plain_logp, proximal, proximal, advantages, mask, None)
    decoupled, diagnostics = _loss(
        decoupled_logp, proximal, proximal, advantages, mask, DecoupledConfig(1.0, over_cap)
    )
    plain.backward()
    decoupled.backward()
    assert decoupled.item() == pytest.approx(plain.item(), rel=1e-6)
    torch.testing.assert_close(decoupled_logp.grad, plain_logp.grad)
    torch.testing.assert_close(diagnostics["behaviour_weight"], mask.float())


def test_registered_and_checked_beside_its_knobs():
    assert set(OFF_POLICY_OBJECTIVES) == {"decoupled"}
    assert off_policy_objective("none") is None
    with pytest.raises(ValueError, match="Valid names: decoupled"):
        off_policy_objective("decoupld")
    spec = off_policy_objective("decoupled")
    assert spec.problems(AlgorithmConfig(off_policy="decoupled")) == []
    (cap,) = spec.problems(AlgorithmConfig(decoupled=DecoupledConfig(behaviour_weight_cap=0.5)))
    assert "algorithm.decoupled.behaviour_weight_cap=0.5 must be >= 1" in cap
    (twice,) = spec.problems(AlgorithmConfig(rollout_correction=RolloutCorrectionConfig(rollout_is="token")))
    assert "algorithm.rollout_correction would weight it twice" in twice
