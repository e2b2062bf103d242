"""Sequence parallelism (Ulysses, ring, both) equals the single-rank computation, on real gloo ranks.

Two levels:

- the attention function alone (:func:`sharded_attention`) against causal attention per packed
  sequence on one process: outputs and the query/key/value gradients, summed over the ranks that
  hold the tokens, for Ulysses 2 and 4, ring 2 and 4, Ulysses 2 x ring 2; with grouped-query heads
  (key/value heads fewer than the Ulysses size) and sequences shorter than the ring's 2R chunks;
- the tiny Qwen2.5-VL under FSDP2 with a ``PolicyActor``: log-probs, entropies, every loss term and
  every parameter's gradient of one update on a batch of text, image and video rows of uneven
  lengths, against the same actor on one rank (fp32, within 1e-5 relative); the same for the tiny
  Qwen3-VL, whose deepstack features must follow the tokens each rank holds. The vision towers
  encode each SP rank's share of the frames and images (:mod:`mmrl.parallel.encoders`): the shares
  add up to the whole, and the tower's gradients equal one rank's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _batches import (
    ACTOR_SETTINGS,
    TEMPERATURE,
    add_training_columns,
    build_batch,
    build_trajectory_batch,
    policy_actor,
)
from _trainer_run import run_main, small_run_overrides

from mmrl.demo.ranks import run_on_ranks
from mmrl.models.attention import PackedSequences
from mmrl.parallel.ring_attention import sharded_attention
from mmrl.parallel.sequence import ShardedSequences, ShardLayout, init_sequence_parallel, split_sizes
from mmrl.protocol import DataProto

LENGTHS = (13, 5, 22, 1, 9)  # the 1-token sequence leaves most of its ring chunks empty
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8

# no clipping of the gradient norm, so gradients compare as they are
SP_ACTOR_SETTINGS = {**ACTOR_SETTINGS, "max_grad_norm": 0.0}
MIXED_ROWS = ({}, {"image": (84, 56)}, {"video_frames": 4}, {}, {"image": (56, 56)}, {"video_frames": 2})
QWEN3_ROWS = (
    {},
    {"image": (84, 56)},
    {"video_frames": 4, "video_fps": 2.0},
    {},
    {"image": (56, 56)},
    {"video_frames": 6, "video_fps": 2.0},
)


# ---------------------------------------------------------------- layout


def test_layout_by_hand():
    layout = ShardLayout((10, 3), ring_size=2, ulysses_size=2)
    # sequence 0 in 4 chunks of 3, 3, 2, 2 at 0, 3, 6, 8; sequence 1 (at 10) in 1, 1, 1, 0
    assert layout.ring_positions[0].tolist() == [0, 1, 2, 8, 9, 10]  # chunks 0 and 3 of each
    assert layout.ring_positions[1].tolist() == [3, 4, 5, 6, 7, 11, 12]  # chunks 1 and 2
    assert layout.local_positions(1, 0).tolist() == [3, 4, 5, 6]
    assert layout.local_positions(1, 1).tolist() == [7, 11, 12]
    assert split_sizes(7, 3) == [3, 2, 2]
    # every position is held exactly once
    held = sorted(p for r in range(2) for u in range(2) for p in layout.local_positions(r, u).tolist())
    assert held == list(range(13))


# ---------------------------------------------------------------- attention alone


def _attention_inputs():
    generator = torch.Generator().manual_seed(0)
    tokens = sum(LENGTHS)
    query = torch.randn(HEADS, tokens, HEAD_DIM, generator=generator).requires_grad_()
    key = torch.randn(KV_HEADS, tokens, HEAD_DIM, generator=generator).requires_grad_()
    value = torch.randn(KV_HEADS, tokens, HEAD_DIM, generator=generator).requires_grad_()
    out_grad = torch.randn(tokens, HEADS, HEAD_DIM, generator=generator)
    return query, key, value, out_grad


def _reference_attention():
    query, key, value, out_grad = _attention_inputs()
    parts = [
        torch.nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], is_causal=True, enable_gqa=True
        )[0]
        for q, k, v in zip(query.split(LENGTHS, 1), key.split(LENGTHS, 1), value.split(LENGTHS, 1))
    ]
    out = torch.cat(parts, dim=1).transpose(0, 1)  # [T, H, D]
    (out * out_grad).sum().backward()
    return out.detach(), query.grad, key.grad, value.grad


def _attention_job(rank: int, world_size: int, ulysses_size: int, ring_size: int):
    groups = init_sequence_parallel(ulysses_size, ring_size)
    layout = ShardLayout(LENGTHS, ring_size, ulysses_size)
    sharded = ShardedSequences(PackedSequences.from_lengths(LENGTHS, "cpu"), layout, groups)
    index = sharded.local_index
    query, key, value, out_grad = _attention_inputs()
    out = sharded_attention(
        torch.nn.Module(), query[:, index][None], key[:, index][None], value[:, index][None], sharded, None
    )[0]  # [T_rank, H, D]
    (out * out_grad[index]).sum().backward()
    return index, out.detach(), query.grad, key.grad, value.grad


@pytest.mark.distributed
@pytest.mark.parametrize(("ulysses_size", "ring_size"), [(2, 1), (1, 2), (2, 2), (4, 1), (1, 4)])
def test_sharded_attention_equals_attention_per_sequence(ulysses_size, ring_size):
    reference = _reference_attention()
    results = run_on_ranks(_attention_job, ulysses_size * ring_size, ulysses_size, ring_size, timeout_s=120)
    out = torch.zeros_like(reference[0])
    grads = [torch.zeros_like(grad) for grad in reference[1:]]
    for index, rank_out, *rank_grads in results:
        out[index] = rank_out
        for total, grad in zip(grads, rank_grads):
            total += grad  # each rank's gradient flows through its own tokens only
    torch.testing.assert_close(out, reference[0], rtol=1e-5, atol=2e-6)
    for grad, expected in zip(grads, reference[1:]):
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=2e-6)


def test_cuda_flash_backward_gets_the_arguments_of_torchs_context_parallel_attention():
    """The CUDA block backward passes what torch's context-parallel ring attention passes: the dense
    forward's undefined ``cum_seq_q``/``cum_seq_k`` (None; a defined empty tensor would select the
    varlen kernel, which rejects 4-D inputs) and the block lengths. Checked on meta tensors, which run
    the ops' shape functions with no GPU; ``bench/gpu_check.py`` runs the kernels on one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mmrl.parallel.ring_attention import cuda_flash_backward, cuda_flash_forward

    flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
    calls = []

    class RecordCalls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append((func, args))
            return func(*args, **(kwargs or {}))

    q = torch.empty(HEADS, 6, HEAD_DIM, device="meta", dtype=torch.bfloat16)
    k = v = torch.empty(HEADS, 10, HEAD_DIM, device="meta", dtype=torch.bfloat16)
    dense = torch.ops.aten._scaled_dot_product_flash_attention(q[None], k[None], v[None], 0.0, False)
    out, lse = cuda_flash_forward(q, k, v, False, 0.5)
    with RecordCalls():
        dq, dk, dv = cuda_flash_backward(out, q, k, v, out, lse, False, 0.5)
    (args,) = [args for func, args in calls if func is flash_backward]
    assert args[6:10] == tuple(dense[2:6]) == (None, None, 6, 10)  # cum_seq_q, cum_seq_k, max_q, max_k
    assert (args[12].dtype, args[13].dtype) == (dense[6].dtype, dense[7].dtype)  # philox seed, offset
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


# ---------------------------------------------------------------- the model under FSDP2


class GradientRecorder(torch.optim.Optimizer):
    """An optimizer whose step keeps a full copy of every gradient (a collective, like FSDP's own
    steps) instead of changing the parameters."""

    def __init__(self, named_parameters):
        named = [(name, p) for name, p in named_parameters if p.requires_grad]
        super().__init__([p for _, p in named], {"lr": 0.0})
        self.names = {id(p): name for name, p in named}
        self.grads: list[dict[str, torch.Tensor]] = []

    @torch.no_grad()
    def step(self, closure=None):
        grads = {}
        for group in self.param_groups:
            for param in group["params"]:
                grad = param.grad
                grads[self.names[id(param)]] = (
                    grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()
                )
        self.grads.append(grads)


def _actor_job(
    rank: int,
    world_size: int,
    model_path: str,
    batch,
    ulysses_size: int,
    ring_size: int,
    chunk_tokens: int = 3,
) -> dict:
    from _models import training_model
    from torch.distributed.device_mesh import init_device_mesh

    from mmrl.models.loading import decoder_layers, tower_modules
    from mmrl.workers.fsdp_engine import apply_fsdp2

    groups = init_sequence_parallel(ulysses_size, ring_size)
    module = apply_fsdp2(
        training_model(model_path, sequence_parallel=world_size > 1),
        init_device_mesh("cpu", (world_size,)),
        torch.float32,
        torch.float32,
    )
    recorder = GradientRecorder(module.named_parameters())
    layer_tokens = []  # tokens each decoder layer call computed: this rank's share of the packed row
    decoder_layers(module)[0].register_forward_hook(
        lambda m, args, out: layer_tokens.append(args[0].shape[1])
    )
    vision_patches = []  # patches each vision block call encoded: this rank's share of the frames
    vision = next(tower for name, tower in tower_modules(module) if name.endswith("visual"))
    vision.blocks[0].register_forward_hook(lambda m, args, out: vision_patches.append(args[0].shape[0]))
    actor = policy_actor(
        module,
        recorder,
        dp_group=groups.dp_group,
        sequence_parallel=groups,
        padding_free=True,
        share_prompts=False,  # SP packs whole rows; so does the one-rank reference, token for token
        **ACTOR_SETTINGS,
        log_prob_chunk_tokens=chunk_tokens,
    )
    log_probs, entropies = actor.compute_log_probs(batch, 4, TEMPERATURE, with_entropy=True)
    metrics = actor.update_policy(batch, len(batch), 2, 1, TEMPERATURE).metrics  # 3 micro-batches, one step
    return {
        "log_probs": log_probs,
        "entropies": entropies,
        "metrics": metrics,
        "grads": recorder.grads[0],
        "layer_tokens": layer_tokens,
        "vision_patches": vision_patches,
    }


def _sp_training_batch(model_path, rows) -> DataProto:
    """Six rows of uneven response lengths through the model's processor, with the update's columns."""
    from transformers import AutoProcessor

    batch = build_batch(AutoProcessor.from_pretrained(model_path), rows, (6, 1, 4, 3, 7, 2), seed=40)
    return add_training_columns(batch, model_path)


@pytest.fixture(scope="module")
def sp_batch(tiny_vl_path):
    return _sp_training_batch(tiny_vl_path, MIXED_ROWS)


@pytest.fixture(scope="module")
def single_rank(tiny_vl_path, sp_batch) -> dict:
    """The reference: one rank, log-probs from the whole logits (the SP runs score 3 tokens at a time)."""
    return run_on_ranks(_actor_job, 1, str(tiny_vl_path), sp_batch, 1, 1, 0, timeout_s=180)[0]


def _assert_same_step(run: dict, reference: dict, metric_abs: float = 1e-7) -> None:
    torch.testing.assert_close(run["log_probs"], reference["log_probs"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run["entropies"], reference["entropies"], rtol=1e-5, atol=1e-5)
    for name in ("pg_loss", "kl_loss", "entropy", "ppo_kl", "pg_clipfrac", "grad_norm"):
        assert run["metrics"][f"{name}"] == pytest.approx(
            reference["metrics"][name], rel=1e-5, abs=metric_abs
        ), name
    assert reference["metrics"]["pg_clipfrac"] > 0  # the clipped branches take part
    assert set(run["grads"]) == set(reference["grads"])
    for name, expected in reference["grads"].items():
        torch.testing.assert_close(run["grads"][name], expected, rtol=1e-5, atol=1e-6, msg=name)
    assert any("visual" in name and grad.abs().sum() > 0 for name, grad in run["grads"].items())


def _assert_tokens_split(runs: list[dict], reference: dict, vision_split: bool = True) -> None:
    """The decoder layers of the SP ranks together computed each packed row once, in equal shares; so
    did the vision towers with the frames and images (mmrl.parallel.encoders) where a call had as many
    temporal patches as ranks (``vision_split``: some call did)."""
    for call in range(len(reference["layer_tokens"])):
        shares = [run["layer_tokens"][call] for run in runs]
        assert sum(shares) == reference["layer_tokens"][call]
        assert max(shares) - min(shares) <= 2 * len(MIXED_ROWS)  # chunks differ by at most one token
    split = 0
    for call, whole in enumerate(reference["vision_patches"]):
        shares = [run["vision_patches"][call] for run in runs]
        if shares != [whole] * len(runs):  # else one image: fewer temporal patches than ranks
            assert sum(shares) == whole and all(0 < share < whole for share in shares), (call, shares, whole)
            split += 1
    assert (split > 0) == vision_split, [run["vision_patches"] for run in runs]


@pytest.mark.distributed
@pytest.mark.parametrize(("ulysses_size", "ring_size"), [(2, 1), (1, 2)])
def test_policy_step_with_sequence_parallel_equals_one_rank(
    tiny_vl_path, sp_batch, single_rank, ulysses_size, ring_size
):
    runs = run_on_ranks(_actor_job, 2, str(tiny_vl_path), sp_batch, ulysses_size, ring_size, timeout_s=180)
    for run in runs:  # every SP rank sees the whole rows' results
        _assert_same_step(run, single_rank)
    _assert_tokens_split(runs, single_rank)


@pytest.fixture(scope="module")
def qwen3_sp_batch(tiny_qwen3_vl_path):
    return _sp_training_batch(tiny_qwen3_vl_path, QWEN3_ROWS)


@pytest.fixture(scope="module")
def qwen3_single_rank(tiny_qwen3_vl_path, qwen3_sp_batch) -> dict:
    return run_on_ranks(_actor_job, 1, str(tiny_qwen3_vl_path), qwen3_sp_batch, 1, 1, 0, timeout_s=180)[0]


@pytest.mark.distributed
@pytest.mark.parametrize(("ulysses_size", "ring_size"), [(2, 1), (1, 2)])
def test_qwen3_vl_policy_step_with_sequence_parallel_equals_one_rank(
    tiny_qwen3_vl_path, qwen3_sp_batch, qwen3_single_rank, ulysses_size, ring_size
):
    """Each rank adds the deepstack features of the visual tokens it holds (ring: non-adjacent chunks)."""
    runs = run_on_ranks(
        _actor_job, 2, str(tiny_qwen3_vl_path), qwen3_sp_batch, ulysses_size, ring_size, timeout_s=180
    )
    for run in runs:
        _assert_same_step(run, qwen3_single_rank)
    _assert_tokens_split(runs, qwen3_single_rank)
    merger_grads = [grad for name, grad in qwen3_single_rank["grads"].items() if "deepstack_merger" in name]
    assert merger_grads and all(grad.abs().sum() > 0 for grad in merger_grads)


# two image tool calls, a text tool answer, a video tool answer, an answer at once (uneven lengths)
TRAJECTORY_ROWS = (
    ({"image": (56, 56)}, 0, [("model", 3), ("observation", {"image": (56, 56)}), ("model", 2),
                              ("observation", {"image": (84, 56)}), ("model", 4)]),
    ({"image": (56, 56)}, 0, [("model", 2), ("observation", {}), ("model", 5)]),
    ({}, 1, [("model", 4), ("observation", {"video_frames": 4}), ("model", 3)]),
    ({}, 1, [("model", 6)]),
)  # fmt: skip


@pytest.mark.distributed
def test_policy_step_with_sequence_parallel_equals_one_rank_on_trajectories(tiny_vl_path):
    """Multi-turn trajectories (images and a video returned by tools, in the middle of the response):
    a response with holes in its mask splits over the SP ranks like any packed row."""
    from transformers import AutoProcessor

    batch = build_trajectory_batch(AutoProcessor.from_pretrained(tiny_vl_path), TRAJECTORY_ROWS, seed=5)
    batch = add_training_columns(batch, tiny_vl_path)
    reference = run_on_ranks(_actor_job, 1, str(tiny_vl_path), batch, 1, 1, 0, timeout_s=180)[0]
    runs = run_on_ranks(_actor_job, 2, str(tiny_vl_path), batch, 2, 1, timeout_s=180)
    for run in runs:
        # ppo_kl is a mean of log-prob differences of ~1e-3: float32 summation order leaves ~1e-7 of it
        _assert_same_step(run, reference, metric_abs=1e-6)


@pytest.mark.slow
@pytest.mark.distributed
def test_policy_step_with_ulysses_inside_ring_on_four_ranks_equals_one_rank(
    tiny_vl_path, sp_batch, single_rank
):
    runs = run_on_ranks(_actor_job, 4, str(tiny_vl_path), sp_batch, 2, 2, timeout_s=300)
    for run in runs:
        _assert_same_step(run, single_rank)
    # every tower call of this batch has fewer temporal patches (at most 2) than the 4 ranks: each
    # rank encodes it whole, as mmrl.parallel.encoders does below one unit per rank
    _assert_tokens_split(runs, single_rank, vision_split=False)


# ---------------------------------------------------------------- the trainer


def ring_run_overrides(tiny_vl_path, shapes_data_dir, save_dir, critic_ring: int) -> list[str]:
    """The actor in one ring of 2 workers (dp 1) with the KL loss against a reference and its vision
    tower frozen, and a GAE critic colocated in the same processes with ring size ``critic_ring``. The
    training set is one step's 4 prompts: the second step is the second epoch."""
    one_step = Path(shapes_data_dir) / "train_4.jsonl"
    lines = (Path(shapes_data_dir) / "train.jsonl").read_text().splitlines(keepends=True)
    one_step.write_text("".join(lines[:4]))
    return small_run_overrides(tiny_vl_path, shapes_data_dir, save_dir) + [
        f"data.train_files={one_step}",
        "data.max_response_length=6",
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_loss=true",
        "algorithm.kl_coef=0.1",
        "worker.actor.global_batch_size=2",
        "worker.actor.micro_batch_size_per_device_for_update=4",
        "worker.actor.ring_size=2",
        "worker.actor.model.freeze_vision_tower=true",
        "worker.critic.global_batch_size=4",  # one critic step: the same rows whatever the split
        "worker.critic.micro_batch_size_per_device_for_update=4",
        f"worker.critic.ring_size={critic_ring}",
        "worker.critic.model.enable_gradient_checkpointing=false",
        "worker.rollout.name=hf",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
    ]


@pytest.fixture(scope="module")
def ring_run(tiny_vl_path, shapes_data_dir, tmp_path_factory) -> list[dict]:
    """2 steps with the critic in the actor's ring: the metrics lines of its steps."""
    save_dir = tmp_path_factory.mktemp("ring_run")
    overrides = ring_run_overrides(tiny_vl_path, shapes_data_dir, save_dir, critic_ring=2)
    # the frozen towers' encodings on disk too (mmrl.models.encoding_store): the ring's ranks agree on
    # what they read, one of them writes
    overrides.append(f"worker.actor.model.encoding_cache_dir={save_dir / 'encodings'}")
    return [row for row in run_main(overrides, save_dir) if "actor/grad_norm" in row] + [
        {"encodings": sorted(path.name for path in (save_dir / "encodings").iterdir())}
    ]


@pytest.mark.slow
@pytest.mark.distributed
def test_trainer_with_ring_sequence_parallel(ring_run):
    """Two workers forming one ring (dp 1): both generate (rollout is not sequence parallel), then the
    actor and ref passes split every row over the ring. The rollout's own log-probs of the sampled
    tokens (whole sequences, transformers) must equal the SP trainer's. The vision tower is frozen, so
    the actor's passes also share one encoding per image (mmrl.models.encoding_cache) over the ring's
    split of the tower's work (mmrl.parallel.encoders), and keep them on disk: whole files only."""
    *steps, files = ring_run
    assert files["encodings"] and all(name.endswith(".pt") for name in files["encodings"])
    assert len(steps) == 2
    # per rank: the 4 images encoded once in the first epoch and reused by every other forward of the
    # step (the reference's included); read from disk in the second, none encoded
    encoders = {key: [row[key] for row in steps] for key in steps[0] if key.startswith("encoders/")}
    assert encoders == {
        "encoders/encoded_items": [4, 0],
        "encoders/disk_read_items": [0, 4],
        "encoders/reused_items": [44, 44],
        "encoders/hashed_items": [0, 0],  # every pass announced its items' digests, taken once
    }
    for row in steps:
        assert row["rollout/log_prob_gap_max"] < 1e-5, row["rollout/log_prob_gap_max"]
        assert row["actor/grad_norm"] > 0 and row["actor/kl_loss"] >= 0
    assert steps[1]["actor/kl_loss"] > 0  # the policy moved away from the reference (SP ref pass)


@pytest.mark.slow
@pytest.mark.distributed
def test_colocated_critic_keeps_its_own_sequence_parallel_size(
    ring_run, tiny_vl_path, shapes_data_dir, tmp_path
):
    """The critic lives in the actor's processes but splits rows by its own layout: with the actor in
    one ring of 2 (dp 1), a critic without sequence parallelism (dp 2: each rank half the rows) and one
    in the actor's ring (its groups shared, the ring test's run) compute the same values and the same
    first value loss."""
    overrides = ring_run_overrides(tiny_vl_path, shapes_data_dir, tmp_path / "critic_ring_1", critic_ring=1)
    (own_layout,) = [
        row
        for row in run_main([*overrides, "trainer.max_steps=1"], tmp_path / "critic_ring_1")
        if "critic/vf_loss" in row
    ]
    shared = ring_run[0]  # its first step
    assert own_layout["critic/score/mean"] == shared["critic/score/mean"]  # the same rollouts
    for key in ("critic/values/mean", "critic/vf_loss", "critic/vpred_mean", "critic/grad_norm"):
        assert shared[key] == pytest.approx(own_layout[key], rel=1e-4, abs=1e-6), key


def _disk_cache_job(rank: int, world_size: int, model_path: str, batch, folders: list[list[str]]) -> dict:
    """One ring of 2 with a frozen tower whose encodings go through a disk cache: one log-prob pass per
    entry of ``folders[rank]`` (this rank's cache folder in that epoch), memory emptied between them."""
    from _models import training_model
    from torch.distributed.device_mesh import init_device_mesh

    from mmrl.models.encoding_cache import EncodingCache, enable_encoding_cache, label_weights, weights_digest
    from mmrl.models.encoding_store import EncodingStore
    from mmrl.models.loading import freeze_vision_tower, vision_modules
    from mmrl.workers.fsdp_engine import apply_fsdp2

    groups = init_sequence_parallel(1, 2)
    model = training_model(model_path, sequence_parallel=True)
    freeze_vision_tower(model)
    (tower,) = vision_modules(model)
    label_weights(tower, weights_digest(tower, torch.float32))
    module = apply_fsdp2(model, init_device_mesh("cpu", (world_size,)), torch.float32, torch.float32)
    cache = EncodingCache()
    enable_encoding_cache([tower], cache)
    vision_patches = []
    tower.blocks[0].register_forward_hook(lambda m, args, out: vision_patches.append(args[0].shape[0]))
    actor = policy_actor(
        module,
        dp_group=groups.dp_group,
        sequence_parallel=groups,
        padding_free=True,
        share_prompts=False,
        **ACTOR_SETTINGS,
    )
    epochs = []
    for folder in folders[rank]:
        cache.clear()
        cache.store = EncodingStore(folder, max_bytes=1 << 30)
        vision_patches.clear()
        log_probs, _ = actor.compute_log_probs(batch, 6, TEMPERATURE)
        epochs.append({"log_probs": log_probs, "patches": sum(vision_patches), **cache.take_counts()})
    return {"epochs": epochs}


@pytest.mark.distributed
def test_ring_ranks_agree_on_disk_hits_and_encode_together(tiny_vl_path, sp_batch, single_rank, tmp_path):
    """Epoch 1 writes the encodings (SP rank 0 alone); in epoch 2 rank 1's folder lacks them (another
    rank's eviction between two reads): both ranks encode, none hangs in the sharded tower's gather;
    in epoch 3 both read and the tower does not run. Log-probs equal one rank's throughout."""
    shared, empty = str(tmp_path / "shared"), str(tmp_path / "empty")
    folders = [[shared, shared, shared], [shared, empty, shared]]
    runs = run_on_ranks(_disk_cache_job, 2, str(tiny_vl_path), sp_batch, folders, timeout_s=180)
    items = 4  # MIXED_ROWS: two images, two videos
    for run in runs:
        for epoch in run["epochs"]:
            torch.testing.assert_close(epoch["log_probs"], single_rank["log_probs"], rtol=1e-5, atol=1e-5)
        first, second, third = run["epochs"]
        assert (first["encoded_items"], first["disk_read_items"]) == (items, 0)
        assert (second["encoded_items"], second["disk_read_items"]) == (items, 0)  # rank 1 missed
        assert (third["encoded_items"], third["disk_read_items"], third["patches"]) == (0, items, 0)
        assert first["patches"] > 0 and second["patches"] == first["patches"]
    assert len(list((tmp_path / "shared").glob("*.pt"))) == items
    assert not any((tmp_path / "empty").iterdir())  # rank 0 of the ring alone writes


@pytest.mark.distributed
@pytest.mark.parametrize("fixture", ["tiny_glm4v_path", "tiny_qwen3_vl_moe_path"])
def test_policy_step_with_ulysses_equals_one_rank_per_family(request, fixture):
    """GLM-4.1V (video frames as image tokens, 3-D RoPE on half of each head) and Qwen3-VL MoE (each
    rank routes the tokens it holds; deepstack features): Ulysses 2 = one rank."""
    path = request.getfixturevalue(fixture)
    batch = _sp_training_batch(path, QWEN3_ROWS)
    reference = run_on_ranks(_actor_job, 1, str(path), batch, 1, 1, 0, timeout_s=180)[0]
    runs = run_on_ranks(_actor_job, 2, str(path), batch, 2, 1, timeout_s=180)
    for run in runs:
        _assert_same_step(run, reference)
    _assert_tokens_split(runs, reference)
    if "moe" in fixture:  # the experts and routers trained on both ranks' tokens
        assert any("mlp.experts" in name and grad.abs().sum() > 0 for name, grad in runs[0]["grads"].items())


OMNI3_ROWS = (
    {"audio_s": 1.0},
    {"image": (64, 64), "audio_s": 0.5},
    {"video_frames": 4, "audio_s": 2.0, "audio_in_video": True},
    {},
    {"image": (96, 64)},
    {"audio_s": 1.5},
)


@pytest.mark.distributed
def test_qwen3_omni_policy_step_with_ulysses_equals_one_rank(tiny_qwen3_omni_path):
    """Qwen3-Omni (MoE decoder, deepstack features, audio tower; audio, image + audio, video with its
    sound track and text rows): Ulysses 2 = one rank, log-probs, metrics and every gradient."""
    batch = _sp_training_batch(tiny_qwen3_omni_path, OMNI3_ROWS)
    reference = run_on_ranks(_actor_job, 1, str(tiny_qwen3_omni_path), batch, 1, 1, 0, timeout_s=180)[0]
    runs = run_on_ranks(_actor_job, 2, str(tiny_qwen3_omni_path), batch, 2, 1, timeout_s=180)
    for run in runs:
        _assert_same_step(run, reference)
    _assert_tokens_split(runs, reference)
    assert any("audio_tower" in name and grad.abs().sum() > 0 for name, grad in runs[0]["grads"].items())
