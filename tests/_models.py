"""Models as the trainer builds them, for tests across the package."""

from __future__ import annotations

from mmrl.models.loading import load_model
from mmrl.models.prepare import prepare_for_training


def training_model(path, role: str = "actor", sequence_parallel: bool = False, **load_kwargs):
    """The model in ``path`` loaded as ``role`` and prepared for padded and packed passes (and, with
    ``sequence_parallel``, rows split over ranks), as ``build_fsdp_model`` prepares the trainer's."""
    model = load_model(str(path), role=role, **load_kwargs)
    return prepare_for_training(
        model, packing=True, sequence_parallel=sequence_parallel, score_tokens=role == "actor"
    )
