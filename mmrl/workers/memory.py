"""Peak memory of each phase on a worker: what a 3B–7B job needs per device, phase by phase.

On an accelerator the peak is the caching allocator's (``torch.cuda.max_memory_allocated``, reset at
the start of each phase); on a CPU it is the process's resident-set high-water mark (``VmHWM`` of
``/proc/self/status``, reset by writing ``5`` to ``/proc/self/clear_refs``, Linux 4.0+). Where the
mark cannot be reset the peak since start is reported, which can only overstate a later phase.
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
        self.peaks: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_resident_peak()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(self.device)
            else:
                peak = resident_peak_bytes()
            self.peaks[name] = max(self.peaks.get(name, 0.0), peak / GiB)

    def take(self) -> dict[str, float]:
        taken = {f"memory/{name}_peak_gib": value for name, value in self.peaks.items()}
        self.peaks = {}
        return taken


def measured(phase: str) -> Callable[[Callable], Callable]:
    """Run a worker method inside ``self.peaks.phase(phase)`` (the worker holds a :class:`PhasePeaks`)."""

    def wrap(method: Callable) -> Callable:
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            with self.peaks.phase(phase):
                return method(self, *args, **kwargs)

        return run

    return wrap
