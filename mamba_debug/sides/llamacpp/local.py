"""Local error per node (`--local` with `--engine llama.cpp`): each node's op recomputed in float64 from the inputs
the node really read (as observed, before anything could overwrite them), against the node's own output. It
separates the error a node makes from the error it inherits: a node whose local error passes its path's floor is
where an error is born, whatever its inputs carried.

Ops: RMS_NORM, MUL_MAT (with ggml's broadcast of src0's heads), SSM_CONV, SSM_SCAN (Mamba-1 and Mamba-2), SILU, SWIGLU,
MUL, ADD, SCALE, and the data movers CONT, CPY, GET_ROWS, CONCAT (exact: a strided view read as contiguous shows
here). Arrays are in ggml's order reversed (numpy shape ne[3], ne[2], ne[1], ne[0]), as nodes.read_data gives them.

Each node is judged against the floor of the arithmetic path it ran on (`path_of`): FP32 paths (every CPU node)
k x FP32_FLOOR, TF32 paths (CUDA's mmf tile kernel and cuBLAS on its TF32 handle) TF32_LIMIT.

Besides the whole-node error (one rel. L2 over every token of the ubatch), each node with a token axis keeps its
per-token errors (token_rows.py): an error at one token is diluted in the whole node, not in its row.

A flat floor ignores conditioning: a row whose result is small against its terms (SSM_SCAN's y at a fresh
sequence's first token, y = dt x (B . C) with B . C cancelling) errs by many ulps in any float32 implementation. So
where a node's row passes the floor, the op is recomputed once more in float32 from the same inputs (numpy, or
torch on the GPU for MUL_MAT): that independent implementation's error at the row is what float32 gives there, and a
row within ORACLE_MARGIN of it is precision, not a fault (`at_token`'s `explained`). A fault (a wrong index, a
strided view read as contiguous) errs by orders of magnitude more.
"""
from __future__ import annotations

import struct
from typing import Optional

import numpy as np

from .activations import (CUDA_MMVQ, MMVQ_MAX_COLS, emulation, f16_products, on_cuda, roundings,
                          settle_ties, split_block, split_sum_reach, with_block_sums)
from .token_rows import flat_sums, layout, ratio, rows_and_whole

FP32_FLOOR = 1e-6       # rel. L2 of one float32 op against float64 (a few ulps); the k_floor multiple applies
# One TF32 matmul's local rel. L2 on the H200: cuBLAS 3-5e-4, mmf up to 1.2e-3 (research/llamacpp-tracing.md 4.5;
# mmf truncates its operands). A TF32 node is excused up to this; beyond it, it is a fault like any other.
TF32_FLOOR = 1.2e-3
TF32_LIMIT = 4 * TF32_FLOOR
# A GGUF's weights narrower than float32 (f16, bf16, a quantized type): ggml rounds a MUL_MAT's activations to the
# weights' dot-product type first, on the CPU (vec_dot_type) and in CUDA's kernels: f16, bf16, or 8-bit blocks with a
# scale each (q8_0 / q8_1 / q8_K) for every quantized type. The float64 recompute reads the same (dequantized)
# weights, so a node's local error is that rounding; each family's floor is the unit roundoff of its rounding (f16
# 2^-11, bf16 2^-8; 8-bit: a step of amax/127 in blocks of 32), and a node is excused up to 4x it, like TF32.
WEIGHT_FLOORS = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8, "8-bit": 2e-2}
WEIGHT_TYPES = {1: "f16", 30: "bf16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 10: "q2_K", 11: "q3_K",
                12: "q4_K", 13: "q5_K", 14: "q6_K"}


def path_floor(path: str) -> float:
    """The floor of a reduced-precision path (path_of's text): TF32's, or its weights' family's."""
    head = path.split(" ", 1)[0]
    return TF32_FLOOR if head == "tf32" else WEIGHT_FLOORS.get(head, WEIGHT_FLOORS["8-bit"])


def path_limit(path: str, k: float) -> float:
    """A node's limit on its path: k x the FP32 floor on an FP32 path, else 4x the path's floor."""
    return k * FP32_FLOOR if path.startswith("fp32") else 4 * path_floor(path)
# Two float32 implementations of one op on the same row differ by their order of sums and their exp: a few times at
# most on rows of thousands of values (the rel. L2 averages each value's rounding). Past this multiple of the
# independent float32 recompute's error, a row's error is the node's own fault.
ORACLE_MARGIN = 4.0
# llama.cpp's SSM_SCAN takes softplus(dt) as logf(1 + expf(dt)) (ggml-impl.h, ggml_compute_softplus_f32): 1 + e
# rounds away e's low bits, so where dt is small (softplus 1e-3..1e-2) delta, and y at a fresh sequence's first
# token, err ~1e-5 relative, 100x what log1pf(expf(dt)) errs (the CPU build: one of 120 random runs read DIVERGED
# at 1.05x so, none since, 2026-12-06). The float32 recompute of an SSM_SCAN takes the larger of both forms' errors
# per row, and an error explained only by this form says so: a precision defect of the op's formula, not a fault.
SOFTPLUS_NOTE = "llama.cpp's softplus, logf(1 + expf(dt)), which loses exp(dt)'s low bits where dt is small"
OPS = ("RMS_NORM", "MUL_MAT", "SSM_CONV", "SSM_SCAN", "SILU", "SWIGLU", "MUL", "ADD", "CONT", "CPY", "GET_ROWS",
       "CONCAT", "SCALE")


def recompute(op: str, srcs: list, out_shape: tuple, op_params, ggml_softplus: bool = False) -> np.ndarray | None:
    """The node's output in float64 from its sources (float64 arrays), or None for an op not recomputed here.
    ggml_softplus: SSM_SCAN's softplus as llama.cpp writes it (SOFTPLUS_NOTE), not log1p(exp(dt))."""
    if op == "RMS_NORM":
        eps = struct.unpack("f", struct.pack("i", op_params[0]))[0]
        x = srcs[0]
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    if op == "MUL_MAT":
        w, x = srcs[0], srcs[1]                 # w (.., M, K), x (.., N, K) -> (.., N, M)
        for ax in (0, 1):                       # ggml broadcasts w's ne3/ne2 over x's: w row i//r for x row i
            if w.shape[ax] != x.shape[ax]:      # (grouped-query attention: kv heads over query heads)
                if w.shape[ax] == 0 or x.shape[ax] % w.shape[ax]:
                    return None
                w = np.repeat(w, x.shape[ax] // w.shape[ax], axis=ax)
        return np.matmul(x, np.swapaxes(w, -1, -2))
    if op in ("ADD", "MUL"):
        a, b = srcs[0], srcs[1]
        if any(db not in (1, da) for da, db in zip(a.shape, b.shape)):
            return None
        return a + b if op == "ADD" else a * b
    if op == "SILU":
        return _silu(srcs[0])
    if op == "SWIGLU" and len(srcs) >= 2:
        return _silu(srcs[0]) * srcs[1]
    if op == "SSM_CONV":
        sx, c = srcs[0][0], srcs[1][0, 0]       # sx (S, D, K-1+T), c (D, K)
        K = c.shape[-1]
        T = sx.shape[-1] - K + 1
        out = sum(c[None, :, k, None] * sx[:, :, k:k + T] for k in range(K))     # (S, D, T)
        return np.swapaxes(out, 1, 2)[None]     # (1, S, T, D)
    if op == "SSM_SCAN":
        return _scan(srcs, out_shape, ggml_softplus)
    if op in ("CONT", "CPY"):                   # the same values in the node's own order
        return srcs[0].reshape(out_shape) if srcs[0].size == int(np.prod(out_shape)) else None
    if op == "GET_ROWS" and srcs[0].ndim == 4 and srcs[0].shape[:2] == (1, 1):
        return srcs[0][0, 0][srcs[1].reshape(-1).astype(np.int64)].reshape(out_shape)
    if op == "SCALE":                           # x * s + b (llama.cpp zeroes a fresh sequence's state rows so)
        s, b = (struct.unpack("f", struct.pack("i", p))[0] for p in op_params[:2])
        return srcs[0] * s + b
    if op == "CONCAT":
        return np.concatenate([srcs[0], srcs[1]], axis=3 - int(op_params[0]))
    return None


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _scan(srcs, out_shape, ggml_softplus: bool = False):
    """ggml's SSM_SCAN in float64, both forms: Mamba-1 (head_dim 1, A per channel and state, one group) and
    Mamba-2 (head_dim P, one scalar A per head, B and C shared by the heads of a group). numpy shapes (ggml's
    reversed): s (slots, H, P, N), x (S, T, H, P), dt (1, S, T, H), A (1, 1, H, N or 1), B and C (S, T, G, N);
    the output is y (S, T, H, P) followed by the final states (S, H, P, N)."""
    s, x, dt, A, B, C, ids = srcs[:7]
    S, T, H, P = x.shape
    G = B.shape[2]
    if s.shape[1:3] != (H, P) or dt.shape[1:] != (S, T, H) or H % G:
        return None
    A = A[0, 0][:, None, :]                      # (H, 1, N or 1)
    group = np.arange(H) // (H // G)             # the group each head reads B and C from
    ids = ids.reshape(-1).astype(np.int64)
    ys, states = np.empty((S, T, H, P)), np.empty((S, H, P, s.shape[3]))
    for q in range(S):
        h = s[ids[q]].copy()                     # (H, P, N)
        for t in range(T):
            d = dt[0, q, t]                      # (H,)
            e = np.exp(np.minimum(d, 20.0))
            d = np.where(d > 20.0, d, np.log(1 + e) if ggml_softplus else np.log1p(e))
            Bt, Ct = B[q, t][group], C[q, t][group]                  # (H, N)
            h = h * np.exp(d[:, None, None] * A) + (d[:, None] * x[q, t])[:, :, None] * Bt[:, None, :]
            ys[q, t] = (h * Ct[:, None, :]).sum(-1)
        states[q] = h
    flat = np.concatenate([ys.reshape(-1), states.reshape(-1)])
    n = int(np.prod(out_shape))
    return flat[:n].reshape(out_shape) if flat.size >= n else None


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    """||got - want|| / ||want|| by token_rows.ratio's rules: a node that made a NaN or inf from finite inputs is
    inf (born here, past every limit), never NaN (which would read as inherited)."""
    d = got - want
    return float(ratio(np.vdot(d, d), np.vdot(want, want)))


NO_ROOM = object()              # _mul_mat_error: the weight does not fit on the device: recompute on the host
GPU_MARGIN = 2 << 30            # bytes left free on the GPU for llama.cpp and torch after a weight is moved


def _fits(device, nbytes: int) -> bool:
    """Does a float64 weight of nbytes fit on a CUDA device with GPU_MARGIN to spare (a 2.8B model's float64 weights
    are 23 GB: on a small GPU they stay on the host)?"""
    import torch  # noqa: PLC0415
    if torch.device(device).type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return nbytes + GPU_MARGIN <= free


# Whether llama.cpp's cuBLAS runs FP32 in this process: NVIDIA_TF32_OVERRIDE was "0" when its first CUDA run loaded
# (side._load records it). ggml creates its cuBLAS handles at its first CUDA matmul and keeps them, so a later
# change is taken not to apply (measured on the H200 for a fresh process only: set before the first CUDA run, every
# cuBLAS node's local error is FP32-sized). None until then. Before, a --fp32-everywhere run was judged as TF32.
CUBLAS_FP32: dict = {"at_init": None}


def path_of(node, weights: int = 0) -> str:
    """The arithmetic path a node ran on (research/llamacpp-tracing.md section 4): every CPU node is FP32; on CUDA
    an f32 MUL_MAT of <= 3 columns runs the FP32 vector kernel, 4..16 columns the TF32 mmf tile kernel, more cuBLAS
    on a TF32 handle (FP32 when NVIDIA_TF32_OVERRIDE=0 was set as CUDA started: --fp32-everywhere; measured on the
    H200, 2.8B shape: local errors of every cuBLAS node within the FP32 floor, 3e-4 without it). A MUL_MAT of weights
    narrower than float32 rounds its activations to their family on either backend (WEIGHT_FLOORS): `weights` is its
    first source's ggml type when that is one of the model's weights (nodes.weight_type), else 0."""
    wt = weights if node.op == "MUL_MAT" else 0
    if wt:
        name = WEIGHT_TYPES.get(wt, f"type {wt}")
        family = name if name in WEIGHT_FLOORS else "8-bit"
        mmvq = family == "8-bit" and on_cuda(node) and node.ne[1] <= MMVQ_MAX_COLS     # CUDA's vector kernel
        return f"{family} weights ({name}; activations rounded to {family}{', CUDA mmvq' if mmvq else ''})"
    if not on_cuda(node) or node.op != "MUL_MAT":
        return "fp32"
    cols = node.ne[1]
    if cols <= 3:
        return "fp32 (mmvf)"
    if cols <= 16 and node.ne[0] % 32 == 0:
        return "tf32 (mmf, no switch)"
    if CUBLAS_FP32["at_init"]:
        return "fp32 (cuBLAS, NVIDIA_TF32_OVERRIDE=0)"
    return "tf32 (cuBLAS; NVIDIA_TF32_OVERRIDE=0 makes it fp32)"


class LocalErrors:
    """Per mapped node: the largest local error over the run; the first node past k x the FP32 floor (`first_over`,
    what `--local` reports); the first node past its own path's limit (`first_fault`: an FP32 node past k x the
    FP32 floor, a TF32 node past TF32_LIMIT); the reduced-precision nodes whose error the FP32 threshold would
    not excuse (`excused`); and, with `ubatch_shape` set, each node's per-token errors per (ubatch, group) for
    `at_token`, and its worst token (`worst_token`)."""

    def __init__(self, k_floor: float, device=None, emulate: Optional[str] = None):
        self.k = k_floor
        self.device = device            # a torch device for MUL_MAT's recompute (cuda: see _mul_mat_error)
        self.emulate = emulate          # the build ("cpu", "cuda") whose narrow-weight rounding is emulated, or None
        self.softplus_rows = None
        self._on_device: dict = {}      # id of a weight's float64 array -> (the array, its tensor on `device`)
        self.mul_mat_on = {str(device): 0, "host": 0} if device is not None else {"host": 0}
        self.worst: dict = {}
        self.first = self.fault = None
        self.excused: dict = {}
        self.explained: dict = {}       # node key -> its worst whole-node error within ORACLE_MARGIN x float32's own
        self.reduced = False            # did any node run on a reduced-precision path
        self.index_of: dict = {}        # (ubatch, first_seq, layer, site) -> the node's index in its graph
        self.ubatch_shape = None        # (S, T) of the ubatch being decoded: `begin`, before each decode
        self.tokens: dict = {}          # (ubatch, first_seq) -> per-token local errors of each node (at_token)
        self.worst_token: dict = {}     # key -> [error, ubatch, seq, token in ubatch]: the node's worst token

    def begin(self, u: int, first_seq: int, S: int, T: int):
        """A decode of ubatch u of the group at first_seq starts (again, in a replay): its per-token record anew."""
        self.ubatch_shape = (S, T)
        self.tokens.pop((u, first_seq), None)

    def place(self, node, u: int, first_seq: int = 0):
        """Note where a node sits in its graph (a divergence at a view, B or C, is bounded by it in at_token)."""
        self.index_of.setdefault((u, first_seq, node.layer, node.site or node.op), node.index)

    def add(self, node, srcs: list, got: np.ndarray, u: int, first_seq: int = 0, weights: int = 0, offs=None,
            scales=None):
        """One observed node: its local error on its path (weights: its weights' ggml type, path_of; offs, scales:
        its weights' offsets and block scales, nodes.read_offsets / read_scales, for the types whose emulation reads
        them)."""
        path = path_of(node, weights)
        self.reduced |= not path.startswith("fp32")
        self.place(node, u, first_seq)
        if node.op not in OPS:
            return
        self.softplus_rows = None       # _error's: the rows where llama.cpp's softplus errs more (SSM_SCAN)
        measured = None if any(a is None for a in srcs) else self._error(node, srcs, got)
        err, rows, oracle, oracle_err = measured or (None, None, None, None)
        self._keep_rows(node, path, err, rows, oracle, u, first_seq)
        if err is None:
            return
        site = node.site or node.op
        key = f"{'head' if node.layer is None else node.layer}.{site}"
        self.worst[key] = max(self.worst.get(key, 0.0), err)
        if rows is not None:
            self._worst_token(key, rows, u, first_seq)
        where = {"ubatch": u, "first_seq": first_seq, "layer": node.layer, "site": site, "op": node.op,
                 "name": node.name, "path": path, "error": err}
        if oracle_err is not None and err > self.k * FP32_FLOOR and err <= ORACLE_MARGIN * oracle_err:
            old = self.explained.get(key)           # conditioning: float32 itself errs as much on these inputs
            if old is None or err > old["error"]:
                self.explained[key] = {**where, "fp32_recompute": oracle_err}
            return
        limit, judged = path_limit(path, self.k), err
        emulated = self._emulated(node, srcs, got, weights, offs, scales) if err > self.k * FP32_FLOOR else None
        if emulated is not None:        # against what its activations' rounding gives: FP32-sized when clean
            judged, reach = emulated
            where["emulated_error"], limit = judged, self.k * FP32_FLOOR
            if reach is not None and ORACLE_MARGIN * reach > limit:     # float32's own error on ggml's split sums
                where["fp32_split_sums"], limit = reach, ORACLE_MARGIN * reach
        if self.first is None and err > self.k * FP32_FLOOR:
            self.first = {**where, "threshold": self.k * FP32_FLOOR, "limit": path_limit(path, self.k),
                          "index": node.index}
        if judged > limit:
            if self.fault is None:
                self.fault = {**where, "threshold": limit, **({"error": judged, "plain_error": err,
                                                              "path": path[:-1] + ", emulated)"} if emulated else {})}
        elif err > self.k * FP32_FLOOR:
            old = self.excused.get((key, path))         # its worst judged error, where the node first passed the floor
            if old is None or judged > old.get("emulated_error", old["error"]):
                self.excused[(key, path)] = {**where, "floor": path_floor(path), "limit": path_limit(path, self.k),
                                             "index": node.index,
                                             "first_seen": old["first_seen"] if old else (first_seq, u, node.index)}

    def _emulated(self, node, srcs: list, got: np.ndarray, weights: int, offs=None, scales=None) -> Optional[tuple]:
        """A MUL_MAT of narrow weights whose activations' rounding is emulated (activations.emulation: every node of
        a CPU build, a CUDA build's mmvq nodes): (its local error against the float64 product of its weights with
        its activations rounded so, and where that passes the FP32 floor on weights with offsets float32's own error
        on the kernel's split sums, split_sum_reach, else None); None where not emulated. The least error over the
        quantizer's forms (a build uses one)."""
        name = WEIGHT_TYPES.get(weights)
        kernel = emulation(self.emulate, name, node) if node.op == "MUL_MAT" else None
        if kernel is None or any(a is None for a in srcs[:2]):
            return None
        w, best = srcs[0].astype(np.float64, copy=False), None
        for x, sums in roundings(kernel, name, srcs[1]):
            if kernel == "cuda" and CUDA_MMVQ[name] == "f16":      # q4_1 / q5_1: scale products rounded to f16
                want = f16_products(w, x, sums, offs, scales)
            else:
                want = recompute("MUL_MAT", [w, x], got.shape, ())
                if want is not None and sums is not None:       # the offsets times the block sums' own rounding
                    want = with_block_sums(want, x, sums, offs) if offs is not None else None
            if want is None or want.shape != got.shape:
                return None
            err = rel_l2(got.astype(np.float64), want)
            best = (err, x, sums, want) if best is None or err < best[0] else best
            if err <= self.k * FP32_FLOOR:
                break
        if best is None:
            return None
        err, x, sums, want = best
        if kernel == "cuda" and err > self.k * FP32_FLOOR:     # a value at a half under fast-math division
            settled = settle_ties(got, want, w, srcs[1], offs if sums is not None else None)
            err = err if settled is None else min(err, settled)
        w2, block = w.reshape(-1, w.shape[-1]), split_block(kernel, name)
        if err <= self.k * FP32_FLOOR or block is None or offs is None or w2.shape[0] != got.shape[-1]:
            return err, None
        return err, split_sum_reach(w2, x, offs, block, sums)

    def _keep_rows(self, node, path: str, err, rows, oracle, u: int, first_seq: int):
        """Keep what at_token reads: per node of the ubatch its per-token errors (S, T) and, where a row passed the
        floor, the float32 recompute's (S, T); else its whole-node error, else None (not recomputed). A graph of an
        (ubatch, group) seen before replaces the old one."""
        if self.ubatch_shape is None:
            return
        rec = self.tokens.setdefault((u, first_seq), {"shape": self.ubatch_shape, "nodes": []})
        rec["nodes"].append((node.index, node.layer, node.site or node.op, node.op, node.name, path, err, rows,
                             oracle, self.softplus_rows))

    def _worst_token(self, key: str, rows: np.ndarray, u: int, first_seq: int):
        i = int(np.argmax(np.where(np.isnan(rows), -np.inf, rows)))       # NaN: inherited (token_rows.ratio)
        e = float(rows.flat[i])
        old = self.worst_token.get(key)
        if old is None or e > old[0] or old[0] != old[0]:
            q, t = divmod(i, rows.shape[1])
            self.worst_token[key] = [e, u, first_seq + q, t]

    def at_token(self, u: int, seq: int, t: int, layer, site) -> Optional[dict]:
        """The per-token local evidence at token t (its index in the ubatch) of sequence seq in ubatch u: over the
        nodes of that ubatch and group of sequences up to and including node (layer, site), in graph order, the
        largest per-token local error and the first node past k x FP32_FLOOR there that its float32 recompute does
        not explain (`explained`: the nodes past the floor within ORACLE_MARGIN x that recompute's error). Nodes
        without a token axis are counted apart with their whole-node error. `earlier_over`: the first such node at
        an earlier token of the same sequence in this ubatch (an error born there reaches token t through the
        states). None where that ubatch or node was not recorded."""
        hit = [(g, rec) for (uu, g), rec in self.tokens.items()
               if uu == u and g <= seq < g + rec["shape"][0] and t < rec["shape"][1]]
        upto = self.index_of.get((u, hit[0][0], layer, site)) if hit else None
        if upto is None:
            return None
        g, rec = hit[0]
        limit = self.k * FP32_FLOOR
        tok, whole, explained, n_none, own, earlier = [], [], [], 0, False, None
        for index, n_layer, n_site, op, name, path, err, rows, oracle, softplus in rec["nodes"]:
            if index > upto:
                break
            where = {"layer": n_layer, "site": n_site, "op": op, "name": name, "path": path}
            if rows is not None:
                over = _unexplained(rows[seq - g], None if oracle is None else oracle[seq - g], limit)
                item = {**where, "error": float(rows[seq - g, t])}
                if item["error"] > limit and not over[t]:
                    explained.append({**item, "fp32_recompute": float(oracle[seq - g, t]),
                                      **({"formula": SOFTPLUS_NOTE} if softplus is not None and softplus[seq - g, t]
                                         else {})})
                    item["explained"] = True
                tok.append(item)
                own |= index == upto
                j = int(np.argmax(over[:t])) if t else 0
                if earlier is None and t and over[j]:
                    earlier = {**where, "token_in_ubatch": j, "error": float(rows[seq - g, j])}
            elif err is not None:
                whole.append({**where, "error": err})
            else:
                n_none += 1
        return {"ubatch": u, "seq": seq, "token_in_ubatch": t, "upto": {"layer": layer, "site": site},
                "limit": limit, "nodes": len(tok), "site_measured": own, **_evidence(tok, limit),
                "explained": explained, "oracle_margin": ORACLE_MARGIN,
                "whole_node_only": {"nodes": len(whole), **_evidence(whole, limit)}, "not_recomputed": n_none,
                "earlier_over": earlier}

    def _error(self, node, srcs: list, got: np.ndarray):
        """(the node's local rel. L2, its per-token errors (S, T) or None, and where either passes the floor the
        same two for an independent float32 recompute from the same inputs, else None, None); None where the node
        is not recomputed. Per-token errors for a node with a token axis (token_rows.layout)."""
        shape = self.ubatch_shape
        lay = None if shape is None else layout(node.op, got.shape, srcs, *shape)
        if node.op == "MUL_MAT" and self.device is not None:
            out = self._mul_mat_error(srcs, got, lay)
            if out is not NO_ROOM:
                self.mul_mat_on[str(self.device)] += 1
                return out
            self.mul_mat_on["host"] += 1         # the weight does not fit on the GPU in float64: numpy, the same sums
        params = node.extra.get("op_params", ())
        want = recompute(node.op, [a.astype(np.float64, copy=False) for a in srcs], got.shape, params)
        if want is None or want.shape != got.shape:
            return None
        got = got.astype(np.float64)
        rows, whole = rows_and_whole(got, want, lay, *shape) if lay is not None else (None, None)
        err = rel_l2(got, want) if whole is None else whole
        if not self._passes_floor(err, rows):
            return err, rows, None, None
        # what an independent float32 implementation errs on these inputs (conditioning, not a fault, within a few x)
        src32 = [a.astype(np.float32) for a in srcs]
        want32 = recompute(node.op, src32, got.shape, params).astype(np.float64)
        oracle = rows_and_whole(want32, want, lay, *shape)[0] if lay is not None else None
        oracle_err = rel_l2(want32, want)
        if node.op == "SSM_SCAN":           # and with llama.cpp's own softplus (SOFTPLUS_NOTE): the larger per row
            g32 = recompute(node.op, src32, got.shape, params, ggml_softplus=True).astype(np.float64)
            g_rows = rows_and_whole(g32, want, lay, *shape)[0] if lay is not None else None
            if g_rows is not None and oracle is not None:
                self.softplus_rows = g_rows > oracle
                oracle = np.fmax(oracle, g_rows)
            oracle_err = max(oracle_err, rel_l2(g32, want))
        return err, rows, oracle, oracle_err

    def _passes_floor(self, err: float, rows) -> bool:
        limit = self.k * FP32_FLOOR
        return err > limit or (rows is not None and bool((np.nan_to_num(rows, nan=0.0) > limit).any()))

    def _mul_mat_error(self, srcs: list, got: np.ndarray, lay=None):
        """MUL_MAT recomputed in float64 by torch on `device`: on a GPU a 2.8B model's matmuls take ~0.1 ms there
        against 10-100 ms each in numpy (the float64 weights stream from host memory every ubatch), which made a
        CUDA run at -ub 1 take minutes. The same sums in float64 as `recompute`, to ~1e-15. With a token layout,
        also the per-token errors (row sums on the device, S x T values back); `_error`'s four values."""
        import torch  # noqa: PLC0415 (only on this path)
        w, x = (self._tensor(a) for a in srcs[:2])
        if w is None or x is None:
            return NO_ROOM
        for ax in (0, 1):                       # ggml's broadcast of w's ne3/ne2 over x's, as in `recompute`
            if w.shape[ax] != x.shape[ax]:
                if w.shape[ax] == 0 or x.shape[ax] % w.shape[ax]:
                    return None
                w = w.repeat_interleave(x.shape[ax] // w.shape[ax], dim=ax)
        want = torch.matmul(x, w.transpose(-1, -2))
        if tuple(want.shape) != got.shape:
            return None
        g = torch.from_numpy(got).to(want.device, torch.float64)
        err, rows = self._torch_errors(g, want, lay)
        if not self._passes_floor(err, rows):
            return err, rows, None, None
        if torch.get_float32_matmul_precision() == "highest":       # torch's FP32 matmul, from the same inputs
            want32 = torch.matmul(x.float(), w.float().transpose(-1, -2)).double()
        else:                       # this process let torch use TF32: numpy's FP32 sums instead, the same inputs
            want32 = torch.from_numpy(recompute("MUL_MAT", [a.astype(np.float32) for a in srcs[:2]], got.shape, ())
                                      .astype(np.float64)).to(want.device)
        oracle_err, oracle = self._torch_errors(want32, want, lay)
        return err, rows, oracle, oracle_err

    def _torch_errors(self, got, want, lay):
        """(rel. L2 by rel_l2's rules, per-token errors (S, T) for a flat token layout else None) of two float64
        tensors on one device."""
        err = float(ratio(float((got - want).square().sum()), float(want.square().sum())))
        if lay is None or lay[0] != "flat":
            return err, None
        S, T = self.ubatch_shape
        num2, den2 = (v.cpu().numpy() for v in flat_sums(got, want, S * T, lay[1]))
        return err, ratio(num2, den2).reshape(S, T)

    def _tensor(self, a: np.ndarray):
        """a as a float64 tensor on `device`; a weight (1 MB or more: the same array every ubatch) is moved once."""
        import torch  # noqa: PLC0415
        if a.nbytes < 1 << 20:
            return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, torch.float64)
        hit = self._on_device.get(id(a))
        if hit is None or hit[0] is not a:
            if not _fits(self.device, a.size * 8):
                return None
            hit = self._on_device[id(a)] = (a, torch.from_numpy(np.ascontiguousarray(a)).to(self.device, torch.float64))
        return hit[1]

    def to_dict(self) -> dict:
        return {"floor": FP32_FLOOR, "threshold": self.k * FP32_FLOOR, "tf32_limit": TF32_LIMIT,
                "oracle_margin": ORACLE_MARGIN, "mul_mat_recomputed_on": dict(self.mul_mat_on),
                "explained": list(self.explained.values()),
                "first_over": self.first, "first_fault": self.fault,
                "max_per_node": {k: v for k, v in self.worst.items()},
                "max_per_token": {k: v for k, v in self.worst_token.items()}}


def _evidence(items: list, limit: float) -> dict:
    """The largest error of the items (NaN: inherited, ranked last), the first past `limit` in graph order that its
    float32 recompute does not explain, and whether there is none."""
    worst = max(items, key=lambda r: -np.inf if r["error"] != r["error"] else r["error"], default=None)
    first = next((r for r in items if r["error"] > limit and not r.get("explained")), None)
    if worst is not None:
        worst = {k: v for k, v in worst.items() if k != "explained"}
    if first is not None:
        first = {k: v for k, v in first.items() if k != "explained"}
    return {"worst": worst, "first_over": first, "within_floor": first is None}


def _unexplained(errors: np.ndarray, oracle, limit: float) -> np.ndarray:
    """Per token of one sequence's row of errors: past `limit` and, where the float32 recompute ran, past
    ORACLE_MARGIN x its error there (NaN, inherited, is never past)."""
    e = np.nan_to_num(errors, nan=0.0)
    over = e > limit
    return over if oracle is None else over & (e > ORACLE_MARGIN * np.nan_to_num(oracle, nan=np.inf))
