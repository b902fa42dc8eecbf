"""Deferred copies: where the C fast path may let llama.cpp run on past a node whose values a site needs.

Each yes to an eval-callback ask ends one of llama.cpp's graph splits (`ggml_backend_sched_compute_splits` computes
the nodes so far, synchronizes, then observes): on CUDA ~45 us each, thousands a decode. A node's values stay in
its memory until a later node writes there (ggml's allocator reuses memory; an in-place op writes over its source
at once), so its copy can wait for a later stop. `plan` chooses the stops for a path of a Tracer's trie: a read
node is DEFER (answered no, kept pending) unless something may overwrite it before the next read; the last pending
read before such a thing is FLUSH (answered yes; at its observe every pending value is copied). What may
overwrite a pending value:
- a node whose output (`data` .. `data + ggml_nbytes`) overlaps it (views, reshapes, permutes and empty nodes write
  nothing);
- llama.cpp's scheduler, which copies a split's inputs from other backends in before the split runs: a change
  between host and device memory from one node to the next (a new split) ends the pending run, and a pending value
  that overlaps a scheduler copy ("CUDA0#name#0") read by a later node is never deferred;
- another graph: a decode's last node, the end of a mirrored path, and a step with more than one child (the path
  may leave there) end the pending run; a node off the path while copies are pending is checked in C
  (fastpath.c: `give_up_overlapped`), and a value it may have overwritten is reported as lost, never copied.
A pending node is marked GGML_TENSOR_FLAG_OUTPUT while it waits, which every backend's fusion check honours (a node
fused into the next one is never written); the flag is put back at the copy.

`Copier` holds what the copies need: whether a buffer is host memory, a backend of the tracer's own per GPU whose
stream copies device memory asynchronously (one wait per stop instead of one per value), pinned host arenas to copy
into, and the table of which ggml ops write their output (learnt from the nodes, unknown ops count as writing).
MAMBA_DEBUG_DEFER=0 plans a stop at every read (one split per read value); MAMBA_DEBUG_ASYNC=0 copies with
`ggml_backend_tensor_get` into plain memory.
"""
from __future__ import annotations

import ctypes
import os
import struct
from typing import Optional

import numpy as np

from .lib import GgmlTensor

NONE, FLUSH, DEFER = 0, 1, 2
MAX_PENDING = 32                # fastpath.c's pending slots
PINNED_ARENA = 8 << 20          # bytes of a pinned arena
SCRATCH = 16 << 20              # pinned bytes a stop copies close-together device values into, as one range
NOOPS = frozenset({"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"})
PTR = struct.Struct("@P")
OP = struct.Struct("@i")
BUFFER_OFF, DATA_OFF = GgmlTensor.buffer.offset, GgmlTensor.data.offset
OP_OFF, FLAGS_OFF = GgmlTensor.op.offset, GgmlTensor.flags.offset
ASYNC_SYMBOLS = ("ggml_backend_buffer_get_type", "ggml_backend_buft_get_device", "ggml_backend_dev_init",
                 "ggml_backend_tensor_get_async", "ggml_backend_synchronize", "ggml_backend_dev_host_buffer_type",
                 "ggml_backend_buft_alloc_buffer", "ggml_backend_buffer_get_base", "ggml_backend_buffer_free")


class Span:
    """What a step's node writes and where its values live: `w` = (start, end) of its output, None if it writes
    nothing; `host` (None: no buffer); the scheduler copies it reads (`copies`, (start, end) each); `backend`: the
    tracer's own backend for its device memory (0: host memory, or no asynchronous copies)."""
    __slots__ = ("w", "host", "copies", "backend", "data", "nbytes")

    def __init__(self, w, host, copies, backend, data, nbytes):
        self.w, self.host, self.copies, self.backend, self.data, self.nbytes = w, host, copies, backend, data, nbytes


def _overlaps(a, spans) -> bool:
    return a is not None and any(a[0] < b[1] and b[0] < a[1] for b in spans)


def plan(chain: list, defer: bool = True) -> list:
    """One mode per step of `chain` (a mirrored path, in graph order): NONE, FLUSH or DEFER (module docstring)."""
    modes = [FLUSH if s.read is not None else NONE for s in chain]
    if not defer:
        return modes
    never: set = set()          # reads a scheduler copy may overwrite: a stop of their own
    while True:
        clash = _plan_once(chain, modes, never)
        if clash is None:
            return modes
        never.add(clash)


def _plan_once(chain: list, modes: list, never: set) -> Optional[int]:
    pending: list = []          # indices into chain

    def stop():
        if pending:
            modes[pending[-1]] = FLUSH
            pending.clear()
    for i, s in enumerate(chain):
        sp, prev = s.span, chain[i - 1] if i else None
        if pending:        # where the pending values live (a read view's are its source's)
            spans = [(chain[j].span.data, chain[j].span.data + chain[j].span.nbytes) for j in pending]
            clash = next((pending[k] for k, b in enumerate(spans) if _overlaps(b, sp.copies)), None)
            if clash is not None:
                return clash
            if (sp.host is not None and sp.host != chain[pending[-1]].span.host or _overlaps(sp.w, spans)
                    or prev is not None and len(prev.kids) > 1):
                stop()
        if s.read is not None:
            modes[i] = DEFER
            pending.append(i)
            if i in never:
                stop()
        if s.ends or len(pending) >= MAX_PENDING - 1:
            stop()
    stop()
    return None


class Copier:
    """The copies' side of one Tracer (module docstring): buffers' host-ness, the tracer's own GPU backends and
    pinned arenas, the ops that write."""

    def __init__(self, lib):
        self.lib, dll = lib, lib.dll
        # without ggml_backend_buffer_is_host nothing is known of a buffer: no deferral, every buffer taken as host
        self.known = known = hasattr(dll, "ggml_backend_buffer_is_host")
        self.defer = os.environ.get("MAMBA_DEBUG_DEFER", "1") != "0" and known
        self.use_async = os.environ.get("MAMBA_DEBUG_ASYNC", "1") != "0" and known and \
            all(hasattr(dll, n) for n in ASYNC_SYMBOLS)
        self.writes = np.ones(256, dtype=np.uint8)      # by ggml op value; read by fastpath.c
        self.hosts: dict = {}
        self.backends: dict = {}                        # device -> backend (or 0: a CPU device)
        self.by_buffer: dict = {}
        self.pinned: dict = {}                          # backend -> the host buffer type of its GPU
        self.scratch: Optional[np.ndarray] = None       # fastpath.c's merged copies land here first

    def span(self, t: int, raw: bytes, op: str, copies: tuple, read: bool) -> Span:
        buf, data = PTR.unpack_from(raw, BUFFER_OFF)[0], PTR.unpack_from(raw, DATA_OFF)[0] or 0
        code = OP.unpack_from(raw, OP_OFF)[0]
        if op in NOOPS and 0 <= code < 256:
            self.writes[code] = 0
        n = self.lib.dll.ggml_nbytes(t)
        w = (data, data + n) if op not in NOOPS and n > 0 and data else None
        host = self.is_host(buf) if buf else None
        backend = self.backend_of(buf) if read and buf and host is False else 0
        return Span(w, host, copies, backend, data, n)

    def is_host(self, buf: int) -> bool:
        h = self.hosts.get(buf)
        if h is None:
            h = self.hosts[buf] = bool(self.lib.dll.ggml_backend_buffer_is_host(buf)) if self.known else True
        return h

    def backend_of(self, buf: int) -> int:
        """The tracer's own backend for the device a buffer lives on (its stream copies asynchronously)."""
        if not self.use_async:
            return 0
        b = self.by_buffer.get(buf)
        if b is None:
            dll = self.lib.dll
            dev = dll.ggml_backend_buft_get_device(dll.ggml_backend_buffer_get_type(buf))
            b = self.backends.get(dev)
            if b is None:
                b = self.backends[dev] = (dll.ggml_backend_dev_init(dev, None) or 0) if dev and \
                    dll.ggml_backend_dev_type(dev) in (1, 2) else 0
                if b:
                    self.pinned[b] = dll.ggml_backend_dev_host_buffer_type(dev)
                    if self.scratch is None:
                        self.scratch = _Pinned.make(dll, self.pinned[b], SCRATCH)
            b = self.by_buffer[buf] = b
        return b

    def arena(self, size: int, backend: int) -> np.ndarray:
        """`size` bytes to copy values into: pinned host memory of the backend's GPU (a copy from device memory
        into it runs asynchronously), else plain memory."""
        buft = self.pinned.get(backend) if backend else None
        if buft:                # few large blocks: each pinned allocation costs a system call or more
            block = _Pinned.make(self.lib.dll, buft, max(size, PINNED_ARENA))
            if block is not None:
                return block
        return np.empty(size, dtype=np.uint8)

    def c_fields(self) -> dict:
        """fastpath.State's fields for the deferred copies."""
        dll = self.lib.dll
        addr = lambda name: ctypes.cast(getattr(dll, name), ctypes.c_void_p).value  # noqa: E731
        return {"get_async": addr("ggml_backend_tensor_get_async") if self.use_async else None,
                "sync": addr("ggml_backend_synchronize") if self.use_async else None,
                "nbytes": addr("ggml_nbytes"), "is_host": addr("ggml_backend_buffer_is_host") if self.defer else None,
                "writes": self.writes.ctypes.data, "flags_off": FLAGS_OFF, "op_off": OP_OFF,
                "buffer_off": BUFFER_OFF, "data_off": DATA_OFF, "tensor_size": ctypes.sizeof(GgmlTensor),
                "type_off": GgmlTensor.type.offset, "ne_off": GgmlTensor.ne.offset, "nb_off": GgmlTensor.nb.offset}

    def words(self) -> str:
        if not self.defer:
            return "a split per read node (MAMBA_DEBUG_DEFER=0, or a library without ggml_backend_buffer_is_host)"
        how = ("device memory on the tracer's own stream into pinned memory, one wait per stop, values close "
               "together in one buffer as one range" if self.use_async else "with ggml_backend_tensor_get")
        return f"deferred to the next stop that nothing can overwrite before (defer.py); copied {how}"


class _Pinned:
    """A pinned host block from a GPU's host buffer type, freed when the last numpy view of it is gone."""

    def __init__(self, dll, buf):
        self.dll, self.buf = dll, buf

    @classmethod
    def make(cls, dll, buft: int, size: int) -> Optional[np.ndarray]:
        buf = dll.ggml_backend_buft_alloc_buffer(buft, size)
        if not buf:
            return None
        owner = cls(dll, buf)
        mem = (ctypes.c_uint8 * size).from_address(dll.ggml_backend_buffer_get_base(buf))
        mem._owner = owner                               # the numpy array keeps mem, mem keeps the buffer
        return np.frombuffer(mem, dtype=np.uint8)

    def __del__(self):
        try:
            self.dll.ggml_backend_buffer_free(self.buf)
        except Exception:  # noqa: BLE001 (interpreter shutdown: the library may be gone)
            pass
