"""Deferred copies (sides/llamacpp/defer.py, fastpath.c): the stops a path is planned with, and the C fast path driven
the way llama.cpp's scheduler drives its eval callback (ggml_backend_sched_compute_splits: ask node after node until
one answers yes, compute that view, observe its last node), over fake nodes whose values a fake compute writes.
A deferred value is copied after later nodes ran, so each case checks that every copy holds what its node wrote,
that nothing a later node overwrote is ever copied, that a pending node is marked an output while it waits (no
fusion into the next node) and gets its flags back, and how many times llama.cpp had to stop."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from mamba_debug.sides.llamacpp import defer, fastpath
from mamba_debug.sides.llamacpp.defer import DEFER, FLUSH, NONE
from mamba_debug.sides.llamacpp.lib import EvalCallback, GgmlTensor
from mamba_debug.sides.llamacpp.observe import NAME_OFF, STRUCT

DLL = fastpath.load()[0]
needs_c = pytest.mark.skipif(DLL is None, reason="no C compiler: the fast path is not built")
HOST, DEVICE = 0x1000, 0x2000           # two fake buffers: host and device memory
VIEW_OP, WRITE_OP = 3, 7                # fake ggml op values: a view (writes nothing), an op that writes


class Graph:
    """Fake nodes over one float32 memory: node i writes i + 1 (times its round) into [off, off + n) when computed."""

    def __init__(self, nodes):
        self.mem = np.zeros(256, dtype=np.float32)
        self.tensors = [GgmlTensor() for _ in nodes]
        self.spec = nodes
        for t, (name, off, n, op, buf) in zip(self.tensors, nodes):
            t.type, t.op, t.buffer = 0, op, buf
            t.ne[:] = (n, 1, 1, 1)
            t.nb[:] = (4, 4 * n, 4 * n, 4 * n)
            t.data = self.mem.ctypes.data + 4 * off
            t.name = name.encode()
        self.round, self.computed, self.flags_seen = 1, [], []

    def addr(self, i) -> int:
        return ctypes.addressof(self.tensors[i])

    def compute(self, i):
        name, off, n, op, _ = self.spec[i]
        self.flags_seen.append([t.flags for t in self.tensors])
        if op == WRITE_OP:
            self.mem[off:off + n] = (i + 1) * self.round
        self.computed.append(i)

    def schedule(self, cb, order=None) -> int:
        """ggml_backend_sched_compute_splits over one split of the nodes in `order` (default: all, in turn): the
        number of views computed (llama.cpp's stops)."""
        order = list(range(len(self.tensors))) if order is None else order
        j0, n, views = 0, len(order), 0
        while j0 < n:
            j1, need = j0, cb(self.addr(order[j0]), True, None)
            while not need and j1 < n - 1:
                j1 += 1
                need = cb(self.addr(order[j1]), True, None)
            for j in range(j0, j1 + 1):
                self.compute(order[j])
            views += 1
            if need:
                cb(self.addr(order[j1]), False, None)
            j0 = j1 + 1
        return views


class Step:
    """What FastPath.mirror and defer.plan read of an observe._Step."""

    def __init__(self, g: Graph, i: int, read: bool, host=True, backend=0):
        _, off, n, op, _ = g.spec[i]
        t = g.tensors[i]
        self.raw = bytes(STRUCT.from_address(g.addr(i)))
        self.dst = np.zeros(n, dtype=np.float32)
        self.read = ((None, g.spec[i][0]), self.dst.ctypes.data, 4 * n, self.dst) if read else None
        data = t.data
        self.span = defer.Span((data, data + 4 * n) if op == WRITE_OP else None, host, (), backend, data, 4 * n)
        self.kids, self.leaves, self.mirror, self.next, self.ends = {}, None, None, None, False


def chain(g: Graph, reads, backend=0, nodes=None) -> list:
    steps = [Step(g, i, i in reads, backend=backend) for i in (range(len(g.spec)) if nodes is None else nodes)]
    for a, b in zip(steps, steps[1:]):
        a.kids[b.raw], a.next = b, b
    return steps


class Harness:
    """A FastPath over fake ggml functions (a plain memcpy for the copies; `async_` a fake backend that counts its
    waits) and a Python callback that starts the path at a graph's first node and answers no to anything else."""

    def __init__(self, async_=False):
        self.syncs, self.py_asks = 0, []
        self._get = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)(
            lambda t, dst, off, size: ctypes.memmove(dst, GgmlTensor.from_address(t).data + off, size))
        self._get_async = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                           ctypes.c_size_t)(lambda b, t, dst, off, size: self._get(t, dst, off, size))
        self._sync = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda b: setattr(self, "syncs", self.syncs + 1))
        self._nbytes = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p)(
            lambda t: 4 * GgmlTensor.from_address(t).ne[0])
        self._is_host = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p)(lambda b: b == HOST)
        self.writes = np.ones(256, dtype=np.uint8)
        self.writes[VIEW_OP] = 0
        self.defer, self.async_ = True, async_
        self.scratch = np.zeros(1 << 16, dtype=np.uint8) if async_ else None   # merged copies land here first
        self.py = EvalCallback(self._py)
        self.fast = fastpath.FastPath(DLL, self.py, ctypes.cast(self._get, ctypes.c_void_p).value,
                                      ctypes.sizeof(STRUCT), NAME_OFF, self)
        self.start = None
        DLL.md_eval.argtypes = [ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p]
        self.cb = lambda t, ask, _: DLL.md_eval(t, ask, self.fast.user_data)

    def c_fields(self) -> dict:
        ptr = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
        return {"get_async": ptr(self._get_async) if self.async_ else None,
                "sync": ptr(self._sync) if self.async_ else None, "nbytes": ptr(self._nbytes),
                "is_host": ptr(self._is_host), "writes": self.writes.ctypes.data, "flags_off": GgmlTensor.flags.offset,
                "op_off": GgmlTensor.op.offset, "buffer_off": GgmlTensor.buffer.offset,
                "data_off": GgmlTensor.data.offset, "tensor_size": ctypes.sizeof(GgmlTensor),
                "type_off": GgmlTensor.type.offset, "ne_off": GgmlTensor.ne.offset, "nb_off": GgmlTensor.nb.offset}

    def _py(self, t, ask, _):
        if ask:
            self.py_asks.append(t)
            if self.start is not None and t == self.start[0]:
                self.fast.go(self.start[1])     # the Tracer's first node of a known graph: C walks on from here
                return self.start[1].read is not None
            return False
        return True

    def run(self, g: Graph, steps: list, order=None) -> int:
        first = 0 if order is None else order[0]
        self.start = (g.addr(first), steps[0])
        self.fast.begin(True)
        views = g.schedule(self.cb, order)
        self.fast.finish()
        return views


def test_the_plan_stops_before_whatever_may_overwrite_a_pending_value():
    g = Graph([("a", 0, 8, WRITE_OP, HOST), ("a_view", 0, 4, VIEW_OP, HOST), ("a_inplace", 0, 8, WRITE_OP, HOST),
               ("d", 8, 8, WRITE_OP, HOST), ("e", 16, 8, WRITE_OP, HOST), ("f", 8, 8, WRITE_OP, HOST)])
    steps = chain(g, {0, 1, 2, 3, 5})
    # a is overwritten in place by a_inplace (its view a_view reads a's memory: it waits with a); f overwrites d
    assert defer.plan(steps) == [DEFER, FLUSH, DEFER, FLUSH, NONE, FLUSH]
    assert defer.plan(steps, defer=False) == [FLUSH, FLUSH, FLUSH, FLUSH, NONE, FLUSH]
    for s in steps[3:]:
        s.span.host = False                             # d on the device: a new split starts there
    assert defer.plan(steps) == [DEFER, FLUSH, FLUSH, FLUSH, NONE, FLUSH]
    steps[4].span.host = True                           # and e back on the host: d's copy cannot wait past it
    steps[5].span.w = None
    assert defer.plan(steps) == [DEFER, FLUSH, FLUSH, FLUSH, NONE, FLUSH]
    for s in steps[3:]:
        s.span.host = True
    steps[5].span.w = (g.tensors[5].data, g.tensors[5].data + 32)
    steps[2].kids["other"] = object()                   # the path may leave after a_inplace: stop before
    assert defer.plan(steps) == [DEFER, FLUSH, FLUSH, FLUSH, NONE, FLUSH]
    del steps[2].kids["other"]
    steps[4].span.copies = ((4 * 8 + g.tensors[0].data, 4 * 12 + g.tensors[0].data),)   # e reads a copy over d
    assert defer.plan(steps)[3] == FLUSH and defer.plan(steps)[2] == DEFER
    steps[4].span.copies = ()
    steps[3].ends = True                                # a graph ended at d once
    assert defer.plan(steps)[3] == FLUSH


def test_a_long_run_of_reads_stops_before_the_c_side_runs_out_of_slots():
    g = Graph([(f"n{i}", i, 1, WRITE_OP, HOST) for i in range(80)])
    modes = defer.plan(chain(g, set(range(80))))
    runs, n = [], 0
    for m in modes:
        n += 1
        if m == FLUSH:
            runs.append(n)
            n = 0
    assert max(runs) < defer.MAX_PENDING and sum(runs) == 80


@needs_c
@pytest.mark.parametrize("async_", [False, True])
def test_deferred_copies_hold_what_each_node_wrote(async_):
    g = Graph([("a", 0, 8, WRITE_OP, HOST), ("a_view", 0, 4, VIEW_OP, HOST), ("a_inplace", 0, 8, WRITE_OP, HOST),
               ("d", 8, 8, WRITE_OP, HOST), ("e", 16, 8, WRITE_OP, HOST), ("f", 8, 8, WRITE_OP, HOST),
               ("g", 24, 8, WRITE_OP, HOST)])
    h = Harness(async_)
    steps = chain(g, {0, 1, 2, 3, 5, 6}, backend=1 if async_ else 0)
    for rnd in (1, 2):                                   # the second round reuses the graph and the mirrors
        g.round = rnd
        views = h.run(g, steps)
        # stops: a's ask goes to Python (the graph's first node), then a_view, d and g (the plan's FLUSH steps)
        assert views == 4
        got = {s.read[0][1]: s.dst.copy() for s in steps if s.read is not None}
        assert np.all(got["a_view"] == rnd) and np.all(got["a_inplace"] == 3 * rnd)
        assert np.all(got["d"] == 4 * rnd) and np.all(got["f"] == 6 * rnd) and np.all(got["g"] == 7 * rnd)
        assert sorted(h.fast.observed_reads()) == sorted(s.read[0] for s in steps[1:] if s.read is not None)
        assert all(t.flags == 0 for t in g.tensors)      # every flag put back
    # while a_inplace was pending, its node was marked an output (no backend fuses it into d)
    assert g.flags_seen[g.computed.index(3)][2] & 2
    c = h.fast.counts()
    assert c["c_deferred"] == 4 and c["c_stops"] == 6 and c["forced_stops"] == 0
    assert h.syncs == (6 if async_ else 0)               # one wait per stop, not one per copy
    # asynchronous: a stop's values close together in one buffer go as one range (a_inplace and d: one call each
    # round; f and g too); synchronous: one call per value
    assert (c["c_copies"], c["c_merged"]) == ((6, 8) if async_ else (10, 0))


@needs_c
@pytest.mark.parametrize("overlaps", [False, True])
def test_a_node_off_the_path_stops_llama_cpp_or_gives_up_what_it_may_overwrite(overlaps):
    # the known path is a, b, x, d; a later graph has x2 in x's place, which overwrites b (or nothing pending)
    g = Graph([("a", 0, 8, WRITE_OP, HOST), ("b", 8, 8, WRITE_OP, HOST), ("x", 32, 8, WRITE_OP, HOST),
               ("d", 16, 8, WRITE_OP, HOST), ("x2", 8 if overlaps else 40, 8, WRITE_OP, HOST)])
    h = Harness()
    steps = chain(g, {0, 1, 3}, nodes=[0, 1, 2, 3])
    assert defer.plan(steps) == [DEFER, DEFER, NONE, FLUSH]
    h.run(g, steps, [0, 1, 2, 3])                        # C walks the known path: a to Python, b deferred, d stops
    assert np.all(steps[1].dst == 2)
    steps[1].dst[:] = 0
    g.round = 5
    h.py_asks.clear()
    views = h.run(g, steps, [0, 1, 4, 3])                # x2 is off the path: Python's turn, with b pending
    assert g.addr(4) in h.py_asks
    if overlaps:                # x2 writes over b before anything could copy it: given up, never copied
        assert h.fast.lost() == [(None, "b")] and np.all(steps[1].dst == 0)
        assert views == 2 and h.fast.counts()["forced_stops"] == 0
    else:                       # llama.cpp is made to stop after x2, and b is copied there
        assert h.fast.lost() == [] and np.all(steps[1].dst == 2 * 5)
        assert views == 3 and h.fast.counts()["forced_stops"] == 1
    assert all(t.flags == 0 for t in g.tensors)


def test_a_copy_given_up_is_not_observed_reported_and_ends_deferral_in_that_context():
    from mamba_debug.sides.llamacpp.observe import Tracer  # noqa: PLC0415

    class Fast:
        def __init__(self):
            self.steps, self.was_reset = [Step(Graph([("a", 0, 4, WRITE_OP, HOST)]), 0, True)], False
            self.steps[0].mirror = 1234

        def reset(self):
            self.was_reset = True

        def counts(self):
            return {"c_stops": 7, "c_deferred": 5, "forced_stops": 1, "c_copies": 3, "c_merged": 2, "c_copy_s": 0.5}

    class Copier:
        defer = True

        def words(self):
            return "deferred"
    tr = Tracer.__new__(Tracer)
    tr.fast, tr.copier, tr.u = Fast(), Copier(), 3
    tr.counts0 = {"c_stops": 2, "c_deferred": 1, "forced_stops": 0}
    tr.data, tr.lost = {(1, "y_scan"): np.zeros(2), (1, "B"): np.zeros(2)}, []
    with pytest.warns(UserWarning, match="deferred copies given up"):
        tr._give_up([(1, "y_scan")])
    assert list(tr.data) == [(1, "B")] and not tr.copier.defer
    assert tr.fast.was_reset and tr.fast.steps[0].mirror is None
    assert tr.copies() == {"how": "deferred", "stops_in_c": 5, "deferred": 4, "forced_stops": 1, "copy_calls": 3,
                           "merged": 2, "copy_s": 0.5, "lost": [{"ubatch": 3, "layer": 1, "site": "y_scan"}]}
