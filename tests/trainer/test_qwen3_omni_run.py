"""A Qwen3-Omni run of the trainer on both rollout backends: one FSDP2 worker, every prompt an image
and a sound (the beeps task's clips beside the colour task's images), the routers' load-balancing loss
in the update; 4 steps in two stages of one command: steps 1-2 on the transformers
rollout, which records its routing for the actor to replay (saved), then the run resumed for steps 3-4
on the vLLM rollout (the fused experts pushed as the files' per-expert tensors and packed again for vLLM's
CPU kernel). Every test here reads that run: parity and router metrics from its metrics, the resume,
and the merge of its last checkpoint."""

from __future__ import annotations

import json
import math
import sys

import _warm_start as warm
import pytest
import torch
from _trainer_run import REPO_ROOT, small_run_overrides, train_on_both_backends

pytestmark = [pytest.mark.slow(seconds=150), pytest.mark.distributed, pytest.mark.shares("vllm")]

LR = 0.02  # small_run_overrides' worker.actor.optim.lr; one Adam update per step (one mini-batch)


def _image_and_audio_rows(shapes_data_dir, audio_dir) -> str:
    """A jsonl of the beeps task's rows, each with a colour-task image before its clip."""
    images = [
        json.loads(line)["images"][0] for line in (shapes_data_dir / "train.jsonl").read_text().splitlines()
    ]
    rows = []
    for index, line in enumerate((audio_dir / "train.jsonl").read_text().splitlines()):
        row = json.loads(line)
        row["problem"] = "<image>" + row["problem"]
        row["images"] = [str(shapes_data_dir / images[index])]
        row["audios"] = [str(audio_dir / row["audios"][0])]
        rows.append(json.dumps(row))
    path = audio_dir / "image_and_audio.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def omni_run(tiny_qwen3_omni_path, shapes_data_dir, tmp_path_factory) -> dict:
    from mmrl.demo.synthetic import generate_shapes_dataset

    root = tmp_path_factory.mktemp("qwen3-omni")
    audio_dir = generate_shapes_dataset("audio_beeps", root / "beeps", n_train=8, n_val=1, seed=0)
    save_dir = root / "run"
    overrides = small_run_overrides(tiny_qwen3_omni_path, shapes_data_dir, save_dir) + [
        f"data.train_files={_image_and_audio_rows(shapes_data_dir, audio_dir)}",
        "data.max_prompt_length=160",
        "worker.actor.moe.aux_loss_coef=0.01",
        "worker.actor.share_prompts=false",
        "trainer.n_gpus_per_node=1",
        "trainer.val_before_train=false",
        "trainer.val_freq=-1",
    ]
    # steps 1-2: the rollout's experts cross to the actor and are replayed (the transformers rollout
    # records them), saved; steps 3-4 resumed on vLLM (the second stage)
    replayed = ("worker.actor.moe.routing_replay=true",)
    return {"save_dir": save_dir, "steps": train_on_both_backends(overrides, save_dir, transformers=replayed)}


@pytest.mark.timeout(600)
def test_each_backend_trains_two_steps_with_parity_router_loss_and_metrics(omni_run):
    assert [row["step"] for row in omni_run["steps"]] == [1, 2, 3, 4]  # the resumed stage: 3-4 only
    for row in omni_run["steps"]:
        # steps 1-2 by the transformers rollout (routing replayed), 3-4 by vLLM after weight pushes; each
        # scores its tokens as the trainer does (fp32: the order of sums)
        assert row["rollout/log_prob_gap_max"] < 1e-4, row["step"]
        assert 1.0 <= row["actor/moe_aux_loss"] <= 2.0  # 1 balanced, E / k = 2 all on two experts
        assert 0.25 <= row["actor/moe_max_expert_share"] <= 0.5  # 1 / E to 1 / k
        assert 0 < row["actor/moe_router_entropy"] < math.log(4)
        assert row["actor/grad_norm"] > 0


def _state(path) -> dict[str, torch.Tensor]:
    from transformers import Qwen3OmniMoeForConditionalGeneration

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.mark.timeout(600)
def test_the_resumed_step_starts_from_the_saved_one_and_merges_into_weights_that_load_back(
    omni_run, tiny_qwen3_omni_path, tmp_path
):
    merged_dir = tmp_path / "merged"
    actor_dir = omni_run["save_dir"] / "global_step_4" / "actor"
    merger = [
        sys.executable,
        "scripts/model_merger.py",
        "--local_dir",
        str(actor_dir),
        "--target_dir",
        str(merged_dir),
    ]
    warm.run(merger, cwd=REPO_ROOT, check=True, capture_output=True, timeout=120)
    merged, base = _state(merged_dir), _state(tiny_qwen3_omni_path)  # the full Omni class, thinker.* inside
    assert merged.keys() == base.keys()
    for name in (
        "thinker.model.layers.0.mlp.experts.gate_up_proj",
        "thinker.model.layers.1.mlp.experts.down_proj",
        "thinker.model.layers.0.self_attn.q_proj.weight",
        "thinker.audio_tower.layers.0.fc1.weight",
        "thinker.visual.blocks.0.attn.qkv.weight",
        "thinker.lm_head.weight",
    ):
        # An Adam update moves an entry by at most about lr, so steps 3-4 started from the base would
        # leave every entry within ~2 lr of it; resumed from step 2's weights and Adam state, entries whose
        # gradient kept its sign moved four updates
        assert (merged[name] - base[name]).abs().max() > 2.5 * LR, name
    # the routers trained too (their gradient: the load-balancing loss and the experts' weights)
    router = "thinker.model.layers.0.mlp.gate.weight"
    assert not torch.equal(merged[router], base[router])
