"""Recovery from a collapse (``worker.actor.collapse_recovery``): a policy put at p ~ 1 on one answer for
every prompt gets a gradient back from the spread term, and after a bounded number of real updates the
transformers rollout samples groups with mixed scores again; outside a collapse (the gate's weight 0)
the update is exactly the one of an actor without the feature.

Single process: the tiny Qwen2 text model trained by :class:`PolicyActor` (the real loss, the chunked
head), sampled by :class:`HFRollout` after each update's weights are pushed to it. The task: one
answer token, right when it is the prompt's (A for half the prompts, B for the others).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _batches import policy_actor
from _models import training_model

from mmrl.config import CollapseRecoveryConfig
from mmrl.core_algos import CollapseGate, all_equal_groups, entropy_from_logits, spread_from_logits
from mmrl.models.loading import load_model
from mmrl.protocol import DataProto
from mmrl.workers.rollout import SamplingParams
from mmrl.workers.rollout.hf import HFRollout
from mmrl.workers.weight_sync import iter_full_state_dict

ANSWERS = (10, 11)  # token ids of the two answers (A, B)
PROMPTS, GROUP, PROMPT_LENGTH = 8, 8, 5
RECIPE = {  # the recipe terms: top-8 entropy bonus, low_var_kl loss
    "entropy_coeff": 0.01,
    "entropy_top_k": 8,
    "use_kl_loss": True,
    "kl_penalty": "low_var_kl",
    "kl_coef": 0.02,
    "max_grad_norm": 1.0,
    "max_response_length": 1,
    "log_prob_chunk_tokens": 16,
}
MAX_RECOVERY_STEPS = 12


# ---- the term and the gate by hand --------------------------------------------------------------


def test_spread_gradient_is_p_minus_uniform_on_the_top_k_and_does_not_vanish_at_saturation():
    logits = torch.tensor([9.0, 2.0, 1.0, 0.5, -3.0], requires_grad=True)  # p(0) = 0.9985
    spread = spread_from_logits(logits, 3)
    probs = torch.softmax(logits.detach(), -1)
    top3 = torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0, 0.0])
    expected = torch.logsumexp(logits.detach(), -1) - logits.detach()[:3].mean() - math.log(3)
    torch.testing.assert_close(spread.detach(), expected)
    (grad,) = torch.autograd.grad(spread, logits)
    torch.testing.assert_close(grad, probs - top3)
    assert grad.norm() > 0.8  # while the sampled token's log-prob and the entropy give ~1e-3
    (lp_grad,) = torch.autograd.grad(torch.log_softmax(logits, -1)[0], logits)
    (ent_grad,) = torch.autograd.grad(entropy_from_logits(logits, 3), logits)
    assert lp_grad.norm() < 3e-3 and ent_grad.norm() < 2e-2


def test_all_equal_groups_by_hand():
    uids = ["a", "a", "b", "b", "c", "d", "d"]
    assert all_equal_groups(uids, [1, 1, 0, 1, 0.5, 0, 0]) == (3, 4, 0)  # a, c (alone), d
    assert all_equal_groups(uids, [1, 1, 0, 1, 0.5, 0, 0], solved_score=1.0) == (3, 4, 1)  # a solved
    assert all_equal_groups(uids, [1, 1, 0, 1, 0.5, 0, 0], solved_score=0.5) == (3, 4, 2)  # a and c
    assert all_equal_groups([], []) == (0, 0, 0)
    with pytest.raises(ValueError, match="2 uids for 1 scores"):
        all_equal_groups(["a", "b"], [1.0])


def test_gate_turns_on_after_patience_collapsed_steps_and_off_at_the_first_mixed_step():
    gate = CollapseGate(enabled=True, coeff=0.1, all_equal_share=0.75, patience=2)
    seen = []
    for all_equal, groups in ((4, 8), (8, 8), (7, 8), (8, 8), (5, 8), (8, 8)):
        gate.observe(all_equal, groups)
        seen.append((gate.coefficient, gate.metrics()["rollout/steps_since_mixed_group"]))
    assert seen == [(0.0, 0.0), (0.0, 1.0), (0.1, 0.0), (0.1, 1.0), (0.0, 0.0), (0.0, 1.0)]
    restored = CollapseGate(enabled=True, coeff=0.1, all_equal_share=0.75, patience=2)
    restored.load_state_dict(gate.state_dict())
    restored.observe(8, 8)
    assert restored.coefficient == 0.1
    off = CollapseGate()
    for _ in range(5):
        off.observe(8, 8)
    assert off.coefficient == 0.0 and off.metrics()["rollout/all_equal_group_frac"] == 1.0
    with pytest.raises(ValueError, match="patience >= 1"):
        CollapseGate(enabled=True, patience=0)


def test_a_solved_policy_is_not_a_collapse():
    """All-equal groups that all scored ``solved_score`` (every response right) are a task learnt: the gate
    judges the share of all-equal groups among the others. A policy settled on one answer of two is right
    on half the prompts and wrong on the rest: collapsed; one right on every prompt: not."""
    gate = CollapseGate(enabled=True, coeff=0.1, all_equal_share=0.95, patience=1)
    gate.observe(8, 8, 8)  # solved: every group all right
    metrics = gate.metrics()
    assert gate.coefficient == 0.0 and metrics["rollout/all_equal_group_frac"] == 1.0
    assert metrics["rollout/solved_group_frac"] == 1.0 and metrics["rollout/stuck_group_frac"] == 0.0
    gate.observe(8, 8, 4)  # one answer for every prompt: right on half, wrong on the other half
    assert gate.coefficient == 0.1 and gate.metrics()["rollout/stuck_group_frac"] == 1.0
    gate.observe(7, 8, 5)  # learning: one mixed group among the three not solved
    assert gate.coefficient == 0.0 and gate.metrics()["rollout/stuck_group_frac"] == 2 / 3
    counting_all = CollapseGate(enabled=True, coeff=0.1, all_equal_share=0.95, patience=1, solved_score=None)
    counting_all.observe(*all_equal_groups(["a"] * 4 + ["b"] * 4, [1.0] * 8, counting_all.solved_score))
    assert counting_all.coefficient == 0.1  # without solved_score a solved policy counts as collapsed


# ---- a constructed collapse on the tiny model ---------------------------------------------------


def _prompts() -> DataProto:
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(20, 200, (PROMPTS, PROMPT_LENGTH), generator=generator)
    prompts = DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)},
        non_tensors={"uid": np.array([f"p{i}" for i in range(PROMPTS)], dtype=object)},
    )
    prompts.non_tensor_batch["answer"] = np.array([ANSWERS[i % 2] for i in range(PROMPTS)], dtype=object)
    return prompts


def _train_answers(model, prompts: DataProto, p_a: float, done) -> None:
    """Supervised steps towards p(A) = ``p_a``, p(B) = 1 - ``p_a`` at every prompt's answer position,
    until ``done(p(A), p(B))`` [PROMPTS] each."""
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-2)
    input_ids = prompts.batch["input_ids"]
    target = torch.zeros(PROMPTS, model.config.vocab_size)
    target[:, ANSWERS[0]], target[:, ANSWERS[1]] = p_a, 1 - p_a
    for _ in range(300):
        logits = model(input_ids=input_ids, use_cache=False).logits[:, -1].float()
        probs = torch.softmax(logits, -1)
        if done(probs[:, ANSWERS[0]], probs[:, ANSWERS[1]]):
            return
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(logits, target).backward()
        optimizer.step()
    raise AssertionError(f"answers not reached: p(A)={probs[:, ANSWERS[0]]}, p(B)={probs[:, ANSWERS[1]]}")


def _scored_step(rollout: HFRollout, prompts: DataProto, seed: int) -> tuple[DataProto, tuple[int, int, int]]:
    """A group of GROUP answers per prompt, scored 1 when right, with GRPO advantages."""
    batch = rollout.generate(prompts, SamplingParams(n=GROUP, temperature=1.0, max_tokens=1, seed=seed))
    scores = (batch.batch["responses"][:, 0].numpy() == batch.non_tensor_batch["answer"].astype(int)).astype(
        float
    )
    grouped = scores.reshape(PROMPTS, GROUP)
    advantages = (grouped - grouped.mean(1, keepdims=True)) / (grouped.std(1, ddof=1, keepdims=True) + 1e-6)
    batch.batch["advantages"] = torch.tensor(advantages.reshape(-1, 1), dtype=torch.float32)
    return batch, all_equal_groups(batch.non_tensor_batch["uid"], scores, solved_score=1.0)


def _with_log_probs(actor, reference, batch: DataProto) -> DataProto:
    batch.batch["old_log_probs"] = actor.compute_log_probs(batch, len(batch), 1.0)[0]
    batch.batch["ref_log_probs"] = reference.compute_log_probs(batch, len(batch), 1.0)[0]
    return batch


@pytest.fixture(scope="module")
def collapsed(tiny_text_path):
    """The warmed-up policy (A or B at chance on every prompt; the KL loss's reference) and the
    collapsed one (p(A) > 0.999 whatever the prompt, the collapse the issue saw), as state dicts."""
    prompts = _prompts()
    model = training_model(tiny_text_path)
    _train_answers(model, prompts, 0.5, lambda a, b: bool((a.min() > 0.3) & (b.min() > 0.3)))
    balanced = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    reference = training_model(tiny_text_path)
    reference.load_state_dict(balanced)
    _train_answers(model, prompts, 1.0, lambda a, b: bool(a.min() > 0.999))
    collapsed = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    return str(tiny_text_path), prompts, balanced, collapsed, policy_actor(reference, **RECIPE)


def _actor(path, state, optimizer=torch.optim.Adam, lr=1e-3, **settings):
    model = training_model(path)
    model.load_state_dict(state)
    return model, policy_actor(model, optimizer(model.parameters(), lr=lr), **settings)


def test_a_collapsed_policy_gets_a_gradient_and_mixed_groups_back(collapsed):
    path, prompts, _, state, reference = collapsed
    model, actor = _actor(
        path, state, **RECIPE, collapse_recovery=CollapseRecoveryConfig(enabled=True, top_k=8)
    )
    rollout = HFRollout(load_model(path), _tokenizer(path), prepack=False)
    rollout.update_weights(iter_full_state_dict(model))
    gate = CollapseGate(enabled=True, coeff=0.05, all_equal_share=0.95, patience=1)
    batch, counts = _scored_step(rollout, prompts, seed=0)
    assert counts[0] >= 0.95 * counts[1]  # collapsed: (almost) every group all-equal
    batch = _with_log_probs(actor, reference, batch)
    _, plain = _actor(path, state, **RECIPE)
    without = plain.update_policy(batch, len(batch), len(batch), 1, 1.0).metrics["grad_norm"]
    norms = []
    for step in range(MAX_RECOVERY_STEPS):
        gate.observe(*counts)
        if counts[0] < counts[1]:
            break
        metrics = actor.update_policy(batch, len(batch), len(batch), 1, 1.0, spread_coeff=gate.coefficient)
        norms.append(metrics.metrics["grad_norm"])
        rollout.update_weights(iter_full_state_dict(model))
        batch, counts = _scored_step(rollout, prompts, seed=step + 1)
        batch = _with_log_probs(actor, reference, batch)
    print(f"grad norm without the term {without:.3g}; with it, per step {norms}; groups {counts}")
    assert norms and norms[0] > 100 * without  # the recipe's own terms have (almost) no gradient left
    assert counts[0] < counts[1], f"still collapsed after {MAX_RECOVERY_STEPS} steps: {counts}"
    assert gate.coefficient == 0.0  # the term switches off with the first mixed step


def _tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def test_outside_a_collapse_the_update_is_exactly_the_one_without_the_feature(collapsed):
    path, prompts, initial, _, reference = collapsed
    rollout = HFRollout(load_model(path), _tokenizer(path), prepack=False)
    rollout.update_weights(initial.items())
    batch, counts = _scored_step(rollout, prompts, seed=0)
    assert counts[0] < counts[1]  # a policy that is not collapsed: mixed groups
    gate = CollapseGate(enabled=True, coeff=0.05, all_equal_share=0.95, patience=1)
    gate.observe(*counts)
    assert gate.coefficient == 0.0
    states = []
    for settings in ({}, {"collapse_recovery": CollapseRecoveryConfig(enabled=True, top_k=8)}):
        model, actor = _actor(path, initial, **RECIPE, **settings)
        batch = _with_log_probs(actor, reference, batch)
        metrics = actor.update_policy(batch, len(batch), 16, 1, 1.0, spread_coeff=gate.coefficient).metrics
        assert "collapse_spread" not in metrics
        states.append((metrics, model.state_dict()))
    (metrics, first), (metrics_on, second) = states
    assert metrics == metrics_on
    for name, tensor in first.items():
        assert torch.equal(tensor, second[name]), name


def test_the_spread_term_through_the_head_equals_the_one_from_whole_logits(collapsed):
    # log_prob_chunk_tokens > 0 (the head's chunks, hand-written backward) and 0 (whole logits, autograd)
    path, prompts, _, state, reference = collapsed
    rollout = HFRollout(load_model(path), _tokenizer(path), prepack=False)
    rollout.update_weights(state.items())
    batch, _ = _scored_step(rollout, prompts, seed=0)
    results = []
    for chunk_tokens in (16, 0):
        settings = {**RECIPE, "log_prob_chunk_tokens": chunk_tokens}
        recovery = CollapseRecoveryConfig(enabled=True)
        # plain SGD: the weight change is the gradient itself (Adam's first step would magnify the
        # rounding differences of near-zero gradient entries to lr-sized steps)
        model, actor = _actor(path, state, torch.optim.SGD, 1.0, **settings, collapse_recovery=recovery)
        batch = _with_log_probs(actor, reference, batch)
        metrics = actor.update_policy(batch, len(batch), 32, 1, 1.0, spread_coeff=0.05).metrics
        results.append((metrics, model.state_dict()))
    (chunked, chunked_state), (whole, whole_state) = results
    assert chunked["collapse_spread"] > 1.0  # far from uniform over the top 8
    for name in ("collapse_spread", "grad_norm", "entropy", "entropy_full", "kl_loss"):
        # abs: at p ~ 1 the whole-logits entropy, lse - sum p z, loses ~1e-6 to cancellation
        assert chunked[name] == pytest.approx(whole[name], rel=1e-4, abs=1e-5), name
    for name, tensor in whole_state.items():
        torch.testing.assert_close(chunked_state[name], tensor, atol=1e-6, rtol=1e-5, msg=name)
