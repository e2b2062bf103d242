"""Preparing a model for the forward passes mmrl runs, once, where the model is built.

:func:`prepare_for_training` applies its family's fix (:class:`~mmrl.models.families.ModelFamily`
``fix_model``), switches the text decoder to packed attention (``packing``), installs the
sequence-parallel input sharding and the vision towers' split of their frames over the SP ranks
(``sequence_parallel``; :mod:`mmrl.parallel.encoders`) and, for a policy (``score_tokens``), the
output head that computes log-probs and entropies in token chunks
(:mod:`mmrl.models.token_scoring`). The forward helpers of
:mod:`mmrl.models.inputs` never change a model: handed an unprepared one for a packed or
sequence-parallel pass they raise, so the module a builder returns is the module that runs.
"""

from __future__ import annotations

from torch import nn

from mmrl.models.attention import enable_packed_attention, packed_attention_enabled
from mmrl.models.families import family_of
from mmrl.models.token_scoring import install_token_scoring_head
from mmrl.parallel.encoders import enable_sharded_encoders
from mmrl.parallel.sequence import enable_sequence_parallel, sequence_parallel_enabled

PREPARE_HINT = (
    "call mmrl.models.prepare.prepare_for_training(model, packing=True, sequence_parallel=...) where the "
    "model is built"
)


def prepare_for_training(
    model: nn.Module,
    packing: bool,
    sequence_parallel: bool = False,
    score_tokens: bool = False,
    packed_attention: str = "sdpa",
) -> nn.Module:
    """Make ``model`` (before FSDP wrapping) ready for padded passes and, with ``packing``,
    packed ones (padding-free, shared prompts; ``packed_attention`` the kernel without flash-attn:
    ``sdpa`` or ``torch_varlen``); with ``sequence_parallel`` also for passes whose rows
    are split over ranks (which are packed); with ``score_tokens`` (a policy, not a critic's value
    head) for log-prob passes that score tokens inside the head. Idempotent; returns ``model`` itself."""
    if sequence_parallel and not packing:
        raise ValueError("prepare_for_training: sequence parallelism runs on packed rows; pass packing=True")
    family = family_of(model)
    if family.fix_model is not None:
        family.fix_model(model)
    if packing:
        enable_packed_attention(model, packed_attention)
    if sequence_parallel:
        enable_sequence_parallel(model, family.shard_decoder_inputs)
        enable_sharded_encoders([tower for _, tower in family.tower_modules(model)])
    if score_tokens:
        install_token_scoring_head(model)
    return model


def check_prepared(model: nn.Module, sequence_parallel: bool, where: str) -> None:
    """Raise unless ``model`` was prepared for packed (and ``sequence_parallel``) passes."""
    missing = []
    if not packed_attention_enabled(model):
        missing.append("packed attention")
    if sequence_parallel and not sequence_parallel_enabled(model):
        missing.append("sequence-parallel input sharding")
    if missing:
        raise RuntimeError(
            f"{where}: {type(model).__name__} is not prepared for this pass ({' and '.join(missing)} not "
            f"enabled): {PREPARE_HINT}"
        )
