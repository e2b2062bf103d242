"""Frozen-tower encodings kept on disk across epochs: one file per media item, named by a digest of
its key, so that the second epoch reads each image's or video's embeddings instead of encoding them.

A key (built by :class:`~mmrl.models.encoding_cache.EncodingCache`) holds the digest of the tower's
weights (as it computes with them), the item's grid and a digest of its pixel rows; the store adds a
digest of the settings that produced the rows (the ``data`` media keys, the processor). A changed
model, processor or media setting therefore names other files: a stale entry is never read, only
evicted as the oldest.

Safe with several ranks and nodes on one folder without a lock: a file is written under a temporary
name and renamed into place (``os.replace`` is atomic on one file system), and two writers of one key
write the same content. A file that cannot be read back whole, or holds another key, is skipped with
a warning and removed. The folder is kept under ``max_bytes``: when this process's count of the
folder's bytes (its last scan plus what it wrote since) passes the bound, or every
``SCAN_EVERY_WRITES`` writes (other writers' files), the folder is scanned and the files read or
written longest ago (their modification time, refreshed on every read) are removed until it fits.
Several writers may overshoot the bound by what they wrote between two scans.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
import uuid
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SUFFIX = ".pt"
STALE_TEMPORARY_S = 3600  # a temporary file this old belongs to a writer that died
SCAN_EVERY_WRITES = 64  # a folder of 100k items costs 100k stat calls a scan: not one per write


def digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _touch(path: Path) -> None:
    # the clock in nanoseconds: a file system's own stamps may not tell apart writes in one tick
    now = time.time_ns()
    os.utime(path, ns=(now, now))


class EncodingStore:
    """``load``/``save`` of one item's tower rows (``pooled`` [tokens, width] and, for Qwen3-VL, the
    deepstack features) under a key; ``reads``/``writes`` count the files read and written."""

    def __init__(self, directory: str | Path, max_bytes: int, settings: str = ""):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.settings = digest(settings)
        self.reads = self.writes = 0
        self.counted_bytes: int | None = None  # the folder's bytes as this process last counted them
        self.writes_since_scan = 0

    def path(self, key: tuple) -> Path:
        return self.directory / f"{digest(repr((self.settings, key)))}{SUFFIX}"

    def load(
        self, key: tuple, rows: int, device: torch.device
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None] | None:
        """The stored rows of ``key`` (``rows`` of them, on ``device``), or None when absent or unusable."""
        path = self.path(key)
        try:
            entry = torch.load(path, map_location=device, weights_only=True)
            pooled, deepstack = entry["pooled"], entry["deepstack"]
            if entry["key"] != repr((self.settings, key)) or pooled.shape[0] != rows:
                raise ValueError(f"holds {entry['key']} with {pooled.shape[0]} rows, not {key} with {rows}")
        except FileNotFoundError:
            return None
        except Exception as error:  # a truncated, corrupt or foreign file: encode instead
            logger.warning(
                "encoding cache: ignoring and removing %s (%s: %s)", path, type(error).__name__, error
            )
            path.unlink(missing_ok=True)
            return None
        # recently used: evicted last (another writer's eviction may have removed it: the rows are whole)
        with contextlib.suppress(FileNotFoundError):
            _touch(path)
        self.reads += 1
        return pooled, deepstack

    def save(self, key: tuple, pooled: torch.Tensor, deepstack: list[torch.Tensor] | None) -> None:
        path = self.path(key)
        temporary = path.with_name(f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        entry = {
            "key": repr((self.settings, key)),
            "pooled": pooled.detach().cpu(),
            "deepstack": [f.detach().cpu() for f in deepstack] if deepstack is not None else None,
        }
        try:
            torch.save(entry, temporary)
            size = temporary.stat().st_size
            os.replace(temporary, path)  # readers see the whole file or none
        except (OSError, RuntimeError) as error:  # a full disk (torch.save: RuntimeError), a read-only
            # folder: they cost the cache, not the run
            logger.warning("encoding cache: cannot write %s (%s)", path, error)
            temporary.unlink(missing_ok=True)
            return
        with contextlib.suppress(FileNotFoundError):  # evicted at once by another writer
            _touch(path)
        self.writes += 1
        self.writes_since_scan += 1
        if self.counted_bytes is not None:
            self.counted_bytes += size
        if (
            self.counted_bytes is None
            or self.counted_bytes > self.max_bytes
            or self.writes_since_scan >= SCAN_EVERY_WRITES
        ):
            self.evict()

    def evict(self) -> None:
        """Remove the least recently used files until the folder holds at most ``max_bytes``."""
        files, total = [], 0
        now = time.time()
        for entry in os.scandir(self.directory):
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue  # removed by another rank meanwhile
            if entry.name.endswith(".tmp"):
                if now - stat.st_mtime > STALE_TEMPORARY_S:
                    Path(entry.path).unlink(missing_ok=True)
                continue
            if entry.name.endswith(SUFFIX):
                files.append((stat.st_mtime_ns, stat.st_size, entry.path))
                total += stat.st_size
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            Path(path).unlink(missing_ok=True)
            total -= size
        self.counted_bytes, self.writes_since_scan = total, 0
