"""The policy's log-prob pass and update with ``log_prob_chunk_tokens`` (log-probs and entropies
computed in the head, a few tokens at a time) equal the unchunked ones (``0``: the whole logits),
padded and packed, tied (Qwen2.5-VL) and untied (Qwen2.5-Omni) heads, with the entropy bonus on."""

from __future__ import annotations

import math

import pytest
import torch
from _batches import ACTOR_SETTINGS, TEMPERATURE, add_training_columns, build_batch, policy_actor
from _models import training_model

from mmrl.protocol import DataProto
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


def _log_probs_and_step(path, batch, chunk_tokens: int, padding_free: bool, **extra) -> dict:
    model = training_model(path)
    settings = {
        **ACTOR_SETTINGS,
        "padding_free": padding_free,
        "log_prob_chunk_tokens": chunk_tokens,
        **extra,
    }
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


def test_top_k_entropy_bonus_chunked_equals_unchunked(training_batches):
    # the entropy over the 5 most probable tokens (worker.actor.entropy_top_k), as the bonus of a step:
    # the head's chunks and the whole logits agree in values, metrics and the step's weights
    path, batch = training_batches["qwen2_5_vl"]
    chunked = _log_probs_and_step(path, batch, CHUNK_TOKENS, True, entropy_top_k=5)
    whole = _log_probs_and_step(path, batch, 0, True, entropy_top_k=5)
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(chunked["entropies"][mask], whole["entropies"][mask], atol=1e-5, rtol=1e-5)
    assert (chunked["entropies"][mask] <= torch.log(torch.tensor(5.0)) + 1e-5).all()
    for name in ("pg_loss", "entropy", "grad_norm"):
        assert chunked["metrics"][name] == pytest.approx(whole["metrics"][name], rel=1e-5, abs=1e-7), name
    for name, tensor in whole["state"].items():
        torch.testing.assert_close(chunked["state"][name], tensor, atol=1e-6, rtol=1e-5, msg=name)


def test_the_entropy_term_of_a_step_is_minus_the_coefficient_the_driver_hands_it(training_batches):
    # advantages 0 and no KL loss: the whole loss is -c * token_mean(entropy), so a plain SGD step (lr 1,
    # no clipping) moves every weight by c * d mean H / d w: nothing at c = 0, twice as far at 2c. The
    # coefficient comes with the update (the driver's EntropyController), not from the config.
    path, batch = training_batches["qwen2_5_vl"]
    batch = _with_zero_advantages(batch)
    quiet = {"use_kl_loss": False, "max_grad_norm": 1e9, "entropy_coeff": 0.5, "entropy_top_k": 5}
    initial = dict(iter_full_state_dict(training_model(path)))
    moves = {}
    for coefficient in (0.0, 1.0, 2.0):  # large: a weight change far above float32 rounding of the weight
        model = training_model(path)
        actor = policy_actor(
            model, torch.optim.SGD(model.parameters(), lr=SGD_LR), **{**ACTOR_SETTINGS, **quiet}
        )
        metrics = actor.update_policy(batch, len(batch), 2, 1, TEMPERATURE, entropy_coeff=coefficient).metrics
        assert metrics["pg_loss"] == 0.0
        moves[coefficient] = {
            name: tensor.detach() - initial[name] for name, tensor in iter_full_state_dict(model)
        }
    assert all(not move.any() for move in moves[0.0].values())  # the config's 0.5 is not used
    assert any(move.abs().max() > 0 for move in moves[1.0].values())
    for name, move in moves[2.0].items():
        torch.testing.assert_close(move, 2 * moves[1.0][name], atol=2e-6, rtol=1e-4, msg=name)


def _with_zero_advantages(batch: DataProto) -> DataProto:
    tensors = dict(batch.batch.items())
    tensors["advantages"] = torch.zeros_like(tensors["advantages"])
    return DataProto.from_dict(tensors=tensors, non_tensors=dict(batch.non_tensor_batch))


def test_chunked_scoring_needs_a_model_prepared_for_it(tiny_vl_path):
    from mmrl.models.loading import load_model

    with pytest.raises(ValueError, match="score_tokens=True"):
        policy_actor(load_model(str(tiny_vl_path)), log_prob_chunk_tokens=CHUNK_TOKENS)
    policy_actor(load_model(str(tiny_vl_path)), log_prob_chunk_tokens=0)  # the whole logits: any head


def _step(path, batch, on_policy: bool = False, **settings) -> tuple[dict, dict]:
    """One SGD step (lr 1: the weight change is the gradient) of a fresh model: (metrics, weights)."""
    model = training_model(path)
    actor = policy_actor(
        model, torch.optim.SGD(model.parameters(), lr=SGD_LR), **{**ACTOR_SETTINGS, **settings}
    )
    metrics = actor.update_policy(batch, len(batch), 2, 1, TEMPERATURE, on_policy=on_policy).metrics
    return metrics, {name: tensor.detach().clone() for name, tensor in iter_full_state_dict(model)}


def _assert_same_step(first: tuple[dict, dict], second: tuple[dict, dict], metric_names) -> None:
    for name in metric_names:
        assert first[0][name] == pytest.approx(second[0][name], rel=1e-5, abs=1e-7), name
    for name, tensor in first[1].items():
        torch.testing.assert_close(second[1][name], tensor, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("loss_avg_mode", ["token_mean", "seq_mean_token_mean"])
def test_masking_truncated_responses_equals_leaving_them_out(loss_avg_mode, training_batches):
    # rows 1 and 4 (row 4 fills the width 7 without EOS: a real truncation) are masked: policy loss,
    # entropy bonus and KL loss, and their token and sequence counts, must be those of the 3 other rows
    path, batch = training_batches["qwen2_5_vl"]
    batch = batch.union(DataProto.from_dict(tensors={"truncated": torch.tensor([0, 1, 0, 0, 1])}))
    kept = batch[[0, 2, 3]]
    masked = _step(path, batch, mask_truncated_responses=True, loss_avg_mode=loss_avg_mode)
    removed = _step(path, kept, loss_avg_mode=loss_avg_mode)
    _assert_same_step(
        masked, removed, ("pg_loss", "kl_loss", "entropy", "pg_clipfrac", "ppo_kl", "grad_norm")
    )
    assert masked[0]["truncated_masked_ratio"] == pytest.approx(2 / 5)
    if loss_avg_mode == "token_mean":  # flag off: the column changes nothing (and no ratio is logged)
        plain = batch.select(batch_keys=[key for key in batch.batch.keys() if key != "truncated"])
        off = _step(path, batch, loss_avg_mode=loss_avg_mode)
        _assert_same_step(
            off, _step(path, plain, loss_avg_mode=loss_avg_mode), ("pg_loss", "kl_loss", "grad_norm")
        )
        assert "truncated_masked_ratio" not in off[0]
        assert off[0]["pg_loss"] != pytest.approx(masked[0]["pg_loss"])


def test_gspo_through_the_actor_clips_at_its_own_defaults(training_batches):
    # old_log_probs are the model's own + N(0, 0.3) noise: sequence ratios are ~0.1 away from 1, far
    # outside GSPO's [1 - 3e-4, 1 + 4e-4] but inside PPO's [0.8, 1.3]; null must mean GSPO's range
    path, batch = training_batches["qwen2_5_vl"]
    null = {"loss_type": "gspo", "clip_ratio_low": None, "clip_ratio_high": None}
    actor = policy_actor(training_model(path), **{**ACTOR_SETTINGS, **null})
    assert actor.config.clip_range == (3e-4, 4e-4)
    defaults = _step(path, batch, **null)
    explicit = _step(path, batch, loss_type="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    _assert_same_step(defaults, explicit, ("pg_loss", "pg_clipfrac", "grad_norm"))
    assert defaults[0]["pg_clipfrac"] > 0.2  # PPO's range would clip (almost) none of these sequences


def test_sapo_on_policy_step_is_the_policy_gradient(training_batches):
    # on-policy r = 1: SAPO's loss is -A * f(1) = -A * 2 / tau and its gradient wrt logp is -A whatever
    # tau (f'(1) = 1): two temperatures give the same step, and pg_loss the token mean of -2 A / tau
    # with tau = tau_positive (1.0) where A >= 0 and tau_negative (1.05) where A < 0
    from mmrl.core_algos import aggregate_loss

    path, batch = training_batches["qwen2_5_vl"]
    sapo = {"loss_type": "sapo", "clip_ratio_low": None, "clip_ratio_high": None}
    tau2 = _step(path, batch, on_policy=True, **sapo, tau_positive=2.0, tau_negative=2.0)
    default = _step(path, batch, on_policy=True, **sapo)
    _assert_same_step(tau2, default, ("kl_loss", "entropy", "grad_norm"))
    advantages, mask = batch.batch["advantages"], batch.batch["response_mask"]
    tau = torch.where(advantages >= 0, 1.0, 1.05)
    assert tau2[0]["pg_loss"] == pytest.approx(
        aggregate_loss(-advantages, mask, "token_mean").item(), rel=1e-5
    )
    expected = aggregate_loss(-2.0 * advantages / tau, mask, "token_mean").item()
    assert default[0]["pg_loss"] == pytest.approx(expected, rel=1e-5)


def test_rollout_correction_weighs_each_tokens_loss(training_batches):
    # on-policy with the rollout's log-probs log rho below the model's own: token TIS at 2 and token
    # rejection outside [1/3.5, 3.5] give per-token weights w (by hand, from log rho's pattern), and the
    # step equals the uncorrected one with advantages * w (every policy loss is linear in a positive
    # weight on A); the KL and entropy terms are not weighted
    from mmrl.config import RolloutCorrectionConfig

    path, batch = training_batches["qwen2_5_vl"]
    own, _ = policy_actor(training_model(path)).compute_log_probs(batch, len(batch), TEMPERATURE)
    pattern = torch.tensor([math.log(3), 0.0, -math.log(2), math.log(1.5), -math.log(4)])
    mask = batch.batch["response_mask"].bool()
    log_rho = pattern.repeat(batch.batch["responses"].shape[1] // 5 + 1)[: mask.shape[1]].expand_as(own)
    by_hand = torch.tensor([2.0, 1.0, 0.5, 1.5, 0.0]).repeat(3)[: mask.shape[1]].expand_as(own)
    rollout = DataProto.from_dict(tensors={"rollout_log_probs": (own - log_rho) * mask})
    correction = RolloutCorrectionConfig(
        rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token", rollout_rs_threshold=3.5
    )
    corrected = _step(path, batch.union(rollout), on_policy=True, rollout_correction=correction)
    weighted = batch.select(batch_keys=[key for key in batch.batch.keys() if key != "advantages"])
    weighted = weighted.union(
        DataProto.from_dict(tensors={"advantages": batch.batch["advantages"] * by_hand})
    )
    weighted.batch["old_log_probs"] = own
    _assert_same_step(corrected, _step(path, weighted), ("pg_loss", "kl_loss", "entropy", "grad_norm"))
    valid = by_hand[mask]
    assert corrected[0]["rollout_rs_masked_frac"] == pytest.approx(float((valid == 0).float().mean()))
    assert corrected[0]["rollout_is_truncated_frac"] == pytest.approx(float((valid == 2).float().mean()))
    assert corrected[0]["rollout_kl_k1"] == pytest.approx(float(-log_rho[mask].mean()), abs=1e-5)
    assert "rollout_rs_masked_seq_frac" not in corrected[0]  # token rejection masks no whole response


def test_decoupled_ppo_weighs_each_tokens_loss_by_proximal_over_behaviour(training_batches):
    # on-policy: the proximal policy is the update's own first forward. The rollout (behaviour) log-probs
    # sit log w below it, w per token 3, 1, 0.5, 1.5, 8 (over the cap 5: masked): the step equals plain
    # PPO with advantages * w' (w' = w, 0 where masked; every policy loss is linear in a positive weight
    # on A), the KL and entropy terms unweighted. (Behaviour == proximal gives plain PPO itself:
    # tests/algorithms/test_decoupled.py.)
    from mmrl.config import DecoupledConfig

    path, batch = training_batches["qwen2_5_vl"]
    own, _ = policy_actor(training_model(path)).compute_log_probs(batch, len(batch), TEMPERATURE)
    mask = batch.batch["response_mask"].bool()
    weights = torch.tensor([3.0, 1.0, 0.5, 1.5, 8.0]).repeat(3)[: mask.shape[1]].expand_as(own)
    applied = torch.where(weights > 5.0, 0.0, weights)
    behaviour = DataProto.from_dict(tensors={"rollout_log_probs": (own - weights.log()) * mask})
    decoupled = {"off_policy": "decoupled", "decoupled": DecoupledConfig(5.0, "mask")}
    stale = _step(path, batch.union(behaviour), on_policy=True, **decoupled)
    weighted = batch.select(batch_keys=[key for key in batch.batch.keys() if key != "advantages"])
    weighted = weighted.union(
        DataProto.from_dict(tensors={"advantages": batch.batch["advantages"] * applied})
    )
    weighted.batch["old_log_probs"] = own
    _assert_same_step(stale, _step(path, weighted), ("pg_loss", "kl_loss", "entropy", "grad_norm"))
    assert stale[0]["behaviour_over_cap"] == pytest.approx(float((weights[mask] > 5).float().mean()))
    assert stale[0]["behaviour_weight"] == pytest.approx(float(weights[mask].mean()), rel=1e-5)
    assert stale[0]["behaviour_kl"] == pytest.approx(float(-weights[mask].log().mean()), abs=1e-5)


def test_the_step_size_scale_is_the_scheduled_rate_times_it_for_this_step_only(training_batches):
    # Adam at 1e-3 with the driver's scale 0.5 takes exactly the step of Adam at 5e-4; the scheduler's
    # rate is back for the next step, and the logged lr is the one the step used
    path, batch = training_batches["qwen2_5_vl"]
    steps = []
    for lr, scale in ((1e-3, 0.5), (5e-4, 1.0)):
        model = training_model(path)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        actor = policy_actor(model, optimizer, lr_scheduler=scheduler, **ACTOR_SETTINGS)
        metrics = actor.update_policy(batch, len(batch), 2, 1, TEMPERATURE, lr_scale=scale).metrics
        assert metrics["lr"] == 5e-4
        assert optimizer.param_groups[0]["lr"] == lr  # the schedule's, untouched by the scale
        steps.append({name: tensor.detach().clone() for name, tensor in iter_full_state_dict(model)})
    for name, tensor in steps[0].items():
        assert torch.equal(tensor, steps[1][name]), name


def test_ppo_kl_k3_is_the_token_mean_of_r_minus_1_minus_log_r(training_batches):
    # the batch's old log-probs are the model's own plus noise: r = p / p_old per token, and the metric
    # the step-size control reads is the token mean of r - 1 - log r (>= 0), ppo_kl that of -log r
    path, batch = training_batches["qwen2_5_vl"]
    model = training_model(path)
    actor = policy_actor(model, torch.optim.SGD(model.parameters(), lr=0.0), **ACTOR_SETTINGS)
    log_probs, _ = actor.compute_log_probs(batch, 2, TEMPERATURE)
    mask = batch.batch["response_mask"].bool()
    log_ratio = (log_probs - batch.batch["old_log_probs"])[mask].double()
    metrics = actor.update_policy(batch, len(batch), 2, 1, TEMPERATURE).metrics
    assert metrics["ppo_kl_k3"] == pytest.approx(float((log_ratio.exp() - 1 - log_ratio).mean()), rel=1e-4)
    assert metrics["ppo_kl"] == pytest.approx(float(-log_ratio.mean()), rel=1e-4, abs=1e-6)
    assert metrics["ppo_kl_k3"] > 0.01  # the noise (0.3 nats) moved it well away from 0
