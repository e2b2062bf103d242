"""Checkpoint layout (atomic commit, tracker, pruning, find-last) and worker training state (DCP).

The distributed test trains the tiny Qwen2.5-VL under FSDP2 on 2 gloo ranks, saves, and checks:
the same 2 ranks resume to the same RNG draws and the same next step, and a single process without
``torch.distributed`` loads the 2-rank checkpoint (resharding) to the same full weights, optimizer
state and next optimizer step. The Qwen3.5 MoE (fused 3-D experts, linear attention) resumes on one
rank alike.
"""

from __future__ import annotations

import copy
import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from mmrl.checkpoint import (
    CheckpointLayout,
    find_last_checkpoint,
    load_train_state,
    load_trainer_state,
    save_train_state,
    save_trainer_state,
)

WORLD_SIZE = 2
LEARNING_RATE = 1e-2
SCHEDULER_GAMMA = 0.5  # StepLR: the lr halves after every step


# ---------------------------------------------------------------- driver-side layout and tracker


def _write_parts(tmp_dir: Path, step: int) -> None:
    """A real (tiny) actor role folder and a trainer state, as the trainer writes them."""
    save_train_state(tmp_dir / "actor", nn.Linear(2, 2))
    save_trainer_state(tmp_dir, {"global_step": step, "epoch": 0, "dataloader": {"position": step * 4}})


def _save(layout: CheckpointLayout, step: int, metric: float | None = None, **kwargs) -> Path:
    tmp_dir = layout.begin(step)
    _write_parts(tmp_dir, step)
    return layout.commit(
        step, metric=metric, metric_name="val/accuracy" if metric is not None else None, **kwargs
    )


def test_commit_publishes_folder_and_tracker(tmp_path):
    layout = CheckpointLayout(tmp_path)
    tmp_dir = layout.begin(3)
    assert tmp_dir == tmp_path / "global_step_3.tmp" and tmp_dir.is_dir()
    _write_parts(tmp_dir, 3)
    step_dir = layout.commit(
        3, parts=("actor", "trainer_state.json"), metric=0.25, metric_name="val/accuracy"
    )

    assert step_dir == tmp_path / "global_step_3" and not tmp_dir.exists()
    assert sorted(path.name for path in step_dir.iterdir()) == ["actor", "trainer_state.json"]
    assert json.loads((tmp_path / "checkpoint_tracker.json").read_text()) == {
        "latest_step": 3,
        "best_step": 3,
        "best_metric": 0.25,
        "metric_name": "val/accuracy",
        "higher_is_better": True,
    }
    assert load_trainer_state(step_dir) == {"global_step": 3, "epoch": 0, "dataloader": {"position": 12}}
    assert layout.latest_step() == 3 and find_last_checkpoint(tmp_path) == step_dir


def test_crash_between_begin_and_commit_changes_nothing(tmp_path):
    layout = CheckpointLayout(tmp_path)
    _save(layout, 1, metric=0.5)
    tracker_before = (tmp_path / "checkpoint_tracker.json").read_bytes()

    with pytest.raises(RuntimeError, match="worker died"):
        tmp_dir = layout.begin(2)
        save_trainer_state(tmp_dir, {"global_step": 2})
        raise RuntimeError("worker died during the save")
    assert not (tmp_path / "global_step_2").exists() and (tmp_path / "global_step_2.tmp").is_dir()
    assert (tmp_path / "checkpoint_tracker.json").read_bytes() == tracker_before
    assert layout.latest_step() == 1 and find_last_checkpoint(tmp_path) == tmp_path / "global_step_1"

    # Committing the incomplete folder is refused with the missing part named.
    with pytest.raises(FileNotFoundError, match="actor is missing"):
        layout.commit(2)
    assert (tmp_path / "checkpoint_tracker.json").read_bytes() == tracker_before

    # The next save removes the stale .tmp folder.
    _save(layout, 3)
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "checkpoint_tracker.json",
        "global_step_1",
        "global_step_3",
    ]


def test_commit_refuses_a_role_folder_with_missing_rank_files(tmp_path):
    layout = CheckpointLayout(tmp_path)
    tmp_dir = layout.begin(1)
    _write_parts(tmp_dir, 1)
    (tmp_dir / "actor" / "extra_state_rank0.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"actor/extra_state_rank0\.pt is missing"):
        layout.commit(1)
    assert layout.latest_step() is None


def test_commit_judges_role_folders_from_the_ranks_reports(tmp_path):
    """With reports the driver never lists a role folder: it trusts what the ranks say they wrote, and
    refuses ranks that did not see its save id (a folder on a disk of their own machine)."""
    from mmrl.checkpoint.tracker import read_save_id

    layout = CheckpointLayout(tmp_path)
    tmp_dir = layout.begin(1)
    report = save_train_state(tmp_dir / "actor", nn.Linear(2, 2))
    save_trainer_state(tmp_dir, {"global_step": 1})
    assert report == {
        "rank": 0,
        "world_size": 1,
        "files": {
            name: (tmp_dir / "actor" / name).stat().st_size
            for name in ("model/__0_0.distcp", "extra_state_rank0.pt", "model/.metadata", "mmrl_state.json")
        },
        "required": ["extra_state_rank0.pt", "mmrl_state.json", "model/.metadata", "model/__0_0.distcp"],
    }

    stranger = {**report, "save_id": None}  # what a rank on a machine without the folder reads
    with pytest.raises(FileNotFoundError, match=r"ranks \[0\] wrote actor .*trainer\.save_checkpoint_path"):
        layout.commit(1, reports={"actor": [stranger]})
    unwritten = {**report, "save_id": read_save_id(tmp_dir), "files": {}}
    with pytest.raises(FileNotFoundError, match=r"actor: extra_state_rank0\.pt is missing"):
        layout.commit(1, reports={"actor": [unwritten]})

    # the driver's own view of the folder plays no part: a file it cannot see does not stop the commit
    (tmp_dir / "actor" / "extra_state_rank0.pt").unlink()
    step_dir = layout.commit(1, reports={"actor": [{**report, "save_id": read_save_id(tmp_dir)}]})
    assert sorted(path.name for path in step_dir.iterdir()) == ["actor", "trainer_state.json"]


def test_prune_keeps_newest_and_best(tmp_path):
    layout = CheckpointLayout(tmp_path, save_limit=2)
    for step, accuracy in zip([1, 2, 3, 4, 5], [0.1, 0.9, 0.3, 0.2, 0.4]):
        _save(layout, step, metric=accuracy)
    # Newest two (4, 5) plus the best (2, accuracy 0.9); 1 and 3 pruned.
    assert layout.complete_steps() == [2, 4, 5]
    tracker = layout.read_tracker()
    assert (tracker["latest_step"], tracker["best_step"], tracker["best_metric"]) == (5, 2, 0.9)


def test_prune_lower_is_better_and_unlimited(tmp_path):
    layout = CheckpointLayout(tmp_path / "loss", save_limit=1)
    for step, loss in zip([1, 2, 3], [0.7, 0.2, 0.5]):
        _save(layout, step, metric=loss, higher_is_better=False)
    assert layout.complete_steps() == [2, 3] and layout.best_step() == 2

    unlimited = CheckpointLayout(tmp_path / "all", save_limit=-1)
    for step in range(1, 4):
        _save(unlimited, step)
    assert unlimited.complete_steps() == [1, 2, 3] and unlimited.best_step() is None


def test_same_step_saved_again_replaces_the_folder(tmp_path):
    layout = CheckpointLayout(tmp_path)
    _save(layout, 4)
    tmp_dir = layout.begin(4)
    _write_parts(tmp_dir, 4)
    save_trainer_state(tmp_dir, {"global_step": 4, "epoch": 1})
    layout.commit(4)
    assert load_trainer_state(tmp_path / "global_step_4") == {"global_step": 4, "epoch": 1}
    assert sorted(path.name for path in tmp_path.iterdir()) == ["checkpoint_tracker.json", "global_step_4"]

    # A crash after the old folder was set aside and before the new one took its name: the old
    # complete folder comes back.
    (tmp_path / "global_step_4").rename(tmp_path / "global_step_4.replaced")
    assert layout.latest_step() == 4
    assert load_trainer_state(tmp_path / "global_step_4") == {"global_step": 4, "epoch": 1}


def test_latest_step_falls_back_to_folders(tmp_path):
    layout = CheckpointLayout(tmp_path)
    assert layout.latest_step() is None and find_last_checkpoint(tmp_path / "never_created") is None
    for step in (2, 5):
        _save(layout, step)
    (tmp_path / "global_step_9.tmp").mkdir()  # an interrupted save is never "latest"

    (tmp_path / "checkpoint_tracker.json").unlink()
    assert layout.latest_step() == 5

    # Stale tracker: its latest folder was deleted by hand.
    _save(layout, 7)
    (tmp_path / "global_step_7").rename(tmp_path / "deleted")
    assert layout.read_tracker()["latest_step"] == 7
    assert layout.latest_step() == 5

    # Corrupt tracker (e.g. a disk filled up by another writer).
    (tmp_path / "checkpoint_tracker.json").write_text("{not json")
    assert layout.latest_step() == 5 and layout.read_tracker() is None


def test_trainer_state_must_be_json(tmp_path):
    with pytest.raises(TypeError, match=r"JSON-serialisable.*\.item\(\)"):
        save_trainer_state(tmp_path, {"kl_coef": torch.tensor(0.1)})


# ---------------------------------------------------------------- worker-side state, distributed


def _text_batch() -> torch.Tensor:
    # Ids below 400 are ordinary BPE tokens (the special and image tokens sit at the end of the vocab).
    return torch.randint(0, 400, (2, 16), generator=torch.Generator().manual_seed(0))  # [B, L]


def _build(model_path: str, shard: bool):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype=torch.float32)
    if shard:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.language_model.layers:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=SCHEDULER_GAMMA)
    return model, optimizer, scheduler


def _train_step(model, optimizer, scheduler, input_ids: torch.Tensor) -> None:
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _draw_random() -> dict:
    return {"torch": torch.rand(4), "python": random.random(), "numpy": np.random.rand(2)}


def _full_state(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {
        "model": get_model_state_dict(model, options=options),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
    }
    # A copy: replicated tensors (Adam's scalar ``step``) come back as the live, in-place-updated ones.
    return copy.deepcopy(state)


def _fsdp_rank(rank: int, world_size: int, model_path: str, checkpoint_dir: str, out_dir: str) -> None:
    """One rank (of mmrl.demo.ranks.run_on_ranks): step, save, note the uninterrupted run's next
    draws and step; then resume a fresh model from the checkpoint after clobbering the RNGs and note its
    draws and step."""
    _seed_everything(100 + rank)  # different streams per rank, as in training
    out = Path(out_dir)

    model, optimizer, scheduler = _build(model_path, shard=True)
    _train_step(model, optimizer, scheduler, _text_batch())
    report = save_train_state(
        checkpoint_dir, model, optimizer, scheduler, model_path, extra={"dataloader": {"position": 8}}
    )
    (out / f"report_rank{rank}.json").write_text(json.dumps(report))
    uninterrupted = _draw_random()
    saved_state = _full_state(model, optimizer)
    _train_step(model, optimizer, scheduler, _text_batch().flip(0))
    after_next_step = _full_state(model, optimizer)["model"]

    _seed_everything(999)
    model, optimizer, scheduler = _build(model_path, shard=True)
    extra = load_train_state(checkpoint_dir, model, optimizer, scheduler)
    resumed = _draw_random()
    resumed_state = _full_state(model, optimizer)
    resumed_lr = scheduler.get_last_lr()
    _train_step(model, optimizer, scheduler, _text_batch().flip(0))
    resumed_after_next_step = _full_state(model, optimizer)["model"]

    torch.save({"uninterrupted": uninterrupted, "resumed": resumed}, out / f"random_rank{rank}.pt")
    if rank == 0:
        results = {
            "saved_state": saved_state,
            "after_next_step": after_next_step,
            "resumed_state": resumed_state,
            "resumed_after_next_step": resumed_after_next_step,
            "resumed_lr": resumed_lr,
            "extra": extra,
        }
        torch.save(results, out / "results.pt")


@pytest.fixture(scope="module")
def fsdp_run(tiny_vl_path, tmp_path_factory):
    from mmrl.demo.ranks import run_on_ranks

    root = tmp_path_factory.mktemp("fsdp_checkpoint")
    checkpoint_dir, out_dir = root / "global_step_1.tmp" / "actor", root / "out"
    out_dir.mkdir()
    run_on_ranks(_fsdp_rank, WORLD_SIZE, str(tiny_vl_path), str(checkpoint_dir), str(out_dir), timeout_s=300)
    results = torch.load(out_dir / "results.pt", weights_only=False)
    random_draws = [
        torch.load(out_dir / f"random_rank{rank}.pt", weights_only=False) for rank in range(WORLD_SIZE)
    ]
    return checkpoint_dir, results, random_draws


def _assert_optimizer_states_equal(actual: dict, expected: dict) -> None:
    assert actual["state"].keys() == expected["state"].keys()
    for fqn, state in expected["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(actual["state"][fqn][name], value, rtol=0, atol=0, msg=f"{fqn}.{name}")
    assert [group["lr"] for group in actual["param_groups"]] == [
        group["lr"] for group in expected["param_groups"]
    ]


def _assert_weights_equal(actual: dict, expected: dict, atol: float = 0.0) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0, atol=atol, msg=key)


@pytest.mark.distributed
def test_fsdp2_ranks_report_what_they_wrote(fsdp_run):
    """Each rank reports its own shard and RNG file (rank 0 also the indexes and state info) with their
    sizes; both derive the same list of needed files from DCP's index; one report alone is not enough."""
    from mmrl.checkpoint.state import missing_from_reports

    checkpoint_dir = fsdp_run[0]
    reports = [
        json.loads((checkpoint_dir.parents[1] / "out" / f"report_rank{rank}.json").read_text())
        for rank in range(WORLD_SIZE)
    ]
    own = {rank: [f"{kind}/__{rank}_0.distcp" for kind in ("model", "optimizer")] for rank in (0, 1)}
    assert sorted(reports[1]["files"]) == sorted([*own[1], "extra_state_rank1.pt"])
    assert sorted(reports[0]["files"]) == sorted(
        [*own[0], "extra_state_rank0.pt", "model/.metadata", "optimizer/.metadata", "extra.pt"]
        + ["mmrl_state.json"]
    )
    for report in reports:
        for name, size in report["files"].items():
            assert size == (checkpoint_dir / name).stat().st_size > 0, name
    assert reports[0]["required"] == reports[1]["required"]
    assert set(reports[0]["required"]) == set().union(*(report["files"] for report in reports))
    assert missing_from_reports(reports) == []
    assert missing_from_reports(reports[:1]) == [
        "rank 1's report",
        *sorted([*own[1], "extra_state_rank1.pt"]),
    ]


@pytest.mark.distributed
def test_fsdp2_resume_on_same_world_size_restores_everything(fsdp_run):
    checkpoint_dir, results, random_draws = fsdp_run
    # Files of the role folder: DCP shards of both ranks, one RNG file per rank, copied HF files.
    assert sorted(path.name for path in (checkpoint_dir / "model").iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    assert (checkpoint_dir / "extra_state_rank1.pt").is_file()
    assert {"config.json", "tokenizer.json", "processor_config.json"} <= {
        path.name for path in (checkpoint_dir / "huggingface").iterdir()
    }

    _assert_weights_equal(results["resumed_state"]["model"], results["saved_state"]["model"])
    _assert_optimizer_states_equal(results["resumed_state"]["optimizer"], results["saved_state"]["optimizer"])
    assert results["resumed_lr"] == [LEARNING_RATE * SCHEDULER_GAMMA]
    assert results["extra"] == {"dataloader": {"position": 8}}
    for rank, draws in enumerate(random_draws):
        torch.testing.assert_close(draws["resumed"]["torch"], draws["uninterrupted"]["torch"], rtol=0, atol=0)
        assert draws["resumed"]["python"] == draws["uninterrupted"]["python"], rank
        np.testing.assert_array_equal(draws["resumed"]["numpy"], draws["uninterrupted"]["numpy"])
    # Each rank restored its own stream, not rank 0's.
    assert not torch.equal(random_draws[0]["resumed"]["torch"], random_draws[1]["resumed"]["torch"])
    # Resumed and uninterrupted runs take the same next step.
    _assert_weights_equal(results["resumed_after_next_step"], results["after_next_step"])


@pytest.mark.distributed
def test_fsdp2_two_rank_checkpoint_loads_in_one_process(fsdp_run, tiny_vl_path, caplog):
    checkpoint_dir, results, _ = fsdp_run
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model, optimizer, scheduler = _build(str(tiny_vl_path), shard=False)
    torch.manual_seed(5)
    expected_draw = torch.rand(3)
    torch.manual_seed(5)
    with caplog.at_level(logging.WARNING, logger="mmrl.checkpoint.state"):
        extra = load_train_state(checkpoint_dir, model, optimizer, scheduler)
    assert "saved by 2 ranks and is loaded by 1" in caplog.text
    # A different world size leaves the RNGs alone.
    torch.testing.assert_close(torch.rand(3), expected_draw, rtol=0, atol=0)
    assert extra == {"dataloader": {"position": 8}}

    _assert_weights_equal(model.state_dict(), results["saved_state"]["model"])
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    optimizer_state = get_optimizer_state_dict(model, optimizer)
    _assert_optimizer_states_equal(optimizer_state, results["saved_state"]["optimizer"])
    # The text-only step gave the vision tower no gradient, hence no optimizer state; it must stay so.
    assert not any(fqn.startswith("model.visual.") for fqn in optimizer_state["state"])
    assert len(optimizer_state["state"]) > 0
    assert scheduler.get_last_lr() == [LEARNING_RATE * SCHEDULER_GAMMA]

    _train_step(model, optimizer, scheduler, _text_batch().flip(0))
    # FSDP averages identical per-rank gradients; the step matches up to thread-count rounding.
    _assert_weights_equal(model.state_dict(), results["after_next_step"], atol=1e-6)


@pytest.mark.distributed
@pytest.mark.parametrize("fixture", ["tiny_qwen3_5_path", "tiny_qwen3_5_moe_path"])
def test_fsdp2_resume_of_a_qwen3_5_restores_its_linear_attention_and_experts(request, fixture, tmp_path):
    """Qwen3.5, dense and MoE, under FSDP2 (one rank; their trainer runs do not resume): the gated delta
    nets (and the MoE's fused 3-D experts and routers) come back with their Adam state, and the resumed
    model takes the uninterrupted one's next step."""
    from mmrl.demo.ranks import run_on_ranks

    path = request.getfixturevalue(fixture)
    checkpoint_dir, out_dir = tmp_path / "global_step_1.tmp" / "actor", tmp_path / "out"
    out_dir.mkdir()
    run_on_ranks(_fsdp_rank, 1, str(path), str(checkpoint_dir), str(out_dir), timeout_s=300)
    results = torch.load(out_dir / "results.pt", weights_only=False)
    saved = results["saved_state"]
    layer = "model.language_model.layers.0"
    trained = ["linear_attn.A_log", "linear_attn.conv1d.weight"]
    if "moe" in fixture:
        assert saved["model"][f"{layer}.mlp.experts.gate_up_proj"].dim() == 3
        trained += ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
    for name in trained:
        assert f"{layer}.{name}" in saved["optimizer"]["state"], name  # trained by the saved step
    _assert_weights_equal(results["resumed_state"]["model"], saved["model"])
    _assert_optimizer_states_equal(results["resumed_state"]["optimizer"], saved["optimizer"])
    _assert_weights_equal(results["resumed_after_next_step"], results["after_next_step"])


def test_single_process_save_and_load_without_process_group(tmp_path):
    """World size 1 without torch.distributed: a plain model round-trips, RNG restored."""
    _seed_everything(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    save_train_state(tmp_path / "actor", model, optimizer)
    expected = torch.rand(2)

    _seed_everything(1)
    restored = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=0.1)
    assert load_train_state(tmp_path / "actor", restored, restored_optimizer) == {}
    torch.testing.assert_close(torch.rand(2), expected, rtol=0, atol=0)
    _assert_weights_equal(restored.state_dict(), model.state_dict())
    for saved, loaded in zip(optimizer.state.values(), restored_optimizer.state.values()):
        _assert_weights_equal(loaded, saved)
    assert not (tmp_path / "actor" / "huggingface").exists()  # no hf_source_dir, nothing to copy


def test_a_load_keeps_the_peak_learning_rate_the_optimizer_was_built_with(tmp_path):
    """A stage of a multi-stage schedule that changes worker.actor.optim.lr: the moments and the
    scheduler's step come from the checkpoint, the peak rate from the new config. Cosine over 10 steps,
    saved after 4 steps at peak 1e-3: resumed at peak 5e-4, the rate is 5e-4 * factor(4) with
    factor(4) = (1 + cos(0.4 pi)) / 2 = 0.6545085; a plain resume (same peak) gets the saved rate."""
    from mmrl.workers.fsdp_engine import build_lr_scheduler

    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = build_lr_scheduler(optimizer, 10, 0, "cosine")
    for _ in range(4):
        model(torch.randn(2, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
    save_train_state(tmp_path / "actor", model, optimizer, scheduler)
    for peak in (5e-4, 1e-3):
        restored = nn.Linear(3, 2)
        restored_optimizer = torch.optim.AdamW(restored.parameters(), lr=peak)
        restored_scheduler = build_lr_scheduler(restored_optimizer, 10, 0, "cosine")
        load_train_state(tmp_path / "actor", restored, restored_optimizer, restored_scheduler)
        assert restored_scheduler.last_epoch == 4
        assert restored_optimizer.param_groups[0]["lr"] == pytest.approx(peak * 0.6545085)
        restored_scheduler.step()  # factor(5) = 0.5
        assert restored_optimizer.param_groups[0]["lr"] == pytest.approx(peak * 0.5)
        for saved, loaded in zip(optimizer.state.values(), restored_optimizer.state.values()):
            _assert_weights_equal(loaded, saved)
