"""FSDP2 training engine: sharding, mixed precision, offload, optimizer, scheduler, gradient steps.

One code path for CPU (gloo) and GPU (NCCL): the device comes from the mesh, and everything that
only matters on an accelerator (pinned memory, moving shards between phases) switches itself off on
the CPU.

Gradient accounting. FSDP *averages* gradients over the ranks of its mesh. Every loss here is a
micro-batch's share of the global (mini-batch, all ranks) mean, so the shares are summed by gradient
accumulation and multiplied by the mesh size before ``backward``: the step then equals the one
computed on the whole mini-batch at once, however it is split over micro-batches and ranks (and,
with sequence parallelism, over the tokens of a row).

Micro-batches hold a fixed number of rows, or, with a token budget, as many rows as fit in it
(:func:`micro_batch_rows`); every rank then runs as many as the rank that needs the most, because
each forward pass issues FSDP collectives that all ranks must join.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from mmrl.models.loading import decoder_layers
from mmrl.parallel.packing import padding_counts, split_groups, token_budget_groups
from mmrl.protocol import DataProto
from mmrl.workers.optim import AdamWBf16
from mmrl.workers.towers import (
    agreed_media,
    media_step,
    micro_batch_media,
    reshard_towers,
    shard_towers,
    sharded_towers,
    towers_gathered,
    unshard_towers,
)

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
SCHEDULER_TYPES = ("constant", "cosine")
BROADCAST_CHUNK_BYTES = 64 * 1024**2  # rank-0 init: the most of a tensor in flight at once

# A micro-batch loss: (micro-batch, global valid-token count, global sequence count) ->
# (its share of the mini-batch loss, {metric name: its share of the metric}).
MicroBatchLoss = Callable[
    [DataProto, torch.Tensor, torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]
]


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """``"auto"`` → bf16 on CUDA, fp32 on CPU; ``"bf16"``/``"fp32"`` (or their long names) as named."""
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def storage_dtype(name: str, device: torch.device | str, trainable: bool) -> torch.dtype:
    """Dtype of a model's stored (sharded) weights. ``"auto"``: fp32 master weights for a trained
    model; for a frozen one (the reference) bf16 on CUDA, since nothing accumulates into its weights
    and its pass computes in bf16 anyway (half the memory, as EasyR1), fp32 on CPU. Named dtypes as
    :func:`resolve_dtype`."""
    if name == "auto" and trainable:
        return torch.float32
    return resolve_dtype(name, device)


def apply_fsdp2(
    model: nn.Module,
    mesh: DeviceMesh | None,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    cpu_offload: bool = False,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard ``model`` in place with ``fully_shard``: one unit per decoder layer, one per Qwen-VL
    vision tower (:func:`mmrl.workers.towers.shard_towers`: gathered only in micro-batches where some
    rank has media, which the ranks agree on once per pass), the input embedding (when not tied to
    ``lm_head``), then the root, which holds the rest (audio towers included: a rank without audio
    never calls its tower, so it is gathered with the root on every rank, and
    ``set_reduce_scatter_unused_params`` reduces zeros for its unused gradients). Parameters are moved
    to the mesh's device unless offloaded.
    """
    mixed_precision = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Pinned host memory needs an accelerator; without CUDA pinning fails (ENVIRONMENT.md).
    offload = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=mixed_precision, offload_policy=offload)
    for layer in decoder_layers(model):
        shard(layer, reshard_after_forward=reshard_after_forward)
    shard_towers(model, shard, mesh)
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is None or head.weight is not embeddings.weight:
        shard(embeddings, reshard_after_forward=reshard_after_forward)
    # None lets FSDP keep the root gathered after forward: backward would gather it again at once.
    shard(model, reshard_after_forward=None if reshard_after_forward else False)
    model.set_reduce_scatter_unused_params(True)
    for tower in sharded_towers(model):  # decided per forward (mmrl.workers.towers)
        tower.set_reduce_scatter_unused_params(False)
    return model


def broadcast_from_rank0(model: nn.Module, device: torch.device | str, cpu_offload: bool = False) -> None:
    """Give every rank rank 0's weights, one tensor at a time (collective), as verl's rank-0 init does.

    On rank 0 ``model`` is the loaded model, not yet sharded: each of its tensors is broadcast as it is
    (shard it afterwards; sharding frees each whole tensor as it goes). On the other ranks it is the
    same model built on the meta device (``load_model(..., empty=True)``) and already sharded
    (``apply_fsdp2``): its shards are allocated here (on the host with ``cpu_offload``) and each keeps
    its slice of every tensor received. Tensors travel in row chunks of at most
    ``BROADCAST_CHUNK_BYTES``, so only rank 0 ever holds the whole model; another rank holds its shards
    and one chunk. Buffers are not sharded and not all in the state dict
    (rotary frequencies): every one of rank 0's is broadcast whole. NCCL broadcasts device tensors, so
    each travels through ``device``.
    """
    device = torch.device(device)
    source = dist.get_rank() == 0
    if not source:
        model.to_empty(device="cpu" if cpu_offload else device)
        for module in model.modules():  # buffers on the device even with offload, as fully_shard puts them
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None and buffer.device != device:
                    setattr(module, name, buffer.to(device))
    # parameters as themselves (keep_vars): a tied one is the same object under both names, on every rank
    state = {id(tensor): (name, tensor) for name, tensor in model.state_dict(keep_vars=True).items()}
    layout = [(name, tuple(tensor.shape), tensor.dtype) for name, tensor in state.values()]
    senders = [layout if source else None]
    dist.broadcast_object_list(senders, src=0)
    mismatch = all_reduce_max(torch.tensor([float(senders[0] != layout)], device=device))
    if mismatch.item():  # every rank stops, rank 0 too, rather than broadcasting into wrong shapes
        differ = [(mine, theirs) for mine, theirs in zip(layout, senders[0]) if mine != theirs][:1]
        raise RuntimeError(
            f"rank {dist.get_rank()}: a rank built the model on the meta device unlike rank 0 loaded it "
            f"({differ or 'on another rank'}); build it with rank0_init=False and report the model family"
        )
    for _, tensor in state.values():  # the same names and order on every rank
        for start, stop in _row_chunks(tensor):
            shape = (stop - start, *tensor.shape[1:]) if tensor.dim() else ()
            if source:
                rows = (tensor.detach()[start:stop] if tensor.dim() else tensor.detach()).to(device)
            else:
                rows = torch.empty(shape, dtype=tensor.dtype, device=device)
            dist.broadcast(rows, src=0)
            if not source:
                _keep_own_rows(tensor, rows, start)
    for buffer in model.buffers():
        carrier = buffer.to(device)
        dist.broadcast(carrier, src=0)
        if not source:
            buffer.copy_(carrier)


def _row_chunks(tensor: torch.Tensor) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of ``tensor``'s first dimension of at most ``BROADCAST_CHUNK_BYTES``
    each (one range for a scalar): the receivers' transient buffer, whatever the largest tensor (a
    151,936-row embedding is 1.2 GB in fp32 at 2,048 columns)."""
    if tensor.dim() == 0 or tensor.shape[0] == 0:
        return [(0, 1 if tensor.dim() == 0 else 0)]
    row_bytes = max(1, math.prod(tensor.shape[1:]) * tensor.element_size())  # shapes: a DTensor's global
    step = max(1, BROADCAST_CHUNK_BYTES // row_bytes)
    return [(start, min(start + step, tensor.shape[0])) for start in range(0, tensor.shape[0], step)]


def _keep_own_rows(target: torch.Tensor, rows: torch.Tensor, start: int) -> None:
    """Copy this rank's part of ``rows`` (rows ``start`` on of the whole tensor) into ``target``: a
    tensor kept whole, or a DTensor shard (its own slice of every dimension)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if target.dim() == 0:
        target.detach().copy_(rows)
        return
    stop = start + rows.shape[0]
    if not isinstance(target, DTensor):
        target.detach()[start:stop].copy_(rows)
        return
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    first, last = max(start, offset[0]), min(stop, offset[0] + shape[0])
    if first >= last:
        return  # none of these rows are this rank's
    others = tuple(slice(begin, begin + size) for size, begin in zip(shape[1:], offset[1:]))
    part = rows[(slice(first - start, last - start), *others)]
    target.to_local().detach()[first - offset[0] : last - offset[0]].copy_(part)


@contextlib.contextmanager
def root_gathered(model: nn.Module) -> Iterator[None]:
    """The root FSDP2 unit's parameters (embeddings, head, audio towers) and the separately sharded
    vision towers gathered, for a call of one of its submodules outside the model's forward (whose
    hooks would gather them), then freed. Every rank of the mesh must enter it together. A no-op for
    an unsharded model."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model._get_fsdp_state()._lazy_init()  # the root's, before a tower unit's own call could claim it
    model.unshard()
    unshard_towers(model)
    try:
        with towers_gathered(model):
            yield
    finally:
        reshard_towers(model)
        model.reshard()


def reshard_after_no_grad(model: nn.Module) -> None:
    """Free the gathered parameters of every FSDP2 unit of ``model`` after a no-grad pass (log-probs,
    reference, values). No backward follows it to reshard them, so the root unit (embeddings, head,
    vision towers: ``reshard_after_forward=None`` keeps them for a backward) would stay gathered until
    the next pass, every layer too with ``enable_full_shard=false``. A no-op for an unsharded model."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def enable_gradient_checkpointing(model: nn.Module, decoder_layers_recomputed: int | None = None) -> None:
    """Recompute each layer's activations in backward (non-reentrant, so it composes with FSDP2); with
    ``decoder_layers_recomputed`` (``gradient_checkpointing_layers``) only the first that many decoder
    layers recompute and the others keep their activations (a count over the model's layers: all). The
    towers' blocks recompute either way."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    if decoder_layers_recomputed is None:
        return
    # the layers that keep their activations (none for a count over the layers: all recompute)
    kept = decoder_layers(model)[decoder_layers_recomputed:]
    other = next((layer for layer in kept if not isinstance(layer, GradientCheckpointingLayer)), None)
    if other is not None:
        raise ValueError(
            f"gradient_checkpointing_layers={decoder_layers_recomputed}: {type(other).__name__}, a decoder "
            f"layer of {type(model).__name__}, is not a transformers GradientCheckpointingLayer, so it cannot "
            "be checkpointed on its own; unset gradient_checkpointing_layers"
        )
    for layer in kept:
        layer.gradient_checkpointing = False  # read by GradientCheckpointingLayer at each call


def _adamw(
    params: list[nn.Parameter], lr: float, betas: tuple[float, float], weight_decay: float
) -> torch.optim.Optimizer:
    """AdamW (decoupled weight decay); the fused kernel (one pass over each tensor: 5x faster than the
    per-tensor loop on a CPU) when the parameters all live on one device type that has it (CUDA and
    CPU do)."""
    device_types = {param.device.type for param in params}
    fused = len(device_types) == 1 and device_types <= {"cuda", "cpu"}
    return torch.optim.AdamW(
        params, lr=lr, betas=betas, weight_decay=weight_decay, fused=True if fused else None
    )


def _adamw_bf16(
    params: list[nn.Parameter], lr: float, betas: tuple[float, float], weight_decay: float
) -> torch.optim.Optimizer:
    """AdamW with bfloat16 moments (:class:`mmrl.workers.optim.AdamWBf16`): half the optimizer state."""
    return AdamWBf16(params, lr=lr, betas=betas, weight_decay=weight_decay)


# optim.strategy -> builder(trainable parameters, lr, betas, weight_decay); one entry per optimizer
OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"adamw": _adamw, "adamw_bf16": _adamw_bf16}


def build_optimizer(
    params: Iterable[nn.Parameter],
    lr: float,
    betas: tuple[float, float] | list[float],
    weight_decay: float,
    strategy: str = "adamw",
) -> torch.optim.Optimizer:
    """The optimizer registered as ``strategy`` in :data:`OPTIMIZERS`, over the parameters that
    require grad."""
    if strategy not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {strategy!r}; expected one of {', '.join(OPTIMIZERS)}")
    trainable = [param for param in params if param.requires_grad]
    if not trainable:
        raise ValueError("build_optimizer: no parameter requires grad; is the whole model frozen?")
    return OPTIMIZERS[strategy](trainable, lr, tuple(betas), weight_decay)


def lr_factor(
    step: int, num_training_steps: int, warmup_steps: int, scheduler_type: str, min_lr_ratio: float
) -> float:
    """Multiplier of the peak lr at 0-based ``step``.

    Warm-up: ``(step + 1) / warmup_steps`` (the first step already learns). Then ``constant``: 1;
    ``cosine``: ``min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2`` with progress
    ``p = (step - warmup_steps) / (num_training_steps - warmup_steps)``, clamped to [0, 1].
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if scheduler_type == "constant":
        return 1.0
    progress = min(max((step - warmup_steps) / max(1, num_training_steps - warmup_steps), 0.0), 1.0)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    num_training_steps: int,
    warmup_steps: int = 0,
    scheduler_type: str = "constant",
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """A ``LambdaLR`` following :func:`lr_factor`; its ``state_dict`` round-trips (a partial, no lambda)."""
    if scheduler_type not in SCHEDULER_TYPES:
        raise ValueError(f"unknown lr scheduler type {scheduler_type!r}; expected one of {SCHEDULER_TYPES}")
    factor = functools.partial(
        lr_factor,
        num_training_steps=num_training_steps,
        warmup_steps=warmup_steps,
        scheduler_type=scheduler_type,
        min_lr_ratio=min_lr_ratio,
    )
    return LambdaLR(optimizer, factor)


# ------------------------------------------------------------------ moving state between phases


def _first_tensor_device(tensors: Iterable[torch.Tensor]) -> torch.device | None:
    return next((tensor.device for tensor in tensors), None)


def offload_fsdp_params(model: nn.Module) -> None:
    """Move the (sharded) parameters to host memory; no-op when they already live there.

    Not for models built with ``cpu_offload=True``: FSDP keeps those on the host itself.
    """
    device = _first_tensor_device(model.parameters())
    if device is not None and device.type != "cpu":
        model.to("cpu")


def load_fsdp_params(model: nn.Module, device: torch.device | str) -> None:
    """Move the (sharded) parameters back to ``device``; no-op on the CPU."""
    if torch.device(device).type != "cpu":
        model.to(device)


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and key != "step":  # AdamW keeps `step` on the host
                state[key] = value.to(device, non_blocking=True)


def offload_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Move the optimizer's moment tensors to host memory; no-op when they already live there."""
    device = _first_tensor_device(
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )
    if device is not None and device.type != "cpu":
        _move_optimizer_state(optimizer, "cpu")


def load_optimizer(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move the optimizer's moment tensors back to ``device``; no-op on the CPU."""
    if torch.device(device).type != "cpu":
        _move_optimizer_state(optimizer, device)


class PhaseOffload:
    """A role's parameters (and optimizer states) parked in host memory between its phases.

    ``offload()`` after a phase, ``onload()`` before one (or ``with offload.loaded(): ...``); what moves
    is what the config asks for. ``offloaded`` tells where the state is meant to be: the moves themselves
    are no-ops on a CPU device, where host memory is the device's.
    """

    def __init__(
        self,
        module: nn.Module,
        device: torch.device | str,
        params: bool,
        optimizer: torch.optim.Optimizer | None = None,
        optimizer_state: bool = False,
    ):
        if optimizer_state and optimizer is None:
            raise ValueError("PhaseOffload: optimizer_state=True needs the optimizer")
        self.module, self.device, self.params = module, torch.device(device), params
        self.optimizer, self.optimizer_state = optimizer, optimizer_state
        self.offloaded = False

    def offload(self) -> None:
        if self.params:
            offload_fsdp_params(self.module)
        if self.optimizer_state:
            offload_optimizer(self.optimizer)
        self.offloaded = self.params or self.optimizer_state

    def onload(self) -> None:
        if self.params:
            load_fsdp_params(self.module, self.device)
        if self.optimizer_state:
            load_optimizer(self.optimizer, self.device)
        self.offloaded = False

    @contextlib.contextmanager
    def loaded(self) -> Iterator[None]:
        """On the device for the ``with`` block's phase, offloaded again after it."""
        self.onload()
        try:
            yield
        finally:
            self.offload()


# ------------------------------------------------------------------ gradient steps


def collective_device(tensor: torch.Tensor) -> torch.device:
    """Where collectives on ``tensor`` run: the mesh's device for a DTensor (host shards included)."""
    if isinstance(tensor, DTensor) and tensor.device_mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return tensor.device


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Global L2 norm of all gradients (every rank's shards) and, when it exceeds ``max_norm`` > 0,
    scale the gradients by ``max_norm / (norm + 1e-6)``.

    A non-finite norm is returned without touching the gradients: the caller skips the step.
    """
    grads = [param.grad for param in model.parameters() if param.grad is not None]
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):  # a partial norm over this rank's shards; reduce over the mesh
        total = total.to(collective_device(total)).full_tensor()
    total_norm = float(total)
    if max_norm > 0 and math.isfinite(total_norm) and total_norm > max_norm:
        # one foreach op for all gradients (on DTensors too), not one dispatch per parameter
        torch._foreach_mul_(grads, max_norm / (total_norm + 1e-6))
    return total_norm


def data_parallel_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (None = default group); 1 without torch.distributed."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place (nothing to do without torch.distributed)."""
    if data_parallel_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Element-wise maximum of ``tensor`` over ``group``, in place (nothing to do without torch.distributed)."""
    if data_parallel_size(group) > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor


def micro_batch_rows(
    attention_mask: torch.Tensor,
    micro_batch_size: int,
    max_tokens_per_micro_batch: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> list[list[int]]:
    """The rows of each micro-batch of a batch with ``attention_mask`` [B, L].

    Without a budget: consecutive runs of ``micro_batch_size`` rows. With one: groups whose packed
    length (valid tokens, ``attention_mask.sum(-1)``) is at most ``max_tokens_per_micro_batch``
    (a longer row alone), then split further until there are as many as on the rank of ``group``
    that needs the most. Collective when a budget is set: every rank of ``group`` must call it.
    """
    num_rows = attention_mask.shape[0]
    if max_tokens_per_micro_batch is None:
        return [
            list(range(start, min(start + micro_batch_size, num_rows)))
            for start in range(0, num_rows, micro_batch_size)
        ]
    seq_lengths = attention_mask.sum(-1).tolist()
    groups = token_budget_groups(seq_lengths, max_tokens_per_micro_batch)
    # On the mask's device: NCCL reduces CUDA tensors only.
    num_groups = all_reduce_max(torch.tensor([len(groups)], device=attention_mask.device), group)
    return split_groups(groups, seq_lengths, int(num_groups))


def row_selection(rows: list[int]) -> slice | list[int]:
    """``rows`` as a slice when they are consecutive (a micro-batch of views: no per-column index op),
    else as they are."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return rows


def global_counts(
    response_mask: torch.Tensor, group: dist.ProcessGroup | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid tokens N, sequences S with at least one valid token) of ``response_mask`` [B, R],
    summed over the ranks of ``group``: the normalisers of ``core_algos.aggregate_loss``."""
    tokens_per_row = response_mask.sum(-1).float()  # [B]
    counts = torch.stack([tokens_per_row.sum(), (tokens_per_row > 0).float().sum()])
    all_reduce_sum(counts, group)
    return counts[0], counts[1]


def token_share(values: torch.Tensor, response_mask: torch.Tensor, num_tokens: torch.Tensor) -> torch.Tensor:
    """This micro-batch's share of a token-mean diagnostic over the whole mini-batch (``num_tokens``
    valid tokens on all ranks): summing the shares of all micro-batches and ranks gives the mean."""
    return (values.detach().float() * response_mask).sum() / num_tokens.clamp(min=1.0)


def all_reduce_metrics(
    local_sums: dict[str, torch.Tensor], device: torch.device | str, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Each metric summed over the ranks of ``group``, in one collective (names sorted, so every rank
    packs them in the same order)."""
    if not local_sums:
        return {}
    names = sorted(local_sums)
    totals = torch.stack([local_sums[name].to(device, torch.float64) for name in names])
    all_reduce_sum(totals, group)
    return dict(zip(names, totals.tolist()))


@contextlib.contextmanager
def gradient_sync(module: nn.Module, sync: bool) -> Iterator[None]:
    """The block's backward reduces the gradients of FSDP2 ``module`` across its ranks (``sync``), or
    leaves them unsharded on each rank, summed in FSDP's reduce dtype, for a later synced backward to
    reduce with its own (``set_requires_gradient_sync``: gradient accumulation without communication).
    The later backward reduces them whether or not it runs the unit: FSDP's final backward callback
    reduces every unit its backward left out (a vision tower that no rank called in the last
    micro-batch, whose gradients came from earlier ones). Reductions are back on after the block."""
    if sync or not isinstance(module, FSDPModule):
        yield
        return
    _gathered_once(module)
    module.set_requires_gradient_sync(False)
    try:
        yield
        _unreduced_grads_in_reduce_dtype(module)
    finally:
        module.set_requires_gradient_sync(True)


@contextlib.contextmanager
def kept_gathered(module: nn.Module, keep: bool) -> Iterator[None]:
    """The block's backward leaves every unit of FSDP2 ``module`` it gathered gathered (``keep``:
    ``set_reshard_after_backward(False)``), so the next micro-batch's forward gathers none of them again
    (with ``reshard_after_forward=False``, nor does its backward). The next backward outside such a block
    reshards every unit, those it did not run too: FSDP's final backward callback runs the post-backward
    of each (a vision tower kept from an earlier micro-batch), so no gathered copy outlives the
    optimizer step that changes its shards."""
    if not keep or not isinstance(module, FSDPModule):
        yield
        return
    module.set_reshard_after_backward(False)
    try:
        yield
    finally:
        module.set_reshard_after_backward(True)


def _gathered_once(module: nn.Module) -> None:
    """Gathers and reshards every FSDP2 unit of ``module`` once in its life, before its first backward
    without reductions: FSDP2 makes a unit's unsharded parameters at its first gather, and such a
    backward's final callback fails on a unit not gathered yet (torch 2.13 reads them to keep its
    gradients: a vision tower that no row has called so far, when compute and reduce dtypes differ).
    Every rank calls it at the same micro-batch, so the gathers pair up."""
    if getattr(module, "_mmrl_units_gathered", False):
        return
    module._get_fsdp_state()._lazy_init()  # the root's, before a unit's own gather could claim it
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.unshard()
            unit.reshard()
    module._mmrl_units_gathered = True


def _unreduced_grads_in_reduce_dtype(module: nn.Module) -> None:
    """After a backward without reductions: every trainable parameter of every FSDP2 unit of
    ``module`` holds its unreduced gradient in the unit's reduce dtype, zeros where it has none yet.
    FSDP2 keeps what a backward without reductions left in the reduce dtype (fp32) but a parameter's
    first gradient, and the zeros it reduces for an unused one, in the compute dtype (bf16); a reducing
    backward that meets both in one unit (an expert first routed in the last micro-batch, an audio
    tower in the root that text rows leave unused) stops ("uniform gradient dtype")."""
    for unit in module.modules():
        if not isinstance(unit, FSDPModule):
            continue
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                if (
                    param.reduce_dtype is None
                    or param.unsharded_accumulated_grad is not None
                    or not param.sharded_param.requires_grad
                ):
                    continue
                # (a gradient still in .grad would be added to it by FSDP's next accumulation)
                param.unsharded_accumulated_grad = torch.zeros_like(
                    param.unsharded_param, dtype=param.reduce_dtype
                )


def optimizer_step(
    module: nn.Module, optimizer: torch.optim.Optimizer, max_grad_norm: float
) -> tuple[float, bool]:
    """Clip, step unless the gradient norm is non-finite, zero the gradients. Returns (norm, stepped)."""
    grad_norm = clip_grad_norm(module, max_grad_norm)
    stepped = math.isfinite(grad_norm)
    if stepped:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, stepped


def train_on_batch(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: DataProto,
    micro_batch_loss: MicroBatchLoss,
    *,
    mini_batch_size: int,
    micro_batch_size: int,
    epochs: int,
    max_grad_norm: float,
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
    max_tokens_per_micro_batch: int | None = None,
    padding_free: bool = False,
    fsdp_size: int | None = None,
    reduce_grads_once: bool = False,
    keep_params_gathered: bool = False,
) -> dict[str, float]:
    """``epochs`` passes over this rank's ``data``: one optimizer step per mini-batch of
    ``mini_batch_size`` rows, gradients accumulated over micro-batches of ``micro_batch_size`` rows
    or, when ``max_tokens_per_micro_batch`` is set, of at most that many packed tokens
    (:func:`micro_batch_rows`). The step does not depend on the split: losses are shares of the
    mini-batch's global token and sequence counts.

    Every rank must hold the same number of rows (the same number of steps and forward passes, or
    FSDP's collectives would not pair up). Metrics are the micro-batch shares summed over
    micro-batches and ranks (i.e. mini-batch values), averaged over mini-batches, plus ``grad_norm``
    (mean over steps with a finite norm), ``skipped_steps``, ``lr`` (at the first step) and
    ``padding_ratio``: the fraction of the tokens the forward passes computed that were padding
    (``padding_free``: the passes run on packed rows, so 0).

    ``group`` holds one rank per data-parallel share of the data; ``fsdp_size`` is the number of ranks
    FSDP averages gradients over (default: ``group``'s size). With sequence parallelism they differ:
    the ranks of an SP group hold the same rows and compute the same loss, each backpropagating
    through its own tokens only, so their gradients add up to the rows' gradient.

    ``reduce_grads_once`` (an FSDP2 module): a mini-batch's gradients are summed unsharded on each rank
    and reduced once, in its last micro-batch (:func:`gradient_sync`), instead of in every micro-batch.
    ``keep_params_gathered``: units stay gathered between a mini-batch's micro-batches (:func:`kept_gathered`).
    """
    gradient_scale = fsdp_size if fsdp_size is not None else data_parallel_size(group)
    # per micro-batch: its metric shares as one float64 vector (one cast, one add), keyed by their names
    share_sums: dict[tuple[str, ...], torch.Tensor] = {}
    token_counts = [0, 0]  # computed tokens, of which padding
    grad_norms: list[float] = []
    skipped_steps = 0
    num_steps = 0
    lr = optimizer.param_groups[0]["lr"]
    mini_batches = data.split(mini_batch_size)
    plans = [  # the same micro-batches in every epoch
        micro_batch_rows(
            mini_batch.batch["attention_mask"].to(device), micro_batch_size, max_tokens_per_micro_batch, group
        )
        for mini_batch in mini_batches
    ]
    # whether some rank has media in each micro-batch: one collective for the whole update
    media = [rows for mini, plan in zip(mini_batches, plans) for rows in micro_batch_media(mini, plan)]
    agreed = iter(agreed_media(module, media, device, group))
    media_flags = [[next(agreed) for _ in plan] for plan in plans]
    for _ in range(epochs):
        for mini_batch, plan, flags in zip(mini_batches, plans, media_flags):
            mini_batch = mini_batch.to(device)
            num_tokens, num_seqs = global_counts(mini_batch.batch["response_mask"], group)
            attention_mask = mini_batch.batch["attention_mask"]
            lengths = attention_mask.sum(-1).tolist()  # one host sync per mini-batch, not per micro-batch
            for index, (rows, flag) in enumerate(zip(plan, flags)):
                micro_batch = mini_batch[row_selection(rows)]
                last = index == len(plan) - 1
                sync, keep = last or not reduce_grads_once, keep_params_gathered and not last
                with gradient_sync(module, sync), kept_gathered(module, keep), media_step(module, flag):
                    loss, shares = micro_batch_loss(micro_batch, num_tokens, num_seqs)
                    (loss * gradient_scale).backward()
                names = tuple(shares)
                stacked = torch.stack([share.detach() for share in shares.values()]).double()
                share_sums[names] = share_sums[names] + stacked if names in share_sums else stacked
                counts = padding_counts(lengths, rows, attention_mask.shape[1], padding_free)
                token_counts = [total + count for total, count in zip(token_counts, counts)]
            grad_norm, stepped = optimizer_step(module, optimizer, max_grad_norm)
            num_steps += 1
            if stepped:
                grad_norms.append(grad_norm)
            else:
                skipped_steps += 1
    metric_sums: dict[str, torch.Tensor] = {}
    for names, sums in share_sums.items():
        for name, total in zip(names, sums.unbind()):
            metric_sums[name] = metric_sums[name] + total if name in metric_sums else total
    token_totals = torch.tensor(token_counts, dtype=torch.float64)
    totals = all_reduce_metrics(
        {**metric_sums, "_computed_tokens": token_totals[0], "_padding_tokens": token_totals[1]},
        device,
        group,
    )
    computed_tokens, padding_tokens = totals.pop("_computed_tokens"), totals.pop("_padding_tokens")
    metrics = {name: total / max(num_steps, 1) for name, total in totals.items()}
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    metrics["skipped_steps"] = float(skipped_steps)
    metrics["lr"] = float(lr)
    metrics["padding_ratio"] = padding_tokens / max(computed_tokens, 1.0)
    return metrics
