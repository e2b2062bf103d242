"""A process's start-up: the imports of torch, transformers, vLLM and Ray, with Python's cyclic garbage
collector paused.

Importing them creates millions of objects and hardly any garbage, yet the collector walks the growing
heap again and again while they load: 10-16 % of the CPU seconds a driver, a training rank or a
reward worker spent on its imports (before reward workers stopped importing transformers), ~18 % of
vLLM's (``bench/startup.py``). Every process of a run pays it, so the driver's config and pre-flight
checks, the worker module a rank imports and a vLLM engine's modules load inside
:func:`collector_paused`. The collector
resumes as they end, before any model is built (vLLM's engine start runs with it on: it collects
explicitly, and is slower when the collector was off).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pauses the cyclic garbage collector for the block (reference counting still frees everything
    acyclic); it resumes after, unless it was already off."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
