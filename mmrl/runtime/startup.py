"""A process's start-up: the imports of torch, transformers, vLLM and Ray, with Python's cyclic garbage
collector paused, and what they built then frozen out of the collector's way.

Importing them creates millions of objects and hardly any garbage, yet the collector walks the growing
heap again and again while they load: 10-16 % of the CPU seconds a driver, a training rank or a
reward worker spent on its imports (before reward workers stopped importing transformers), ~18 % of
vLLM's (``bench/startup.py``). Every process of a run pays it, so the driver's config and pre-flight
checks, the worker module a rank imports and a vLLM engine's modules load inside
:func:`collector_paused`.

Once loaded, those objects live as long as the process, but every full collection walks them again:
a rank's and the driver's collections of a 2-step tiny run cost ~0.9 CPU-s each, and a vLLM engine's
start collects five times on purpose (~1.4 CPU-s). A process that owns its whole life (the driver
once it trains, a rank once its worker module is in) therefore calls :func:`freeze_heap` there, and a
vLLM rollout does once vLLM's modules are in (its engine freezes everything itself as it finishes
starting): everything alive moves to the collector's permanent generation (:func:`gc.freeze`, the
pattern the Python documentation gives for a process after its start-up), and later collections walk
only what came after. It happens before the collector resumes (``collector_paused(freeze=True)``):
the objects a paused block made are all in the youngest generation, and the first passes after it
would walk them all.
The few cycles the imports left (~9,000 objects, paused) stay until the process ends.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def collector_paused(*, freeze: bool = False) -> Iterator[None]:
    """Pauses the cyclic garbage collector for the block (reference counting still frees everything
    acyclic); it resumes after, unless it was already off. With ``freeze``, a block that ends without
    an error ends with :func:`freeze_heap`, before the collector resumes: otherwise its first passes
    walk everything the block built, young as it all is (~0.3 CPU-s each in a driver)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
        if freeze:
            freeze_heap()
    finally:
        if was_enabled:
            gc.enable()


def freeze_heap() -> None:
    """Moves every object alive now to the collector's permanent generation: later collections skip
    them (their memory is freed as usual when their last reference goes). For processes that own
    their whole life (a driver as it trains, a rank), or about to start a vLLM engine (which freezes
    the heap itself); never a library caller's process otherwise.

    At exit the heap goes back to the collector (``gc.unfreeze``), so the interpreter's last collection
    finalizes it as it would have: extensions that count their objects as they unload (triton's
    nanobind bindings, which torch's compiler imports) would otherwise print pages of "leaked" ones."""
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache  # registered once per process
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)
