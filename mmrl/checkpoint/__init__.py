"""Checkpoints: worker-side training state (DCP), driver-side layout and tracker, and the merger.

- ``state``: ``save_train_state`` / ``load_train_state``, called on every rank of a worker group.
- ``tracker``: ``CheckpointLayout`` (``global_step_N.tmp`` -> ``global_step_N``, tracker file,
  pruning, find-last) and the driver's ``trainer_state.json``.
- ``merger``: ``merge_checkpoint`` writes a role folder as Hugging Face safetensors
  (``scripts/model_merger.py``); imported from its module, since it needs transformers.

``state`` is imported on first use: it pulls in ``torch.distributed.checkpoint`` (two seconds on a
small CPU), which the driver, needing only the tracker, does without.
"""

from typing import Any

from mmrl.checkpoint.tracker import (
    TRAINER_STATE_FILE,
    CheckpointLayout,
    find_last_checkpoint,
    load_trainer_state,
    save_trainer_state,
)

__all__ = [
    "TRAINER_STATE_FILE",
    "CheckpointLayout",
    "find_last_checkpoint",
    "load_train_state",
    "load_trainer_state",
    "save_train_state",
    "save_trainer_state",
]


def __getattr__(name: str) -> Any:
    if name in ("load_train_state", "save_train_state"):
        from mmrl.checkpoint import state

        return getattr(state, name)
    raise AttributeError(f"module 'mmrl.checkpoint' has no attribute {name!r}")
