"""Weights pushed to a rollout engine of its own over the push group (mmrl/workers/weight_push.py): a
real gloo group on loopback, as training rank 0 and a rollout worker run them
(worker.rollout.placement=separate). The sender is a thread of this process, or 2 FSDP2 training ranks
(spawned processes, gloo) whose rank 0 sends; the receiver is a thread of this process."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
from _models import training_model

from mmrl.data.collate import collate_prompts
from mmrl.data.config import DataConfig
from mmrl.data.dataset import PromptDataset
from mmrl.data.processing import attach_media, load_tokenizer_and_processor
from mmrl.demo.ranks import run_on_ranks
from mmrl.demo.tiny import MAX_PIXELS, MIN_PIXELS
from mmrl.models.loading import load_model
from mmrl.workers.rollout import SamplingParams
from mmrl.workers.rollout.hf import HFRollout
from mmrl.workers.weight_push import WeightPushGroup, manifest_bytes, push_from_rank
from mmrl.workers.weight_sync import full_state_manifest, iter_full_state_dict

CPU = torch.device("cpu")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _push(sender: torch.nn.Module, receiver: HFRollout, dtype: torch.dtype | None) -> int:
    """Push ``sender``'s weights (cast to ``dtype``) into ``receiver``; returns the bytes sent."""
    port, sent, errors = _free_port(), [], []
    manifest = full_state_manifest(sender, dtype=dtype, checkpoint_format=True)

    def member(rank: int) -> None:
        try:
            group = WeightPushGroup("127.0.0.1", port, rank, 2, CPU, timeout_s=60)
            if rank == 0:
                tensors = iter_full_state_dict(sender, dtype=dtype, checkpoint_format=True)
                sent.append(group.send(tensors, manifest))
            else:
                receiver.update_weights(group.receive(manifest))
        except Exception as error:  # raised in the test's thread below
            errors.append(error)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert sent[0] == manifest_bytes(manifest)
    return sent[0]


def _state_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of every parameter and persistent buffer (tied ones once), floats counted in ``dtype``."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        size = torch.empty((), dtype=dtype).element_size() if dtype and tensor.is_floating_point() else None
        total += tensor.numel() * (size or tensor.element_size())
    return total


def _trained(path) -> torch.nn.Module:
    """The tiny model with every weight moved, as an actor's are after updates."""
    return _moved(load_model(str(path)))


def _moved(model: torch.nn.Module) -> torch.nn.Module:
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model


@pytest.fixture(scope="module")
def prompts(tiny_vl_path, shapes_data_dir):
    tokenizer, processor = load_tokenizer_and_processor(str(tiny_vl_path))
    dataset = PromptDataset(
        str(shapes_data_dir / "train.jsonl"),
        tokenizer,
        processor,
        DataConfig(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
    )
    return tokenizer, attach_media(
        collate_prompts([dataset[i] for i in range(3)], tokenizer.pad_token_id), dataset.media
    )


def test_a_rollout_engine_given_pushed_weights_samples_as_the_trainers_weights(tiny_vl_path, prompts):
    # the receiver starts from the model's files (as a rollout worker does); the sender holds weights
    # trained away from them: after the push the receiver's greedy responses and their log-probs are the
    # trainer's weights' own, and before it they were not
    tokenizer, batch = prompts
    trainer_model = _trained(tiny_vl_path)
    reference = HFRollout(_trained(tiny_vl_path), tokenizer, return_log_probs=True, prepack=False)
    receiver = HFRollout(load_model(str(tiny_vl_path)), tokenizer, return_log_probs=True, prepack=False)
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=6)
    expected = reference.generate(batch, greedy).batch
    before = receiver.generate(batch, greedy).batch
    assert not torch.allclose(before["rollout_log_probs"], expected["rollout_log_probs"])

    sent = _push(trainer_model, receiver, dtype=None)

    after = receiver.generate(batch, greedy).batch
    assert torch.equal(after["responses"], expected["responses"])
    torch.testing.assert_close(after["rollout_log_probs"], expected["rollout_log_probs"], rtol=0, atol=1e-6)
    assert sent == _state_bytes(trainer_model)  # every parameter and buffer once, tied ones once


def test_a_bf16_push_casts_before_sending_and_sends_half_the_bytes(tiny_vl_path):
    # fp32 masters, a bf16 engine: the tensors travel as bf16 (half of the floats' bytes) and arrive
    # as the masters rounded to bf16
    trainer_model = _trained(tiny_vl_path)
    tokenizer, _ = load_tokenizer_and_processor(str(tiny_vl_path))
    receiver = HFRollout(load_model(str(tiny_vl_path), torch_dtype=torch.bfloat16), tokenizer, prepack=False)

    sent = _push(trainer_model, receiver, dtype=torch.bfloat16)

    assert sent == _state_bytes(trainer_model, torch.bfloat16) < _state_bytes(trainer_model)
    received = receiver.model.state_dict()
    for name, tensor in trainer_model.state_dict().items():
        assert torch.equal(received[name], tensor.to(received[name].dtype)), name


# ---------------------------------------------------------------- 2 training ranks, rank 0 sends

PUSH_DTYPES = (None, torch.bfloat16)  # fp32 as the masters, then a bf16 engine's push


def _training_ranks_push(rank: int, world_size: int, model_path: str, port: int) -> dict:
    """A training rank of HybridWorker.push_rollout_weights: the moved tiny model sharded over the
    ranks (FSDP2), each push gathered by every rank in step, broadcast by rank 0 alone."""
    from torch.distributed.device_mesh import init_device_mesh

    from mmrl.workers.fsdp_engine import apply_fsdp2

    mesh = init_device_mesh("cpu", (world_size,))
    model = apply_fsdp2(_moved(training_model(model_path)), mesh, torch.float32, torch.float32)
    # rank 0 alone joins the push group (HybridWorker.join_weight_push); its members: rank 0, 1 receiver
    group = WeightPushGroup("127.0.0.1", port, 0, 2, CPU, timeout_s=60) if rank == 0 else None
    results: dict = {"sent": [], "manifests": []}
    for dtype in PUSH_DTYPES:
        manifest = full_state_manifest(model, dtype=dtype, checkpoint_format=True)
        tensors = iter_full_state_dict(model, dtype=dtype, checkpoint_format=True)
        results["sent"].append(push_from_rank(tensors, group, manifest))
        results["manifests"].append(manifest)
    return results


@pytest.mark.distributed
def test_two_training_ranks_push_the_full_model_through_rank_0(tiny_vl_path, prompts):
    # the receiver (a rollout worker's engine, from the model's files) gets one push per dtype while both
    # ranks gather: every tensor is the full (unsharded) moved model's, the greedy responses and their
    # log-probs are its, and rank 0 sent the model's bytes (rank 1 none)
    tokenizer, batch = prompts
    trainer_model = _trained(tiny_vl_path)
    receivers = {
        dtype: HFRollout(
            load_model(str(tiny_vl_path), torch_dtype=dtype or torch.float32),
            tokenizer,
            return_log_probs=True,
            prepack=False,
        )
        for dtype in PUSH_DTYPES
    }
    port, errors = _free_port(), []

    def receive() -> None:
        try:
            group = WeightPushGroup("127.0.0.1", port, 1, 2, CPU, timeout_s=60)
            for dtype, receiver in receivers.items():
                # the manifest rank 0 reads from its shards, here from the unsharded model
                manifest = full_state_manifest(trainer_model, dtype=dtype, checkpoint_format=True)
                receiver.update_weights(group.receive(manifest))
        except Exception as error:  # raised in the test's thread below
            errors.append(error)

    receiving = threading.Thread(target=receive)
    receiving.start()
    ranks = run_on_ranks(_training_ranks_push, 2, str(tiny_vl_path), port, timeout_s=120)
    receiving.join(timeout=60)
    assert not receiving.is_alive() and not errors, errors

    # both ranks walk the same manifest (what rank 0 sends, what the receivers allocate)
    for dtype, rank0, rank1 in zip(PUSH_DTYPES, ranks[0]["manifests"], ranks[1]["manifests"], strict=True):
        assert rank0 == rank1 == full_state_manifest(trainer_model, dtype=dtype, checkpoint_format=True)
    assert ranks[0]["sent"] == [_state_bytes(trainer_model), _state_bytes(trainer_model, torch.bfloat16)]
    assert ranks[1]["sent"] == [0, 0]
    for dtype, receiver in receivers.items():
        received = receiver.model.state_dict()
        assert received.keys() == trainer_model.state_dict().keys()
        for name, tensor in trainer_model.state_dict().items():
            assert torch.equal(received[name], tensor.to(dtype or tensor.dtype)), (dtype, name)

    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=6)
    reference = HFRollout(trainer_model, tokenizer, return_log_probs=True, prepack=False)
    expected = reference.generate(batch, greedy).batch
    after = receivers[None].generate(batch, greedy).batch
    assert torch.equal(after["responses"], expected["responses"])
    torch.testing.assert_close(after["rollout_log_probs"], expected["rollout_log_probs"], rtol=0, atol=0)


# ---------------------------------------------------------------- a member that dies or hangs mid-push

MEMBER = """
import os, sys, time, torch
from mmrl.workers.weight_push import WeightPushGroup

port, rank, stop_after, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
print("imported", flush=True)
group = WeightPushGroup("127.0.0.1", port, rank, 2, torch.device("cpu"), timeout_s=60)
manifest = [(f"t{i}", (64, 1024), torch.float32) for i in range(8)]
if rank == 0:  # sends stop_after tensors
    group.send(((name, torch.ones(shape)) for name, shape, _ in manifest[:stop_after]), manifest[:stop_after])
else:
    for _ in zip(range(stop_after), group.receive(manifest)):
        pass
if mode == "exit":
    os._exit(1)  # dies: the OS closes its sockets
time.sleep(600)  # hung: alive, taking no part
"""
MANIFEST = [(f"t{i}", (64, 1024), torch.float32) for i in range(8)]


@pytest.mark.parametrize(
    ("other_rank", "mode", "timeout_s", "expected"),
    [
        (1, "exit", 60, "tensor 4 of 8 (t3) failed after .* sending to the rollout workers 0 "),
        (1, "hang", 3, r"tensor 4 of 8 \(t3\) failed after \d+\.\d s sending to the rollout workers 0 "),
        (0, "exit", 60, "tensor 4 of 8 (t3) failed after .* receiving from training rank 0"),
    ],
    ids=["rollout worker dies", "rollout worker hangs", "training rank 0 dies"],
)
def test_a_member_that_dies_or_hangs_fails_the_push_with_a_message_naming_it(
    other_rank, mode, timeout_s, expected
):
    # the other member (a process of its own) takes part in 3 tensors, then exits (its sockets close: the
    # push fails at once, not after the timeout) or stays alive taking no part (the push fails when
    # worker.rollout.push_timeout_s runs out); the error names the tensor and whom it waited for
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    import mmrl

    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(mmrl.__file__).parents[1])}
    command = [sys.executable, "-c", MEMBER, str(port), str(other_rank), "3", mode]
    member = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert member.stdout.readline() == "imported\n"  # the group's set-up counts in its timeout too
        group = WeightPushGroup("127.0.0.1", port, 1 - other_rank, 2, CPU, timeout_s=timeout_s)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=expected.replace("(t3)", r"\(t3\)")) as failure:
            if other_rank == 1:
                group.send(((name, torch.ones(shape)) for name, shape, _ in MANIFEST), MANIFEST)
            else:
                list(group.receive(MANIFEST))
        elapsed = time.monotonic() - started
    finally:
        member.kill()
        member.wait()
    assert "worker.rollout.push_timeout_s=" in str(failure.value)
    assert elapsed < (timeout_s + 10 if mode == "hang" else 10)
    assert mode != "hang" or elapsed >= timeout_s  # it waited out push_timeout_s for the hung member
