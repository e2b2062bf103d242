"""Peak memory of each phase on a worker: what a 3B–7B job needs per device, phase by phase.

On an accelerator three figures per phase, because the tensors alone understate what a device holds:
the peak of the tensors (``torch.cuda.max_memory_allocated``, ``memory/<phase>_peak_gib``), the peak
that torch's caching allocator reserved from the device (``max_memory_reserved``, tensors plus cached
blocks and fragmentation: ``<phase>_reserved_peak_gib``), and what the device had free at the phase's
end (``mem_get_info``: memory of every process and allocator on it counted, vLLM's own and NCCL's
included: ``<phase>_device_free_gib``); the peaks are reset at the start of each phase. On a CPU the
peak is the process's resident-set high-water mark (``VmHWM`` of ``/proc/self/status``, reset by
writing ``5`` to ``/proc/self/clear_refs``, Linux 4.0+). Where the mark cannot be reset the peak since
start is reported, which can only overstate a later phase.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

GiB = 1024**3


def _reset_resident_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def resident_peak_bytes() -> int:
    """This process's peak resident set since start or the last reset (VmHWM), in bytes."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PhasePeaks:
    """``with peaks.phase("update_actor"): ...`` records that phase's peak; :meth:`take` hands the
    peaks of the phases since the last take to the driver (``memory/<phase>_peak_gib``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.peaks: dict[str, float] = {}  # metric name -> GiB: the largest peak, the smallest free

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_resident_peak()
        try:
            yield
        finally:
            figures = self._cuda_figures() if self.device.type == "cuda" else {"peak": resident_peak_bytes()}
            for figure, value in figures.items():
                key = f"memory/{name}_{figure}_gib"
                worst = min if figure.endswith("free") else max
                self.peaks[key] = worst(self.peaks.get(key, value / GiB), value / GiB)

    def _cuda_figures(self) -> dict[str, int]:
        free, _ = torch.cuda.mem_get_info(self.device)
        return {
            "peak": torch.cuda.max_memory_allocated(self.device),
            "reserved_peak": torch.cuda.max_memory_reserved(self.device),
            "device_free": free,
        }

    def take(self) -> dict[str, float]:
        taken, self.peaks = self.peaks, {}
        return taken


def combine_rank_peaks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The ranks' :meth:`PhasePeaks.take` as one set of metrics: the largest peak of any rank, the
    smallest free memory of any rank (``*_free_gib``)."""
    keys = set().union(*per_rank)
    return {
        key: (min if key.endswith("_free_gib") else max)(peaks[key] for peaks in per_rank if key in peaks)
        for key in keys
    }


def measured(phase: str) -> Callable[[Callable], Callable]:
    """Run a worker method inside ``self.peaks.phase(phase)`` (the worker holds a :class:`PhasePeaks`)."""

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            with self.peaks.phase(phase):
                return method(self, *args, **kwargs)

        return run

    return wrap
