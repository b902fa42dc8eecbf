"""gc_scope.young_only: the old heap out of the collector's reach inside, everything as it was after."""
import gc
import threading

import pytest

from mamba_debug.gc_scope import YOUNG_THRESHOLD, young_only


@pytest.fixture
def clean_gc():
    gc.unfreeze()
    before = gc.get_threshold()
    yield before
    gc.unfreeze()
    gc.set_threshold(*before)


def test_scope_freezes_the_old_heap_and_restores_everything(clean_gc):
    old = [object() for _ in range(3)] + [[1], {2: 3}]      # tracked containers, alive before the scope
    with young_only():
        assert gc.get_freeze_count() > len(old)
        assert gc.get_threshold()[0] == max(YOUNG_THRESHOLD, clean_gc[0])
        with young_only():                                   # nested: the outer scope keeps acting
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() > 0, "the inner scope's exit must not unfreeze the outer one's heap"
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == clean_gc


def test_an_error_inside_restores_the_collector(clean_gc):
    with pytest.raises(RuntimeError, match="inside"), young_only():
        raise RuntimeError("inside")
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == clean_gc


def test_cycles_made_inside_are_still_collected(clean_gc):
    class Node:
        pass
    with young_only():
        a, b = Node(), Node()
        a.other, b.other = b, a
        del a, b
        assert gc.collect() >= 2        # young garbage is collected inside the scope


def _frozen(obj) -> bool:
    """Whether a tracked object is frozen: gc.get_objects() lists the three generations, not the frozen set. (The
    freeze count cannot say: it drops whenever a frozen object dies, e.g. one a thread of an earlier test held.)"""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


def test_a_process_that_froze_its_own_objects_is_left_alone(clean_gc):
    theirs = []
    gc.freeze()
    with young_only():
        assert gc.get_threshold() == clean_gc
    assert _frozen(theirs), "its frozen objects are not ours to unfreeze"


def test_a_freeze_made_while_the_scope_is_open_is_kept(clean_gc):
    """Another thread (or a library about to fork) freezing the heap inside the scope: the exit must not undo it."""
    with young_only():
        theirs = []
        gc.freeze()
    assert _frozen(theirs), "frozen by someone else while the scope was open: not ours to unfreeze"
    assert gc.get_threshold() == clean_gc


def test_threads_share_one_scope(clean_gc):
    inside, go = threading.Event(), threading.Event()

    def worker():
        with young_only():
            inside.set()
            go.wait(10)
    t = threading.Thread(target=worker)
    with young_only():
        t.start()
        inside.wait(10)
    assert gc.get_freeze_count() > 0, "the other thread's scope is still open"
    go.set()
    t.join(10)
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == clean_gc
