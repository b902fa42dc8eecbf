"""Keep Python's cyclic garbage collector off the old heap while a run or a dashboard redraw works.

A process that has imported torch, Triton and matplotlib tracks ~330 000 container objects, and a full collection
walks them all: ~150 ms on the 2-core CI machine. Triton's interpreter allocates enough to set one off every
second or so (5 in one 6-second compare, 0.7 s of it; one in the middle of most dashboard updates). Inside
`young_only()`, `gc.freeze()` has moved every object that existed at entry out of the collector's reach, so the
collections that still run walk only what the scope allocated, and fewer of them run (a larger first threshold);
at exit `gc.unfreeze()` hands the old objects back and the thresholds are restored. Nothing is freed later than
it would be otherwise except cycles among objects older than the scope, which the next full collection after it
frees.

Process-wide settings, so: only the outermost scope of any thread acts (a counter under a lock), and not at all when
the process has frozen objects of its own (`gc.get_freeze_count() > 0` at entry: unfreezing those is not ours to
do) or turned the collector off. Nor does the exit unfreeze when someone froze objects while the scope was open
(another thread, a library about to fork): `gc.unfreeze()` would undo their freeze, so the heap then stays frozen as
they asked. A marker made just after our freeze tells: it is among the collector's objects at exit unless a freeze
took it. (The freeze count cannot tell: it also drops whenever a frozen object dies.) Listing those objects is cheap
there, as they are only what the scope allocated and kept.
"""
from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

YOUNG_THRESHOLD = 20_000    # allocations between young collections inside a scope (Python's default: 700)

_lock = threading.Lock()
_depth = 0
_saved = None               # the thresholds to restore, when the outermost scope froze the heap
_marker = None              # a container made just after that freeze: frozen at exit only by someone else's freeze


@contextmanager
def young_only():
    """Collect only objects younger than the outermost scope while it lasts (see the module docstring)."""
    _enter()
    try:
        yield
    finally:
        _leave()


def _enter():
    global _depth, _saved, _marker
    with _lock:
        if _depth == 0 and gc.isenabled() and gc.get_freeze_count() == 0:
            _saved = gc.get_threshold()
            gc.freeze()
            _marker = []
            gc.set_threshold(max(YOUNG_THRESHOLD, _saved[0]), *_saved[1:])
        _depth += 1


def _leave():
    global _depth, _saved, _marker
    with _lock:
        _depth -= 1
        if _depth == 0 and _saved is not None:
            if any(o is _marker for o in gc.get_objects()):     # nobody else froze the heap meanwhile
                gc.unfreeze()
            gc.set_threshold(*_saved)
            _saved = _marker = None
