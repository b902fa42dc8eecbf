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
"""
from __future__ import annotations

import ctypes

import numpy as np

from .lib import GgmlTensor
from .local import OPS as LOCAL_OPS
from .nodes import DTYPES, HEAD_NAMES, GraphMap, host_array, model_input, read_data, read_node

STRUCT = ctypes.c_char * GgmlTensor.extra.offset     # the struct up to its name; the backend's `extra` left out
NAME = ctypes.c_char * 64
NAME_OFF = GgmlTensor.name.offset
# Leaves that live as long as the context (model weights, recurrent states, KV cache): never renamed nor moved
LASTING = (b"blk.", b"token_embd", b"output", b"cache_")
MAX_STEPS = 200_000         # trie nodes kept before it starts over (graphs that never repeat would grow it forever)


class _Step:
    """One node of a graph, mapped, given exactly the nodes before it on its path."""
    __slots__ = ("parent", "node", "addr", "leaves", "read", "size", "shape", "emb", "kids", "next_raw", "next")

    def __init__(self, parent, node=None, leaves=None, read=None, shape=None, emb=False):
        self.parent, self.node, self.leaves, self.read, self.shape, self.emb = parent, node, leaves, read, shape, emb
        self.addr = node.addr if node is not None else None
        self.size = node.size if node is not None else 0
        self.kids: dict = {}
        self.next_raw = self.next = None        # the first child: most graphs of a kind take one path

    def add(self, raw: bytes, kid: "_Step") -> "_Step":
        self.kids[raw] = kid
        if self.next is None or raw == self.next_raw:
            self.next_raw, self.next = raw, kid
        return kid


def graph_nodes(g: dict) -> list:
    """The Nodes of one ubatch graph in graph order."""
    if "map" in g:
        return list(g["map"].nodes.values())
    out, s = [], g.get("last")
    while s is not None and s.node is not None:
        out.append(s.node)
        s = s.parent
    return out[::-1]


class Tracer:
    """The side's eval callback (`eval`) and what it keeps: `begin` before each llama_decode, `end` after it."""

    def __init__(self, lib, kinds: list, observed: frozenset):
        self.lib, self.kinds, self.observed = lib, kinds, observed
        self.get = lib.dll.ggml_backend_tensor_get
        self.tracing, self.error, self.graphs, self.cur = False, None, [], None
        self.local = self.fault = None
        self.weights: dict = {}         # --local: weights as float64, read once
        self._reset_trie()

    def _reset_trie(self):
        self.root, self.pool, self.steps = _Step(None), {}, 0

    def release(self):
        """Drop everything it holds: the trie and its buffers, the weights kept for --local, the last ubatch's
        graphs and node data, and the LocalErrors (on a GPU, its float64 weights). The ctypes callback that wraps
        `eval` is kept for the life of the process (side._KEEP), and with it this object: a 2.8B run left ~25 GB
        of host and ~15 GB of GPU memory behind per run before this dropped the last three."""
        self._reset_trie()
        self.weights = {}
        self.tracing, self.local, self.fault, self.cur, self.gm = False, None, None, None, None
        self.graphs, self.names, self.data = [], {}, {}

    def begin(self, trace: bool, u: int, first_seq: int, fault=None, local=None):
        if self.steps > MAX_STEPS:
            self._reset_trie()
        self.tracing, self.u, self.first_seq, self.fault, self.local = trace, u, first_seq, fault, local
        self.graphs, self.error, self.names, self.data = [], None, {}, {}
        self.cur = self.gm = None
        self.legacy, self.checked = local is not None, set()
        self.every = fault is not None      # the fault hook sees every node, between nodes

    def end(self) -> list:
        self.tracing = False
        if self.graphs and "map" not in self.graphs[0]:
            self._close(self.graphs[0])
        return self.graphs

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
                cur = self.cur
                if cur is not None:
                    raw = STRUCT.from_address(t).raw
                    s = cur.next if raw == cur.next_raw else cur.kids.get(raw)
                    if s is not None and (s.leaves is None or self._same_leaves(s.leaves)):
                        self.cur = s
                        return self.every or s.read is not None
                    return self._slow(t, raw)
                return self.legacy or self._slow(t, None)
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

    def _fail(self, exc) -> bool:
        if self.error is None:
            self.error = exc
        self.legacy, self.tracing = False, False        # nothing more asked for: the decode ends as it is
        return False

    def _same_leaves(self, leaves) -> bool:
        for addr, name in leaves:
            if NAME.from_address(addr + NAME_OFF).value != name:
                return False
        return True

    # -- the slow path: a node the trie does not know here ------------------------------------------------------------
    def _slow(self, t: int, raw) -> bool:
        """Map a node node by node (at its ask) and grow the trie; whether to observe it."""
        raw = STRUCT.from_address(t).raw if raw is None else raw
        cur = self.cur
        if cur is None:                             # the first node of this decode starts its graph
            s = self.root.kids.get(raw)
            if s is not None and (s.leaves is None or self._same_leaves(s.leaves)):
                self.cur = s
                self._start(s, t)
                return self.every or s.read is not None
            cur, self.gm = self.root, GraphMap(self.names, self.kinds)
        elif self.gm is None:                       # left the trie: the nodes so far mapped again, live
            self._remap(cur)
        index = 0 if cur is self.root else cur.node.index + 1
        node = read_node(self.lib, t, index, raw)
        emb = node.op == "GET_ROWS" and is_embedding(self.lib, t)
        if emb and cur is not self.root:           # a second graph in one decode (step() refuses it): as before
            self._close(self.graphs[0])
            self.legacy, self.cur = True, None
            return True
        gm, checked, leaves = self.gm, self.checked, []
        for a in node.src + [node.view_src] if node.view_src else node.src:    # the tensors read that are no nodes
            if a not in gm.nodes and a not in checked:
                checked.add(a)
                name = NAME.from_address(a + NAME_OFF).value
                if not name.startswith(LASTING):
                    leaves.append((a, name))
        gm.add(node)
        read = None
        if node.site and (node.layer, node.site) in self.observed:
            read = self._buffer(node, index)
        shape = (node.ne[1], node.ne[2]) if node.op == "SSM_CONV" else cur.shape
        s = self.cur = cur.add(raw, _Step(cur, node, tuple(leaves) or None, read, shape, emb))
        self.steps += 1
        if cur is self.root:
            self._start(s, t)
        return self.every or read is not None

    def _remap(self, cur: _Step):
        self.gm = GraphMap(self.names, self.kinds)
        path = []
        while cur.node is not None:
            path.append(cur)
            cur = cur.parent
        for s in reversed(path):
            self.gm.add(read_node(self.lib, s.node.addr, s.node.index))
            self.checked.update(a for a, _ in s.leaves or ())

    def _buffer(self, node, index: int) -> tuple:
        """(site, address, bytes, array): where a mapped node's values are copied; one buffer per position in the
        graph and size, shared by the paths through it (one graph at a time uses it)."""
        dtype = DTYPES.get(node.type)
        if dtype is None:
            raise TypeError(f"node {node.name!r}: ggml type {node.type} is not read by mamba-debug")
        extent = self.lib.dll.ggml_nbytes(node.addr)
        pooled = self.pool.get((index, extent))
        if pooled is None:
            buf = np.empty(max(extent, 1), dtype=np.uint8)
            pooled = self.pool[(index, extent)] = buf, buf.ctypes.data
        arr = np.ndarray(shape=node.ne[::-1], dtype=dtype, buffer=pooled[0], strides=node.nb[::-1])
        return (node.layer, node.site), pooled[1], extent, arr

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
            self.local.add(node, srcs, data, self.u, self.first_seq)

    def _leaf(self, g: dict, addr: int):
        """A source that is not a node of this graph: a weight (read once), an input of this ubatch, or the
        scheduler's copy of a node for another backend ("CUDA0#node_3#0"): that node's values as observed, since the
        copy's memory may already hold something else when its consumer is observed."""
        if addr in self.weights:
            return self.weights[addr]
        leaf = read_node(self.lib, addr, -1)
        if leaf.type not in DTYPES:
            return None
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
        if leaf.name.startswith(("blk.", "token_embd", "output")):
            data = self.weights[addr] = data.astype(np.float64)    # converted once: read by every ubatch
        return data


def is_embedding(lib, addr: int) -> bool:
    """The GET_ROWS of the token embedding: `embd` in Mamba-1's graph, unnamed in Granite's (which scales it into
    `embd` next)."""
    src = GgmlTensor.from_address(addr).src[0]
    return bool(src) and GgmlTensor.from_address(src).name == b"token_embd.weight" and \
        lib.dll.ggml_op_desc(addr) == b"GET_ROWS"

