"""The eval callback's fast path in C (fastpath.c): a graph of a kind already seen is answered without entering Python.

observe.py's Tracer follows a trie of its nodes' struct bytes: on a repeated graph each ask is one comparison and
each observe one `ggml_backend_tensor_get`, yet each still costs a ctypes call into Python (~1-2 us, thousands
a decode). Here the trie's paths are mirrored into C structs (`md_step`: the struct bytes, the names of the leaves
to check, where to copy the values, the first child), and `md_eval` (the callback llama.cpp calls) walks them; any
node off a mirrored path goes to the Tracer's own callback, which says where the path stands when it returns.

The C file is compiled once per source and compiler into the cache folder ($MAMBA_DEBUG_CACHE or
~/.cache/mamba-debug/fastpath/) with the system's `cc`; where that fails, `load()` says why and the side runs
the Python callback alone, and records which one ran (`config.llama_cpp.callback`).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

from ...safeio import atomic_path, cache_dir
from . import defer

SOURCE = Path(__file__).with_name("fastpath.c")
MAX_OBSERVED = 1 << 13          # observes on the fast path per decode (past it, Python takes them)

_LOADED: dict = {}              # one library per process: (CDLL, None) or (None, why it is not there)


class Leaf(ctypes.Structure):
    _fields_ = [("addr", ctypes.c_size_t), ("name", ctypes.c_char * 64)]


# md_step, as numpy lays a block of them out (a path's steps are mirrored together, one array)
STEP = np.dtype([("raw", np.uintp), ("leaves", np.uintp), ("n_leaves", np.int32), ("id", np.int32),
                 ("read", np.int32), ("host", np.int32), ("dst", np.uintp), ("nbytes", np.uintp),
                 ("backend", np.uintp), ("next", np.uintp)])
ID_OFF, NEXT_OFF = STEP.fields["id"][1], STEP.fields["next"][1]
MAX_LOST = 1 << 10


class Pending(ctypes.Structure):
    _fields_ = [("tensor", ctypes.c_void_p), ("step", ctypes.c_void_p), ("flags", ctypes.c_int32),
                ("pad", ctypes.c_int32)]


class State(ctypes.Structure):
    _fields_ = [("cur", ctypes.c_void_p), ("due", ctypes.c_void_p), ("due_tensor", ctypes.c_void_p),
                ("py", ctypes.c_void_p), ("get", ctypes.c_void_p), ("raw_len", ctypes.c_size_t),
                ("name_off", ctypes.c_size_t), ("observed", ctypes.POINTER(ctypes.c_int32)),
                ("n_observed", ctypes.c_int32), ("max_observed", ctypes.c_int32),
                ("off", ctypes.c_int32), ("pad", ctypes.c_int32), ("fast_asks", ctypes.c_int64),
                ("fast_observes", ctypes.c_int64), ("py_calls", ctypes.c_int64),
                ("get_async", ctypes.c_void_p), ("sync", ctypes.c_void_p), ("nbytes", ctypes.c_void_p),
                ("is_host", ctypes.c_void_p), ("writes", ctypes.c_void_p), ("flags_off", ctypes.c_size_t),
                ("op_off", ctypes.c_size_t), ("buffer_off", ctypes.c_size_t), ("data_off", ctypes.c_size_t),
                ("forced", ctypes.c_void_p), ("forced_py", ctypes.c_int32), ("n_pending", ctypes.c_int32),
                ("pending", Pending * defer.MAX_PENDING), ("lost", ctypes.POINTER(ctypes.c_int32)),
                ("n_lost", ctypes.c_int32), ("max_lost", ctypes.c_int32), ("flushes", ctypes.c_int64),
                ("deferred", ctypes.c_int64), ("forced_flushes", ctypes.c_int64), ("scratch", ctypes.c_void_p),
                ("scratch_size", ctypes.c_size_t), ("tensor_size", ctypes.c_size_t), ("type_off", ctypes.c_size_t),
                ("ne_off", ctypes.c_size_t), ("nb_off", ctypes.c_size_t), ("copies", ctypes.c_int64),
                ("merged_copies", ctypes.c_int64), ("copy_ns", ctypes.c_int64)]


def load():
    """(the compiled library, None), or (None, why not): compiled at the first call of a process for this source."""
    if "lib" in _LOADED:
        return _LOADED["lib"]
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    src = SOURCE.read_bytes()
    try:
        if cc is None:
            raise RuntimeError("no C compiler (cc, gcc or $CC) on PATH")
        key = hashlib.sha256(src + cc.encode()).hexdigest()[:16]
        so = cache_dir("fastpath", f"fastpath-{key}.so")
        if not so.is_file():
            with atomic_path(so) as part:           # built aside, then moved in whole
                r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(part), str(SOURCE)],
                                   capture_output=True, text=True, timeout=120)
                if r.returncode != 0:
                    raise RuntimeError(f"{cc} failed on {SOURCE}: {r.stderr.strip()[-400:]}")
        dll = ctypes.CDLL(str(so))
        dll.md_eval.restype = ctypes.c_bool
        got = (ctypes.c_size_t * 9)()
        dll.md_layout(got)
        want = (STEP.itemsize, ID_OFF, NEXT_OFF, ctypes.sizeof(State), State.off.offset, State.get_async.offset,
                State.lost.offset, defer.MAX_PENDING, State.scratch.offset)
        if tuple(got) != want:
            raise RuntimeError(f"{so}: struct layout {tuple(got)}, fastpath.py expects {want}")
        _LOADED["lib"] = (dll, None)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        _LOADED["lib"] = (None, f"the C fast path is not available ({exc}); every ask goes to Python")
    return _LOADED["lib"]


class FastPath:
    """One context's C state: the callback to hand llama.cpp (`address`, `user_data`), and the mirrors of the
    Tracer's steps. `py` is the Tracer's ctypes callback; `get` the address of ggml_backend_tensor_get."""

    def __init__(self, dll, py, get: int, raw_len: int, name_off: int, copier: "defer.Copier"):
        self.dll, self.py, self.copier = dll, py, copier    # kept alive as long as C may call them
        self.observed = (ctypes.c_int32 * MAX_OBSERVED)()
        self.lost_ids = (ctypes.c_int32 * MAX_LOST)()
        self.state = State(py=ctypes.cast(py, ctypes.c_void_p), get=get, raw_len=raw_len, name_off=name_off,
                           observed=self.observed, max_observed=MAX_OBSERVED, lost=self.lost_ids,
                           max_lost=MAX_LOST, **copier.c_fields())
        self.address = ctypes.cast(dll.md_eval, ctypes.c_void_p).value
        self.user_data = ctypes.addressof(self.state)
        self.reset()
        self.begin(False)

    def reset(self):
        """Forget every mirror (the Tracer dropped its trie)."""
        self.state.cur = self.state.due = None
        self.steps: list = []           # the mirrored Python steps, by id
        self.blocks: list = []          # their C structs (and what those point at), alive as long as the steps
        self.reads: dict = {}           # observed_reads' dicts, by the ids observed

    def begin(self, trace: bool):
        """A decode starts (trace: the Tracer maps it), or ends (False: every ask answered no in C)."""
        self.dll.md_drop(ctypes.byref(self.state))      # nothing is pending here, but after a failed decode
        self.state.cur = self.state.due = None
        self.state.n_observed = self.state.n_lost = 0
        self.state.off = not trace

    def finish(self):
        """The decode is over: the copies still pending (a graph that ended before its planned stop) are made."""
        self.dll.md_finish(ctypes.byref(self.state))

    def drop(self):
        """Tracing stopped inside a decode: the pending nodes get their flags back, nothing more is copied."""
        self.dll.md_drop(ctypes.byref(self.state))

    def lost(self) -> list:
        """The steps of this decode whose deferred copy was given up (a node off the path may have overwritten
        them: fastpath.c), as the sites they were read for."""
        return [self.steps[i].read[0] for i in self.lost_ids[:self.state.n_lost]]

    def at(self):
        """The Python step where the fast path stands, or None."""
        cur = self.state.cur
        return self.steps[ctypes.c_int32.from_address(cur + ID_OFF).value] if cur else None

    def observed_reads(self) -> dict:
        """site -> the array its values were copied into, for the steps observed on the fast path in this decode:
        one dict per sequence of steps (a repeated graph observes the same steps again, into the same buffers)."""
        n = self.state.n_observed
        key = ctypes.string_at(self.observed, 4 * n)
        reads = self.reads.get(key)
        if reads is None:
            if len(self.reads) >= 64:
                self.reads.clear()
            reads = self.reads[key] = {r[0]: r[3] for r in [self.steps[i].read for i in self.observed[:n]]}
        return reads

    def go(self, step):
        """Continue the fast path after `step` (None: Python keeps every ask). A step with no child yet is not
        mirrored: the next ask comes back to Python anyway (the first graph of a kind costs no structs)."""
        if step is None or step.mirror is None and step.next is None:
            self.state.cur = None
        else:
            self.state.cur = self.mirror(step)

    def mirror(self, step) -> int:
        """The address of a step's C struct, made with those of its chain of first children (the path C may walk),
        as one block: ~1 us a step."""
        chain, s = [], step
        while s is not None and s.mirror is None:
            chain.append(s)
            s = s.next
        n = len(chain)
        if n == 0:
            return step.mirror
        block = np.zeros(n, STEP)
        raw = np.frombuffer(b"".join([c.raw for c in chain]), dtype=np.uint8).copy()
        width = len(chain[0].raw)
        base = block.ctypes.data
        block["raw"] = raw.ctypes.data + np.arange(n, dtype=np.uintp) * width
        block["id"] = np.arange(len(self.steps), len(self.steps) + n, dtype=np.int32)
        scratch = self.copier.scratch
        if scratch is not None and not self.state.scratch:      # the first GPU backend was made: merged copies
            self.state.scratch, self.state.scratch_size = scratch.ctypes.data, scratch.size
        reads = [c.read for c in chain]
        block["read"] = defer.plan(chain, self.copier.defer)
        block["host"] = [-1 if c.span.host is None else int(c.span.host) for c in chain]
        block["backend"] = [c.span.backend for c in chain]
        block["dst"] = [r[1] if r is not None else 0 for r in reads]
        block["nbytes"] = [r[2] if r is not None else 0 for r in reads]
        block["next"][:-1] = base + np.arange(1, n, dtype=np.uintp) * STEP.itemsize
        block["next"][-1] = s.mirror if s is not None else 0        # an older block (or the end of the path)
        kept = [block, raw]
        for i, c in enumerate(chain):
            c.mirror = base + i * STEP.itemsize
            if c.leaves:
                leaves = (Leaf * len(c.leaves))(*[Leaf(a, nm) for a, nm in c.leaves])
                block["leaves"][i], block["n_leaves"][i] = ctypes.addressof(leaves), len(c.leaves)
                kept.append(leaves)
        self.steps.extend(chain)
        self.blocks.append(kept)
        return step.mirror

    def linked(self, step):
        """step's first child was set after its mirror was made: link it."""
        if step.mirror is not None and step.next is not None:
            ctypes.c_size_t.from_address(step.mirror + NEXT_OFF).value = self.mirror(step.next)

    def counts(self) -> dict:
        """Callbacks so far: asks and observes answered in C, calls handed to Python."""
        st = self.state
        return {"c_asks": int(st.fast_asks), "c_observes": int(st.fast_observes), "python_calls": int(st.py_calls),
                "c_stops": int(st.flushes), "c_deferred": int(st.deferred), "forced_stops": int(st.forced_flushes),
                "c_copies": int(st.copies), "c_merged": int(st.merged_copies), "c_copy_s": st.copy_ns * 1e-9}
