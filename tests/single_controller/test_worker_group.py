"""RayWorkerGroup on a real local Ray cluster (CPU, gloo): the torchrun environment, collectives, dispatch of a
DataProto with padding, and failing fast when a rank raises or dies while its peer waits in a barrier."""

from __future__ import annotations

import gc
import os
import re
import sys
import time
from datetime import timedelta

import numpy as np
import pytest
import ray
import torch
import torch.distributed as dist
from _ray_clients import assert_refuses_other_tokens

from mmrl.config import TrainerConfig
from mmrl.dispatch import rows_per_data_parallel_share, rows_per_rank
from mmrl.protocol import DataProto
from mmrl.single_controller import (
    RayWorkerGroup,
    ResourcePool,
    ResourcePoolError,
    WorkerGroupError,
    alive_node_resources,
    distributed_env,
    init_ray,
    merge_dp_outputs,
    method_name,
    nodes_that_fit,
)
from mmrl.single_controller import worker_group as worker_group_module
from mmrl.trainer.placement import Placement, PlacementError, plan_placement

pytestmark = pytest.mark.distributed

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
FAST_S = 8.0  # a failure must surface within this, although the other rank blocks for up to 60 s
CPUS_PER_RANK = 0.5  # two ranks and the driver share the machine's two cores


class GlooWorker:
    """Joins a gloo process group from the environment in __init__, as a training worker does."""

    def __init__(self, scale: float) -> None:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        self.rank = dist.get_rank()
        self.scale = scale

    def environment(self) -> dict[str, str | None]:
        keys = (*ENV_KEYS, "TOKENIZERS_PARALLELISM", "MMRL_TEST_FLAG", "MMRL_CLUSTER_FLAG")
        return {key: os.environ.get(key) for key in keys}

    def runtime_env_vars(self) -> dict[str, str]:
        """The variables Ray's runtime environment set in this process."""
        return dict(ray.get_runtime_context().runtime_env.get("env_vars", {}))

    def pid(self) -> int:
        return os.getpid()

    def collector_heap(self) -> tuple[int, int]:
        """(objects frozen out of the collector's way, objects it still walks) in this process."""
        return gc.get_freeze_count(), len(gc.get_objects())

    def all_reduce_rank_plus_one(self) -> float:
        value = torch.tensor([self.rank + 1.0])
        dist.all_reduce(value)
        return value.item()

    def add(self, a: int, b: int = 0) -> int:
        return self.rank * 100 + a + b

    def raise_or_wait(self, failing_rank: int) -> str:
        if self.rank == failing_rank:
            raise ValueError(f"rank {self.rank} cannot read sample 3")
        dist.barrier()  # blocks until the failing rank arrives, which it never does
        return "passed"

    def exit_or_wait(self, failing_rank: int) -> str:
        if self.rank == failing_rank:
            os._exit(1)
        dist.barrier()
        return "passed"

    def exit_late_or_raise(self, failing_rank: int) -> str:
        """The failing rank dies 0.3 s from now; the others raise at once, as a collective does whose
        peer's connection drops (gloo may fail them before Ray has seen the death)."""
        if self.rank == failing_rank:
            time.sleep(0.3)
            os._exit(1)
        raise RuntimeError(f"rank {self.rank}: connection to a peer closed")


class DataWorker(GlooWorker):
    """Adds a dispatched method; kept apart so the failure tests' processes skip importing tensordict."""

    def scale_rows(self, data: DataProto) -> DataProto:
        """y = scale * x per row; tags each row with the rank that computed it."""
        return DataProto.from_dict(
            tensors={"y": data.batch["x"] * self.scale},
            non_tensors={"uid": data.non_tensor_batch["uid"], "rank": [self.rank] * len(data)},
            meta_info={"metrics": {"rows": len(data), "rank": [self.rank]}},
        )

    @rows_per_rank
    def scale_rows_per_rank(self, data: DataProto) -> DataProto:
        return self.scale_rows(data)

    @rows_per_data_parallel_share
    def scale_rows_per_share(self, data: DataProto) -> DataProto:
        return self.scale_rows(data)

    @rows_per_data_parallel_share(role="critic")
    def scale_rows_per_critic_share(self, data: DataProto) -> DataProto:
        return self.scale_rows(data)

    @rows_per_data_parallel_share(role="reward_model")
    def scale_rows_per_reward_model_share(self, data: DataProto) -> DataProto:
        return self.scale_rows(data)


class Sleeper:
    """Needs no torch, so its process starts in ~2 s (worker_group imports DataProto only where used)."""

    def pid(self) -> int:
        return os.getpid()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@pytest.fixture(scope="module")
def ray_cluster():
    # Worker processes cannot import this test module by name; ship its classes by value instead.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started_here = not ray.is_initialized()
    # 2 logical GPUs on this CPU machine: what the driver plans a GPU run from (no worker here uses them)
    init_ray(
        num_cpus=4,
        num_gpus=2,
        object_store_memory_bytes=150_000_000,
        runtime_env_vars={"MMRL_CLUSTER_FLAG": "2"},
    )
    assert ray.cluster_resources()["CPU"] == 4, "these tests expect the 4-CPU local cluster started here"
    yield
    if started_here:
        ray.shutdown()


def make_group(worker_cls: type, name_prefix: str, procs: int = 2, args=(10.0,), **kwargs) -> RayWorkerGroup:
    pool = ResourcePool(nnodes=1, procs_per_node=procs, use_gpu=False, cpus_per_proc=CPUS_PER_RANK)
    try:
        return RayWorkerGroup(worker_cls, pool, args=args, name_prefix=name_prefix, **kwargs)
    except BaseException:  # a group that failed to start holds no CPUs the next tests count
        pool.remove()
        raise


@pytest.fixture(scope="module")
def group(ray_cluster):
    # started in two phases, as the trainer does: processes, env and imports first, workers later
    worker_group = make_group(
        DataWorker,
        "train",
        env={"MMRL_TEST_FLAG": "1"},
        start=False,
        sequence_parallel_size=2,
        role_sequence_parallel_sizes={"critic": 1},
    )
    worker_group.start()  # the constructor's args: scale 10
    yield worker_group
    worker_group.shutdown()


def test_the_local_cluster_refuses_a_client_without_its_token(ray_cluster) -> None:
    """init_ray starts a cluster with token authentication on: a process with another token is refused."""
    assert os.environ["RAY_AUTH_MODE"] == "token"
    assert_refuses_other_tokens(ray.get_runtime_context().gcs_address)


def test_ranks_get_torchrun_env_and_all_reduce(group: RayWorkerGroup) -> None:
    envs = group.call(GlooWorker.environment)
    assert [env["RANK"] for env in envs] == ["0", "1"]
    assert [env["LOCAL_RANK"] for env in envs] == ["0", "1"]
    assert {(env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) for env in envs} == {("2", "2")}
    assert envs[0]["MASTER_ADDR"] == envs[1]["MASTER_ADDR"] == ray.util.get_node_ip_address()
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    # init_ray's defaults, its caller's variables and the group's own env all reach the worker processes;
    # init_ray's through the environment a local cluster inherits, not a runtime environment (which
    # would start each worker through a set-up process: resource_pool.init_ray)
    assert {env["TOKENIZERS_PARALLELISM"] for env in envs} == {"false"}
    assert {env["MMRL_CLUSTER_FLAG"] for env in envs} == {"2"}
    assert {env["MMRL_TEST_FLAG"] for env in envs} == {"1"}
    assert group.call(GlooWorker.runtime_env_vars) == [{"MMRL_TEST_FLAG": "1"}] * 2
    # (0 + 1) + (1 + 1) summed over the two ranks of a real gloo group.
    assert group.call(GlooWorker.all_reduce_rank_plus_one) == [3.0, 3.0]
    # the worker module's imports (torch: ~300k objects) were frozen as the rank started: the collector
    # walks only what came after (mmrl.runtime.startup)
    for frozen, walked in group.call(GlooWorker.collector_heap):
        assert frozen > 100_000 and walked < frozen / 4, (frozen, walked)


def test_call_rank_and_async_calls(group: RayWorkerGroup) -> None:
    assert group.call(GlooWorker.add, 1, b=2) == [3, 103]
    assert group.call_rank(1, GlooWorker.add, 5) == 105
    refs = group.call_async(GlooWorker.add, 7)
    assert group.collect(refs) == [7, 107]
    # a method is named by reference; anything else fails here, before reaching a rank, with the fix
    with pytest.raises(
        TypeError, match=r"^train: the string 'add' names no method; pass the method itself: DataWorker.add"
    ):
        group.call("add", 1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^train: Sleeper.sleep is not a method of DataWorker; .*scale_rows"):
        group.call(Sleeper.sleep, 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Sleeper.pid is not a method of DataWorker"):
        group.dispatch(Sleeper.pid, DataProto.from_dict(tensors={"x": torch.ones(2)}))  # type: ignore[arg-type]
    assert group.call(GlooWorker.add, 2) == [2, 102]  # and the group still works


def test_a_worker_method_is_named_by_a_reference_to_the_class_function() -> None:
    """The name sent to the ranks comes from the function the caller holds; a reference that a reader
    could not follow to the worker's method fails with a message that says what to pass."""
    assert method_name(DataWorker, DataWorker.scale_rows) == "scale_rows"
    assert method_name(DataWorker, GlooWorker.add) == "add"  # inherited: the same function
    assert method_name(Sleeper, Sleeper.sleep) == "sleep"
    wrong = {
        "sleep": "the string 'sleep' names no method; pass the method itself: Sleeper.sleep",
        Sleeper().sleep: "Sleeper.sleep is bound to an instance; pass the function from the class: Sleeper.sleep",
        GlooWorker.pid: "GlooWorker.pid is not a method of Sleeper; pass one of Sleeper's methods",
        len: "len is not a method of Sleeper",
        Sleeper.__init__: "is private; call a public method of the worker",
    }
    for reference, message in wrong.items():
        with pytest.raises(TypeError, match=re.escape(message)) as error:
            method_name(Sleeper, reference)
        assert str(error.value).endswith("(its public methods: pid, sleep).")


def test_dispatch_pads_splits_and_rejoins_in_order(group: RayWorkerGroup) -> None:
    uids = ["a", "b", "c", "d", "e"]
    data = DataProto.from_dict(tensors={"x": torch.arange(5.0)}, non_tensors={"uid": uids})

    out = group.dispatch(DataWorker.scale_rows, data)
    # 5 rows padded to 6: rank 0 gets rows 0-2, rank 1 rows 3, 4 and the pad copy of row 0 (dropped).
    assert torch.equal(out.batch["y"], torch.tensor([0.0, 10.0, 20.0, 30.0, 40.0]))
    assert out.non_tensor_batch["uid"].tolist() == uids
    assert out.non_tensor_batch["rank"].tolist() == [0, 0, 0, 1, 1]
    assert out.meta_info["metrics"] == {"rows": [3, 3], "rank": [0, 1]}

    # dp_size=1: both ranks form one sequence-parallel group, get all 5 rows, and rank 0's copy is kept.
    whole = group.dispatch(DataWorker.scale_rows, data, dp_size=1)
    assert whole.non_tensor_batch["rank"].tolist() == [0] * 5
    assert whole.meta_info["metrics"] == {"rows": [5, 5], "rank": [0, 1]}


def test_dispatch_layout_is_declared_on_the_worker_method(group: RayWorkerGroup) -> None:
    """The group was made with sequence_parallel_size=2: a method marked per data-parallel share sends
    both ranks (one SP group) all rows; a method marked per rank splits them; neither takes a dp_size."""
    data = DataProto.from_dict(tensors={"x": torch.arange(5.0)}, non_tensors={"uid": list("abcde")})
    per_rank = group.dispatch(DataWorker.scale_rows_per_rank, data)
    assert per_rank.non_tensor_batch["rank"].tolist() == [0, 0, 0, 1, 1]
    per_share = group.dispatch(DataWorker.scale_rows_per_share, data)
    assert per_share.non_tensor_batch["rank"].tolist() == [0] * 5
    assert per_share.meta_info["metrics"] == {"rows": [5, 5], "rank": [0, 1]}
    assert torch.equal(per_share.batch["y"], torch.arange(5.0) * 10)
    with pytest.raises(ValueError, match="declares its layout"):
        group.dispatch(DataWorker.scale_rows_per_share, data, dp_size=2)


def test_a_mark_naming_a_role_splits_rows_by_that_roles_sequence_parallel_size(group: RayWorkerGroup) -> None:
    """Roles colocated in one worker (the critic next to the actor) keep their own sequence-parallel
    sizes: the group's is 2 (all rows to both ranks), the critic's 1 (rows split over the 2 ranks)."""
    data = DataProto.from_dict(tensors={"x": torch.arange(5.0)}, non_tensors={"uid": list("abcde")})
    per_critic_share = group.dispatch(DataWorker.scale_rows_per_critic_share, data)
    assert per_critic_share.non_tensor_batch["rank"].tolist() == [0, 0, 0, 1, 1]
    assert torch.equal(per_critic_share.batch["y"], torch.arange(5.0) * 10)
    with pytest.raises(ValueError, match="role 'reward_model', which this group was not given"):
        group.dispatch(DataWorker.scale_rows_per_reward_model_share, data)
    pool = ResourcePool(nnodes=1, procs_per_node=2, use_gpu=False, cpus_per_proc=CPUS_PER_RANK)
    try:
        with pytest.raises(ValueError, match="critic=3 must divide the world size 2"):
            RayWorkerGroup(DataWorker, pool, role_sequence_parallel_sizes={"critic": 3})
    finally:
        pool.remove()


def _assert_processes_exit(pids: list[int], within_s: float) -> None:
    deadline = time.monotonic() + within_s
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _process_alive(pid)]
        time.sleep(0.1)
    assert not alive, f"worker processes {alive} still run after the group failed"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of the raylet may linger as a zombie until reaped; it no longer runs. It may also
    # be reaped between the signal and the read, which then fails.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except OSError:
        return False


def test_raising_rank_fails_fast_while_peer_waits_in_barrier(ray_cluster) -> None:
    with make_group(GlooWorker, "raiser") as group:
        pids = group.call(GlooWorker.pid)
        start = time.monotonic()
        with pytest.raises(WorkerGroupError) as failure:
            group.call(GlooWorker.raise_or_wait, failing_rank=1)
        assert time.monotonic() - start < FAST_S
        assert (failure.value.rank, failure.value.method) == (1, "raise_or_wait")
        message = str(failure.value)
        assert "raiser_rank1 (rank 1 of 2) raised an exception in 'raise_or_wait'" in message
        assert "ValueError: rank 1 cannot read sample 3" in message
        assert "in raise_or_wait" in message  # the remote traceback's frame
        # The rank stuck in the barrier was killed, and the group refuses further work.
        _assert_processes_exit(pids, within_s=FAST_S)
        with pytest.raises(WorkerGroupError, match="shut down"):
            group.call(GlooWorker.pid)


def test_dying_rank_fails_fast_while_peer_waits_in_barrier(ray_cluster) -> None:
    with make_group(GlooWorker, "crasher", timeout_s=60.0) as group:
        pids = group.call(GlooWorker.pid)
        start = time.monotonic()
        with pytest.raises(WorkerGroupError) as failure:
            group.call(GlooWorker.exit_or_wait, failing_rank=0)
        assert time.monotonic() - start < FAST_S
        assert (failure.value.rank, failure.value.method) == (0, "exit_or_wait")
        assert "crasher_rank0 (rank 0 of 2) lost its process" in str(failure.value)
        _assert_processes_exit(pids, within_s=FAST_S)


def test_a_dead_rank_is_blamed_rather_than_the_peer_its_death_failed(ray_cluster, monkeypatch) -> None:
    """Rank 1 raises first, rank 0's process dies a moment later: the group names rank 0's lost
    process (the root cause), not rank 1's exception (its symptom)."""
    # rank 0's death reaches the driver within the grace however loaded the machine (the wait ends at it)
    monkeypatch.setattr(worker_group_module, "LOST_PROCESS_GRACE_S", 30.0)
    with make_group(GlooWorker, "dying", timeout_s=60.0) as group:
        pids = group.call(GlooWorker.pid)
        with pytest.raises(WorkerGroupError) as failure:
            group.call(GlooWorker.exit_late_or_raise, failing_rank=0)
        assert (failure.value.rank, failure.value.method) == (0, "exit_late_or_raise")
        assert "dying_rank0 (rank 0 of 2) lost its process" in str(failure.value)
        _assert_processes_exit(pids, within_s=FAST_S)


def test_call_past_timeout_stops_the_group(ray_cluster) -> None:
    with make_group(Sleeper, "sleeper", procs=1, args=(), timeout_s=1.0) as group:
        pids = group.collect(group.call_async(Sleeper.pid), timeout_s=60)  # the 1 s is for the sleep
        start = time.monotonic()
        with pytest.raises(WorkerGroupError, match=r"ranks \[0\] did not finish 'sleep' within 1 s"):
            group.call(Sleeper.sleep, 60.0)
        assert time.monotonic() - start < FAST_S
        _assert_processes_exit(pids, within_s=FAST_S)


def test_deferred_start_takes_late_arguments_once(ray_cluster) -> None:
    pool = ResourcePool(nnodes=1, procs_per_node=2, use_gpu=False, cpus_per_proc=CPUS_PER_RANK)
    late = RayWorkerGroup(DataWorker, pool, name_prefix="late", start=False)
    try:
        late.start(args=(3.0,))
        data = DataProto.from_dict(tensors={"x": torch.ones(2, 1)}, non_tensors={"uid": ["a", "b"]})
        assert late.dispatch(DataWorker.scale_rows, data).batch["y"].flatten().tolist() == [3.0, 3.0]
        with pytest.raises(RuntimeError, match="already started"):
            late.start(args=(3.0,))
    finally:
        late.shutdown()


def test_resource_pool_reports_what_the_cluster_lacks(group: RayWorkerGroup) -> None:
    # 2 × 2.5 CPU on one node: more than the 4 CPUs the single node has, so no waiting.
    with pytest.raises(ResourcePoolError, match=r"asked for 2 CPU bundles .* nodes have \[4 CPU, 2 GPU\]"):
        ResourcePool(nnodes=1, procs_per_node=2, use_gpu=False, cpus_per_proc=2.5)
    with pytest.raises(ResourcePoolError, match="asked for 3 GPU bundles"):
        ResourcePool(nnodes=1, procs_per_node=3, use_gpu=True)

    # Fits the cluster, but the module's group holds 2 × 0.5 CPU: the wait times out with what is free.
    # Groups the tests before shut down free their CPUs a moment later (Ray kills actors asynchronously).
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU") != 3.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    start = time.monotonic()
    with pytest.raises(ResourcePoolError, match=r"within 1 s\. .* only 3 CPU, 2 GPU free"):
        ResourcePool(nnodes=1, procs_per_node=1, use_gpu=False, cpus_per_proc=4.0, timeout_s=1.0)
    assert time.monotonic() - start < FAST_S


def test_the_driver_plans_gpus_and_cpus_from_the_clusters_resources(group: RayWorkerGroup) -> None:
    """What ``ray.nodes()`` reports is what the driver plans with (mmrl.trainer.placement): the module's
    cluster has 4 CPUs and 2 logical GPUs, and the plan's GPU bundles are placed."""
    nodes = alive_node_resources()
    assert [(node["CPU"], node["GPU"]) for node in nodes] == [(4.0, 2.0)]
    placement = plan_placement(TrainerConfig(n_gpus_per_node=2), reward_cpus=1.0, nodes=nodes)
    assert placement == Placement(use_gpu=True, cpus_per_worker=1.0, worker_threads=1)  # (4 - 1) // 2
    pool = ResourcePool(1, 2, placement.use_gpu, cpus_per_proc=placement.cpus_per_worker, timeout_s=30)
    try:
        assert pool.bundle == {"GPU": 1, "CPU": 1.0} and len(pool.bundles()) == 2
    finally:
        pool.remove()
    with pytest.raises(
        PlacementError, match=r"4 GPUs asked for, but the Ray cluster has 2 \(nodes: 4 CPU, 2 GPU\)"
    ):
        plan_placement(TrainerConfig(n_gpus_per_node=4, device="cuda"), reward_cpus=1.0, nodes=nodes)


# ---------------------------------------------------------------------- pure helpers, no Ray needed


def test_distributed_env_local_ranks_and_shared_gpus() -> None:
    # Ranks landed on nodes a, b, a, b with GPUs 3, 0, 5, 1.
    envs = distributed_env(
        ["a", "b", "a", "b"], ["3", "0", "5", "1"], master_addr="10.0.0.1", master_port=29500
    )
    assert [env["LOCAL_RANK"] for env in envs] == ["0", "0", "1", "1"]
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["3,5", "0,1", "3,5", "0,1"]
    assert {(env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["MASTER_PORT"]) for env in envs} == {
        ("4", "2", "29500")
    }
    cpu_envs = distributed_env(["a", "a"], [None, None], master_addr="10.0.0.1", master_port=1)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in cpu_envs] == ["", ""]  # no GPU, even on a GPU machine


def test_nodes_that_fit() -> None:
    nodes = [{"CPU": 16.0, "GPU": 8.0}, {"CPU": 8.0, "GPU": 4.0}, {"CPU": 64.0}]
    # 4 bundles of {GPU 1, CPU 2} per group: the first node holds 2 groups, the second 1, the third none.
    assert nodes_that_fit(nodes, {"GPU": 1, "CPU": 2}, procs_per_node=4) == 3
    assert nodes_that_fit(nodes, {"CPU": 0.5}, procs_per_node=4) == 8 + 4 + 32


def test_merge_dp_outputs_with_two_rows_per_input() -> None:
    """3 prompts on 2 dp ranks: padded to 4, chunks of 2; each rank returns 2 responses per prompt."""

    def shard(prompt_ids: list[int]) -> DataProto:
        rows = np.repeat(prompt_ids, 2)  # interleaved: [p, p, q, q]
        return DataProto.from_dict(
            tensors={"prompt": torch.tensor(rows)}, meta_info={"temperature": 1.0, "metrics": {"n": 2.0}}
        )

    outputs = [shard([0, 1]), shard([2, 0]), shard([0, 1])]  # rank 2 is rank 0's sequence-parallel peer
    merged = merge_dp_outputs(outputs, dp_rank_of=[0, 1, 0], chunk_len=2, pad_size=1, method="generate")
    assert merged.batch["prompt"].tolist() == [0, 0, 1, 1, 2, 2]
    assert merged.meta_info == {"temperature": 1.0, "metrics": {"n": [2.0, 2.0, 2.0]}}
    with pytest.raises(ValueError, match="returned \\[4, 3\\] rows"):
        merge_dp_outputs(
            [shard([0, 1]), shard([2, 0])[:3]], [0, 1], chunk_len=2, pad_size=1, method="generate"
        )


# ---- media: put once, processed where the model runs ---------------------------------------------


class MediaWorker(GlooWorker):
    """Attaches the processed media of its rows as a training worker does, keeping them between calls."""

    def __init__(self, scale: float, model_path: str, data_config) -> None:
        from mmrl.data.processing import MediaCache, MediaProcessor, load_tokenizer_and_processor

        super().__init__(scale)
        self.media = MediaProcessor(*load_tokenizer_and_processor(model_path), data_config)
        self.cache = MediaCache()

    @rows_per_data_parallel_share
    def pixel_sums(self, data: DataProto) -> DataProto:
        from mmrl.data.processing import attach_media

        data = attach_media(data, self.media, self.cache)
        inputs = data.non_tensor_batch["multi_modal_inputs"]
        sums = torch.stack([row["pixel_values"].double().sum() for row in inputs])
        counts = {"processed": self.cache.processed, "reused": self.cache.reused}
        return DataProto.from_dict(tensors={"pixel_sum": sums}, meta_info={"metrics": counts})


def test_media_go_through_the_object_store_once_and_are_processed_once_per_rank(
    ray_cluster, tmp_path, tiny_vl_path
) -> None:
    from mmrl.data.collate import collate_prompts
    from mmrl.data.config import DataConfig
    from mmrl.data.dataset import PromptDataset
    from mmrl.data.processing import attach_media, load_tokenizer_and_processor
    from mmrl.demo.synthetic import write_photo_dataset
    from mmrl.single_controller import TransferCounter, put_media
    from mmrl.single_controller.transfer import ENCODED_MEDIA, MEDIA, RECEIVED, SENT, TENSORS

    data_config = DataConfig(min_pixels=3136, max_pixels=50176, max_prompt_length=256)
    tokenizer, processor = load_tokenizer_and_processor(str(tiny_vl_path))
    dataset = PromptDataset(
        str(write_photo_dataset(tmp_path, 4) / "train.jsonl"), tokenizer, processor, data_config
    )
    prompts = collate_prompts([dataset[i] for i in range(4)], tokenizer.pad_token_id).repeat(
        2
    )  # [a a b b ...]
    expected = attach_media(prompts, dataset.media).non_tensor_batch["multi_modal_inputs"]
    expected_sums = [float(row["pixel_values"].double().sum()) for row in expected]

    transfers = TransferCounter()
    shared = put_media(prompts, transfers)
    files = sum(media.encoded_bytes for media in dataset_media(prompts))
    assert transfers.bytes[ENCODED_MEDIA] == files > 300_000  # 4 JPEGs, each put once for its 2 rows
    assert files <= transfers.bytes[MEDIA] <= files + 4 * 1024  # the file bytes and a prompt each
    refs = shared.non_tensor_batch["prompt_media"]
    assert refs[0] is refs[1] and refs[0] is not refs[2]

    pool = ResourcePool(nnodes=1, procs_per_node=2, use_gpu=False, cpus_per_proc=CPUS_PER_RANK)
    group = RayWorkerGroup(
        MediaWorker,
        pool,
        args=(1.0, str(tiny_vl_path), data_config),
        name_prefix="media",
        transfers=transfers,
    )
    try:
        first = group.dispatch(MediaWorker.pixel_sums, shared)
        assert first.batch["pixel_sum"].tolist() == expected_sums  # as made in this process
        assert first.meta_info["metrics"] == {"processed": [2, 2], "reused": [0, 0]}  # 2 prompts per rank
        again = group.dispatch(
            MediaWorker.pixel_sums, shared
        )  # the next phase of the step: nothing processed again
        assert again.meta_info["metrics"] == {"processed": [2, 2], "reused": [2, 2]}
        # rows moved to the other rank (as balance_batch may move them) are fetched and processed there
        moved = group.dispatch(MediaWorker.pixel_sums, shared.reorder([0, 1, 4, 5, 2, 3, 6, 7]))
        assert moved.batch["pixel_sum"].tolist() == [expected_sums[i] for i in (0, 1, 4, 5, 2, 3, 6, 7)]
        assert moved.meta_info["metrics"] == {"processed": [3, 3], "reused": [3, 3]}
    finally:
        group.shutdown()
    # three dispatches of 8 rows moved token columns, refs and scores: no media (a 224-pixel image's
    # pixel_values alone are 1.2 MB), under 1 kB per row and dispatch beside the tensors
    objects = transfers.bytes[SENT] + transfers.bytes[RECEIVED] - transfers.bytes[TENSORS]
    assert 0 < objects < 3 * 8 * 1024


def dataset_media(prompts: DataProto) -> list:
    """The distinct PromptMedia of a batch."""
    return list({id(media): media for media in prompts.non_tensor_batch["prompt_media"]}.values())
