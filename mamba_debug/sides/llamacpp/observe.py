"""The eval callback of the llama.cpp side: every node of every ubatch graph mapped (nodes.GraphMap) at its ask, and
the values a site needs copied at its observe, at a cost close to that of the callback itself.

Ask: a node's struct is final when llama.cpp asks about it, so it is mapped there; the answer is yes only for a node
whose values a site needs (llama.cpp then computes the nodes in between in one go, and synchronises only where a
copy is due), or for every node when a fault hook is set (it writes between nodes) and with --local (which reads
every node: the node-by-node path `_legacy`). Observe: the fault hook, then one `ggml_backend_tensor_get`.

A graph's node map is a pure function of its nodes' `ggml_tensor` structs in graph order (name, op, op_params,
shapes, strides, sources, views, buffer and data pointers) and of the names of the tensors they read that are no
nodes (weights, inputs, the state and KV caches). The first graph of a kind is mapped node by node (read_node +
GraphMap.add) and each node's outcome is kept in a trie keyed by the node's struct bytes: its Node (layer, site),
whether a site needs its values, and a buffer for them. A later graph whose nodes have the same bytes, one by one,
and whose graph inputs the same names, takes the trie's path: one struct comparison per node (the weights and the
state / KV caches a node reads never change name or place while the context lives). A node that differs leaves
the trie: the nodes so far are mapped again from their live structs, and the rest of the graph node by node (a new
branch). The buffers of a path are reused by the next graph that takes it: a graph's values are valid until the next
traced decode (the side converts them into its StepOutput before that).

A new context has new addresses, so its first graph of each kind would be mapped node by node again (~15 us a node,
~5x the rest of the callback); instead each node's outcome is also remembered across contexts and runs by an
address-free key (recall.py: its struct with sources as node indices or names, for this model and library), and a
node the raw trie does not know but the remembered trie does is rebuilt from it with its live addresses (~5 us) and
keyed into the raw trie; only a node neither knows is mapped node by node (the nodes before it on this graph's path
are then mapped again from their live structs, as when leaving the raw trie).
"""
from __future__ import annotations

import ctypes
import warnings
from typing import Optional

import numpy as np

from . import defer, recall
from .lib import GgmlTensor
from .activations import wants_offsets, wants_scales
from .local import OPS as LOCAL_OPS, WEIGHT_TYPES
from .nodes import (DTYPES, HEAD_NAMES, WEIGHT_PREFIXES, GraphMap, host_array, model_input, read_data,
                    read_dequantized, read_from_file, read_node, read_offsets, read_scales, repacked)

STRUCT = ctypes.c_char * GgmlTensor.extra.offset     # the struct up to its name; the backend's `extra` left out
NAME = ctypes.c_char * 64
NAME_OFF = GgmlTensor.name.offset
assert NAME_OFF == recall.NAME_OFF and GgmlTensor.src.offset == recall.PTRS_OFF
# Leaves that live as long as the context (model weights, recurrent states, KV cache): never renamed nor moved
LASTING = (b"blk.", b"token_embd", b"output", b"cache_")
MAX_STEPS = 200_000         # trie nodes kept before it starts over (graphs that never repeat would grow it forever)
ARENA = 1 << 20             # bytes of the arenas the observed values are copied into


class _Step:
    """One node of a graph, mapped, given exactly the nodes before it on its path. A step rebuilt from what recall.py
    remembers makes its Node (from `kept` and its struct's bytes `raw`) only when asked for it: most never are."""
    __slots__ = ("parent", "index", "addr", "raw", "kept", "_node", "leaves", "read", "size", "shape", "emb", "kids",
                 "next_raw", "next", "mirror", "span", "ends")

    def __init__(self, parent, index=-1, addr=None, raw=None, kept=None, node=None, leaves=None, read=None,
                 shape=None, emb=False, span=None):
        self.parent, self.index, self.addr, self.raw, self.kept, self._node = parent, index, addr, raw, kept, node
        self.leaves, self.read, self.shape, self.emb, self.span = leaves, read, shape, emb, span
        self.ends = False                       # a decode's graph ended here (defer.plan stops before it)
        self.size = node.size if node is not None else kept.size if parent is not None else 0
        self.kids: dict = {}
        self.next_raw = self.next = None        # the first child: most graphs of a kind take one path
        self.mirror = None                      # its C struct, once the fast path may walk it (fastpath.py)

    @property
    def node(self):
        if self._node is None and self.parent is not None:
            self._node = self.kept.node(self.raw, self.addr, self.index)
        return self._node

    def add(self, raw: bytes, kid: "_Step") -> "_Step":
        self.kids[raw] = kid
        if self.next is None or raw == self.next_raw:
            self.next_raw, self.next = raw, kid
        return kid

    def path(self) -> list:
        """The steps from the graph's first node to this one."""
        out, s = [], self
        while s.parent is not None:
            out.append(s)
            s = s.parent
        return out[::-1]


def graph_nodes(g: dict, sited: bool = False) -> list:
    """The Nodes of one ubatch graph in graph order; sited: only those with a site (the others are not made)."""
    if "map" in g:
        return [n for n in g["map"].nodes.values() if n.site or not sited]
    path = g["last"].path() if g.get("last") is not None else []
    return [s.node for s in path if s.kept.site or not sited]


class Tracer:
    """The side's eval callback (`eval`) and what it keeps: `begin` before each llama_decode, `end` after it."""

    fast = None     # the C fast path (fastpath.FastPath), set by the side once it has made this Tracer's callback

    def __init__(self, lib, kinds: list, observed: frozenset, model=None, gguf_path=None):
        """model: what identifies the model's file (side.model_key); the remembered trie is this model's, library's,
        layer kinds' and observed sites' own (recall.py). None: nothing remembered across Tracers. gguf_path: the
        file llama.cpp loaded (--local reads a repacked weight from it, nodes.read_from_file)."""
        self.lib, self.kinds, self.observed, self.gguf_path = lib, kinds, observed, gguf_path
        self.get = lib.dll.ggml_backend_tensor_get
        self.copier = defer.Copier(lib)      # what the fast path's deferred copies need
        self.lost: list = []                 # (ubatch, site): deferred copies given up (fastpath.c), never compared
        self.counts0: dict = {}              # the fast path's counts when this run began
        self.tracing, self.error, self.graphs, self.cur = False, None, [], None
        self.local = self.fault = None
        self.weights: dict = {}         # --local: weights as float64, read once
        self.weight_types: dict = {}    # --local: a weight's ggml type, by address (a MUL_MAT's arithmetic path)
        self.weight_offsets: dict = {}  # --local: a weight's offsets (nodes.OFFSET_LAYOUT), by address
        self.weight_scales: dict = {}   # --local: q4_1 / q5_1 block scales on CUDA (nodes.SCALE_FIRST), by address
        self.recall_key = None if model is None else \
            (str(lib.path), lib.version, lib.commit, model, tuple(kinds), observed)
        self._reset_trie()

    def _reset_trie(self):
        self.memory = None if self.recall_key is None else recall.memory(self.recall_key)
        self.root = _Step(None, kept=None if self.memory is None else self.memory.root)
        self.pool, self.arenas, self.steps = {}, {}, 0
        if self.fast is not None:
            self.fast.reset()

    def release(self):
        """Drop everything it holds: the trie and its buffers, the weights kept for --local, the last ubatch's
        graphs and node data, and the LocalErrors (on a GPU, its float64 weights). The ctypes callback that wraps
        `eval` is kept for the life of the process (contexts.KEEP_ALIVE), and with it this object: a 2.8B run left
        ~25 GB of host and ~15 GB of GPU memory behind per run before this dropped the last three. What recall.py
        remembers (no addresses, buffers or values) stays for the next context."""
        self._reset_trie()
        self.park()

    def park(self):
        """Drop all but the trie and its buffers: its context is kept for the next run (contexts.py). What recall.py
        remembers goes to disk if it grew (the next process recalls its first graphs)."""
        recall.persist(self.recall_key)
        self.weights, self.weight_types, self.weight_offsets, self.weight_scales = {}, {}, {}, {}
        self.tracing, self.local, self.fault, self.cur, self.gm = False, None, None, None, None
        self.graphs, self.names, self.data, self.at, self.checked, self.bufs = [], {}, {}, None, set(), {}

    def begin(self, trace: bool, u: int, first_seq: int, fault=None, local=None):
        if self.steps > MAX_STEPS or self.memory is not None and self.memory.full():
            self._reset_trie()
        self.tracing, self.u, self.first_seq, self.fault, self.local = trace, u, first_seq, fault, local
        self.graphs, self.error, self.names, self.data = [], None, {}, {}
        self.cur = self.gm = self.at = None
        self.legacy, self.checked, self.bufs = local is not None, set(), {}
        self.every = fault is not None      # the fault hook sees every node, between nodes
        if trace and u == 0 and first_seq == 0:        # a run begins: what copies() reports starts here
            self.lost, self.counts0 = [], self.fast.counts() if self.fast is not None else {}
        if self.fast is not None:
            self.fast.begin(trace)

    def end(self) -> list:
        self.tracing = False
        if self.fast is not None:           # what the fast path walked and copied
            self.fast.finish()
            self._sync()
            self.data.update(self.fast.observed_reads())
            self._give_up(self.fast.lost())
            self.fast.begin(False)
        if self.graphs and "map" not in self.graphs[0]:
            self._close(self.graphs[0])
            if self.graphs[0]["last"] is not None:
                self.graphs[0]["last"].ends = True
        return self.graphs

    def copies(self) -> dict:
        """How this run's values were copied (config.llama_cpp.copies): the stops the fast path made, the copies
        it deferred, and any it gave up (those sites are not observed in that ubatch)."""
        if self.fast is None:
            return {"how": "the Python callback: llama.cpp stops at every node whose values a site needs"}
        now = self.fast.counts()
        d = {k: now[k] - self.counts0.get(k, 0) for k in ("c_stops", "c_deferred", "forced_stops", "c_copies",
                                                          "c_merged", "c_copy_s")}
        return {"how": self.copier.words(), "stops_in_c": d["c_stops"], "deferred": d["c_deferred"],
                "forced_stops": d["forced_stops"], "copy_calls": d["c_copies"], "merged": d["c_merged"],
                "copy_s": round(d["c_copy_s"], 4),
                "lost": [{"ubatch": u, "layer": layer, "site": site} for u, (layer, site) in self.lost]}

    def _give_up(self, sites: list):
        """Deferred copies the fast path gave up (a node off its path may have overwritten them): those sites are not
        observed in this ubatch, and nothing is deferred any more in this context (every mirror made again)."""
        if not sites:
            return
        for site in sites:
            self.data.pop(site, None)
            self.lost.append((self.u, site))
        warnings.warn(f"llama.cpp side: ubatch {self.u}: {len(sites)} deferred copies given up (a node off the "
                      f"known path may have overwritten them): {sites[:4]} not observed in this ubatch; deferred "
                      f"copies are off for the rest of this context (config.llama_cpp.copies)", stacklevel=2)
        self.copier.defer = False
        for step in self.fast.steps:        # their C structs go with the mirrors
            step.mirror = None
        self.fast.reset()

    # -- the callback ---------------------------------------------------------------------------------------------
    def eval(self, t, ask, user_data):
        """ask -> map the node (follow the trie, or map it node by node) and say yes where a site needs its values
        (every node with a fault hook or --local); observe -> the fault hook, the copy. Never raises into C (an
        exception is kept and raised after llama_decode); observe always returns True (False would end the current
        split early)."""
        if ask:
            if not self.tracing:
                return False
            try:
                if self.fast is None:
                    return self._ask(t)
                self._sync()
                yes = self._ask(t)
                self.fast.go(self.cur if self.tracing and not (self.legacy or self.every) else None)
                return yes
            except BaseException as exc:  # noqa: BLE001 (kept, raised after llama_decode)
                return self._fail(exc)
        try:
            if self.legacy:
                self._legacy(t)
                return True
            s = self.cur
            if s is None or s.addr != t:
                raise RuntimeError(f"llama.cpp observed node {t:#x}, the callback had mapped "
                                   f"{'none' if s is None else hex(s.addr)} last")
            if self.fault is not None and s.size:       # the tests' stand-in for a fault inside the build
                self.fault(s.node, host_array(s.node), self.u, self.first_seq)
            r = s.read
            if r is not None:
                if r[2]:
                    self.get(t, r[1], 0, r[2])
                self.data[r[0]] = r[3]
        except BaseException as exc:  # noqa: BLE001 (kept, raised after llama_decode)
            self._fail(exc)
        return True

    def _ask(self, t) -> bool:
        cur = self.cur
        if cur is not None:
            raw = STRUCT.from_address(t).raw
            s = cur.next if raw == cur.next_raw else cur.kids.get(raw)
            if s is not None and (s.leaves is None or self._same_leaves(s.leaves)):
                self.cur = s
                return self.every or s.read is not None
            return self._slow(t, raw)
        return self.legacy or self._slow(t, None)

    def _sync(self):
        """Python's turn after the fast path walked on: its last step is where this graph stands."""
        at = self.fast.at()
        if at is not None:
            self.cur = at

    def _fail(self, exc) -> bool:
        if self.error is None:
            self.error = exc
        self.legacy, self.tracing = False, False        # nothing more asked for: the decode ends as it is
        if self.fast is not None:
            self.fast.begin(False)
        return False

    def _same_leaves(self, leaves) -> bool:
        for addr, name in leaves:
            if NAME.from_address(addr + NAME_OFF).value != name:
                return False
        return True

    # -- the slow path: a node the trie does not know here ------------------------------------------------------------
    def _slow(self, t: int, raw) -> bool:
        """Map a node the raw trie does not know here (at its ask): from what recall.py remembers, else node by node;
        key it into the raw trie; whether to observe it."""
        raw = STRUCT.from_address(t).raw if raw is None else raw
        cur = self.cur
        if cur is None:                             # the first node of this decode starts its graph
            s = self.root.kids.get(raw)
            if s is not None and (s.leaves is None or self._same_leaves(s.leaves)):
                self.cur = s
                self._start(s, t)
                return self.every or s.read is not None
            cur, self.at = self.root, {}
        elif self.at is None:                       # left the raw trie: this graph's nodes so far, from the path
            self._resume(cur)
        index = cur.index + 1
        self.new_leaves, self.new_copies = [], []
        key = recall.node_key(raw, self.at, self._leaf_name, self._buffer_name)
        kept = cur.kept.kids.get(key) if cur.kept is not None and self.gm is None else None
        node = None
        if kept is None:                            # node by node (the nodes so far mapped again, live)
            if self.gm is None:
                self._remap(cur)
            node = self.gm.add(read_node(self.lib, t, index, raw))
            kept = recall.Kept(node, node.op == "GET_ROWS" and is_embedding(self.lib, t), self._view(node))
            if cur.kept is not None and self.memory is not None:
                self.memory.add(cur.kept, key, kept)
        self.at[t] = index
        if kept.emb and cur is not self.root:      # a second graph in one decode (step() refuses it): as before
            self._close(self.graphs[0])
            self.legacy, self.cur = True, None
            return True
        span = self.copier.span(t, raw, kept.op, tuple(self.new_copies), kept.view is not None)
        read = None if kept.view is None else self._buffer(kept, index, span.backend)
        s = self.cur = cur.add(raw, _Step(cur, index, t, raw, kept, node, tuple(self.new_leaves) or None, read,
                                          kept.conv or cur.shape, kept.emb, span))
        if cur.mirror is not None and cur.next is s:    # the fast path reached cur: it may walk on to s next time
            self.fast.linked(cur)
        self.steps += 1
        if cur is self.root:
            self._start(s, t)
        return self.every or read is not None

    def _leaf_name(self, a: int) -> bytes:
        """The name of a tensor read that is no node; noted at its first read in a graph unless it lasts as long as
        the context (checked on the raw trie's path: its address may hold another tensor in a later graph)."""
        name = NAME.from_address(a + NAME_OFF).value
        if name.count(b"#") >= 2:           # the scheduler's copy of a tensor for another backend (defer.py)
            data = GgmlTensor.from_address(a).data or 0
            self.new_copies.append((data, data + self.lib.dll.ggml_nbytes(a)))
        if a not in self.checked:
            self.checked.add(a)
            if not name.startswith(LASTING):
                self.new_leaves.append((a, name))
        return name

    def _buffer_name(self, buf: int) -> bytes:
        name = self.bufs.get(buf)
        if name is None:
            name = self.bufs[buf] = self.lib.dll.ggml_backend_buffer_name(buf) if buf else b"?"
        return name

    def _resume(self, cur: _Step):
        """Where this graph's nodes so far are and which tensors they read, from the raw trie's path to cur."""
        self.at = {}
        for s in cur.path():
            self.at[s.addr] = s.index
            self.checked.update(a for a, _ in s.leaves or ())

    def _remap(self, cur: _Step):
        self.gm = GraphMap(self.names, self.kinds)
        for s in cur.path():
            self.gm.add(read_node(self.lib, s.addr, s.index))

    def _view(self, node) -> Optional[tuple]:
        """How a mapped node's values are read, where a site needs them: (shape, dtype, strides, ggml_nbytes)."""
        if not node.site or (node.layer, node.site) not in self.observed:
            return None
        dtype = DTYPES.get(node.type)
        if dtype is None:
            raise TypeError(f"node {node.name!r}: ggml type {node.type} is not read by mamba-debug")
        return node.ne[::-1], dtype, node.nb[::-1], self.lib.dll.ggml_nbytes(node.addr)

    def _buffer(self, kept: recall.Kept, index: int, backend: int) -> tuple:
        """(site, address, bytes, array): where a mapped node's values are copied; one slice of an arena per
        position in the graph and size, shared by the paths through it (one graph at a time uses it). Values in a
        GPU's memory go to pinned arenas (an asynchronous copy needs one: defer.Copier), others to plain ones."""
        shape, dtype, strides, extent = kept.view
        pinned = bool(backend)
        slot = self.pool.get((index, extent, pinned))
        if slot is None:
            size = -(-max(extent, 1) // 64) * 64
            arena, used = self.arenas.get(pinned, (None, 0))
            if arena is None or used + size > arena.size:       # a new arena (the old one stays alive as long
                arena, used = self.copier.arena(max(size, ARENA), backend), 0   # as arrays view it)
            slot = self.pool[(index, extent, pinned)] = arena, used, arena.ctypes.data + used
            self.arenas[pinned] = arena, used + size
        arr = np.ndarray(shape=shape, dtype=dtype, buffer=slot[0], offset=slot[1], strides=strides)
        return (kept.layer, kept.site), slot[2], extent, arr

    def _start(self, s: _Step, t: int):
        g = {"data": self.data, "last": None}
        if s.emb:           # the tokens this graph embeds, read from its input (the struct read live)
            g["tokens"] = read_data(self.lib, read_node(self.lib, s.node.src[1], -1)).reshape(-1).copy()
        self.graphs.append(g)

    def _close(self, g: dict):
        g["last"] = g["last"] or self.cur
        if g["last"] is not None and g["last"].shape is not None:
            g["shape"] = g["last"].shape

    # -- node by node, every node read: --local, and a second graph in one decode ---------------------------------
    def _legacy(self, t: int):
        embedding = is_embedding(self.lib, t)
        if not self.graphs or embedding:
            self.graphs.append({"map": GraphMap(self.names, self.kinds), "data": {}, "n": 0})
        g = self.graphs[-1]
        node = g["map"].add(read_node(self.lib, t, g["n"]))
        g["n"] += 1
        if embedding:
            src = read_node(self.lib, node.src[1], -1)
            g["tokens"] = read_data(self.lib, src).reshape(-1).copy()
        if node.op == "SSM_CONV":
            g["shape"] = (node.ne[1], node.ne[2])
        data = None
        if self.fault is not None and node.size:
            self.fault(node, host_array(node), self.u, self.first_seq)
        if node.site and (node.layer, node.site) in self.observed:
            data = g["data"][(node.layer, node.site)] = read_data(self.lib, node)
        if self.local is not None:
            self._local(g, node, data)

    def _local(self, g: dict, node, data):
        """--local: keep every node's output as it was when observed (its memory may be reused later) and
        recompute the node's op in float64 from its sources."""
        if node.size == 0 or node.type not in DTYPES:
            return
        data = read_data(self.lib, node) if data is None else data
        g.setdefault("all", {})[node.addr] = data
        if node.op in LOCAL_OPS and (node.layer is not None or node.extra.get("head")) or model_input(node) \
                or node.name in HEAD_NAMES:
            srcs = [g["all"].get(a) if a in g["map"].nodes else self._leaf(g, a) for a in node.src]
            weights = self.weight_types.get(node.src[0], 0) if node.src else 0     # picks a MUL_MAT's path
            offs = self.weight_offsets.get(node.src[0]) if node.src else None
            scales = self.weight_scales.get(node.src[0]) if node.src else None
            self.local.add(node, srcs, data, self.u, self.first_seq, weights, offs, scales)
        elif node.site:                 # a compared view (B, C): where a divergence there sits in the graph
            self.local.place(node, self.u, self.first_seq)

    def _leaf(self, g: dict, addr: int):
        """A source that is not a node of this graph: a weight (read once), an input of this ubatch, or the
        scheduler's copy of a node for another backend ("CUDA0#node_3#0"): that node's values as observed, since the
        copy's memory may already hold something else when its consumer is observed."""
        if addr in self.weights:
            return self.weights[addr]
        leaf = read_node(self.lib, addr, -1)
        weight = leaf.name.startswith(WEIGHT_PREFIXES)
        if weight:
            self.weight_types[addr] = leaf.type
            if self.local is not None and wants_offsets(self.local.emulate, WEIGHT_TYPES.get(leaf.type), leaf):
                self.weight_offsets[addr] = read_offsets(self.lib, leaf, self.gguf_path)   # None: a type without
            if self.local is not None and wants_scales(self.local.emulate, WEIGHT_TYPES.get(leaf.type), leaf):
                self.weight_scales[addr] = read_scales(self.lib, leaf, self.gguf_path)
        if repacked(leaf):              # ggml cannot read it back: the file's values, for a weight
            data = read_from_file(self.gguf_path, leaf) if weight and self.gguf_path else None
            if data is not None:
                data = self.weights[addr] = data.astype(np.float64)
            return data
        if leaf.type not in DTYPES:
            data = read_dequantized(self.lib, leaf) if weight else None     # bf16, quantized: their values
            if data is not None:
                data = self.weights[addr] = data.astype(np.float64)
            return data
        data = None
        if leaf.name.count("#") >= 2:
            seen = g.get("all", {})
            cands = [n for n in g["map"].named(leaf.name.split("#")[1])
                     if n.addr in seen and seen[n.addr].size == leaf.size]
            if len(cands) == 1:
                return seen[cands[0].addr].reshape(leaf.ne[::-1])
            if cands:           # several nodes of that name (views): the one whose values the copy holds
                data = read_data(self.lib, leaf)
                if not any(np.array_equal(seen[n.addr].reshape(data.shape), data) for n in cands):
                    return None     # its memory holds something else by now: no local error for the consumer
                return data
        data = read_data(self.lib, leaf) if data is None else data
        if weight:
            data = self.weights[addr] = data.astype(np.float64)    # converted once: read by every ubatch
        return data


def is_embedding(lib, addr: int) -> bool:
    """The GET_ROWS of the token embedding: `embd` in Mamba-1's graph, unnamed in Granite's (which scales it into
    `embd` next)."""
    src = GgmlTensor.from_address(addr).src[0]
    return bool(src) and GgmlTensor.from_address(src).name == b"token_embd.weight" and \
        lib.dll.ggml_op_desc(addr) == b"GET_ROWS"

