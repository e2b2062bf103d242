"""Starting Ray and reserving one bundle of resources per training process.

A `ResourcePool` holds one placement group per node, `STRICT_PACK`ed so that the `procs_per_node` bundles of
a node really share a machine (NVLink, shared memory); bundle b of group n becomes rank
`n * procs_per_node + b`. When the cluster has at least `nnodes` machines that can each hold a group, the
groups go to distinct machines (Ray itself would pack two small groups onto one); on a smaller cluster
(one machine for a CPU trial of `nnodes=2`) groups share machines. A bundle is `{"GPU": 1, "CPU": cpus_per_proc}` on GPU machines and
`{"CPU": cpus_per_proc}` on a CPU machine.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import ray
from ray.util.placement_group import (
    NODE_ID_LABEL_KEY,
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

from mmrl.runtime.debris import remove_ray_session_at_exit
from mmrl.single_controller.ray_auth import enable_token_auth

__all__ = [
    "DEFAULT_WORKER_ENV_VARS",
    "ResourcePool",
    "ResourcePoolError",
    "alive_node_resources",
    "init_ray",
    "nodes_that_fit",
]

# Set in every Ray worker process (before it imports anything) unless the caller overrides them.
DEFAULT_WORKER_ENV_VARS = {
    # Tokenizers forked into Ray workers otherwise warn and may deadlock on their thread pool.
    "TOKENIZERS_PARALLELISM": "false",
}


class ResourcePoolError(RuntimeError):
    """The Ray cluster cannot hold the requested bundles (now, or within the timeout)."""


def init_ray(
    address: str | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    include_dashboard: bool = False,
    object_store_memory_bytes: int | None = None,
    runtime_env_vars: dict[str, str] | None = None,
) -> None:
    """Connect to Ray once per process; later calls are no-ops.

    `address=None` starts a local cluster with `num_cpus` logical CPUs (None = all cores) and `num_gpus`
    GPUs (None = the machine's; a number makes them logical, as tests do on a CPU machine), no dashboard
    (it costs ~0.7 GB) and an object store of `object_store_memory_bytes` (None = Ray's default, 30% of
    memory). `address="auto"` or `"ip:port"` joins a cluster started with `ray start`; the local-cluster
    arguments are then ignored. `runtime_env_vars` (PYTHONPATH, OMP_NUM_THREADS, HF_HOME, ...) are set in
    every worker process at start, on top of `DEFAULT_WORKER_ENV_VARS` (a variable already set in this
    process keeps its value). A joined cluster gets them as the job's runtime environment. A local
    cluster's processes inherit this process's environment, so they are set here instead: a runtime
    environment would start every worker through a set-up process of its own (~0.3 CPU-s and ~0.6 s
    more per worker, measured on the 2-core machine). A local cluster stops, and its session folder
    under /tmp/ray goes, when this process exits.

    Token authentication is on, for a local cluster and a joined one (:mod:`ray_auth`), and a local
    cluster's dashboard (when included) listens on loopback only.
    """
    if ray.is_initialized():
        return
    enable_token_auth(joining=address is not None)
    wanted = {**DEFAULT_WORKER_ENV_VARS, **(runtime_env_vars or {})}
    env_vars = {key: os.environ.get(key, str(value)) for key, value in wanted.items()}
    options: dict[str, Any] = {}
    if address is not None:
        options["runtime_env"] = {"env_vars": env_vars}
    else:
        os.environ.update(env_vars)  # inherited by the cluster's processes, started below
        options.update(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=include_dashboard,
            dashboard_host="127.0.0.1",
            object_store_memory=object_store_memory_bytes,
            # Ray would start idle Python workers for plain tasks at once (two on this 2-core machine, more
            # with more cores); mmrl runs actors with environments of their own, which never take them:
            # ~0.4 CPU-s and ~80 MB each
            _system_config={"prestart_worker_first_driver": False},
        )
    ray.init(address=address, **options)
    if address is None:  # the cluster is this process's: nothing of it outlives the process
        remove_ray_session_at_exit()


def alive_node_resources() -> list[dict[str, float]]:
    """The resources (``{"CPU": 16.0, "GPU": 8.0, "memory": ...}``) of each alive node of the cluster."""
    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive", True)]


def nodes_that_fit(
    node_resources: list[dict[str, float]], bundle: dict[str, float], procs_per_node: int
) -> int:
    """How many node groups of `procs_per_node` bundles the given nodes can hold, each group on one node.

    A node holding `R[k]` of resource k fits `min_k floor(R[k] / (procs_per_node * bundle[k]))` groups.
    """
    total = 0
    for resources in node_resources:
        per_node = [
            math.floor(resources.get(key, 0.0) / (amount * procs_per_node) + 1e-9)
            for key, amount in bundle.items()
            if amount > 0
        ]
        total += min(per_node) if per_node else 0
    return total


class ResourcePool:
    """`nnodes × procs_per_node` bundles, reserved as one STRICT_PACK placement group per node.

    Blocks until every group is placed; raises `ResourcePoolError` at once when the cluster can never hold
    them, or after `timeout_s` when they would fit but the resources are in use. `remove()` frees them.
    """

    def __init__(
        self,
        nnodes: int,
        procs_per_node: int,
        use_gpu: bool,
        cpus_per_proc: float = 1.0,
        timeout_s: float = 60.0,
    ) -> None:
        if nnodes < 1 or procs_per_node < 1 or cpus_per_proc < 0:
            raise ValueError(
                f"ResourcePool needs nnodes >= 1, procs_per_node >= 1 and cpus_per_proc >= 0; got "
                f"nnodes={nnodes}, procs_per_node={procs_per_node}, cpus_per_proc={cpus_per_proc}."
            )
        self.nnodes = nnodes
        self.procs_per_node = procs_per_node
        self.use_gpu = use_gpu
        self.cpus_per_proc = cpus_per_proc
        self.bundle: dict[str, float] = {"CPU": cpus_per_proc}
        if use_gpu:
            self.bundle = {"GPU": 1, "CPU": cpus_per_proc}

        spread = self._check_cluster_can_hold()
        if spread:
            self.placement_groups: list[PlacementGroup] = []
            self._place_on_distinct_nodes(timeout_s)
        else:
            self.placement_groups = [self._new_group() for _ in range(nnodes)]
            self._wait_until_placed(timeout_s)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.procs_per_node

    def bundles(self) -> list[tuple[PlacementGroup, int]]:
        """(placement group, bundle index) of every rank, in rank order."""
        return [(group, index) for group in self.placement_groups for index in range(self.procs_per_node)]

    def remove(self) -> None:
        """Free the reserved resources (kill the actors placed on them first)."""
        for group in self.placement_groups:
            remove_placement_group(group)
        self.placement_groups = []

    def node_ids(self) -> list[str]:
        """The Ray node id of each placement group (node group n's machine), in group order."""
        return [placement_group_table(group)["bundles_to_node_id"][0] for group in self.placement_groups]

    def _new_group(self, avoid_nodes: list[str] | None = None) -> PlacementGroup:
        bundles = [dict(self.bundle)] * self.procs_per_node
        if not avoid_nodes:
            return placement_group(bundles, strategy="STRICT_PACK")
        # every node carries the label ray.io/node-id; "!in(a,b)" keeps the group off those machines
        selector = {NODE_ID_LABEL_KEY: f"!in({','.join(avoid_nodes)})"}
        return placement_group(
            bundles, strategy="STRICT_PACK", bundle_label_selector=[selector] * len(bundles)
        )

    def _place_on_distinct_nodes(self, timeout_s: float) -> None:
        """One group at a time, each kept off the machines of the groups placed before it."""
        deadline = time.monotonic() + timeout_s
        used_nodes: list[str] = []
        for _ in range(self.nnodes):
            group = self._new_group(used_nodes)
            self.placement_groups.append(group)
            ready, _ = ray.wait([group.ready()], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                self._fail_to_place(timeout_s, placed=len(self.placement_groups) - 1)
            used_nodes.append(placement_group_table(group)["bundles_to_node_id"][0])

    def _request_text(self) -> str:
        kind = "GPU" if self.use_gpu else "CPU"
        return (
            f"asked for {self.world_size} {kind} bundles {self.bundle} ({self.nnodes} node(s) × "
            f"{self.procs_per_node} processes, each node's bundles on one machine)"
        )

    def _check_cluster_can_hold(self) -> bool:
        """Raises when the cluster can never hold the groups; True when `nnodes > 1` distinct machines can
        each hold one group (then they are spread over machines)."""
        alive = alive_node_resources()
        if nodes_that_fit(alive, self.bundle, self.procs_per_node) >= self.nnodes:
            machines = sum(
                nodes_that_fit([resources], self.bundle, self.procs_per_node) > 0 for resources in alive
            )
            return self.nnodes > 1 and machines >= self.nnodes
        per_node = "; ".join(_describe(resources) for resources in alive) or "no alive nodes"
        raise ResourcePoolError(
            f"ResourcePool {self._request_text()}, but the Ray cluster cannot hold them: its nodes have "
            f"[{per_node}]. Use fewer processes per node or nodes, lower the CPUs per process, or add "
            "machines with `ray start --address=<head>:6379` (for a local cluster: raise ray num_cpus)."
        )

    def _wait_until_placed(self, timeout_s: float) -> None:
        ready_refs = [group.ready() for group in self.placement_groups]
        ready, _ = ray.wait(ready_refs, num_returns=len(ready_refs), timeout=timeout_s)
        if len(ready) != len(ready_refs):
            self._fail_to_place(timeout_s, placed=len(ready))

    def _fail_to_place(self, timeout_s: float, placed: int) -> None:
        self.remove()
        raise ResourcePoolError(
            f"ResourcePool {self._request_text()}: only {placed} of {self.nnodes} node groups were "
            f"placed within {timeout_s:g} s. The cluster has {_describe(ray.cluster_resources())} in total "
            f"but only {_describe(ray.available_resources())} free; another run or worker group holds the "
            "rest. Free it (shut down the other group) or wait for it to finish."
        )


def _describe(resources: dict[str, float]) -> str:
    """`{"CPU": 4.0, "GPU": 8.0, "memory": ...}` → `"4 CPU, 8 GPU"` (only the resources bundles use)."""
    parts = [f"{resources.get(key, 0.0):g} {key}" for key in ("CPU", "GPU")]
    return ", ".join(parts)
