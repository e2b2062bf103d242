"""Driver-side checkpoint layout: atomic commit, tracker of the latest and best steps, pruning.

Layout under ``save_dir``::

    global_step_N.tmp/          a save in progress (workers write actor/, critic/; the driver
                                trainer_state.json); renamed to global_step_N once every part is there
    global_step_N/              a complete checkpoint
    checkpoint_tracker.json     {"latest_step", "best_step", "best_metric", "metric_name",
                                "higher_is_better"}, replaced atomically

A crash during a save leaves only a ``.tmp`` folder: the latest complete checkpoint and the tracker
are untouched, ``latest_step`` ignores the folder and the next ``begin`` removes it. No
``torch.distributed`` here: the driver calls these between the workers' save calls.

Several machines: ``save_dir`` must be one folder that the driver and every training machine see
(a shared filesystem). ``begin`` writes a random save id into the ``.tmp`` folder; each rank reads it
back (:func:`read_save_id`) and returns it with the report of what it wrote, and ``commit`` judges the
folder complete from those reports, refusing a save whose ranks did not see the driver's id (they
wrote to a disk of their own).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

TRACKER_FILE = "checkpoint_tracker.json"
TRAINER_STATE_FILE = "trainer_state.json"
STEP_PREFIX = "global_step_"
TMP_SUFFIX = ".tmp"
# In a .tmp folder while a save runs: the driver's id of the save, which every rank reads back.
SAVE_ID_FILE = ".save_id"
# A committed folder being replaced by a new save of the same step; removed at the next begin().
REPLACED_SUFFIX = ".replaced"
_STEP_DIR_PATTERN = re.compile(rf"^{STEP_PREFIX}(\d+)$")


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (full disk, unwritable folder); the message names the folder,
    the OS error and the last complete checkpoint, which is left intact."""


def _write_json_atomically(path: Path, data: dict[str, Any]) -> None:
    """Writes ``path`` so that readers see the old or the new content, never a partial file."""
    tmp_path = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp_path, "w") as file:
        file.write(json.dumps(data, indent=2) + "\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp_path, path)


def read_save_id(tmp_dir: str | Path) -> str | None:
    """The save id ``CheckpointLayout.begin`` wrote into ``tmp_dir``, as this process sees it (None
    when this machine does not see the driver's folder)."""
    try:
        return (Path(tmp_dir) / SAVE_ID_FILE).read_text().strip()
    except FileNotFoundError:
        return None


def save_trainer_state(directory: str | Path, state: dict[str, Any]) -> Path:
    """Writes ``state`` (global step, epoch, dataloader position, KL coefficient, ...) as JSON."""
    path = Path(directory) / TRAINER_STATE_FILE
    try:
        text = json.dumps(state, indent=2)
    except TypeError as error:
        raise TypeError(
            f"trainer state for {path} must be JSON-serialisable (numbers, strings, lists, dicts): {error}; "
            f"convert tensors with .item() / .tolist() first"
        ) from error
    path.write_text(text + "\n")
    return path


def load_trainer_state(step_dir: str | Path) -> dict[str, Any]:
    """The trainer state saved in ``step_dir`` (a ``global_step_N`` folder)."""
    path = Path(step_dir) / TRAINER_STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: {step_dir} is not a complete mmrl checkpoint")
    return json.loads(path.read_text())


class CheckpointLayout:
    """The ``global_step_N`` folders and tracker file under ``save_dir``.

    ``save_limit``: keep the newest ``save_limit`` complete checkpoints plus the best one (so at most
    ``save_limit + 1`` folders); -1 or 0 keeps all.
    """

    def __init__(self, save_dir: str | Path, save_limit: int = -1):
        self.save_dir = Path(save_dir)
        self.save_limit = save_limit

    @property
    def tracker_path(self) -> Path:
        return self.save_dir / TRACKER_FILE

    def step_dir(self, step: int) -> Path:
        return self.save_dir / f"{STEP_PREFIX}{step}"

    def tmp_dir(self, step: int) -> Path:
        return self.save_dir / f"{STEP_PREFIX}{step}{TMP_SUFFIX}"

    def complete_steps(self) -> list[int]:
        """Steps of the committed ``global_step_N`` folders, ascending (``.tmp`` folders excluded)."""
        if not self.save_dir.is_dir():
            return []
        steps = []
        for path in self.save_dir.iterdir():
            match = _STEP_DIR_PATTERN.match(path.name)
            if match and path.is_dir():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def read_tracker(self) -> dict[str, Any] | None:
        """The tracker's content, or None when it is missing or unreadable."""
        try:
            return json.loads(self.tracker_path.read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, OSError) as error:
            logger.warning("ignoring unreadable checkpoint tracker %s: %s", self.tracker_path, error)
            return None

    def latest_step(self) -> int | None:
        """Newest complete checkpoint: the tracker's ``latest_step`` when its folder exists and no newer
        complete one does (a crash between rename and tracker update), else the newest folder found."""
        if self.save_dir.is_dir():
            self._restore_replaced()
        steps = self.complete_steps()
        if not steps:
            return None
        tracker = self.read_tracker()
        tracked = tracker.get("latest_step") if tracker else None
        if tracked != steps[-1]:
            logger.info(
                "checkpoint tracker %s says latest step %s; the newest complete folder is %s — using the folder",
                self.tracker_path,
                tracked,
                self.step_dir(steps[-1]).name,
            )
        return steps[-1]

    def best_step(self) -> int | None:
        """The tracker's best step if its folder still exists."""
        tracker = self.read_tracker()
        best = tracker.get("best_step") if tracker else None
        return best if best is not None and self.step_dir(best).is_dir() else None

    def _restore_replaced(self) -> None:
        """Puts back a complete folder set aside by a commit of the same step that crashed before the
        new folder took its name."""
        for path in self.save_dir.glob(f"{STEP_PREFIX}*{REPLACED_SUFFIX}"):
            original = path.with_name(path.name.removesuffix(REPLACED_SUFFIX))
            if path.is_dir() and not original.exists():
                logger.warning("restoring %s, set aside by an interrupted checkpoint save", original)
                path.rename(original)

    def begin(self, step: int) -> Path:
        """Removes leftovers of interrupted saves and returns a fresh, empty ``global_step_{step}.tmp``."""
        self.save_dir.mkdir(parents=True, exist_ok=True)
        self._restore_replaced()
        for path in self.save_dir.iterdir():
            if path.name.startswith(STEP_PREFIX) and path.name.endswith((TMP_SUFFIX, REPLACED_SUFFIX)):
                logger.warning("removing %s left by an interrupted checkpoint save", path)
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
        tmp_dir = self.tmp_dir(step)
        tmp_dir.mkdir()
        save_id_file = tmp_dir / SAVE_ID_FILE
        try:
            save_id_file.write_text(uuid.uuid4().hex + "\n")
        except OSError as err:  # a full disk fails at close, with no file named
            raise OSError(err.errno, err.strerror, str(save_id_file)) from None
        return tmp_dir

    def _check_reports(self, tmp_dir: Path, part: str, reports: Sequence[Mapping[str, Any]]) -> list[str]:
        """Problems of ``part`` according to its ranks' reports (see :func:`read_save_id`)."""
        from mmrl.checkpoint.state import missing_from_reports

        save_id = read_save_id(tmp_dir)
        strangers = sorted(report["rank"] for report in reports if report.get("save_id") != save_id)
        if strangers:
            return [
                f"ranks {strangers} wrote {part} into a folder {tmp_dir} of their own machine, not the "
                "driver's: trainer.save_checkpoint_path must be a folder that the driver and every node "
                "share (NFS, Lustre, a mounted bucket)"
            ]
        return [f"{part}: {name} is missing" for name in missing_from_reports(list(reports))]

    def _check_parts(
        self, tmp_dir: Path, parts: Sequence[str], reports: Mapping[str, Sequence[Mapping[str, Any]]]
    ) -> None:
        # here, not at the top: the state module imports torch.distributed.checkpoint (seconds)
        from mmrl.checkpoint.state import missing_state_files

        problems = []
        for part in parts:
            path = tmp_dir / part
            if part in reports:
                problems += self._check_reports(tmp_dir, part, reports[part])
            elif not path.exists():
                problems.append(f"{part} is missing")
            elif path.is_dir():
                problems += [f"{part}/{name} is missing" for name in missing_state_files(path)]
        if problems:
            raise FileNotFoundError(
                f"checkpoint {tmp_dir} is incomplete: {'; '.join(problems)}. Every part listed in "
                f"commit(parts=...) must be fully written before the commit; the folder is left as is"
            )

    def _updated_tracker(
        self, step: int, metric: float | None, metric_name: str | None, higher_is_better: bool
    ) -> dict[str, Any]:
        tracker = self.read_tracker() or {}
        best_step = self.best_step()
        best_metric = tracker.get("best_metric") if best_step is not None else None
        tracked_metric = (tracker.get("metric_name"), tracker.get("higher_is_better", True))
        if metric is not None:
            if best_step is not None and tracked_metric != (metric_name, higher_is_better):
                logger.warning(
                    "checkpoint metric changed from %s to %s: the best step restarts from step %d",
                    tracked_metric,
                    (metric_name, higher_is_better),
                    step,
                )
                best_step, best_metric = None, None
            tracked_metric = (metric_name, higher_is_better)
            if best_metric is None or (metric > best_metric if higher_is_better else metric < best_metric):
                best_step, best_metric = step, float(metric)
        return {
            "latest_step": step,
            "best_step": best_step,
            "best_metric": best_metric,
            "metric_name": tracked_metric[0],
            "higher_is_better": tracked_metric[1],
        }

    def commit(
        self,
        step: int,
        parts: Sequence[str] = ("actor", TRAINER_STATE_FILE),
        metric: float | None = None,
        metric_name: str | None = None,
        higher_is_better: bool = True,
        reports: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    ) -> Path:
        """Publishes ``global_step_{step}.tmp`` as ``global_step_{step}`` and returns the new folder.

        Checks every name in ``parts``: a role folder with ``reports`` (its ranks' ``save_train_state``
        reports, each with the ``save_id`` the rank read) from the reports alone; any other part by
        looking at the folder (the driver's own files; role folders saved in this process). Then
        renames, updates the tracker (the best step follows ``metric`` when given) and prunes to
        ``save_limit`` keeping the best.
        """
        tmp_dir, step_dir = self.tmp_dir(step), self.step_dir(step)
        if not tmp_dir.is_dir():
            raise FileNotFoundError(f"{tmp_dir} does not exist; call begin({step}) before commit({step})")
        self._check_parts(tmp_dir, parts, reports or {})
        (tmp_dir / SAVE_ID_FILE).unlink(missing_ok=True)
        tracker = self._updated_tracker(step, metric, metric_name, higher_is_better)
        if step_dir.exists():
            # The same step saved again (e.g. the final save right after a periodic one): keep the old
            # folder under another name until the new one is in place (a crash in between restores it).
            replaced_dir = step_dir.with_name(step_dir.name + REPLACED_SUFFIX)
            step_dir.rename(replaced_dir)
            tmp_dir.rename(step_dir)
            shutil.rmtree(replaced_dir)
        else:
            tmp_dir.rename(step_dir)
        _write_json_atomically(self.tracker_path, tracker)
        self.prune()
        return step_dir

    def prune(self) -> list[int]:
        """Removes the oldest complete checkpoints beyond ``save_limit``, never the best or the newest."""
        steps = self.complete_steps()
        if self.save_limit is None or self.save_limit <= 0 or len(steps) <= self.save_limit:
            return []
        keep = set(steps[-self.save_limit :])
        best = self.best_step()
        if best is not None:
            keep.add(best)
        removed = [step for step in steps if step not in keep]
        for step in removed:
            shutil.rmtree(self.step_dir(step))
        return removed


def find_last_checkpoint(save_dir: str | Path) -> Path | None:
    """The newest complete ``global_step_N`` folder under ``save_dir``, or None."""
    layout = CheckpointLayout(save_dir)
    step = layout.latest_step()
    return None if step is None else layout.step_dir(step)
