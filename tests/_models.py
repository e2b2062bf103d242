"""Models as the trainer builds them, for tests across the package."""

from __future__ import annotations

import contextlib

from mmrl.models.loading import load_model
from mmrl.models.prepare import prepare_for_training


def training_model(path, role: str = "actor", sequence_parallel: bool = False, **load_kwargs):
    """The model in ``path`` loaded as ``role`` and prepared for padded and packed passes (and, with
    ``sequence_parallel``, rows split over ranks), as ``build_fsdp_model`` prepares the trainer's."""
    model = load_model(str(path), role=role, **load_kwargs)
    return prepare_for_training(
        model, packing=True, sequence_parallel=sequence_parallel, score_tokens=role == "actor"
    )


def perturbed_model(path, seed: int = 0):
    """The tiny model with noise added to every weight, as an actor's are after updates: a random tiny
    model answers every prompt with the same token, which would make token-for-token agreement
    meaningless."""
    import torch

    model = training_model(path)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    return model


class PushBefore:
    """:class:`mmrl.agent.backend.DecodeChunks` as the streaming thread is to a decoder, with a weight
    push landing as the decoder enters the engine for the ``at``-th time (from 0): ``push()`` puts the
    new weights (policy version 1) into the engine. Transformers enters once for a micro-batch's
    prefill and once per chunk; vLLM once per chunk (its first includes the prefill)."""

    def __init__(self, push, tokens: int, at: int):
        self.push, self.tokens, self.at = push, tokens, at
        self.version, self.entries = 0, 0

    @contextlib.contextmanager
    def engine(self):
        if self.entries == self.at:
            self.push()
            self.version = 1
        self.entries += 1
        yield


def build_hub_cache(model_dir, cache_dir, repo_id: str, revision: str = "0" * 40):
    """A Hugging Face hub cache at ``cache_dir`` (what ``HF_HUB_CACHE`` names) holding ``repo_id`` as
    a copy of ``model_dir``: ``models--owner--name/snapshots/<revision>/`` and ``refs/main``, the layout
    ``snapshot_download`` leaves; returns the snapshot folder."""
    import shutil
    from pathlib import Path

    repo = Path(cache_dir) / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot
