"""Local error per node (`--local` with `--engine llama.cpp`): each node's op recomputed in float64 from the inputs
the node really read (as observed, before anything could overwrite them), against the node's own output. It
separates the error a node makes from the error it inherits: a node whose local error passes its path's floor is
where an error is born, whatever its inputs carried.

Ops: RMS_NORM, MUL_MAT, SSM_CONV, SSM_SCAN (Mamba-1), SILU, SWIGLU, MUL, ADD. Arrays are in ggml's order reversed
(numpy shape ne[3], ne[2], ne[1], ne[0]), as nodes.read_data gives them.
"""
from __future__ import annotations

import struct

import numpy as np

FP32_FLOOR = 1e-6       # rel. L2 of one float32 op against float64 (a few ulps); the k_floor multiple applies
OPS = ("RMS_NORM", "MUL_MAT", "SSM_CONV", "SSM_SCAN", "SILU", "SWIGLU", "MUL", "ADD")


def recompute(op: str, srcs: list, out_shape: tuple, op_params) -> np.ndarray | None:
    """The node's output in float64 from its sources (float64 arrays), or None for an op not recomputed here."""
    if op == "RMS_NORM":
        eps = struct.unpack("f", struct.pack("i", op_params[0]))[0]
        x = srcs[0]
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    if op == "MUL_MAT":
        w, x = srcs[0], srcs[1]                 # w (.., M, K), x (.., N, K) -> (.., N, M)
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
        return _scan(srcs, out_shape)
    return None


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _scan(srcs, out_shape):
    s, x, dt, A, B, C, ids = srcs[:7]
    if s.shape[2] != 1:                          # head_dim 1: Mamba-1 only
        return None
    x, dt = x[..., 0], dt[0]                     # x (S, T, D); dt (S, T, D)
    A = A[0, 0]                                  # (D, N)
    B, C = B[:, :, 0, :], C[:, :, 0, :]          # (S, T, N)
    ids = ids.reshape(-1).astype(np.int64)
    S, T, D = x.shape
    ys, states = np.empty((S, T, D)), np.empty((S, D, A.shape[1]))
    for q in range(S):
        h = s[ids[q], :, 0, :].copy()            # (D, N)
        for t in range(T):
            d = dt[q, t]
            d = np.where(d > 20.0, d, np.log1p(np.exp(np.minimum(d, 20.0))))
            h = h * np.exp(d[:, None] * A) + (d * x[q, t])[:, None] * B[q, t][None, :]
            ys[q, t] = h @ C[q, t]
        states[q] = h
    flat = np.concatenate([ys.reshape(-1), states.reshape(-1)])
    n = int(np.prod(out_shape))
    return flat[:n].reshape(out_shape) if flat.size >= n else None


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    den = float(np.sqrt((want * want).sum()))
    num = float(np.sqrt(((got - want) ** 2).sum()))
    return num / den if den > 0 else (0.0 if num == 0 else float("inf"))


class LocalErrors:
    """Per mapped node: the largest local error over the run, and the first node past k x its path's floor."""

    def __init__(self, k_floor: float):
        self.k = k_floor
        self.worst: dict = {}
        self.first = None

    def add(self, node, srcs: list, got: np.ndarray, u: int):
        if node.op not in OPS or any(a is None for a in srcs):
            return
        want = recompute(node.op, [a.astype(np.float64) for a in srcs], got.shape, node.extra.get("op_params", ()))
        if want is None or want.shape != got.shape:
            return
        err = rel_l2(got.astype(np.float64), want)
        key = f"{'head' if node.layer is None else node.layer}.{node.site or node.op}"
        self.worst[key] = max(self.worst.get(key, 0.0), err)
        if self.first is None and err > self.k * FP32_FLOOR:
            self.first = {"ubatch": u, "layer": node.layer, "site": node.site or node.op, "op": node.op,
                          "name": node.name, "error": err, "threshold": self.k * FP32_FLOOR}

    def to_dict(self) -> dict:
        return {"floor": FP32_FLOOR, "threshold": self.k * FP32_FLOOR, "first_over": self.first,
                "max_per_node": {k: v for k, v in self.worst.items()}}
