"""The policy's log-prob pass and update with ``log_prob_chunk_tokens`` (log-probs and entropies
computed in the head, a few tokens at a time) equal the unchunked ones (``0``: the whole logits),
padded and packed, tied (Qwen2.5-VL) and untied (Qwen2.5-Omni) heads, with the entropy bonus on."""

from __future__ import annotations

import pytest
import torch
from _batches import ACTOR_SETTINGS, TEMPERATURE, add_training_columns, build_batch, policy_actor
from _models import training_model

from mmrl.workers.weight_sync import iter_full_state_dict

ROWS = ({}, {"image": (84, 56)}, {"video_frames": 4}, {}, {"image": (56, 56)})
RESPONSE_LENGTHS = (6, 1, 4, 3, 7)
CHUNK_TOKENS = 3  # several chunks per micro-batch, the last one partial
SGD_LR = 1.0  # plain SGD: the weight change is the gradient itself


@pytest.fixture(scope="module")
def training_batches(tiny_vl_path, tiny_omni_path):
    from transformers import AutoProcessor

    batches = {}
    for kind, path in (("qwen2_5_vl", tiny_vl_path), ("qwen2_5_omni", tiny_omni_path)):
        rows = ROWS if kind == "qwen2_5_vl" else ({}, {"image": (56, 56)}, {"audio_s": 1.0}, {}, {})
        batch = build_batch(AutoProcessor.from_pretrained(path), rows, RESPONSE_LENGTHS, seed=5)
        batches[kind] = (str(path), add_training_columns(batch, str(path)))
    return batches


def _log_probs_and_step(path, batch, chunk_tokens: int, padding_free: bool) -> dict:
    model = training_model(path)
    settings = {**ACTOR_SETTINGS, "padding_free": padding_free, "log_prob_chunk_tokens": chunk_tokens}
    actor = policy_actor(model, torch.optim.SGD(model.parameters(), lr=SGD_LR), **settings)
    log_probs, entropies = actor.compute_log_probs(batch, 2, TEMPERATURE, with_entropy=True)
    metrics = actor.update_policy(batch, len(batch), 2, 1, TEMPERATURE).metrics
    state = {name: tensor.detach().clone() for name, tensor in iter_full_state_dict(model)}
    return {"log_probs": log_probs, "entropies": entropies, "metrics": metrics, "state": state}


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen2_5_omni"])
@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_chunked_log_probs_and_update_equal_unchunked(kind, padding_free, training_batches):
    path, batch = training_batches[kind]
    chunked = _log_probs_and_step(path, batch, CHUNK_TOKENS, padding_free)
    whole = _log_probs_and_step(path, batch, 0, padding_free)
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(chunked["log_probs"][mask], whole["log_probs"][mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked["entropies"][mask], whole["entropies"][mask], atol=1e-5, rtol=1e-5)
    assert not chunked["log_probs"][~mask].any() and not chunked["entropies"][~mask].any()
    assert ACTOR_SETTINGS["entropy_coeff"] != 0  # the entropy's gradient is part of the step
    for name in ("pg_loss", "entropy", "kl_loss", "ppo_kl", "pg_clipfrac", "grad_norm"):
        assert chunked["metrics"][name] == pytest.approx(whole["metrics"][name], rel=1e-5, abs=1e-7), name
    initial = dict(iter_full_state_dict(training_model(path)))
    for name, tensor in whole["state"].items():
        torch.testing.assert_close(chunked["state"][name], tensor, atol=1e-6, rtol=1e-5, msg=name)
    moved = [name for name, tensor in whole["state"].items() if not torch.equal(tensor, initial[name])]
    assert "lm_head.weight" in moved or kind == "qwen2_5_vl"  # Omni's untied head is trained too
    assert any(name.startswith("model.embed_tokens") or "embed_tokens" in name for name in moved)


def test_chunked_scoring_needs_a_model_prepared_for_it(tiny_vl_path):
    from mmrl.models.loading import load_model

    with pytest.raises(ValueError, match="score_tokens=True"):
        policy_actor(load_model(str(tiny_vl_path)), log_prob_chunk_tokens=CHUNK_TOKENS)
    policy_actor(load_model(str(tiny_vl_path)), log_prob_chunk_tokens=0)  # the whole logits: any head
