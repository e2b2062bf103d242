"""The collector pause of a process's start-up and the frozen heap after it (mmrl.runtime.startup)."""

import gc
import json
import subprocess
import sys
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


FREEZE_CHILD = """
import gc, json, weakref
from mmrl.runtime.startup import collector_paused, freeze_heap

with collector_paused(freeze=True):
    import torch  # a start-up's heap, frozen before the collector resumes
young_after_the_block, frozen_by_the_block = gc.get_count()[0], gc.get_freeze_count()

class Node:
    pass

def dropped_cycle():
    node = Node()
    node.self = node
    freed = []
    return node, freed, weakref.ref(node, lambda _: freed.append(True))

before, freed_before, ref_before = dropped_cycle()
freeze_heap()
walked_after = len(gc.get_objects())
after, freed_after, ref_after = dropped_cycle()
del before, after
gc.collect()
print(json.dumps([young_after_the_block, frozen_by_the_block, walked_after, freed_before, freed_after]))
"""


def test_a_frozen_heap_is_left_out_of_every_later_collection():
    """Everything alive at the freeze (torch's modules) leaves the collector's generations: a later
    collection walks only newer objects, frees a cycle made after it, and leaves one made before. A
    paused block that freezes leaves nothing young for the collector's first pass after it."""
    done = subprocess.run([sys.executable, "-c", FREEZE_CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    young_after_the_block, frozen, walked_after, freed_before, freed_after = json.loads(done.stdout)
    assert frozen > 100_000  # torch's heap
    assert young_after_the_block < 100  # went straight from the pause to the freeze, not through gen 0
    assert walked_after < 100  # the second freeze took the first cycle and what the child defined
    assert freed_after == [True] and freed_before == []


def test_a_block_that_fails_freezes_nothing():
    frozen = gc.get_freeze_count()
    with pytest.raises(ImportError), collector_paused(freeze=True):
        raise ImportError("a failed import")
    assert gc.get_freeze_count() == frozen and gc.isenabled()
