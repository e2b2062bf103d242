"""What the policy and the critic share: the columns of a forward pass, its micro-batches, and the
head outputs at the valid response tokens.

Batch keys (:mod:`mmrl.columns`): ``input_ids``/``attention_mask`` [B, P + R], ``responses`` [B, R],
optional ``mm_token_type_ids`` and ``position_ids``, and the object column ``multi_modal_inputs`` (made on
the worker from the batch's compact ``prompt_media``, :func:`mmrl.data.processing.attach_media`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from mmrl.models.alignment import check_media_alignment
from mmrl.models.families import UnknownModelFamilyError, family_of
from mmrl.models.inputs import ResponseScoring, response_token_outputs, sequence_position_ids
from mmrl.parallel.sequence import SequenceParallelGroups
from mmrl.protocol import DataProto
from mmrl.workers.fsdp_engine import micro_batch_rows, train_on_batch
from mmrl.workers.towers import MEDIA_COLUMN, agreed_media

FORWARD_KEYS = ("input_ids", "attention_mask", "responses")
# routed_experts: what a MoE rollout routed, replayed by the actor (mmrl.models.moe)
OPTIONAL_FORWARD_KEYS = ("mm_token_type_ids", "position_ids", "response_turns", "routed_experts")


def forward_columns(data: DataProto, extra_keys: tuple[str, ...] = ()) -> DataProto:
    """The columns a forward pass needs (plus ``extra_keys``), so micro-batches move nothing else."""
    batch_keys = [*FORWARD_KEYS, *extra_keys]
    batch_keys += [key for key in OPTIONAL_FORWARD_KEYS if key in data.batch.keys()]
    missing = [key for key in batch_keys if key not in data.batch.keys()]
    if missing:
        raise KeyError(f"the batch lacks {missing}; it has {sorted(data.batch.keys())}")
    media = [MEDIA_COLUMN] if MEDIA_COLUMN in data.non_tensor_batch else []
    return data.select(batch_keys=batch_keys, non_tensor_keys=media, meta_info_keys=[])


def forward_arguments(data: DataProto) -> tuple:
    """``(input_ids, attention_mask, response_length, multi_modal_inputs, mm_token_type_ids)`` of a
    batch: the leading arguments of the forward helpers of :mod:`mmrl.models.inputs`."""
    batch = data.batch
    media = data.non_tensor_batch.get(MEDIA_COLUMN)
    return (
        batch["input_ids"],
        batch["attention_mask"],
        batch["responses"].shape[-1],
        None if media is None else list(media),
        batch["mm_token_type_ids"] if "mm_token_type_ids" in batch.keys() else None,
    )


def add_position_ids(module: nn.Module, data: DataProto) -> DataProto:
    """``data`` (a rollout batch) with its ``position_ids`` column, numbered once per distinct prompt by
    :func:`mmrl.models.inputs.sequence_position_ids`; every later pass reads them instead of running
    ``get_rope_index`` per row."""
    check_alignment(module, data, names=_sample_names(data))
    data.batch["position_ids"] = sequence_position_ids(module, *forward_arguments(data))
    return data


def _sample_names(data: DataProto) -> list[str] | None:
    indices = data.non_tensor_batch.get("sample_index")
    return (
        None
        if indices is None
        else [f"sample {index} (batch row {row})" for row, index in enumerate(indices)]
    )


def check_alignment(module: nn.Module, data: DataProto, names: list[str] | None = None) -> None:
    """Placeholder tokens against media features of every row, turn by turn (mmrl.models.alignment)."""
    batch = data.batch
    check_media_alignment(
        getattr(module, "config", None),
        batch["input_ids"],
        data.non_tensor_batch.get(MEDIA_COLUMN),
        batch["response_turns"] if "response_turns" in batch.keys() else None,
        names,
    )


def micro_batch_token_outputs(
    module: nn.Module,
    micro_batch: DataProto,
    padding_free: bool,
    sequence_parallel: SequenceParallelGroups | None = None,
    share_prompts: bool = False,
    scoring: ResponseScoring | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's head outputs predicting the K valid response tokens, [K, D] ([K, 4] log-prob and
    entropy with ``scoring``), and where those tokens are, ``response_valid`` [b, R] (see
    ``mmrl.models.inputs.response_token_outputs``)."""
    batch = micro_batch.batch  # media alignment: checked once per pass (role_micro_batches, train_role)
    return response_token_outputs(
        module,
        *forward_arguments(micro_batch),
        padding_free=padding_free,
        sequence_parallel=sequence_parallel,
        position_ids=batch["position_ids"] if "position_ids" in batch.keys() else None,
        share_prompts=share_prompts,
        scoring=scoring,
    )


def check_sequence_parallel(
    sequence_parallel: SequenceParallelGroups | None, padding_free: bool, dp_group: dist.ProcessGroup | None
) -> SequenceParallelGroups | None:
    """``sequence_parallel`` when it splits rows (None for size 1), after checking its requirements."""
    if sequence_parallel is None or sequence_parallel.size == 1:
        return None
    if not padding_free:
        raise ValueError("sequence parallelism runs on packed rows: set padding_free=true")
    if dp_group is not sequence_parallel.dp_group:
        raise ValueError("with sequence parallelism, dp_group must be sequence_parallel.dp_group")
    return sequence_parallel


def fsdp_size(sequence_parallel: SequenceParallelGroups | None) -> int | None:
    """Ranks FSDP averages over when they are more than the data-parallel ones (sequence parallelism)."""
    if sequence_parallel is None:
        return None
    return sequence_parallel.size * sequence_parallel.dp_size


def forward_micro_batches(
    data: DataProto,
    micro_batch_size: int,
    max_tokens_per_micro_batch: int | None,
    device: torch.device | str,
    group: dist.ProcessGroup | None,
) -> tuple[list[DataProto], np.ndarray]:
    """``data``'s micro-batches for a forward-only pass (still where ``data`` is), and ``restore``: the
    row order that puts the micro-batches' concatenated outputs back in the order of ``data``.
    ``device`` is where the micro-batch count is agreed on with the other ranks (a token budget)."""
    attention_mask = data.batch["attention_mask"].to(device)
    groups = micro_batch_rows(attention_mask, micro_batch_size, max_tokens_per_micro_batch, group)
    order = np.concatenate([np.asarray(rows, dtype=np.int64) for rows in groups])
    return [data[rows] for rows in groups], np.argsort(order)


def role_micro_batches(
    role, data: DataProto, micro_batch_size: int
) -> tuple[list[DataProto], list[bool | None], np.ndarray]:
    """:func:`forward_micro_batches` of ``data``'s forward columns for ``role`` (a ``PolicyActor`` or
    ``ValueCritic``: its token budget for no-grad passes, device and data-parallel group), after
    checking the media alignment of all its rows at once, with each micro-batch's "media on some rank"
    flag for :func:`~mmrl.workers.towers.media_step` (:func:`~mmrl.workers.towers.agreed_media`: one
    collective for the pass)."""
    check_alignment(role.module, data, names=_sample_names(data))
    config = role.config
    micro_batches, restore = forward_micro_batches(
        forward_columns(data),
        micro_batch_size,
        config.max_tokens_per_micro_batch_for_experience or config.max_tokens_per_micro_batch,
        role.device,
        role.dp_group,
    )
    media = [batch.non_tensor_batch.get(MEDIA_COLUMN) for batch in micro_batches]
    return micro_batches, agreed_media(role.module, media, role.device, role.dp_group), restore


def train_role(
    role,
    columns: DataProto,
    micro_batch_loss,
    mini_batch_size: int,
    micro_batch_size: int,
    epochs: int,
    *,
    lr_scale: float = 1.0,
) -> dict[str, float]:
    """One training step of ``role`` (a ``PolicyActor`` or ``ValueCritic``) over this rank's rows
    (``train_on_batch`` with the role's clipping, packing and groups); the scheduler advances once.
    ``lr_scale`` multiplies the scheduled learning rate for this step's optimizer steps only.
    The media alignment of all rows is checked once, not per micro-batch and epoch."""
    check_alignment(role.module, columns, names=_sample_names(columns))
    role.module.train()
    with scaled_lr(role.optimizer, lr_scale):
        metrics = train_on_batch(
            role.module,
            role.optimizer,
            columns,
            micro_batch_loss,
            mini_batch_size=mini_batch_size,
            micro_batch_size=micro_batch_size,
            epochs=epochs,
            max_grad_norm=role.config.max_grad_norm,
            device=role.device,
            group=role.dp_group,
            max_tokens_per_micro_batch=role.config.max_tokens_per_micro_batch,
            padding_free=role.config.padding_free,
            fsdp_size=fsdp_size(role.sequence_parallel),
            reduce_grads_once=role.config.reduce_grads_once,
            keep_params_gathered=role.config.keep_params_gathered,
        )
    if role.lr_scheduler is not None:
        role.lr_scheduler.step()
    return metrics


@contextlib.contextmanager
def scaled_lr(optimizer: torch.optim.Optimizer, scale: float) -> Iterator[None]:
    """The optimizer's learning rates times ``scale`` inside the block, the scheduled ones after (1:
    untouched)."""
    if scale == 1.0:
        yield
        return
    scheduled = [group["lr"] for group in optimizer.param_groups]
    for group, lr in zip(optimizer.param_groups, scheduled):
        group["lr"] = lr * scale
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, scheduled):
            group["lr"] = lr


def prompts_shared(module: nn.Module, share_prompts: bool) -> bool:
    """Whether a role's packed micro-batches share their prompts: ``share_prompts`` (the config's), unless
    the model's decoder carries a state along each sequence (the family's ``sequence_state``: Qwen3.5's
    linear attention), which must see every sequence whole; such a model packs each response after its
    own prompt, as with ``share_prompts=false``."""
    if not share_prompts:
        return False
    try:
        return family_of(module).sequence_state is None
    except UnknownModelFamilyError:  # a model mmrl has no spec of: nothing says it carries a state
        return True
