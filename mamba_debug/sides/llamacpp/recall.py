"""What the eval callback remembers of a graph kind across contexts: each node's mapping outcome, keyed by the node's
struct with its addresses replaced by what they stand for, so that the first graph of a kind in a new context (new
addresses) is not mapped node by node again.

observe.py's trie is keyed by raw struct bytes, which hold the addresses of the node's sources, its buffer and its
data: a new context (every run) has new ones, and `Tracer.release` drops the trie with its buffers anyway. A node's
map (nodes.GraphMap) does not depend on any address, only on what the addresses point at: its *address-free key*
(`node_key`) is its struct bytes up to its name with the pointers left out (type, ne, nb, op, op_params, flags,
view_offs), its name (up to the NUL), the name of the buffer its output lives in (the backend), and each of its ten
sources and its view source as the index of that node in this graph, or, for a tensor that is no node (a weight, an
input, a state or KV cache, a scheduler copy), its name; the data pointer is left out (nothing of the map reads it).
Given the nodes before it on the path (a trie again: a node's outcome depends on the graph so far, through the data
flow and the ordinals), that key fixes the Node's name, op, layer, site and extra, whether it is the embedding
lookup, and the byte extent of its values. That is all a remembered step holds: no address, buffer or values.

Whose graphs: the remembered trie is one per (library file, version and commit, GGUF file by path, size and mtime,
the per-layer kinds, the observed sites) (`Tracer(..., model=)`, side.py: `model_key`), so another model or library in
the same process never starts from this one's steps, even if its graph looked the same. Bounded: at most MAX_MODELS
of them (the least recently used one is dropped), each dropped and started over past MAX_KEPT steps (a few graph kinds
are ~600 steps each).
"""
from __future__ import annotations

import struct
from collections import OrderedDict
from typing import Optional

from . import recall_disk as disk
from .lib import GgmlTensor as _T
from .nodes import LAYOUT, Node

NAME_OFF = _T.name.offset
PTRS_OFF = _T.src.offset        # src[10], then view_src
PTRS = struct.Struct("@11P")
BUFFER = struct.Struct("@P")
assert _T.view_src.offset == PTRS_OFF + 10 * PTRS.size // 11, "lib.GgmlTensor: view_src follows src[10]"
MAX_KEPT = 50_000
MAX_MODELS = 4
_MEMORY: "OrderedDict[tuple, Memory]" = OrderedDict()


class Kept:
    """A remembered node: its mapping outcome given the nodes before it (`kids`: the next node by its key). `view`:
    how its values are read ((shape, dtype, strides, ggml_nbytes) as numpy takes them) where a site needs them;
    `conv`: [T, S] of an SSM_CONV."""
    __slots__ = ("kids", "name", "op", "layer", "site", "backend", "extra", "size", "emb", "view", "conv")

    def __init__(self, node: Optional[Node] = None, emb: bool = False, view: Optional[tuple] = None):
        self.kids: dict = {}
        if node is not None:
            self.name, self.op, self.layer, self.site = node.name, node.op, node.layer, node.site
            self.backend, self.size, self.emb, self.view = node.backend, node.size, emb, view
            self.conv = (node.ne[1], node.ne[2]) if node.op == "SSM_CONV" else None
            # extra holds no address (op_params, the weight read, flags); the dict itself, so that what later nodes
            # of the graph add to it (the count of x_proj's views) is there too, as in the node-by-node map
            self.extra = node.extra

    def node(self, raw: bytes, addr: int, index: int) -> Node:
        """The Node it stands for at addr in this context, from its struct's bytes."""
        f = LAYOUT.unpack_from(raw)
        return Node(index, addr, self.name, self.op, f[2:6], f[6:10], f[0], [s for s in f[28:38] if s], f[38] or 0,
                    f[39], self.backend, self.layer, self.site, dict(self.extra))


class Memory:
    """The remembered trie of one model and library: `root` (the first node of each graph kind), `steps` kept;
    `dirty`: steps added since it was last written to disk."""

    def __init__(self):
        self.root, self.steps, self.dirty = Kept(), 0, False

    def add(self, parent: Kept, key: tuple, kid: Kept) -> Kept:
        parent.kids[key] = kid
        self.steps += 1
        self.dirty = True
        return kid

    def full(self) -> bool:
        return self.steps > MAX_KEPT


def memory(key: tuple) -> Memory:
    """The remembered trie for this model and library (key: see the module docstring), made on first use."""
    m = _MEMORY.get(key)
    if m is None or m.full():
        m = _MEMORY[key] = (disk.load(key, Memory, Kept) if m is None else None) or Memory()
        while len(_MEMORY) > MAX_MODELS:
            _MEMORY.popitem(last=False)
    _MEMORY.move_to_end(key)
    return m


def node_key(raw: bytes, at: dict, leaf_name, buffer_name) -> tuple:
    """The node's address-free key (module docstring) from its struct's bytes: `at` address -> index of this graph's
    nodes so far, `leaf_name(addr)` the name of a tensor that is no node, `buffer_name(addr)` a buffer's."""
    fixed = (raw[:_T.type.size] + raw[_T.ne.offset:PTRS_OFF]           # type; ne, nb, op, op_params, flags
             + raw[_T.view_offs.offset:_T.view_offs.offset + _T.view_offs.size])
    return (fixed + raw[NAME_OFF:NAME_OFF + 64].split(b"\0", 1)[0],
            buffer_name(BUFFER.unpack_from(raw, _T.buffer.offset)[0]),
            tuple([-1 if not a else at[a] if a in at else leaf_name(a) for a in PTRS.unpack_from(raw, PTRS_OFF)]))


def persist(key: Optional[tuple]):
    """Write this model's and library's remembered trie to disk if it grew (recall_disk.py: the next process's first
    graphs are then recalled, not mapped node by node)."""
    m = _MEMORY.get(key) if key is not None else None
    if m is not None and m.dirty:
        disk.save(key, m)
        m.dirty = False
