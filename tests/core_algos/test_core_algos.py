"""Tests for mmrl.core_algos against numbers worked out by hand in the comments."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mmrl import core_algos as ca
from mmrl.config import PolicyLossConfig as Options

SQRT_1_3 = math.sqrt(1 / 3)  # 0.5773503


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    expected = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=0)


def outcome_rewards(scores: list[float], lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """token_level_rewards with each score on the last valid token, and the response mask. [B, width]."""
    rewards = torch.zeros(len(scores), width)
    mask = torch.zeros(len(scores), width)
    for row, (score, length) in enumerate(zip(scores, lengths)):
        mask[row, :length] = 1
        rewards[row, length - 1] = score
    return rewards, mask


# ------------------------------------------------------------------------------------------------
# Advantage estimators
# ------------------------------------------------------------------------------------------------


def test_grpo_group_of_three_by_hand():
    # rewards [1, 0, 0]: mean = 1/3; deviations 2/3, -1/3, -1/3; squares 4/9 + 1/9 + 1/9 = 2/3
    # unbiased var = (2/3) / (3 - 1) = 1/3, std = sqrt(1/3) = 0.57735
    # A = (2/3) / 0.57735 = 1.15470, (-1/3) / 0.57735 = -0.57735 (eps 1e-6 is below the tolerance)
    rewards, mask = outcome_rewards([1.0, 0.0, 0.0], lengths=[3, 1, 2], width=4)
    advantages, returns = ca.compute_grpo_advantages(rewards, mask, index=["p", "p", "p"])
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3]) / SQRT_1_3
    close(advantages, expected.unsqueeze(-1) * mask)  # broadcast over tokens, 0 on padding
    close(returns, advantages)
    assert advantages[1, 1:].abs().sum() == 0


def test_grpo_without_std_is_dr_grpo():
    # Dr. GRPO: A = r - mean = [1 - 1/3, 0 - 1/3, 0 - 1/3] = [2/3, -1/3, -1/3]
    rewards, mask = outcome_rewards([1.0, 0.0, 0.0], lengths=[2, 2, 2], width=2)
    advantages, _ = ca.compute_grpo_advantages(rewards, mask, index=["p"] * 3, norm_adv_by_std=False)
    close(advantages[:, 0], [2 / 3, -1 / 3, -1 / 3])


def test_grpo_groups_by_uid_not_position():
    # interleaved uids a, b, a, b, a, b. Group a = [1, 0, 0] -> [1.15470, -0.57735, -0.57735] (above).
    # group b = [1, 1, 0]: mean 2/3, deviations 1/3, 1/3, -2/3, squares sum 2/3, unbiased std sqrt(1/3)
    # -> [0.57735, 0.57735, -1.15470]
    rewards, mask = outcome_rewards([1.0, 1.0, 0.0, 1.0, 0.0, 0.0], lengths=[2] * 6, width=2)
    index = np.array(["a", "b", "a", "b", "a", "b"], dtype=object)
    advantages, _ = ca.compute_grpo_advantages(rewards, mask, index=index)
    big, small = (2 / 3) / SQRT_1_3, (1 / 3) / SQRT_1_3
    close(advantages[:, 0], [big, small, -small, small, -small, -big])

    # permuting the batch permutes the advantages and nothing else
    perm = torch.tensor([5, 2, 0, 4, 1, 3])
    permuted, _ = ca.compute_grpo_advantages(rewards[perm], mask[perm], index=index[perm.numpy()])
    close(permuted, advantages[perm])


def test_grpo_size_one_group_gets_zero_advantage():
    # "solo" has no peers: no baseline, advantage 0 (with and without std); the pair is [1, 0] ->
    # mean 0.5, unbiased std sqrt(0.5) = 0.70711 -> A = +-0.5 / 0.70711 = +-0.70711
    rewards, mask = outcome_rewards([1.0, 0.0, 5.0], lengths=[1, 1, 1], width=1)
    advantages, _ = ca.compute_grpo_advantages(rewards, mask, index=["pair", "pair", "solo"])
    close(advantages[:, 0], [math.sqrt(0.5), -math.sqrt(0.5), 0.0])
    dr_advantages, _ = ca.compute_grpo_advantages(
        rewards, mask, index=["pair", "pair", "solo"], norm_adv_by_std=False
    )
    close(dr_advantages[:, 0], [0.5, -0.5, 0.0])


def test_grpo_ignores_rewards_outside_the_mask():
    # a reward on a padding position must not count: scores are [1, 0] -> A = [+0.70711, -0.70711]
    rewards, mask = outcome_rewards([1.0, 0.0], lengths=[2, 1], width=3)
    rewards[1, 2] = 100.0
    advantages, _ = ca.compute_grpo_advantages(rewards, mask, index=[7, 7])
    close(advantages[:, 0], [math.sqrt(0.5), -math.sqrt(0.5)])


def test_grpo_index_errors_name_the_problem():
    rewards, mask = outcome_rewards([1.0, 0.0], lengths=[1, 1], width=1)
    with pytest.raises(ValueError, match="index has 1 uids but the batch has 2"):
        ca.compute_grpo_advantages(rewards, mask, index=["a"])
    with pytest.raises(ValueError, match="pass index="):
        ca.compute_grpo_advantages(rewards, mask)


def test_grpo_passk_only_the_best_response_of_a_group_moves_by_hand():
    # uid a: scores [1, 0, 0] -> best row 0, runner-up 0: margin 1, unbiased std sqrt(1/3):
    #        A = 1 / 0.5773503 = 1.7320508 on row 0, 0 on rows 1 and 2
    # uid b: scores [0.5, 0.2, 0.9] (rows 3, 4, 5 interleaved with a's) -> best 0.9, runner-up 0.5:
    #        margin 0.4; mean 0.5333, squares 0.0011111 + 0.1111111 + 0.1344444 = 0.2466667, / 2:
    #        std = sqrt(0.1233333) = 0.3511885 -> A = 0.4 / 0.3511885 = 1.1389918
    # uid c: scores [1, 1, 0] -> two best: margin 0, every advantage 0 (a tie gives no push)
    # uid d: one response -> 0
    rewards, mask = outcome_rewards(
        [1.0, 0.5, 0.0, 0.2, 0.0, 0.9, 1.0, 1.0, 0.0, 3.0], lengths=[2, 1, 2, 2, 1, 2, 1, 1, 1, 2], width=2
    )
    index = ["a", "b", "a", "b", "a", "b", "c", "c", "c", "d"]
    advantages, returns = ca.compute_grpo_passk_advantages(rewards, mask, index=index)
    expected = [1.7320508, 0.0, 0.0, 0.0, 0.0, 1.1389918, 0.0, 0.0, 0.0, 0.0]
    close(advantages, torch.tensor(expected).unsqueeze(-1) * mask)
    close(returns, advantages)
    # norm_adv_by_std=False: the margin itself
    advantages, _ = ca.compute_grpo_passk_advantages(rewards, mask, index=index, norm_adv_by_std=False)
    close(advantages[:, 0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.4, 0.0, 0.0, 0.0, 0.0])
    assert ca.get_adv_estimator("grpo_passk") is ca.compute_grpo_passk_advantages


def test_rloo_by_hand():
    # group p = [1, 0, 0]: A_0 = 1 - (0 + 0)/2 = 1; A_1 = 0 - (1 + 0)/2 = -0.5; A_2 = -0.5
    # (same as n/(n-1) * (r - mean) = 3/2 * [2/3, -1/3, -1/3]); the size-1 group "solo" gets 0
    rewards, mask = outcome_rewards([1.0, 0.0, 3.0, 0.0], lengths=[2, 1, 2, 2], width=2)
    advantages, returns = ca.compute_rloo_advantages(rewards, mask, index=["p", "p", "solo", "p"])
    close(advantages, torch.tensor([[1.0, 1.0], [-0.5, 0.0], [0.0, 0.0], [-0.5, -0.5]]))
    close(returns, advantages)


def test_reinforce_plus_plus_discounting_and_whitening_by_hand():
    # gamma = 0.5. Row 0: mask [1,1,1], rewards [0,0,1] -> G = [0.25, 0.5, 1]
    #              Row 1: mask [1,1,0], rewards [0,2,0] -> G = [2*0.5, 2, 0] = [1, 2, 0]
    # valid G: 0.25, 0.5, 1, 1, 2 -> mean 4.75/5 = 0.95; deviations -0.7, -0.45, 0.05, 0.05, 1.05
    # squares 0.49 + 0.2025 + 0.0025 + 0.0025 + 1.1025 = 1.8; unbiased var 1.8/4 = 0.45, std 0.670820
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    advantages, returns = ca.compute_reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    close(returns, [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]])
    std = math.sqrt(0.45)
    close(advantages, [[-0.7 / std, -0.45 / std, 0.05 / std], [0.05 / std, 1.05 / std, 0.0]])


def test_remax_by_hand():
    # scores [1, 0.5], greedy baselines [0.5, 0.5] -> A = [0.5, 0] on every valid token
    rewards, mask = outcome_rewards([1.0, 0.5], lengths=[3, 2], width=3)
    advantages, returns = ca.compute_remax_advantages(
        rewards, mask, reward_baselines=torch.tensor([0.5, 0.5])
    )
    close(advantages, [[0.5, 0.5, 0.5], [0.0, 0.0, 0.0]])
    close(returns, [[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]])  # undiscounted returns-to-go
    with pytest.raises(ValueError, match="reward_baselines"):
        ca.compute_remax_advantages(rewards, mask)


def test_gae_single_sequence_by_hand():
    # mask [1,1,1,0], rewards [0,0,1,0], values [0.5, 0.6, 0.8, 9.9 (padding junk, must not leak)]
    # gamma = 1, lam = 0.5:
    #   t=2: delta = 1 + 0 - 0.8 = 0.2;            A2 = 0.2
    #   t=1: delta = 0 + 0.8 - 0.6 = 0.2;          A1 = 0.2 + 0.5 * 0.2 = 0.3
    #   t=0: delta = 0 + 0.6 - 0.5 = 0.1;          A0 = 0.1 + 0.5 * 0.3 = 0.25
    # returns = A + V = [0.75, 0.9, 1.0]; whitening [0.25, 0.3, 0.2]: mean 0.25, deviations 0, 0.05, -0.05,
    # unbiased var (0.0025 + 0.0025)/2 = 0.0025, std 0.05 -> [0, 1, -1]
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.8, 9.9]])
    advantages, returns = ca.compute_gae_advantages(rewards, mask, values=values, gamma=1.0, lam=0.5)
    close(returns, [[0.75, 0.9, 1.0, 0.0]])
    close(advantages, [[0.0, 1.0, -1.0, 0.0]], atol=1e-4)

    # gamma = 0.9, lam = 0.5 (gamma * lam = 0.45):
    #   t=2: delta = 1 - 0.8 = 0.2;                A2 = 0.2
    #   t=1: delta = 0.9 * 0.8 - 0.6 = 0.12;       A1 = 0.12 + 0.45 * 0.2 = 0.21
    #   t=0: delta = 0.9 * 0.6 - 0.5 = 0.04;       A0 = 0.04 + 0.45 * 0.21 = 0.1345
    # returns = [0.6345, 0.81, 1.0]
    _, returns = ca.compute_gae_advantages(rewards, mask, values=values, gamma=0.9, lam=0.5)
    close(returns, [[0.6345, 0.81, 1.0, 0.0]])
    with pytest.raises(ValueError, match="values="):
        ca.compute_gae_advantages(rewards, mask)


def test_gae_skips_masked_tokens_inside_a_response():
    # mask [1, 0, 1] (a tool-output token in the middle), rewards [0, 5 (masked), 1], values [0.5, 7, 0.8]
    # gamma = lam = 1. t=2: A2 = 1 - 0.8 = 0.2. t=1 is skipped: the next valid value stays 0.8.
    # t=0: delta = 0 + 0.8 - 0.5 = 0.3, A0 = 0.3 + 0.2 = 0.5 -> returns [1.0, 0, 1.0]
    rewards = torch.tensor([[0.0, 5.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 7.0, 0.8]])
    _, returns = ca.compute_gae_advantages(rewards, mask, values=values, gamma=1.0, lam=1.0)
    close(returns, [[1.0, 0.0, 1.0]])


def test_every_estimator_accepts_the_common_signature():
    rewards, mask = outcome_rewards([1.0, 0.0, 0.5, 0.5], lengths=[3, 2, 1, 3], width=3)
    common = {
        "index": ["a", "a", "b", "b"],
        "values": torch.zeros(4, 3),
        "reward_baselines": torch.zeros(4),
        "gamma": 1.0,
        "lam": 1.0,
        "norm_adv_by_std": True,
        "eps": 1e-6,
    }
    for name in ("grpo", "rloo", "reinforce_plus_plus", "remax", "gae"):
        advantages, returns = ca.get_adv_estimator(name)(rewards, mask, **common)
        assert advantages.shape == returns.shape == (4, 3)
        assert torch.isfinite(advantages).all()
        assert (advantages * (1 - mask)).abs().sum() == 0, name


# ------------------------------------------------------------------------------------------------
# Policy losses
# ------------------------------------------------------------------------------------------------


def test_ppo_clip_both_sides_and_dual_clip_by_hand():
    # clip_ratio_low = 0.2, clip_ratio_high = 0.28 -> clip range [0.8, 1.28]; dual clip c = 3
    # token: A,   ratio -> -A*r,  -A*clip(r),  PPO loss              gradient d/dlogp (of -A*r: -A*r)
    #   0:  +1,  1.5   -> -1.5,  -1.28,       -1.28 (clipped high)  0
    #   1:  +1,  0.5   -> -0.5,  -0.8,        -0.5                  -0.5
    #   2:  -1,  0.5   ->  0.5,   0.8,         0.8 (clipped low)    0
    #   3:  -1,  1.5   ->  1.5,   1.28,        1.5                  +1.5
    #   4:  -1,  5.0   ->  5.0,   1.28,        5.0 -> dual min(5, 3) = 3  0
    #   5:  +1,  5.0   -> -5.0,  -1.28,       -1.28 (no dual for A > 0)  0
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.5, 5.0, 5.0]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0, -1.0, 1.0]])
    old_log_probs = torch.full((1, 6), -1.0)
    log_probs = (old_log_probs + ratios.log()).requires_grad_()
    mask = torch.ones(1, 6)
    loss, diagnostics = ca.compute_ppo_policy_loss(
        old_log_probs,
        log_probs,
        advantages,
        mask,
        Options(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_dual=3.0),
    )
    close(loss.detach(), [[-1.28, -0.5, 0.8, 1.5, 3.0, -1.28]])
    close(diagnostics["pg_clipfrac"], [[1.0, 0.0, 1.0, 0.0, 0.0, 1.0]])  # token 4: only the dual clip
    close(diagnostics["pg_clipfrac_dual"], [[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    close(diagnostics["ppo_kl"], -ratios.log())
    loss.sum().backward()
    close(log_probs.grad, [[0.0, -0.5, 0.0, 1.5, 0.0, 0.0]])

    # without dual clip token 4 keeps the full -A*r = 5
    loss, diagnostics = ca.compute_ppo_policy_loss(
        old_log_probs,
        log_probs,
        advantages,
        mask,
        Options(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_dual=None),
    )
    close(loss[0, 4].detach(), 5.0)
    assert diagnostics["pg_clipfrac_dual"].sum() == 0
    with pytest.raises(ValueError, match="clip_ratio_dual must be > 1"):
        ca.compute_ppo_policy_loss(old_log_probs, log_probs, advantages, mask, Options(clip_ratio_dual=0.5))


def test_ppo_huge_log_ratio_stays_finite():
    # log-ratio 200 would overflow exp in float32; clamped to 20, then clipped: loss = -1 * 1.2
    log_probs = torch.tensor([[0.0]], requires_grad=True)
    loss, _ = ca.compute_ppo_policy_loss(
        torch.tensor([[-200.0]]), log_probs, torch.ones(1, 1), torch.ones(1, 1), Options(clip_ratio_high=0.2)
    )
    loss.sum().backward()
    close(loss.detach(), [[-1.2]])
    assert torch.isfinite(log_probs.grad).all()


def test_gspo_sequence_ratio_and_gradient_versus_ppo():
    # row 0: log-ratios [0.2, -0.1], padding junk 3.0 -> s = exp((0.2 - 0.1)/2) = exp(0.05) = 1.051271
    #        inside [0.75, 1.25], A = +1: loss = -s on both tokens; gradient -A * s / N on every token
    # row 1: log-ratios [0.0, 0.6] -> s = exp(0.3) = 1.349859 > 1.25, A = +1: clipped, loss -1.25, grad 0,
    #        although token 0 alone (ratio 1) would be inside the clip range for token-level PPO.
    log_ratio = torch.tensor([[0.2, -0.1, 3.0], [0.0, 0.6, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    advantages = torch.ones(2, 3)
    old_log_probs = torch.full((2, 3), -2.0)

    log_probs = (old_log_probs + log_ratio).requires_grad_()
    loss, diagnostics = ca.compute_gspo_policy_loss(
        old_log_probs, log_probs, advantages, mask, Options(clip_ratio_low=0.25, clip_ratio_high=0.25)
    )
    s = math.exp(0.05)
    close(loss.detach() * mask, [[-s, -s, 0.0], [-1.25, -1.25, 0.0]])
    close(diagnostics["pg_clipfrac"] * mask, [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    ca.aggregate_loss(loss, mask, "token_mean").backward()  # N = 4 tokens
    close(log_probs.grad, [[-s / 4, -s / 4, 0.0], [0.0, 0.0, 0.0]])

    # token-level PPO on the same tokens: gradient -A * r_t / N differs per token (exp(0.2) = 1.2214 and
    # exp(-0.1) = 0.9048 are inside the range); in row 1 token 0 (ratio 1) is not clipped, token 1
    # (ratio exp(0.6) = 1.82) is
    ppo_log_probs = (old_log_probs + log_ratio).requires_grad_()
    ppo_loss, _ = ca.compute_ppo_policy_loss(
        old_log_probs, ppo_log_probs, advantages, mask, Options(clip_ratio_low=0.25, clip_ratio_high=0.25)
    )
    ca.aggregate_loss(ppo_loss, mask, "token_mean").backward()
    close(ppo_log_probs.grad, [[-math.exp(0.2) / 4, -math.exp(-0.1) / 4, 0.0], [-1.0 / 4, 0.0, 0.0]])


def test_gspo_token_trick_matches_the_sequence_level_objective():
    # GSPO objective: J = mean_i (-A_i * s_i) with s_i = exp(mean_t log-ratio). With seq_mean_token_mean
    # aggregation the token-trick loss must give the same value and the same gradient.
    torch.manual_seed(0)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    old_log_probs = -torch.rand(3, 4)
    log_ratio = 0.05 * torch.randn(3, 4)
    advantages = torch.tensor([[1.0], [-0.5], [2.0]]).expand(3, 4)
    wide = {"clip_ratio_low": 10.0, "clip_ratio_high": 10.0}  # no clipping in this comparison

    reference_log_probs = (old_log_probs + log_ratio).requires_grad_()
    seq_ratio = torch.exp(ca.masked_mean(reference_log_probs - old_log_probs, mask, dim=-1))  # [B]
    reference = (-advantages[:, 0] * seq_ratio).mean()
    reference.backward()
    for loss_fn in (ca.compute_gspo_policy_loss, ca.compute_gspo_token_policy_loss):
        log_probs = (old_log_probs + log_ratio).requires_grad_()
        loss, _ = loss_fn(old_log_probs, log_probs, advantages, mask, Options(**wide))
        aggregated = ca.aggregate_loss(loss, mask, "seq_mean_token_mean")
        aggregated.backward()
        close(aggregated.detach(), reference.detach())
        close(log_probs.grad, reference_log_probs.grad)


def test_gspo_token_equals_gspo_for_sequence_advantages_and_not_for_token_ones():
    # One row, 2 valid tokens, log-ratios [0.1, -0.1] -> s = exp(0) = 1 (inside any clip range).
    # Row sum of the per-token loss, d/dlogp_t (n = 2):
    #   gspo:       sum_u -A_u * s,  s = exp(mean log-ratio)  -> -s * (A_0 + A_1) / 2 on both tokens
    #   gspo_token: sum_u -A_u * s_u, grad s_u = s * grad logp_u -> -s * A_t on token t
    # sequence-level A = [1.5, 1.5]: both -1.5; token-level A = [2, -1]: gspo -0.5, -0.5; token 2, -1 -> -2, +1
    old_log_probs = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    for advantages, gspo_grad, token_grad in (
        ([[1.5, 1.5]], [[-1.5, -1.5]], [[-1.5, -1.5]]),
        ([[2.0, -1.0]], [[-0.5, -0.5]], [[-2.0, 1.0]]),
    ):
        values = {}
        for name, expected in (("gspo", gspo_grad), ("gspo_token", token_grad)):
            log_probs = (old_log_probs + torch.tensor([[0.1, -0.1]])).requires_grad_()
            loss, _ = ca.get_policy_loss(name)(old_log_probs, log_probs, torch.tensor(advantages), mask)
            loss.sum().backward()
            close(log_probs.grad, expected)
            values[name] = loss.detach()
        close(values["gspo"], values["gspo_token"])  # the value is -A_t * s either way
        close(values["gspo"], -torch.tensor(advantages))


def test_gspo_defaults_clip_the_sequence_ratio_at_3e4_4e4():
    # s = exp(mean log-ratio) = exp(0.001) = 1.0010005 > 1 + 4e-4, A = +1: clipped, loss -(1 + 4e-4), no
    # gradient; with PPO's 0.3 it would not clip. s = exp(-0.0002) = 0.9998 stays inside [1 - 3e-4, ..].
    old_log_probs = torch.zeros(2, 2)
    log_probs = torch.tensor([[0.0005, 0.0015], [-0.0002, -0.0002]], requires_grad=True)
    for name in ("gspo", "gspo_token"):
        loss, diagnostics = ca.get_policy_loss(name)(
            old_log_probs, log_probs, torch.ones(2, 2), torch.ones(2, 2)
        )
        close(loss.detach(), [[-1.0004, -1.0004], [-math.exp(-0.0002)] * 2])
        close(diagnostics["pg_clipfrac"], [[1.0, 1.0], [0.0, 0.0]])


def test_clip_defaults_come_from_one_table():
    assert ca.policy_clip_range("ppo") == (0.2, 0.3)
    assert ca.policy_clip_range("gspo") == ca.policy_clip_range("gspo_token") == (3e-4, 4e-4)
    assert ca.policy_clip_range("cispo") == (1.0, 4.0)
    assert ca.policy_clip_range("sapo") is None
    assert ca.policy_clip_range("gspo", clip_ratio_high=1e-3) == (3e-4, 1e-3)  # only null keys default
    assert set(ca.POLICY_LOSS_CLIP_DEFAULTS) == set(ca.POLICY_LOSSES)
    with pytest.raises(ValueError, match="'sapo' has no clip range"):
        ca.policy_clip_range("sapo", clip_ratio_low=0.2)
    with pytest.raises(ValueError, match="Unknown policy loss 'ppo2'"):
        ca.policy_clip_range("ppo2")
    assert ca.policy_clip_range("clip_cov") == (0.2, 0.3) and ca.policy_clip_range("kl_cov") is None
    assert Options(loss_type="gspo", clip_ratio_high=1e-3).clip_range == (3e-4, 1e-3)


def test_cispo_gradient_is_clipped_weight_times_advantage():
    # ratios [1.5, 0.5, 1.0], A [1, -1, 2], clip range [0.8, 1.28] -> weights [1.28, 0.8, 1.0]
    # loss_t = -w_t * A_t * logp_t; token_mean over N = 3: d/dlogp_t = -w_t * A_t / 3
    #   = [-1.28/3, +0.8/3, -2/3]: clipped tokens keep a gradient, unlike PPO
    ratios = torch.tensor([[1.5, 0.5, 1.0]])
    advantages = torch.tensor([[1.0, -1.0, 2.0]])
    old_log_probs = torch.tensor([[-1.0, -2.0, -0.5]])
    log_probs = (old_log_probs + ratios.log()).requires_grad_()
    mask = torch.ones(1, 3)
    loss, diagnostics = ca.compute_cispo_policy_loss(
        old_log_probs, log_probs, advantages, mask, Options(clip_ratio_low=0.2, clip_ratio_high=0.28)
    )
    weights = torch.tensor([[1.28, 0.8, 1.0]])
    close(loss.detach(), -weights * advantages * log_probs.detach())
    close(diagnostics["pg_clipfrac"], [[1.0, 1.0, 0.0]])
    ca.aggregate_loss(loss, mask, "token_mean").backward()
    close(log_probs.grad, [[-1.28 / 3, 0.8 / 3, -2.0 / 3]])


def test_cispo_low_zero_keeps_every_weight_at_least_one_and_the_default_has_no_lower_bound():
    # ratios [0.25, 0.9, 1.0, 7.0], A = 1: loss_t = -w_t * logp_t, so d/dlogp_t = -w_t
    #   low 0, high 4 (EasyR1's recipe): w = clip(r, 1, 5) = [1, 1, 1, 5]
    #   defaults (1.0, 4.0):             w = clip(r, 0, 5) = [0.25, 0.9, 1, 5]
    ratios = torch.tensor([[0.25, 0.9, 1.0, 7.0]])
    old_log_probs = torch.full((1, 4), -1.0)
    for knobs, weights in (
        ({"clip_ratio_low": 0.0, "clip_ratio_high": 4.0}, [1.0, 1.0, 1.0, 5.0]),
        ({}, [0.25, 0.9, 1.0, 5.0]),
    ):
        log_probs = (old_log_probs + ratios.log()).requires_grad_()
        loss, _ = ca.compute_cispo_policy_loss(
            old_log_probs, log_probs, torch.ones(1, 4), torch.ones(1, 4), Options(**knobs)
        )
        loss.sum().backward()
        close(-log_probs.grad, [weights])
    assert (-log_probs.grad >= 0).all()
    low_zero = ca.compute_cispo_policy_loss
    log_probs = (old_log_probs + torch.linspace(-3, 3, 4).unsqueeze(0)).requires_grad_()
    low_zero(old_log_probs, log_probs, torch.ones(1, 4), torch.ones(1, 4), Options(clip_ratio_low=0.0))[
        0
    ].sum().backward()
    assert (-log_probs.grad >= 1.0).all()


def test_sapo_gate_values_and_gradients_by_hand():
    # f(r) = (4/tau) sigmoid(tau (r - 1)), loss = -A f(r), d loss/d logp = -A f'(r) r, f'(r) = 4 s (1 - s)
    # tau_positive 2, tau_negative 1:
    #   token 0: A = +1, r = 1 + ln3/2 (tau (r-1) = ln 3, s = 3/4): f = 2 * 3/4 = 1.5, loss -1.5,
    #            f' = 4 * 3/16 = 0.75, grad = -0.75 * (1 + ln3/2) = -1.1619795
    #   token 1: A = -2, r = 1 + ln3 (tau 1: s = 3/4): f = 3, loss +6, grad = 2 * 0.75 * (1 + ln3) = 3.1479184
    #   token 2: A = +1, r = 1: f = (4/2)/2 = 1, loss -1, grad -1
    #   token 3: A = -1, r = 1: f = 4/2 = 2, loss +2, grad +1
    ln3 = math.log(3.0)
    ratios = torch.tensor([[1 + ln3 / 2, 1 + ln3, 1.0, 1.0]])
    advantages = torch.tensor([[1.0, -2.0, 1.0, -1.0]])
    old_log_probs = torch.full((1, 4), -1.5)
    log_probs = (old_log_probs + ratios.log()).requires_grad_()
    loss, diagnostics = ca.compute_sapo_policy_loss(
        old_log_probs, log_probs, advantages, torch.ones(1, 4), Options(tau_positive=2.0, tau_negative=1.0)
    )
    close(loss.detach(), [[-1.5, 6.0, -1.0, 2.0]])
    loss.sum().backward()
    close(log_probs.grad, [[-1.1619795, 3.1479184, -1.0, 1.0]])
    assert diagnostics["pg_clipfrac"].sum() == 0 and diagnostics["pg_clipfrac_dual"].sum() == 0
    close(diagnostics["ppo_kl"], -ratios.log())
    # below 1: tau 4, r = 1 - ln3/4 (s = 1/4): f = 1/4, loss -0.25, f' = 0.75, grad -0.75 * 0.7253469
    log_probs = (torch.zeros(1, 1) + math.log(1 - ln3 / 4)).requires_grad_()
    loss, _ = ca.compute_sapo_policy_loss(
        torch.zeros(1, 1), log_probs, torch.ones(1, 1), torch.ones(1, 1), Options(tau_positive=4.0)
    )
    loss.sum().backward()
    close(loss.detach(), [[-0.25]])
    close(log_probs.grad, [[-0.75 * (1 - ln3 / 4)]])


def test_sapo_gradient_at_ratio_one_is_minus_the_advantage_for_any_tau():
    # f'(1) = 4 * (1/2) * (1/2) = 1 and r = 1: d loss/d logp = -A whatever tau (the plain policy gradient)
    torch.manual_seed(0)
    advantages = torch.randn(3, 5)
    old_log_probs = -torch.rand(3, 5)
    for tau_positive, tau_negative in ((1.0, 1.05), (0.3, 7.0)):
        log_probs = old_log_probs.clone().requires_grad_()
        loss, _ = ca.compute_sapo_policy_loss(
            old_log_probs,
            log_probs,
            advantages,
            torch.ones(3, 5),
            Options(tau_positive=tau_positive, tau_negative=tau_negative),
        )
        loss.sum().backward()
        close(log_probs.grad, -advantages)
    with pytest.raises(ValueError, match="temperatures must be > 0"):
        ca.compute_sapo_policy_loss(
            old_log_probs, old_log_probs, advantages, torch.ones(3, 5), Options(tau_negative=0.0)
        )


def test_clip_cov_cuts_the_gradient_of_high_covariance_tokens_by_hand():
    # A = [3, 1, -1, -3] (mean 0), logp = [-1, -2, -3, -4] (mean -2.5, centred [1.5, 0.5, -0.5, -1.5]):
    # cov = A * centred logp = [4.5, 0.5, 0.5, 4.5]; with (lb, ub) = (1, 5) tokens 0 and 3 are candidates
    advantages = torch.tensor([[3.0, 1.0, -1.0, -3.0]])
    mask = torch.ones(1, 4)
    values = torch.tensor([[-1.0, -2.0, -3.0, -4.0]])

    def run(old_shift, **knobs):
        log_probs = values.clone().requires_grad_()
        options = Options(loss_type="clip_cov", clip_ratio_low=0.2, clip_ratio_high=0.3, **knobs)
        loss, diagnostics = ca.compute_policy_loss(values - old_shift, log_probs, advantages, mask, options)
        loss.sum().backward()
        return loss.detach(), diagnostics, log_probs.grad

    # on-policy (ratio 1), clip_cov_ratio 0.5 -> max(1, floor(0.5 * 4)) = 2 tokens: both candidates cut.
    # PPO's loss -A * r = [-3, -1, 1, 3] becomes [0, -1, 1, 0]; gradient -A * r on the others
    loss, diagnostics, grad = run(torch.zeros(1, 4), clip_cov_ratio=0.5)
    close(loss, [[0.0, -1.0, 1.0, 0.0]])
    close(grad, [[0.0, -1.0, 1.0, 0.0]])
    close(diagnostics["pg_covfrac"], [[1.0, 0.0, 0.0, 1.0]])
    # clip_cov_ratio 0.25 -> 1 token, drawn among the two candidates
    cut = run(torch.zeros(1, 4), clip_cov_ratio=0.25)[1]["pg_covfrac"]
    assert cut.sum() == 1 and (cut[0, 0] + cut[0, 3]) == 1
    # ub 4 < 4.5: no candidate, PPO's loss untouched
    loss, diagnostics, _ = run(torch.zeros(1, 4), clip_cov_ratio=0.5, clip_cov_ub=4.0)
    close(loss, [[-3.0, -1.0, 1.0, 3.0]])
    assert diagnostics["pg_covfrac"].sum() == 0
    # token 0 at ratio 1.5 > 1.3 with A > 0 is clipped by PPO already (loss -3 * 1.3): not a candidate
    loss, diagnostics, _ = run(torch.tensor([[math.log(1.5), 0.0, 0.0, 0.0]]), clip_cov_ratio=0.5)
    close(loss, [[-3.9, -1.0, 1.0, 0.0]])
    close(diagnostics["pg_covfrac"], [[0.0, 0.0, 0.0, 1.0]])
    close(diagnostics["pg_clipfrac"], [[1.0, 0.0, 0.0, 0.0]])


def test_kl_cov_penalises_the_highest_covariance_tokens_by_hand():
    # A = [3, 1, -1, -3], logp = [-1, -2, -3, -5] (mean -2.75, centred [1.75, 0.75, -0.25, -2.25]):
    # cov = [5.25, 0.75, 0.25, 6.75]. log-ratio = logp - old = [0.1, 0, 0, -0.2]; no ratio clip.
    # loss_t = -A_t r_t (+ coef |log-ratio_t| on the penalised tokens), d/dlogp = -A_t r_t (+ coef sign):
    #   token 0: -3 e^0.1 = -3.3155128, grad -3.3155128; penalised: -3.2155128, grad -2.3155128
    #   token 3: +3 e^-0.2 = 2.4561922, grad 2.4561922;  penalised: 2.6561922, grad 1.4561922
    advantages = torch.tensor([[3.0, 1.0, -1.0, -3.0]])
    values = torch.tensor([[-1.0, -2.0, -3.0, -5.0]])
    old_log_probs = values - torch.tensor([[0.1, 0.0, 0.0, -0.2]])
    for ratio, loss_expected, grad_expected in (
        (0.25, [-3.3155128, -1.0, 1.0, 2.6561922], [-3.3155128, -1.0, 1.0, 1.4561922]),  # 1 token: 3
        (0.5, [-3.2155128, -1.0, 1.0, 2.6561922], [-2.3155128, -1.0, 1.0, 1.4561922]),  # 2: 3 and 0
    ):
        log_probs = values.clone().requires_grad_()
        options = Options(loss_type="kl_cov", kl_cov_ratio=ratio, kl_cov_coef=1.0)
        loss, diagnostics = ca.compute_policy_loss(
            old_log_probs, log_probs, advantages, torch.ones(1, 4), options
        )
        loss.sum().backward()
        close(loss.detach(), [loss_expected])
        close(log_probs.grad, [grad_expected])
        assert diagnostics["pg_clipfrac"].sum() == 0
    close(diagnostics["pg_covfrac"], [[1.0, 0.0, 0.0, 1.0]])
    # padding never counts: with token 3 masked, the single penalised token is token 0
    log_probs = values.clone().requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    _, diagnostics = ca.compute_policy_loss(
        old_log_probs, log_probs, advantages, mask, Options(loss_type="kl_cov", kl_cov_ratio=0.25)
    )
    close(diagnostics["pg_covfrac"], [[1.0, 0.0, 0.0, 0.0]])


def test_policy_losses_read_their_knobs_from_the_loss_section():
    # the same call for every loss: compute_policy_loss picks options.loss_type and hands it the section
    old_log_probs, log_probs = torch.zeros(1, 2), torch.tensor([[0.5, -0.5]])
    advantages, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    for name in ca.POLICY_LOSSES:
        options = Options(loss_type=name)
        loss, diagnostics = ca.compute_policy_loss(old_log_probs, log_probs, advantages, mask, options)
        direct, _ = ca.get_policy_loss(name)(old_log_probs, log_probs, advantages, mask, options)
        close(loss, direct)
        assert {"pg_clipfrac", "pg_clipfrac_dual", "ppo_kl"} <= set(diagnostics), name
    # r = e^0.5 = 1.6487 with A = +1: PPO clips at 1 + clip_ratio_high, read from the section
    loss, _ = ca.compute_policy_loss(old_log_probs, log_probs, advantages, mask, Options(clip_ratio_high=0.1))
    close(loss[0, 0], -1.1)


# ------------------------------------------------------------------------------------------------
# Entropy
# ------------------------------------------------------------------------------------------------


def test_top_k_entropy_and_where_the_bonus_goes_by_hand():
    # p = softmax(log [3, 1, 1, 1]) = [1/2, 1/6, 1/6, 1/6]
    #   whole vocabulary: H = 0.5 ln 2 + 0.5 ln 6 = 1.2424533
    #   top 2: q = [3/4, 1/4], H = 0.75 ln(4/3) + 0.25 ln 4 = 0.5623351
    # dH/dz = -p (ln p + H): whole vocabulary, each tail token: -(1/6)(ln(1/6) + 1.2424533) = +0.0915510,
    # so a bonus (ascending H) raises every tail logit: on a large vocabulary of non-words, mass goes there.
    # top 2: -q (ln q + H) = [-0.2059898, +0.2059898] on the two candidates, 0 on the tail: the bonus
    # only levels the candidates.
    logits = torch.tensor([[math.log(3.0), 0.0, 0.0, 0.0]], requires_grad=True)
    whole = ca.entropy_from_logits(logits)
    close(whole.detach(), [1.2424533])
    (grad_whole,) = torch.autograd.grad(whole.sum(), logits)
    close(grad_whole[0, 1:], [0.0915510] * 3)
    top2 = ca.entropy_from_logits(logits, top_k=2)
    close(top2.detach(), [0.5623351])
    (grad_top2,) = torch.autograd.grad(top2.sum(), logits)
    close(grad_top2[0, 0], -0.2059898)
    close(grad_top2[0, 1:].sum(), 0.2059898)  # one of the tied tail logits is the second candidate
    assert (grad_top2[0, 1:] == 0).sum() == 2
    for k in (0, 4, 9):  # the whole vocabulary (k >= V) is the plain entropy
        close(ca.entropy_from_logits(logits, top_k=k).detach(), whole.detach())


def test_entropy_controller_update_rule_by_hand():
    # start 0, target 0.5, step 0.01, bounds [0, 0.025]; entropies after each step and the result:
    #   0.3 -> 0.01 (active: below target)   0.3 -> 0.02   0.3 -> 0.03, clipped to 0.025
    #   0.6 -> 0.015 (inactive: coefficient 0)   0.6 -> 0.005   0.6 -> -0.005, clipped to 0
    #   0.5 -> at the target is not below: 0, inactive   0.4 -> 0.01, active again
    control = ca.EntropyController(0.0, enabled=True, target_entropy=0.5, delta=0.01, low=0.0, high=0.025)
    assert control.coefficient == 0.0 and control.active  # before the first step: the start value
    applied, values = [], []
    for entropy in (0.3, 0.3, 0.3, 0.6, 0.6, 0.6, 0.5, 0.4):
        control.update(entropy)
        applied.append(control.coefficient)
        values.append(control.value)
    assert values == pytest.approx([0.01, 0.02, 0.025, 0.015, 0.005, 0.0, 0.0, 0.01])
    assert applied == pytest.approx([0.01, 0.02, 0.025, 0.0, 0.0, 0.0, 0.0, 0.01])
    assert control.metrics() == pytest.approx(
        {"actor/entropy_coeff": 0.01, "actor/entropy_coeff_value": 0.01, "actor/entropy_target": 0.5}
    )
    resumed = ca.EntropyController(0.0, enabled=True, target_entropy=0.5, delta=0.01, low=0.0, high=0.025)
    resumed.load_state_dict(control.state_dict())
    control.update(0.9), resumed.update(0.9)
    assert (resumed.value, resumed.coefficient) == (control.value, control.coefficient) == (0.0, 0.0)
    fixed = ca.EntropyController(0.003)  # not enabled: a fixed bonus
    fixed.update(0.0), fixed.update(9.0)
    assert fixed.coefficient == 0.003 and fixed.metrics() == {"actor/entropy_coeff": 0.003}
    with pytest.raises(ValueError, match="low <= high"):
        ca.EntropyController(0.0, enabled=True, low=0.1, high=0.01)


def test_overlong_penalty_by_hand():
    # L_max 20, buffer 4, factor 0.5: free up to 16; 17 -> (16-17)/4*0.5 = -0.125; 18 -> -0.25; 20 -> -0.5
    lengths = torch.tensor([3, 16, 17, 18, 20, 25])
    close(ca.overlong_penalty(lengths, 20, 4, 0.5), [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="buffer_length=20 must be in"):
        ca.overlong_penalty(lengths, 20, 20, 1.0)


# ------------------------------------------------------------------------------------------------
# Loss aggregation
# ------------------------------------------------------------------------------------------------


def test_aggregation_modes_by_hand():
    # rows [1, 2, 3] (3 tokens) and [4, 5, 100 (padding)] (2 tokens)
    #   token_mean              = (1+2+3+4+5) / 5 = 3
    #   seq_mean_token_mean     = (6/3 + 9/2) / 2 = (2 + 4.5) / 2 = 3.25
    #   seq_mean_token_sum      = (6 + 9) / 2 = 7.5
    #   seq_mean_token_sum_norm = (6 + 9) / (2 * 4) = 1.875   (max_response_length = 4)
    loss_mat = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    close(ca.aggregate_loss(loss_mat, mask, "token_mean"), 3.0)
    close(ca.aggregate_loss(loss_mat, mask, "seq_mean_token_mean"), 3.25)
    close(ca.aggregate_loss(loss_mat, mask, "seq_mean_token_sum"), 7.5)
    close(ca.aggregate_loss(loss_mat, mask, "seq_mean_token_sum_norm", max_response_length=4), 1.875)
    with pytest.raises(ValueError, match="needs max_response_length"):
        ca.aggregate_loss(loss_mat, mask, "seq_mean_token_sum_norm")


def test_aggregation_of_an_empty_piece_is_zero():
    loss_mat, mask = torch.ones(2, 3), torch.zeros(2, 3)
    for mode in ca.LOSS_AGG_MODES:
        close(ca.aggregate_loss(loss_mat, mask, mode, max_response_length=3), 0.0)


@pytest.mark.parametrize("mode", ca.LOSS_AGG_MODES)
def test_micro_batch_and_rank_shares_sum_to_the_whole(mode):
    # 9 sequences of lengths 1..6 (one empty row), split over 2 simulated ranks (5 + 4 rows) and then
    # into uneven micro-batches, each trimmed to its own longest row (dynamic padding).
    torch.manual_seed(0)
    lengths = [3, 1, 6, 0, 2, 5, 4, 6, 1]
    width = 6
    loss_mat = torch.randn(len(lengths), width)
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(-1)).float()
    whole = ca.aggregate_loss(loss_mat, mask, mode, max_response_length=width)

    global_num_tokens = mask.sum()
    global_num_seqs = (mask.sum(-1) > 0).sum()
    ranks = [[[0, 1], [2], [3, 4]], [[5, 6, 7], [8]]]  # rows of each micro-batch, per rank
    total = torch.zeros(())
    for micro_batches in ranks:
        for rows in micro_batches:
            piece_width = max(max(lengths[r] for r in rows), 1)
            share = ca.aggregate_loss(
                loss_mat[rows, :piece_width],
                mask[rows, :piece_width],
                mode,
                global_num_tokens=global_num_tokens,
                global_num_seqs=global_num_seqs,
                max_response_length=width,
            )
            total = total + share
    close(total, whole)


def test_mean_of_micro_batch_means_is_not_the_whole_token_mean():
    # why the global normalisers exist: [1, 1, 1] and [4] -> token mean 7/4 = 1.75, mean of means 2.5
    loss_mat = torch.tensor([[1.0, 1.0, 1.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    naive = (
        ca.aggregate_loss(loss_mat[:1], mask[:1], "token_mean")
        + ca.aggregate_loss(loss_mat[1:], mask[1:], "token_mean")
    ) / 2
    close(naive, 2.5)
    close(ca.aggregate_loss(loss_mat, mask, "token_mean"), 1.75)


# ------------------------------------------------------------------------------------------------
# KL
# ------------------------------------------------------------------------------------------------


def test_kl_estimators_by_hand():
    # logp = [-1, -2], ref = [-1.5, -1] -> d = logp - ref = [0.5, -1]
    #   k1  = [0.5, -1];  k2 = 0.5 * d^2 = [0.125, 0.5];  abs = [0.5, 1]
    #   k3: x = ref - logp = [-0.5, 1]: e^x - x - 1 = [0.606531 + 0.5 - 1, 2.718282 - 2]
    #                                               = [0.106531, 0.718282]
    log_prob = torch.tensor([-1.0, -2.0])
    ref_log_prob = torch.tensor([-1.5, -1.0])
    close(ca.kl_penalty(log_prob, ref_log_prob, "k1"), [0.5, -1.0])
    close(ca.kl_penalty(log_prob, ref_log_prob, "kl"), [0.5, -1.0])
    close(ca.kl_penalty(log_prob, ref_log_prob, "k2"), [0.125, 0.5])
    close(ca.kl_penalty(log_prob, ref_log_prob, "abs"), [0.5, 1.0])
    k3 = [math.exp(-0.5) - 0.5, math.e - 2.0]
    close(ca.kl_penalty(log_prob, ref_log_prob, "k3"), k3)
    close(ca.kl_penalty(log_prob, ref_log_prob, "low_var_kl"), k3)
    # ref - logp = 15: e^15 - 16 = 3.27e6 is clamped to 10
    close(ca.kl_penalty(torch.tensor([-15.0]), torch.tensor([0.0]), "k3"), [10.0])


def test_apply_kl_penalty_by_hand():
    # kl (k1) = [[0.1, 0.2, 0.3], [0.4, 0.5, 9 (padding)]], kl_coef 0.5
    # rewards = scores - 0.5 * kl * mask = [[-0.05, -0.1, 1 - 0.15], [-0.2, 2 - 0.25, 0]]
    # mean_kl = mean(seq means) = mean(0.6/3, 0.9/2) = mean(0.2, 0.45) = 0.325
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ref_log_prob = torch.full((2, 3), -1.0)
    log_prob = ref_log_prob + torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 9.0]])
    rewards, mean_kl = ca.apply_kl_penalty(scores, log_prob, ref_log_prob, mask, kl_coef=0.5, kind="k1")
    close(rewards, [[-0.05, -0.1, 0.85], [-0.2, 1.75, 0.0]])
    close(mean_kl, 0.325)


def test_kl_controllers_by_hand():
    fixed = ca.FixedKLController(kl_coef=0.05)
    fixed.update(current_kl=100.0, n_steps=512)
    assert fixed.value == 0.05

    # init 0.1, target 6, horizon 10000
    # update(kl=9, n=256): error = 9/6 - 1 = 0.5 -> clipped 0.2; value = 0.1 * (1 + 0.2*256/10000) = 0.100512
    # update(kl=5.4, n=1000): error = 0.9 - 1 = -0.1; value = 0.100512 * (1 - 0.1*0.1) = 0.09950688
    adaptive = ca.AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    adaptive.update(current_kl=9.0, n_steps=256)
    assert adaptive.value == pytest.approx(0.100512, abs=1e-12)
    adaptive.update(current_kl=5.4, n_steps=1000)
    assert adaptive.value == pytest.approx(0.09950688, abs=1e-12)
    with pytest.raises(ValueError, match="horizon > 0"):
        ca.AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=0)


def test_kl_controller_by_name():
    fixed = ca.build_kl_controller("fixed", kl_coef=0.05, kl_target=6.0, kl_horizon=10000)
    fixed.update(current_kl=9.0, n_steps=256)
    assert isinstance(fixed, ca.FixedKLController) and fixed.value == 0.05
    # as in test_kl_controllers_by_hand: 0.1 * (1 + 0.2 * 256 / 10000)
    adaptive = ca.build_kl_controller("adaptive", kl_coef=0.1, kl_target=6.0, kl_horizon=10000)
    adaptive.update(current_kl=9.0, n_steps=256)
    assert adaptive.value == pytest.approx(0.100512, abs=1e-12)
    with pytest.raises(ValueError, match="fixed, adaptive"):
        ca.build_kl_controller("pid", kl_coef=0.1, kl_target=6.0, kl_horizon=10000)


# ------------------------------------------------------------------------------------------------
# Value loss and logit helpers
# ------------------------------------------------------------------------------------------------


def test_value_loss_clipping_by_hand():
    # c = 0.2
    # tok0: v=1.0, v_old=0.5 -> clip to 0.7; (1-1.5)^2 = 0.25, (0.7-1.5)^2 = 0.64 -> 0.5*0.64 = 0.32, clipped
    # tok1: v=0.0, v_old=0.5 -> clip to 0.3; (0-1)^2 = 1, (0.3-1)^2 = 0.49   -> 0.5*1 = 0.5, not clipped
    # tok2: v=2.0, v_old=1.0 -> clip to 1.2; (2-3)^2 = 1, (1.2-3)^2 = 3.24   -> 0.5*3.24 = 1.62, clipped
    vpreds = torch.tensor([[1.0, 0.0, 2.0]])
    returns = torch.tensor([[1.5, 1.0, 3.0]])
    values_old = torch.tensor([[0.5, 0.5, 1.0]])
    loss, diagnostics = ca.compute_value_loss(
        vpreds, returns, values_old, torch.ones(1, 3), cliprange_value=0.2
    )
    close(loss, [[0.32, 0.5, 1.62]])
    close(diagnostics["vf_clipfrac"], [[1.0, 0.0, 1.0]])


def test_entropy_from_logits():
    # uniform over V = 5: H = log 5; p = [1/4, 3/4] (logits [0, log 3]):
    # H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.346574 + 0.215762 = 0.562335
    close(ca.entropy_from_logits(torch.zeros(2, 3, 5)), torch.full((2, 3), math.log(5)))
    close(ca.entropy_from_logits(torch.tensor([0.0, math.log(3)])), 0.562335)
    # a near one-hot distribution is stable: H ~ 0, no NaN from 0 * log 0
    close(ca.entropy_from_logits(torch.tensor([1e4, 0.0, -1e4])), 0.0)


def test_log_probs_from_logits_matches_log_softmax_gather():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7) * 4
    labels = torch.randint(0, 7, (2, 3))
    expected = torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    close(ca.log_probs_from_logits(logits, labels), expected)

    # bf16 logits are upcast chunk by chunk; compare with the float32 log-softmax of the same values
    bf16_logits = logits.bfloat16()
    expected = torch.log_softmax(bf16_logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    result = ca.log_probs_from_logits(bf16_logits, labels, chunk_rows=4)
    assert result.dtype == torch.float32
    close(result, expected)


def test_masked_whiten_and_mean():
    # valid values [1, 2, 3] (4 is padding): mean 2, unbiased var (1 + 0 + 1)/2 = 1 -> [-1, 0, 1]
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    close(ca.masked_mean(values, mask), 2.0)
    close(ca.masked_mean(values, mask, dim=-1), [1.5, 3.0])
    close(ca.masked_whiten(values, mask) * mask, [[-1.0, 0.0], [1.0, 0.0]])


# ------------------------------------------------------------------------------------------------
# Registries
# ------------------------------------------------------------------------------------------------


def test_unknown_names_list_the_valid_ones():
    # every registered name, sorted (more may be registered than these: mmrl/algorithms)
    with pytest.raises(ValueError, match="Unknown advantage estimator 'ppo'. Valid names: ") as raised:
        ca.get_adv_estimator("ppo")
    assert f"Valid names: {', '.join(sorted(ca.ADV_ESTIMATORS))}." in str(raised.value)
    assert "gae, grpo, grpo_passk" in str(raised.value)
    with pytest.raises(ValueError, match="Unknown policy loss 'dpo'. Valid names: ") as raised:
        ca.get_policy_loss("dpo")
    assert f"Valid names: {', '.join(sorted(ca.POLICY_LOSSES))}." in str(raised.value)
    assert "cispo, clip_cov, gspo, gspo_token, kl_cov, ppo, sapo" in str(raised.value)
    with pytest.raises(ValueError, match="Unknown KL estimator 'k4'.*abs, k1, k2, k3"):
        ca.kl_penalty(torch.zeros(1), torch.zeros(1), "k4")
    with pytest.raises(ValueError, match="Valid modes: token_mean, seq_mean_token_mean"):
        ca.aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "token-mean")


def test_registries_hold_the_documented_names():
    # a module of mmrl/algorithms may register more (each with its own tests)
    assert set(ca.ADV_ESTIMATORS) >= {"grpo", "grpo_passk", "rloo", "reinforce_plus_plus", "remax", "gae"}
    assert set(ca.POLICY_LOSSES) >= {"ppo", "gspo", "gspo_token", "cispo", "sapo", "clip_cov", "kl_cov"}
    assert ca.ADV_ESTIMATORS["gae"] is ca.compute_gae_advantages
    assert ca.POLICY_LOSSES["cispo"] is ca.compute_cispo_policy_loss
    assert set(ca.KL_ESTIMATORS) == {"k1", "kl", "k2", "mse", "k3", "low_var_kl", "abs"}
