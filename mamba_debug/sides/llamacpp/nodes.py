"""Reading `ggml_tensor` nodes in the eval callback, and the node map: every node of a ubatch graph to (layer, site).

Layers are assigned by data flow, never by position (adjacent layers' nodes interleave in llama.cpp's graph): the
`-N` suffix of the three stable names (`norm-N`, `attn_norm-N`, `l_out-N`), the `blk.N.*` weight a node reads, the
`cache_r_lN` / `cache_s_lN` state it touches, else the highest layer among its inputs. The head (`norm`,
`result_norm`, `result_output`) and the embedding are model level (layer None).

The site: DESIGN.md's name where one exists (NODE_MAP, the one table), else the ggml op name with an ordinal from
the second node of that op in the layer (`SSM_CONV`, `MUL_MAT#2`, `CONT#2`). Views, reshapes, permutes and
transposes compute nothing and are not sites, except the B and C views of the x_proj output (DESIGN.md's B, C).
NODE_MAP and LAYER_SITES are Mamba-1's; the layers of a Mamba-2 or hybrid graph are mapped by maps.py (GraphMap is
given each layer's kind).
"""
from __future__ import annotations

import ctypes
import re
import struct
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .lib import GgmlTensor
from .maps import design_site

NO_COMPUTE = {"VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE", "NONE"}
DTYPES = {0: np.float32, 26: np.int32, 1: np.float16}
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
_CACHE = re.compile(r"cache_([rskv])_l(\d+)")      # recurrent r/s states; attention's KV cache k/v
_SUFFIX = re.compile(r"^(norm|attn_norm|l_out)-(\d+)$")
HEAD_NAMES = {"norm": "RMS_NORM", "result_norm": "final_norm", "result_output": "logits"}
# struct ggml_tensor up to its name, as lib.GgmlTensor lays it out: type, buffer, ne, nb, op, op_params, flags, src,
# view_src, view_offs, data, name (one unpack instead of a ctypes access per field)
LAYOUT = struct.Struct("@iP4q4Qi16ii10PPQP64s")
assert LAYOUT.size == GgmlTensor.extra.offset, "nodes.LAYOUT does not match lib.GgmlTensor"
_OP_DESC: dict = {}         # (op, op_params[0]) -> ggml_op_desc (which reads nothing else) of the process's library
_PARSED: dict = {}          # tensor name -> (blk layer, weight, cache kind, cache layer), the regexes' answers

# The node map (Mamba-1, llama.cpp src/models/mamba-base.cpp): how a node is recognised -> DESIGN.md's site.
# Keys: (op, what identifies it). "weight:X" = reads blk.N.X; "cache:r" = a CPY into cache_r_lN (the new state).
NODE_MAP = {
    ("MUL", "weight:attn_norm.weight"): "norm",
    ("MUL_MAT", "weight:ssm_in.weight"): "xz",
    ("CPY", "cache:r"): "conv_state",
    ("ADD", "weight:ssm_conv1d.bias"): "conv",
    ("SILU", "after:conv"): "conv_act",
    ("ADD", "weight:ssm_dt.bias"): "dt",
    ("VIEW", "B"): "B",
    ("VIEW", "C"): "C",
    ("SSM_SCAN", ""): "y_scan",
    ("CPY", "cache:s"): "ssm_state",
    ("ADD", "after:y_scan"): "y_skip",
    ("SWIGLU", ""): "y_gated",
    ("MUL_MAT", "weight:ssm_out.weight"): "out",
    ("ADD", "name:l_out"): "resid",
}
# Sites of a layer in llama.cpp's graph order, as the map yields them for a Mamba-1 block (op-named nodes only where
# the reference can say what they should hold: see reference.py). DESIGN.md's `gate` (silu(z) alone) does not exist
# in llama.cpp: SWIGLU fuses it into y_gated, so it is not observed.
LAYER_SITES = ("GET_ROWS", "RMS_NORM", "norm", "xz", "CONCAT", "conv_state", "SSM_CONV", "conv", "conv_act", "MUL_MAT#2", "CONT",
               "MUL_MAT#3", "dt", "B", "C", "y_scan", "ssm_state", "CONT#2", "MUL#2", "y_skip", "y_gated", "out",
               "resid")
HEAD_SITES = ("final_norm", "logits")


@dataclass
class Node:
    index: int                  # position in this ubatch graph
    addr: int
    name: str
    op: str                     # ggml_op_desc: SILU / SWIGLU for unary and GLU ops
    ne: tuple
    nb: tuple
    type: int
    src: list                   # addresses
    view_src: int
    view_offs: int
    backend: str
    layer: Optional[int] = None
    site: Optional[str] = None  # DESIGN.md's name or OP[#k]; None for views and empty nodes
    extra: dict = field(default_factory=dict)

    @property
    def size(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n


def read_node(lib, addr: int, index: int, raw: Optional[bytes] = None) -> Node:
    """The node at addr; raw: its struct's bytes when the caller has them (LAYOUT.size of them at least)."""
    f = LAYOUT.unpack_from(ctypes.string_at(addr, LAYOUT.size) if raw is None else raw)
    dll = lib.dll
    buf = dll.ggml_backend_buffer_name(f[1]).decode() if f[1] else "?"
    op = _OP_DESC.get((f[10], f[11]))
    if op is None:
        op = _OP_DESC[(f[10], f[11])] = (dll.ggml_op_desc(addr) or b"?").decode()
    node = Node(index, addr, f[41].split(b"\0", 1)[0].decode(errors="replace"), op, f[2:6], f[6:10], f[0],
                [s for s in f[28:38] if s], f[38] or 0, f[39], buf)
    node.extra["op_params"] = f[11:15]
    return node


def parse_name(name: str) -> tuple:
    """(blk layer, weight, cache kind, cache layer) of a tensor name, each None where the name has none."""
    p = _PARSED.get(name)
    if p is None:
        m, c = _BLK.match(name), _CACHE.search(name)
        p = (int(m.group(1)), m.group(2)) if m else (None, None)
        p += (c.group(1), int(c.group(2))) if c else (None, None)
        if len(_PARSED) > 100_000:
            _PARSED.clear()
        _PARSED[name] = p
    return p


def read_data(lib, node: Node) -> np.ndarray:
    """The node's values as a numpy array in ggml's order reversed (ne[3], ne[2], ne[1], ne[0]), honouring its byte
    strides (a strided view is read over its extent, then indexed like ggml does)."""
    dtype = DTYPES.get(node.type)
    if dtype is None:
        raise TypeError(f"node {node.name!r}: ggml type {node.type} is not read by mamba-debug")
    extent = lib.ggml_nbytes(node.addr)
    buf = np.empty(max(extent, 1), dtype=np.uint8)
    if extent:
        lib.ggml_backend_tensor_get(node.addr, buf.ctypes.data, 0, extent)
    return np.ndarray(shape=node.ne[::-1], dtype=dtype, buffer=buf, strides=node.nb[::-1]).copy()


def host_array(node: Node) -> np.ndarray:
    """A writable numpy view of a host-resident node's own memory (CPU build): for fault injection in tests."""
    t = GgmlTensor.from_address(node.addr)
    extent = int(sum((n - 1) * b for n, b in zip(node.ne, node.nb)) + node.nb[0])
    raw = (ctypes.c_char * extent).from_address(t.data)
    return np.ndarray(shape=node.ne[::-1], dtype=DTYPES[node.type], buffer=raw, strides=node.nb[::-1])


WEIGHT_PREFIXES = ("blk.", "token_embd", "output")


def weight_type(lib, addr: int) -> int:
    """The ggml type of the tensor at addr when it is one of the model's weights, else 0 (F32: a matmul of two
    activations); what picks a MUL_MAT's arithmetic path (local.path_of)."""
    leaf = read_node(lib, addr, -1)
    return leaf.type if leaf.name.startswith(WEIGHT_PREFIXES) else 0


def read_dequantized(lib, node: Node) -> Optional[np.ndarray]:
    """A weight stored narrower than float32 in a type read_data does not read (bf16, the quantized types) as its
    float32 values, in read_data's layout (gguf-py's dequantizers, llama.cpp's formats); None where it cannot be."""
    raw = _raw_rows(lib, node)
    if raw is None:
        return None
    try:
        from gguf import GGMLQuantizationType  # noqa: PLC0415
        from gguf.quants import dequantize  # noqa: PLC0415
        return dequantize(raw, GGMLQuantizationType(node.type)).reshape(node.ne[::-1])
    except (ImportError, ValueError, NotImplementedError):
        return None


def _raw_rows(lib, node: Node) -> Optional[np.ndarray]:
    """A weight's bytes as (rows, bytes a row), or None when it is not one contiguous run of rows."""
    if node.nb[2] != node.nb[1] * node.ne[1] or node.nb[3] != node.nb[2] * node.ne[2]:
        return None
    buf = np.empty(node.ne[1] * node.ne[2] * node.ne[3] * node.nb[1], dtype=np.uint8)
    lib.ggml_backend_tensor_get(node.addr, buf.ctypes.data, 0, buf.size)
    return buf.reshape(-1, node.nb[1])


# The types whose values are an offset plus a scaled non-negative integer: q4_1 and q5_1 (offset m per block of 32),
# q2_K (-dmin * m per 16), q4_K and q5_K (per 32); q4_0 and q5_0 (-8 d and -16 d per 32: CUDA's mmvq meets them with
# the activations' block sums). ggml's dot products sum the offsets' part apart from the scaled part
# (activations.split_sum_reach). By type: the block's bytes, the byte range holding the integers (zeroed, the
# dequantized block is its offsets alone), and the values one offset spans. Layouts: ggml-common.h.
OFFSET_LAYOUT = {2: (18, 2, 18, 32), 3: (20, 4, 20, 32), 6: (22, 2, 22, 32), 7: (24, 4, 24, 32),
                 10: (84, 16, 80, 16), 12: (144, 16, 144, 32), 13: (176, 16, 176, 32)}


def offsets(raw: Optional[np.ndarray], ggml_type: int) -> Optional[np.ndarray]:
    """The offsets of a weight's rows (raw: uint8 (rows, bytes a row)) as float64 (rows, K / span): each block
    dequantized with its integers zeroed (gguf-py); None for other types or where it cannot be."""
    layout_ = OFFSET_LAYOUT.get(ggml_type)
    if raw is None or layout_ is None or raw.shape[-1] % layout_[0]:
        return None
    size, lo, hi, span = layout_
    blocks = raw.reshape(raw.shape[0], -1, size).copy()
    blocks[:, :, lo:hi] = 0
    try:
        from gguf import GGMLQuantizationType  # noqa: PLC0415
        from gguf.quants import dequantize  # noqa: PLC0415
        values = dequantize(blocks.reshape(raw.shape), GGMLQuantizationType(ggml_type))
    except (ImportError, ValueError, NotImplementedError):
        return None
    return values.reshape(raw.shape[0], -1, span)[:, :, 0].astype(np.float64)


# q4_1's and q5_1's blocks begin with their scale d as an f16 (ggml-common.h), which CUDA's mmvq multiplies by the
# activations' f16 scale in f16 (activations.f16_products). By type: the block's bytes.
SCALE_FIRST = {3: 20, 7: 24}


def scales(raw: Optional[np.ndarray], ggml_type: int) -> Optional[np.ndarray]:
    """The block scales d of a q4_1 / q5_1 weight's rows (raw: uint8 (rows, bytes a row)) as float64 (rows, K / 32);
    None for other types or where it cannot be."""
    size = SCALE_FIRST.get(ggml_type)
    if raw is None or size is None or raw.shape[-1] % size:
        return None
    first = np.ascontiguousarray(raw.reshape(raw.shape[0], -1, size)[:, :, :2])
    return first.view(np.float16)[:, :, 0].astype(np.float64)


def read_offsets(lib, node: Node, gguf_path=None) -> Optional[np.ndarray]:
    """A weight's offsets (OFFSET_LAYOUT): from its buffer, or from the GGUF file for a repacked one."""
    return offsets(_weight_rows(lib, node, gguf_path), node.type) if node.type in OFFSET_LAYOUT else None


def read_scales(lib, node: Node, gguf_path=None) -> Optional[np.ndarray]:
    """A q4_1 / q5_1 weight's block scales (SCALE_FIRST), read as read_offsets reads its offsets."""
    return scales(_weight_rows(lib, node, gguf_path), node.type) if node.type in SCALE_FIRST else None


def _weight_rows(lib, node: Node, gguf_path=None) -> Optional[np.ndarray]:
    """A weight's bytes as (rows, bytes a row): from its buffer, or from the GGUF file for a repacked one."""
    if not repacked(node):
        return _raw_rows(lib, node)
    t = _file_tensor(gguf_path, node) if gguf_path else None
    return None if t is None else np.asarray(t.data).reshape(-1, t.data.shape[-1])


# ggml-cpu's extra buffer types keep a weight re-laid out for their kernels (q4_0 as q4_0x8 on AVX2, AMX tiles,
# KleidiAI) and give no get_tensor: ggml_backend_tensor_get on one dereferences a null pointer (a segfault at the
# first quantized matmul of a CPU build, 2026-12-06). Such a weight is read from the GGUF file instead.
REPACKED_BUFFERS = ("REPACK", "AMX", "KLEIDIAI")
_READERS: dict = {}


def repacked(node: Node) -> bool:
    """Whether the node lives in a buffer ggml cannot read back (REPACKED_BUFFERS)."""
    return any(k in node.backend.upper() for k in REPACKED_BUFFERS)


def read_from_file(gguf_path, node: Node) -> Optional[np.ndarray]:
    """A weight's float32 values from the GGUF file llama.cpp loaded, by its name (dequantized by gguf-py), in
    read_data's layout; None where the file, the name or its shape does not match."""
    try:
        from gguf.quants import dequantize  # noqa: PLC0415
        t = _file_tensor(gguf_path, node)
        if t is None:
            return None
        data = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        want = tuple(node.ne[::-1])
        return data.reshape(want) if data.size == int(np.prod(want)) else None
    except (ImportError, ValueError, NotImplementedError, OSError):
        return None


def _file_tensor(gguf_path, node: Node):
    """The GGUF file's tensor of the node's name (gguf-py's reader, one file's kept), or None."""
    try:
        from gguf import GGUFReader  # noqa: PLC0415
        key = str(gguf_path)
        if key not in _READERS:
            _READERS.clear()                        # one model's file at a time
            _READERS[key] = {t.name: t for t in GGUFReader(key).tensors}
        return _READERS[key].get(node.name)
    except (ImportError, ValueError, OSError):
        return None


def model_input(node: Node) -> bool:
    """The embedding lookup (by the weight it reads, whatever its name) and what llama.cpp names the layers' input,
    "embd" (the lookup itself in Mamba's graph; in Granite's, the SCALE by the embedding multiplier after it):
    nodes before layer 0, in no layer."""
    return node.name == "embd" or bool(node.extra.get("embedding"))


def outside_layers(node: Node) -> bool:
    """Nodes in no layer: the model input, and the head (by its names, or a node reading a head node: Granite's
    unnamed head MUL_MAT before the SCALE it names result_output)."""
    return model_input(node) or node.name in HEAD_NAMES or bool(node.extra.get("head"))


class GraphMap:
    """Maps the nodes of one ubatch graph as they are observed, in graph order (inputs before consumers)."""

    def __init__(self, names: dict, kinds: Optional[list] = None):
        self.names = names                  # address -> name of every tensor seen (weights included)
        self.kinds = kinds or []            # per layer: maps.layer_kinds (none given: every layer Mamba-1)
        self.nodes: dict = {}               # address -> Node
        self.count: dict = {}               # (layer, op) -> nodes of that op so far
        self.roles: dict = {}               # address -> DESIGN site of already mapped nodes
        self.copies: dict = {}              # address of a scheduler copy -> the name of what it copies
        self._named: dict = {}              # name -> the nodes of that name, in graph order

    def src_name(self, addr: int) -> str:
        """A source's name; for the scheduler's copy of a tensor for another backend ("CUDA0#blk.0.ssm_in.weight#0",
        "CUDA_Host#node_36 (view)#0": op offload and backend boundaries), the name of what it copies."""
        if addr in self.nodes:
            return self.nodes[addr].name
        name = self.names.get(addr)
        if name is None:
            name = GgmlTensor.from_address(addr).name.decode(errors="replace")
            parts = name.split("#")
            if len(parts) != 3:
                self.names[addr] = name     # weights, inputs, caches; not copies (the scheduler's, per graph)
                return name
            self.copies[addr] = parts[1]
            return parts[1]
        return name

    def named(self, name: str) -> list:
        """The nodes of this graph with that name. Names are not unique: views are " (view)" or "node_36 (view)"
        (the scan's y and its state are both views of the scan), so a copy may be of any of them."""
        return self._named.get(name, [])

    def sources(self, addr: int) -> list:
        """The node(s) a source may be: itself, or for a scheduler copy every node of the name it copies."""
        node = self.nodes.get(addr)
        if node is not None:
            return [node]
        return self.named(self.copies[addr]) if addr in self.copies else []

    def add(self, node: Node) -> Node:
        node.extra["embedding"] = (node.op == "GET_ROWS" and bool(node.src)
                                   and self.src_name(node.src[0]) == "token_embd.weight")
        node.layer, weight, cache = self._layer(node)
        node.extra["weight"] = weight
        self.nodes[node.addr] = node
        self._named.setdefault(node.name, []).append(node)
        op = node.op
        kind = self.kind(node.layer)
        if kind != "mamba1":                # maps.py: the layer types beyond Mamba-1
            return self._add_other(node, weight, cache, kind)
        if op in NO_COMPUTE and op != "VIEW" or node.size == 0:
            return node
        site = self._design_site(node, weight, cache)
        if op == "VIEW" and site is None:
            return node
        if node.layer is not None or outside_layers(node):
            k = self.count[(node.layer, op)] = self.count.get((node.layer, op), 0) + 1
            node.site = site or (op if k == 1 else f"{op}#{k}")
            if site:
                self.roles[node.addr] = site
        return node

    def kind(self, layer: Optional[int]) -> str:
        return self.kinds[layer] if layer is not None and layer < len(self.kinds) else "mamba1"

    def _add_other(self, node: Node, weight, cache, kind: str) -> Node:
        """A node of a Mamba-2 or attention layer: every computing node counts for its op's ordinal, empty or not
        (so a name means the same node in every ubatch); views are no sites there."""
        op = node.op
        if op in NO_COMPUTE:
            return node
        k = self.count[(node.layer, op)] = self.count.get((node.layer, op), 0) + 1
        if node.size == 0:
            return node
        site = design_site(self, node, weight, cache, kind)
        node.site = site or (op if k == 1 else f"{op}#{k}")
        if site:
            self.roles[node.addr] = site
        return node

    def _layer(self, node: Node):
        weight = cache = None
        layers = []
        for s in node.src + ([node.view_src] if node.view_src else []):
            blk, w, c, c_layer = parse_name(self.src_name(s))
            if blk is not None:
                layers.append(blk)
                weight = w
            if c is not None:
                layers.append(c_layer)
                cache = c
            src = self.nodes.get(s)
            if src is not None:
                if src.layer is None and (src.name in HEAD_NAMES or src.extra.get("head")):
                    node.extra["head"] = True
                elif src.layer is not None:
                    layers.append(src.layer)
        m = _SUFFIX.match(node.name)
        if outside_layers(node):
            return None, weight, cache
        if m:
            return int(m.group(2)), weight, cache
        c = parse_name(node.name)[2]
        if c is not None and node.op == "CPY":
            cache = c
        return (max(layers) if layers else None), weight, cache

    def _design_site(self, node: Node, weight, cache) -> Optional[str]:
        op = node.op
        if node.name in HEAD_NAMES:
            return None if HEAD_NAMES[node.name] == "RMS_NORM" else HEAD_NAMES[node.name]
        if weight and (op, f"weight:{weight}") in NODE_MAP:
            return NODE_MAP[(op, f"weight:{weight}")]
        if op == "CPY" and cache and "copy of" in node.name:
            return NODE_MAP.get(("CPY", f"cache:{cache}"))
        if _SUFFIX.match(node.name) and node.name.startswith("l_out"):
            return "resid"
        if op in ("SSM_SCAN", "SWIGLU"):
            return NODE_MAP[(op, "")]
        roles = [self.roles.get(s) for s in node.src]
        if op == "SILU" and "conv" in roles:
            return "conv_act"
        if op == "ADD" and any(n.view_src in self.roles and self.roles[n.view_src] == "y_scan"
                               for s in node.src for n in self.sources(s)):       # y + D x (a copy of y: op offload)
            return "y_skip"
        if op == "VIEW" and node.view_src in self.nodes:
            parent = self.nodes[node.view_src]
            if parent.op == "MUL_MAT" and parent.extra.get("weight") == "ssm_x.weight" and node.view_offs > 0:
                k = parent.extra["views"] = parent.extra.get("views", 0) + 1
                return "B" if k == 1 else "C" if k == 2 else None
        return None
