"""The collector pause of a process's start-up (mmrl.runtime.startup)."""

import gc
import weakref

import pytest

from mmrl.runtime.startup import collector_paused


def _cycle_collected_by_the_collector() -> bool:
    """Makes a reference cycle, drops it, and says whether the collector (run by allocation, as it runs
    on its own) freed it."""

    class Node:
        pass

    node = Node()
    node.self = node
    freed = []

    ref = weakref.ref(node, lambda _: freed.append(True))
    del node
    kept = [[] for _ in range(10_000)]  # live objects well past the youngest generation's threshold (700)
    del kept, ref
    return bool(freed)


def test_the_collector_is_off_inside_and_on_again_after():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        assert not _cycle_collected_by_the_collector()
    assert gc.isenabled()
    assert _cycle_collected_by_the_collector()


def test_an_error_inside_turns_it_on_again_and_a_collector_that_was_off_stays_off():
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("a failed import")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
