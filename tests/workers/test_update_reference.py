"""The actor's update against a plain loop written out here: the same loss, gradient norm and
updated weights, whatever the packing does to save host work (rows packed whole or sharing a prompt,
masks made once, attention buckets taken as views, gradients clipped in one foreach op, metric shares
summed as one vector).

The plain loop: the unprepared model on padded rows (prompts of equal length, right-padded
responses), the last R + 1 positions' logits, a log-softmax gather, PPO's dual-clip loss as a token
mean over the whole batch, two micro-batches, torch's ``clip_grad_norm_``, SGD (the weight change is
the clipped gradient itself).
"""

from __future__ import annotations

import pytest
import torch
from _batches import policy_actor
from _models import training_model

from mmrl.models.loading import load_model
from mmrl.protocol import DataProto

PROMPT, RESPONSE_LENGTHS = 6, (5, 3, 6, 2)  # rows 0 and 1 share their prompt; 2 and 3 have their own
CLIP_LOW, CLIP_HIGH, DUAL, MAX_NORM = 0.2, 0.3, 3.0, 0.5


def _batch(reference) -> DataProto:
    generator = torch.Generator().manual_seed(0)
    width = max(RESPONSE_LENGTHS)
    prompts = torch.randint(50, 300, (4, PROMPT), generator=generator)
    prompts[1] = prompts[0]
    response_mask = (torch.arange(width) < torch.tensor(RESPONSE_LENGTHS)[:, None]).long()
    responses = torch.randint(50, 300, (4, width), generator=generator) * response_mask
    batch = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": torch.cat([torch.ones(4, PROMPT, dtype=torch.long), response_mask], dim=1),
        "response_mask": response_mask,
        "advantages": torch.tensor([1.0, -0.5, -1.5, 2.0])[:, None].expand(4, width).contiguous(),
    }
    with torch.no_grad():  # old log-probs off the current ones, so that some ratios clip (both ways)
        current = _log_probs(reference, batch, slice(0, 4))
    batch["old_log_probs"] = (current + 0.4 * torch.randn(current.shape, generator=generator)) * response_mask
    return DataProto.from_dict(tensors=batch)


def _log_probs(model, batch: dict, rows: slice) -> torch.Tensor:
    width = batch["responses"].shape[1]
    logits = model(
        input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows], use_cache=False
    ).logits[:, PROMPT - 1 : PROMPT - 1 + width]
    return torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"][rows, :, None]).squeeze(-1)


def _plain_update(model, batch: dict) -> tuple[float, float]:
    mask = batch["response_mask"].float()
    loss_sum = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        ratio = torch.exp(_log_probs(model, batch, rows) - batch["old_log_probs"][rows])
        advantages = batch["advantages"][rows]
        clipped = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
        token_loss = torch.where(advantages < 0, torch.minimum(clipped, -advantages * DUAL), clipped)
        loss = (token_loss * mask[rows]).sum() / mask.sum()
        loss.backward()
        loss_sum += float(loss.detach())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param -= param.grad
    return loss_sum, float(norm)


def test_update_equals_the_plain_loop(tiny_vl_path):
    reference = load_model(str(tiny_vl_path))
    batch = _batch(reference)
    model = training_model(str(tiny_vl_path))
    actor = policy_actor(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        loss_type="ppo",
        clip_ratio_low=CLIP_LOW,
        clip_ratio_high=CLIP_HIGH,
        clip_ratio_dual=DUAL,
        max_grad_norm=MAX_NORM,
        max_response_length=max(RESPONSE_LENGTHS),
        log_prob_chunk_tokens=3,
    )
    assert actor.config.padding_free and actor.config.share_prompts
    metrics = actor.update_policy(batch, 4, 2, 1, temperature=1.0).metrics
    loss, norm = _plain_update(reference, {key: batch.batch[key] for key in batch.batch.keys()})
    assert metrics["pg_loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert norm > MAX_NORM and 0 < metrics["pg_clipfrac"] < 1  # clipping of both kinds took part
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name].detach(), atol=2e-6, rtol=0, msg=name)
