"""`RayWorkerGroup`: one Ray actor per bundle of a `ResourcePool`, each a rank of one torch.distributed group.

Start-up handshake (composition: the worker class inherits nothing and never sees Ray):

1. one `_WorkerHost` actor starts per bundle and reports its node IP, node id and GPU ids;
2. every host sets the torchrun variables `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
   `MASTER_ADDR` (and on GPU `CUDA_VISIBLE_DEVICES`, see `distributed_env`) in its environment and
   imports the worker's module (seconds);
3. rank 0's host picks a free port on its own node → `MASTER_PORT`, set on every host right before it
   builds `worker_cls(*args, **kwargs)`: the port is free when picked, and the imports no longer sit
   between the pick and the bind, where another process of the node could take it. The worker's
   `__init__` may call `torch.distributed.init_process_group(backend)`, whose default `env://` reads
   those variables.

Afterwards `call` / `dispatch` run a worker method on every host. The caller names the method by reference,
`group.call(HybridWorker.sync_rollout_weights)`, so a reader (and a tool) reaches the callee in one jump;
the group checks that the function is a public method of its worker class (`method_name`) and sends
its name to the hosts.

Fail fast: results are collected with `ray.wait`, so the first rank that raises or dies ends the call with
a `WorkerGroupError` naming the rank, the method and the remote traceback, even while the other ranks are
blocked in a collective waiting for it. The group then kills its actors (a broken collective cannot be
recovered) and refuses further calls; `shutdown()` still frees the placement groups.
"""

from __future__ import annotations

import inspect
import os
import re
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mmrl.dispatch import ROWS_PER_DATA_PARALLEL_SHARE, ROWS_PER_RANK, layout_of, sequence_parallel_role_of
from mmrl.runtime.startup import collector_paused
from mmrl.single_controller.resource_pool import ResourcePool
from mmrl.single_controller.transfer import SENT, TransferCounter

if TYPE_CHECKING:
    # Every worker process imports this module for `_WorkerHost`; importing torch (via DataProto) only where
    # it is used lets workers that need no torch (reward scorers, tests) start in ~2 s instead of ~6 s.
    from mmrl.protocol import DataProto

__all__ = ["RayWorkerGroup", "WorkerGroupError", "distributed_env", "merge_dp_outputs", "method_name"]

Worker = TypeVar("Worker")
Params = ParamSpec("Params")
Result = TypeVar("Result")

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
# how long a rank's exception waits for a peer's lost process to be reported: when a rank dies, the ranks
# blocked with it in a collective fail as soon as the connection drops, often before Ray reports the death
LOST_PROCESS_GRACE_S = 2.0


class WorkerGroupError(RuntimeError):
    """A rank raised, died or timed out. `rank` and `method` name the first failure; the message holds
    the remote traceback and `cause` the rank's own exception when it raised one. The worker group is
    shut down when this is raised."""

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        method: str | None = None,
        cause: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.method = method
        self.cause = cause


class _WorkerHost:
    """The Ray actor behind one rank: sets up the rank's environment, then holds and runs the worker."""

    def __init__(self, label: str) -> None:
        self._label = label
        self._worker: Any = None

    def __repr__(self) -> str:
        # Ray prefixes the actor's log lines with its repr: `(actor_rank1 pid=...)`.
        return self._label

    def node_info(self) -> tuple[str, str, list[str]]:
        """(node IP, Ray node id, GPU ids Ray assigned to this actor)."""
        context = ray.get_runtime_context()
        gpu_ids = [str(gpu) for gpu in context.get_accelerator_ids().get("GPU", [])]
        return ray.util.get_node_ip_address(), context.get_node_id(), gpu_ids

    def free_port(self) -> int:
        """A TCP port free on this node now (the OS picks it; torch binds it moments later)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def prepare(self, env: dict[str, str], worker_cls_ref: list[ray.ObjectRef]) -> None:
        """Set the rank's environment, then fetch the worker class, which imports its module (torch,
        transformers: seconds) before the caller knows the worker's arguments. The class comes as a ref
        inside a list so that Ray does not unpickle it, importing the module, before ``env`` is set
        (``CUDA_VISIBLE_DEVICES`` must precede anything that counts devices)."""
        os.environ.update(env)
        # torch's and transformers' modules; this process is the rank's: its collections skip them from
        # now on (mmrl.runtime.startup)
        with collector_paused(freeze=True):
            self._worker_cls = ray.get(worker_cls_ref[0])

    def start(self, master_port: int, args: tuple, kwargs: dict[str, Any]) -> None:
        os.environ["MASTER_PORT"] = str(master_port)
        self._worker = self._worker_cls(*args, **kwargs)

    def execute(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._worker, method)(*args, **kwargs)


def method_name(worker_cls: type, method: Callable) -> str:
    """The name under which ``worker_cls`` holds ``method``, a public function taken from the class
    (``HybridWorker.update_actor``, or one it inherits). Anything else (a string, a bound method, a
    private method, another class's function) raises ``TypeError`` saying what to pass instead."""
    name = getattr(method, "__name__", None)
    if isinstance(name, str) and not name.startswith("_") and getattr(worker_cls, name, None) is method:
        return name
    cls = worker_cls.__name__
    what = getattr(method, "__qualname__", repr(method))
    if isinstance(method, str):
        problem, fix = f"the string {method!r} names no method", f"pass the method itself: {cls}.{method}"
    elif inspect.ismethod(method):
        problem, fix = f"{what} is bound to an instance", f"pass the function from the class: {cls}.{name}"
    elif isinstance(name, str) and name.startswith("_"):
        problem, fix = f"{what} is private", "call a public method of the worker"
    else:
        problem, fix = f"{what} is not a method of {cls}", f"pass one of {cls}'s methods: {cls}.<name>"
    public = sorted(
        attr for attr in dir(worker_cls) if not attr.startswith("_") and callable(getattr(worker_cls, attr))
    )
    raise TypeError(f"{problem}; {fix} (its public methods: {', '.join(public)}).")


def distributed_env(
    node_ids: Sequence[str], gpu_ids: Sequence[str | None], master_addr: str, master_port: int | None = None
) -> list[dict[str, str]]:
    """The torchrun environment of each rank, given where each rank landed (`MASTER_PORT` only where
    `master_port` is given: the group sets it when it starts the workers).

    `node_ids[r]` is the node of rank r and `gpu_ids[r]` its GPU (None on CPU). `LOCAL_RANK` is r's position
    among the ranks on its node, in rank order. On GPU every rank of a node sees all of that node's GPUs of
    the group, listed in local-rank order, so rank r's device is `cuda:LOCAL_RANK` as under torchrun (Ray
    would show each actor only its own GPU as cuda:0; Ray Train shares them the same way, for NCCL P2P and
    CUDA IPC between ranks of a node). A CPU rank gets an empty `CUDA_VISIBLE_DEVICES`: it sees no GPU.
    """
    ranks_on_node: dict[str, list[int]] = {}
    for rank, node_id in enumerate(node_ids):
        ranks_on_node.setdefault(node_id, []).append(rank)
    envs = []
    for rank, node_id in enumerate(node_ids):
        peers = ranks_on_node[node_id]
        env = {
            "MASTER_ADDR": master_addr,
            "RANK": str(rank),
            "WORLD_SIZE": str(len(node_ids)),
            "LOCAL_RANK": str(peers.index(rank)),
            "LOCAL_WORLD_SIZE": str(len(peers)),
        }
        if master_port is not None:
            env["MASTER_PORT"] = str(master_port)
        if gpu_ids[rank] is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(gpu_ids[peer]) for peer in peers)
        else:  # a CPU rank sees no GPU, even on a GPU machine (Ray leaves the variable alone without GPUs)
            env["CUDA_VISIBLE_DEVICES"] = ""
        envs.append(env)
    return envs


def merge_dp_outputs(
    outputs: Sequence[Any], dp_rank_of: Sequence[int], chunk_len: int, pad_size: int, method: str
) -> DataProto:
    """Join the DataProtos returned by `dispatch` into one, in data-parallel order, without the padding.

    `outputs[r]` is rank r's result for chunk `dp_rank_of[r]` of `chunk_len` rows; ranks sharing a dp rank
    (a sequence-parallel group) return the same rows, so the first of them is kept. A result may hold k rows
    per input row (k equal for all ranks, e.g. n responses per prompt, repeated in place), so the padding
    is the last `pad_size * k` rows. `meta_info["metrics"]` of every rank (a dict of scalars or lists) is
    merged into one dict of lists, in rank order.
    """
    from mmrl.protocol import DataProto

    metrics: dict[str, list[Any]] = {}
    for rank, output in enumerate(outputs):
        if not isinstance(output, DataProto):
            raise TypeError(
                f"dispatch({method!r}): rank {rank} returned {type(output).__name__}; dispatched methods must "
                "return a DataProto (use `call` for other results)."
            )
        for name, value in output.meta_info.get("metrics", {}).items():
            metrics.setdefault(name, []).extend(value if isinstance(value, (list, tuple)) else [value])

    first_rank_of_dp: dict[int, int] = {}
    for rank, dp_rank in enumerate(dp_rank_of):
        first_rank_of_dp.setdefault(dp_rank, rank)
    shards = [outputs[first_rank_of_dp[dp_rank]] for dp_rank in sorted(first_rank_of_dp)]

    rows_per_input = len(shards[0]) // chunk_len if chunk_len else 1
    lengths = [len(shard) for shard in shards]
    if any(length != rows_per_input * chunk_len for length in lengths):
        raise ValueError(
            f"dispatch({method!r}): each dp rank got {chunk_len} rows but returned {lengths} rows; results "
            "must hold the same whole number of rows per input row on every rank."
        )
    without_metrics = [
        DataProto(
            batch=shard.batch,
            non_tensor_batch=shard.non_tensor_batch,
            meta_info={key: value for key, value in shard.meta_info.items() if key != "metrics"},
        )
        for shard in shards
    ]
    try:
        merged = DataProto.concat(without_metrics).unpad(pad_size * rows_per_input)
    except ValueError as error:
        raise ValueError(
            f"dispatch({method!r}): cannot join the ranks' results: {error} Put per-rank values in "
            "meta_info['metrics'], which is merged across ranks."
        ) from error
    if not metrics:
        return merged
    return DataProto(merged.batch, merged.non_tensor_batch, {**merged.meta_info, "metrics": metrics})


class RayWorkerGroup(Generic[Worker]):
    """`resource_pool.world_size` ranks, each a Ray actor holding `worker_cls(*args, **kwargs)`.

    Its methods are called by reference: `group.call(worker_cls.method, ...)`, `group.dispatch(...)`.

    `env` adds environment variables to this group's processes at start (before any import). `timeout_s`
    bounds every call (None: wait as long as it takes); a call past it stops the group like a failure.
    `start_timeout_s` bounds each start-up step (process start, then `worker_cls.__init__`, which may load a
    model); None leaves it to torch's own rendezvous timeout. With `start=False` the constructor only starts
    the processes, sets their environment and imports the worker's module there, without waiting for the
    import; `start(args, kwargs)` then builds the workers (so a driver can prepare what the arguments need
    meanwhile). `sequence_parallel_size` is the ranks of one sequence-parallel group of this role: the
    methods its worker class marks `rows_per_data_parallel_share` (`mmrl.dispatch`) get one share of the
    rows per `world_size // sequence_parallel_size` data-parallel rank; a method whose mark names a role
    (a worker holding several, e.g. the critic next to the actor) uses that role's size in
    `role_sequence_parallel_sizes`.
    Keyword arguments are forwarded to the worker's method, except those named in a method's signature here
    (`dp_size`, `dp_rank_of` for `dispatch`). If a rank fails while the group starts, the constructor raises
    `WorkerGroupError` after killing the actors; the pool stays reserved until `resource_pool.remove()`.
    `transfers` counts the bytes of every batch chunk and argument the group puts in Ray's object store
    and of every result it gets back (`mmrl.single_controller.transfer`).
    """

    def __init__(
        self,
        worker_cls: type[Worker],
        resource_pool: ResourcePool,
        *,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
        name_prefix: str = "worker",
        env: dict[str, str] | None = None,
        timeout_s: float | None = None,
        start_timeout_s: float | None = None,
        start: bool = True,
        sequence_parallel_size: int = 1,
        role_sequence_parallel_sizes: Mapping[str, int] | None = None,
        transfers: TransferCounter | None = None,
    ) -> None:
        role_sizes = dict(role_sequence_parallel_sizes or {})
        for what, size in {"sequence_parallel_size": sequence_parallel_size, **role_sizes}.items():
            if size < 1 or resource_pool.world_size % size:
                raise ValueError(
                    f"{name_prefix}: the sequence-parallel size {what}={size} must divide the world size "
                    f"{resource_pool.world_size}"
                )
        self.worker_cls = worker_cls
        self.sequence_parallel_size = sequence_parallel_size
        self.role_sequence_parallel_sizes = role_sizes
        self.start_timeout_s = start_timeout_s
        self.resource_pool = resource_pool
        self.name_prefix = name_prefix
        self.timeout_s = timeout_s
        self.transfers = transfers if transfers is not None else TransferCounter()
        self._failure: str | None = None
        self._async_labels: dict[ray.ObjectRef, tuple[int, str]] = {}
        self._hosts = self._create_hosts(env or {})

        node_infos = self._collect(
            [host.node_info.remote() for host in self._hosts], "node_info", timeout_s=start_timeout_s
        )
        gpu_ids = [gpus[0] if resource_pool.use_gpu else None for _, _, gpus in node_infos]
        # where each rank landed, as its own process reported it (the driver logs it; tests check placement)
        self.node_ids: list[str] = [node_id for _, node_id, _ in node_infos]
        envs = distributed_env(
            node_ids=self.node_ids,
            gpu_ids=gpu_ids,
            master_addr=node_infos[0][0],
        )
        shared_cls = ray.put(worker_cls)
        self._prepare_refs = [host.prepare.remote(env, [shared_cls]) for host, env in zip(self._hosts, envs)]
        self._args, self._kwargs = args, kwargs or {}
        if start:
            self.start()

    def start(self, args: tuple | None = None, kwargs: dict[str, Any] | None = None) -> None:
        """Build every rank's ``worker_cls(*args, **kwargs)`` (the constructor's, unless given here);
        once, after ``start=False``."""
        if self._prepare_refs is None:
            raise RuntimeError(f"{self.name_prefix}: the worker group has already started")
        self._collect(self._prepare_refs, "__init__", timeout_s=self.start_timeout_s)
        self._prepare_refs = None
        master_port = self._collect(
            [self._hosts[0].free_port.remote()], "free_port", ranks=[0], timeout_s=self.start_timeout_s
        )[0]
        args = self._args if args is None else args
        kwargs = self._kwargs if kwargs is None else kwargs
        shared_args, shared_kwargs = ray.put(args), ray.put(kwargs)
        start_refs = [host.start.remote(master_port, shared_args, shared_kwargs) for host in self._hosts]
        self._collect(start_refs, "__init__", timeout_s=self.start_timeout_s)

    def _create_hosts(self, env: dict[str, str]) -> list[Any]:
        pool = self.resource_pool
        remote_host = ray.remote(_WorkerHost)
        hosts = []
        for rank, (placement_group, bundle_index) in enumerate(pool.bundles()):
            options: dict[str, Any] = {
                "num_cpus": pool.cpus_per_proc,
                "num_gpus": 1 if pool.use_gpu else 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=placement_group, placement_group_bundle_index=bundle_index
                ),
            }
            if env:
                options["runtime_env"] = {"env_vars": {key: str(value) for key, value in env.items()}}
            hosts.append(remote_host.options(**options).remote(self._label(rank)))
        return hosts

    @property
    def world_size(self) -> int:
        return self.resource_pool.world_size

    # ------------------------------------------------------------------ calls

    def call(
        self,
        method: Callable[Concatenate[Worker, Params], Result],
        /,
        *args: Params.args,
        **kwargs: Params.kwargs,
    ) -> list[Result]:
        """Run `method(worker, *args, **kwargs)` on every rank; the results in rank order."""
        return self.collect(self.call_async(method, *args, **kwargs))

    def call_rank(
        self,
        rank: int,
        method: Callable[Concatenate[Worker, Params], Result],
        /,
        *args: Params.args,
        **kwargs: Params.kwargs,
    ) -> Result:
        """Run `method(worker, *args, **kwargs)` on one rank only and return its result."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"{self.name_prefix}: rank {rank} is not in [0, {self.world_size}).")
        name = self._resolve(method)
        ref = self._hosts[rank].execute.remote(name, *args, **kwargs)
        return self._collect([ref], name, ranks=[rank], timeout_s=self.timeout_s)[0]

    def call_async(
        self,
        method: Callable[Concatenate[Worker, Params], Any],
        /,
        *args: Params.args,
        **kwargs: Params.kwargs,
    ) -> list[ray.ObjectRef]:
        """Start `method(worker, *args, **kwargs)` on every rank; pass the refs to `collect` for the results.

        Arguments are put in the object store once and shared by all ranks.
        """
        name = self._resolve(method)
        shared_args, shared_kwargs = self._share_arguments(args, kwargs)
        refs = [host.execute.remote(name, *shared_args, **shared_kwargs) for host in self._hosts]
        self._async_labels.update({ref: (rank, name) for rank, ref in enumerate(refs)})
        return refs

    def collect(self, refs: Sequence[ray.ObjectRef], timeout_s: float | None = None) -> list[Any]:
        """Results of `call_async` refs in order, failing fast (see module doc). `timeout_s` overrides the
        group's."""
        labels = [self._async_labels.pop(ref, (-1, "?")) for ref in refs]
        method = labels[0][1] if labels else "?"
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        results = self._collect(list(refs), method, ranks=[rank for rank, _ in labels], timeout_s=timeout_s)
        self.transfers.received(refs)
        return results

    def dispatch(
        self,
        method: Callable[Concatenate[Worker, DataProto, ...], DataProto],
        data: DataProto,
        /,
        *args: Any,
        dp_size: int | None = None,
        dp_rank_of: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> DataProto:
        """Split `data` over the data-parallel ranks, run `method(worker, chunk, *args, **kwargs)`, join.

        `data` is padded (`pad_to_divisor`) to a multiple of `dp_size` and cut into `dp_size` chunks; rank r
        gets chunk `dp_rank_of[r]`. A method marked in `mmrl.dispatch` takes its layout from the mark (and
        no `dp_size`/`dp_rank_of`); otherwise by default `dp_size = world_size` and, for a smaller
        `dp_size`, ranks form consecutive sequence-parallel groups of `world_size // dp_size` (a `(dp, sp)`
        device mesh: `dp_rank_of[r] = r // sp_size`). Results are joined by `merge_dp_outputs`: B rows in
        the input order.
        """
        return self.dispatch_async(method, data, *args, dp_size=dp_size, dp_rank_of=dp_rank_of, **kwargs)()

    def dispatch_async(
        self,
        method: Callable[Concatenate[Worker, DataProto, ...], DataProto],
        data: DataProto,
        /,
        *args: Any,
        dp_size: int | None = None,
        dp_rank_of: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> Callable[[], DataProto]:
        """`dispatch`, started: the ranks run while the caller goes on; the returned function waits for
        them and joins their results (failing fast as `collect` does)."""
        name = self._resolve(method)
        dp_size = self._declared_dp_size(method, dp_size, dp_rank_of)
        dp_rank_of = self._dp_rank_of(dp_size, dp_rank_of)
        num_chunks = max(dp_rank_of) + 1
        padded, pad_size = data.pad_to_divisor(num_chunks)
        chunks = padded.chunk(num_chunks)
        chunk_refs = [self.transfers.put(chunk, SENT) for chunk in chunks]
        shared_args, shared_kwargs = self._share_arguments(args, kwargs)
        refs = [
            host.execute.remote(name, chunk_refs[dp_rank_of[rank]], *shared_args, **shared_kwargs)
            for rank, host in enumerate(self._hosts)
        ]

        def join() -> DataProto:
            outputs = self._collect(refs, name, timeout_s=self.timeout_s)
            self.transfers.received(refs)
            self.transfers.add_tensor_bytes([*chunks, *outputs])
            return merge_dp_outputs(outputs, dp_rank_of, len(padded) // num_chunks, pad_size, name)

        return join

    def _share_arguments(self, args: tuple, kwargs: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """Each argument put in the object store once (N ranks read one copy), counted as sent."""

        def share(value: Any) -> Any:
            return value if isinstance(value, ray.ObjectRef) else self.transfers.put(value, SENT)

        return [share(value) for value in args], {key: share(value) for key, value in kwargs.items()}

    def _declared_dp_size(
        self, method: Callable, dp_size: int | None, dp_rank_of: Sequence[int] | None
    ) -> int | None:
        """The data-parallel size the worker class declares for `method` (`mmrl.dispatch`), else `dp_size`."""
        layout = layout_of(method)
        if layout is None:
            return dp_size
        if dp_size is not None or dp_rank_of is not None:
            raise ValueError(
                f"dispatch: {method.__qualname__} declares its layout ({layout}); "
                "pass no dp_size or dp_rank_of"
            )
        if layout == ROWS_PER_RANK:
            return self.world_size
        assert layout == ROWS_PER_DATA_PARALLEL_SHARE, layout
        role = sequence_parallel_role_of(method)
        if role is None:
            return self.world_size // self.sequence_parallel_size
        if role not in self.role_sequence_parallel_sizes:
            raise ValueError(
                f"dispatch: {method.__qualname__} splits its rows by the sequence-parallel size "
                f"of role {role!r}, which this group was not given (role_sequence_parallel_sizes="
                f"{self.role_sequence_parallel_sizes})"
            )
        return self.world_size // self.role_sequence_parallel_sizes[role]

    def _dp_rank_of(self, dp_size: int | None, dp_rank_of: Sequence[int] | None) -> list[int]:
        world_size = self.world_size
        if dp_rank_of is None:
            dp_size = world_size if dp_size is None else dp_size
            if dp_size < 1 or world_size % dp_size != 0:
                raise ValueError(
                    f"dispatch: dp_size={dp_size} must divide the world size {world_size} (each dp rank's "
                    "sequence-parallel group has world_size // dp_size ranks)."
                )
            return [rank // (world_size // dp_size) for rank in range(world_size)]
        dp_rank_of = list(dp_rank_of)
        expected = set(range(max(dp_rank_of, default=-1) + 1))
        if len(dp_rank_of) != world_size or set(dp_rank_of) != expected:
            raise ValueError(
                f"dispatch: dp_rank_of must give each of the {world_size} ranks a dp rank, using every dp rank "
                f"0..n-1 at least once; got {dp_rank_of}."
            )
        if dp_size is not None and dp_size != len(expected):
            raise ValueError(f"dispatch: dp_size={dp_size} but dp_rank_of uses {len(expected)} dp ranks.")
        return dp_rank_of

    # ------------------------------------------------------------------ failures and shutdown

    def _collect(
        self,
        refs: list[ray.ObjectRef],
        method: str,
        ranks: Sequence[int] | None = None,
        *,
        timeout_s: float | None,
    ) -> list[Any]:
        """`ray.get` of every ref, in order, raising `WorkerGroupError` at the first failure (no waiting for
        the other ranks) or when `timeout_s` (None: no limit) runs out."""
        ranks = list(range(len(refs))) if ranks is None else list(ranks)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        position = {ref: index for index, ref in enumerate(refs)}
        results: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining)
            if not ready:
                late = sorted(ranks[position[ref]] for ref in pending)
                self._abort(f"ranks {late} did not finish {method!r} within {timeout_s:g} s")
                raise WorkerGroupError(
                    f"{self.name_prefix}: ranks {late} did not finish {method!r} within {timeout_s:g} s "
                    "(a hang in a collective, or a timeout too short for the work); the worker group was "
                    "shut down.",
                    rank=late[0],
                    method=method,
                )
            for ref in ready:
                index = position[ref]
                try:
                    results[index] = ray.get(ref)
                except RayError as error:
                    index, error = self._root_failure(index, error, pending, position)
                    message = self._failure_message(ranks[index], method, error)
                    self._abort(message)
                    cause = error.cause if isinstance(error, RayTaskError) else None
                    raise WorkerGroupError(message, rank=ranks[index], method=method, cause=cause) from None
        return results

    @staticmethod
    def _root_failure(
        index: int, error: RayError, pending: list[ray.ObjectRef], position: dict[ray.ObjectRef, int]
    ) -> tuple[int, RayError]:
        """The failure to report: a rank's exception, unless another rank lost its process within
        ``LOST_PROCESS_GRACE_S`` (the exception is then a symptom of that death: a collective whose peer
        vanished); ``(index of the rank's ref, its error)``."""
        if not isinstance(error, RayTaskError) or not pending:
            return index, error
        deadline = time.monotonic() + LOST_PROCESS_GRACE_S
        waiting = list(pending)
        while waiting and (left := deadline - time.monotonic()) > 0:
            ready, waiting = ray.wait(waiting, num_returns=1, timeout=left)
            for ref in ready:
                try:
                    ray.get(ref)
                except RayActorError as lost:
                    return position[ref], lost
                except RayError:
                    pass
        return index, error

    def _failure_message(self, rank: int, method: str, error: RayError) -> str:
        if isinstance(error, RayTaskError):
            what = "raised an exception"
        elif isinstance(error, RayActorError):
            what = "lost its process (a crash, os._exit, a signal or the OOM killer)"
        else:
            what = f"failed ({type(error).__name__})"
        remote_text = _ANSI_ESCAPE.sub("", str(error)).strip()
        return (
            f"{self._label(rank)} (rank {rank} of {self.world_size}) {what} in {method!r}; the other ranks "
            f"were stopped and the worker group shut down.\n--- remote error ---\n{remote_text}"
        )

    def _abort(self, reason: str) -> None:
        """Kill every actor, so no rank stays blocked in a collective waiting for a failed peer."""
        self._failure = reason
        for host in self._hosts:
            ray.kill(host, no_restart=True)
        self._hosts = []
        self._async_labels.clear()

    def _resolve(self, method: Callable) -> str:
        """``method``'s name on the hosts' workers, once the group is known to be running."""
        try:
            name = method_name(self.worker_cls, method)
        except TypeError as error:
            raise TypeError(f"{self.name_prefix}: {error}") from None
        if not self._hosts:
            reason = (self._failure or "no reason recorded").splitlines()[0]
            raise WorkerGroupError(
                f"{self.name_prefix}: the worker group is shut down ({reason}).", method=name
            )
        return name

    def _label(self, rank: int) -> str:
        return f"{self.name_prefix}_rank{rank}"

    def shutdown(self, remove_placement_groups: bool = True) -> None:
        """Kill the actors and (unless another group shares the pool) free the placement groups."""
        if self._hosts:
            self._abort("shutdown() was called")
        if remove_placement_groups:
            self.resource_pool.remove()

    def __enter__(self) -> RayWorkerGroup[Worker]:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
