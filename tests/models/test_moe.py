"""Mixture-of-experts routers (mmrl.models.moe): the load-balancing loss and router metrics by hand on
a real Qwen3-VL MoE router, what a recorder sees in padded and packed forwards, and the loss term in
the actor's update."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from _batches import policy_actor
from _models import training_model
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextTopKRouter

from mmrl.config import MoEConfig
from mmrl.models.moe import (
    RouterCall,
    RouterRecorder,
    load_balancing_loss,
    mean_load_balancing_loss,
    num_experts_of,
    router_metrics,
    router_modules,
)
from mmrl.protocol import DataProto

# two tokens' router probabilities over 4 experts, top-2: token 0 -> {0, 1}, token 1 -> {1, 2}
PROBS = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.5, 0.3, 0.1]])


def _router_call() -> tuple[RouterCall, Qwen3VLMoeTextTopKRouter]:
    """The real router with weights whose logits on one-hot hidden states are log PROBS."""
    router = Qwen3VLMoeTextTopKRouter(SimpleNamespace(num_experts_per_tok=2, num_experts=4, hidden_size=2))
    with torch.no_grad():
        router.weight.copy_(PROBS.log().T)  # [E, D]: column t is token t's logits
    logits, _, experts = router(torch.eye(2))
    return RouterCall(logits, experts), router


def test_load_balancing_loss_by_hand_on_a_real_router():
    call, router = _router_call()
    assert call.experts.sort(-1).values.tolist() == [[0, 1], [1, 2]]
    # f = routed shares (1, 2, 1, 0) / 4; P = mean probs (.25, .4, .25, .1)
    # E * sum f P = 4 * (.25*.25 + .5*.4 + .25*.25 + 0) = 4 * .325 = 1.3
    loss = load_balancing_loss(call, 4)
    assert loss.item() == pytest.approx(1.3, abs=1e-6)
    loss.backward()  # trained through P only: d loss / d P_i = E f_i / T per token
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    # balanced routing scores 1: uniform probabilities, every expert equally often
    uniform = RouterCall(torch.zeros(4, 4), torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3]]))
    assert load_balancing_loss(uniform, 4).item() == pytest.approx(1.0)
    # padding tokens are left out: token 1 masked -> f = (.5, .5, 0, 0), P = token 0's
    masked = RouterCall(call.logits, call.experts, torch.tensor([True, False]))
    assert load_balancing_loss(masked, 4).item() == pytest.approx(4 * (0.5 * 0.4 + 0.5 * 0.3), abs=1e-6)


def test_router_metrics_by_hand():
    call, _ = _router_call()
    metrics = router_metrics([call, call], 4)  # two equal layers: the means are one layer's values
    assert metrics["moe_max_expert_share"].item() == pytest.approx(0.5)  # expert 1: 2 of 4 pairs
    entropy = [-sum(p * math.log(p) for p in row) for row in PROBS.tolist()]
    assert metrics["moe_router_entropy"].item() == pytest.approx(sum(entropy) / 2, abs=1e-6)


def test_recorder_sees_every_layer_and_only_real_tokens(tiny_qwen3_vl_moe_path):
    """A padded forward records its padding as not real; its real tokens route as in the packed
    forward of the same rows, so both give the same loss and metrics."""
    model = training_model(tiny_qwen3_vl_moe_path).eval()
    assert num_experts_of(model) == 4 and len(router_modules(model)) == 2
    input_ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    attention_mask = (input_ids != 0).long()
    padded = RouterRecorder(model)
    with torch.no_grad(), padded.recording():
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    assert (
        len(padded.calls) == 2
        and padded.calls[0].valid.tolist() == attention_mask.reshape(-1).bool().tolist()
    )
    rows = RouterRecorder(model)
    with torch.no_grad(), rows.recording():  # each row alone, unpadded
        model(input_ids=input_ids[:1, 2:], use_cache=False)
        model(input_ids=input_ids[1:], use_cache=False)
    assert all(call.valid is None for call in rows.calls)
    for layer in range(2):
        alone = torch.cat([rows.calls[layer].experts, rows.calls[2 + layer].experts])
        assert torch.equal(padded.calls[layer].real()[1], alone)
    dense = Qwen3ForCausalLM(
        Qwen3Config(vocab_size=16, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                    num_attention_heads=1, num_key_value_heads=1, head_dim=32)
    )  # fmt: skip
    assert num_experts_of(dense) == 0
    with (
        pytest.raises(ValueError, match="Qwen3ForCausalLM has no MoE routers"),
        RouterRecorder(dense).recording(),
    ):
        pass


def test_aux_loss_coef_adds_exactly_its_gradient_to_the_update(tiny_qwen3_vl_moe_path):
    """With plain SGD and no clipping, the update with ``moe.aux_loss_coef`` c moves each router weight
    by the one without it plus -lr * c * d(aux)/dw, aux the loss of a separate forward of the batch."""
    batch = _one_row_batch()
    lr, coef = 0.1, 0.5
    moved = {}
    for c in (0.0, coef):
        model = training_model(tiny_qwen3_vl_moe_path)
        before = {name: router.weight.detach().clone() for name, router in router_modules(model)}
        actor = policy_actor(
            model,
            torch.optim.SGD(model.parameters(), lr=lr),
            max_grad_norm=1e9,
            moe=MoEConfig(aux_loss_coef=c),
        )
        metrics = actor.update_policy(batch, 1, 1, 1, temperature=1.0).metrics
        moved[c] = {name: router.weight.detach() - before[name] for name, router in router_modules(model)}
    assert 1.0 < metrics["moe_aux_loss"] < 2.0 and 0.25 <= metrics["moe_max_expert_share"] <= 0.5
    assert 0 < metrics["moe_router_entropy"] < math.log(4)
    model = training_model(tiny_qwen3_vl_moe_path)
    recorder = RouterRecorder(model)
    with recorder.recording():  # the same tokens as the update's packed forward
        model(input_ids=batch.batch["input_ids"], use_cache=False)
    aux = mean_load_balancing_loss(recorder.calls, 4)
    assert aux.item() == pytest.approx(metrics["moe_aux_loss"], abs=1e-5)
    aux.backward()
    for name, router in router_modules(model):
        torch.testing.assert_close(
            moved[coef][name] - moved[0.0][name], -lr * coef * router.weight.grad, atol=1e-6, rtol=1e-4
        )


def _one_row_batch() -> DataProto:
    prompt, response = torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([[10, 11, 12]])
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.cat([prompt, response], -1),
            "attention_mask": torch.ones(1, 8, dtype=torch.long),
            "responses": response,
            "response_mask": torch.ones(1, 3, dtype=torch.long),
            "advantages": torch.ones(1, 3),
            "old_log_probs": torch.full((1, 3), -7.0),
        }
    )
