"""Per-token local errors: a node's output split into one row per token of the ubatch, and each row's rel. L2 against
its float64 recompute (||got - want|| / ||want|| over the row: the measure the compared sites use per token).

A whole-node local error is one rel. L2 over every token of the ubatch, so an error confined to one token is diluted
by the others; a site's error and threshold are per token. The rows, in llama.cpp's layouts (numpy shapes are ggml's
ne reversed; the ubatch is sequence-major, S sequences of T tokens each, llama.cpp's split_equal):
- [X, S*T] (norms, matmuls, elementwise ops on [n_embd, n_tokens]): numpy (1, 1, S*T, X);
- [X, T, S] (inside the SSM block, SSM_CONV's output): (1, S, T, X);
- [A, B, T, S] (Mamba-2's heads, the grouped norm): (S, T, B, A);
- SSM_SCAN: one flat array, y (S, T, H, P) first, then the final states: the y part only;
- CONCAT (the conv window [K-1+T, D, S]: (1, S, D, K-1+T)): token t reads columns t .. t+K-1, as the CONCAT site.
In the flat layouts row r is token r % T of the group's sequence r // T. No token axis: state copies (CPY), a state
read when T > 1 (one row per sequence), a per-head MUL_MAT (attention's kq, kqv): they keep their whole-node error.
"""
from __future__ import annotations

import numpy as np


def layout(op: str, shape: tuple, srcs: list, S: int, T: int):
    """("flat", X): the output's first S*T*X values are the tokens' rows of X values, sequence-major;
    ("window", K): CONCAT's conv window; None: no token axis."""
    N = S * T
    if op == "CPY":                             # a state written into the cache for the next ubatch
        return None
    if op == "SSM_SCAN":                        # x (S, T, H, P) says how long y is
        x = srcs[1] if len(srcs) > 1 else None
        return ("flat", x.size // N) if x is not None and x.shape[:2] == (S, T) else None
    if op == "CONCAT":                          # checked first: (1, S, D, K-1+T) may look like (1, S, T, X)
        return ("window", shape[3] - T + 1) if len(shape) == 4 and shape[:2] == (1, S) and shape[3] >= T else None
    if op == "MUL_MAT" and srcs and srcs[0] is not None and srcs[0].shape[:2] != (1, 1):
        return None                             # per head (kq, kqv): the head axis is no token axis
    if len(shape) != 4 or not (shape[:3] == (1, 1, N) or shape[:3] == (1, S, T) or shape[:2] == (S, T)):
        return None
    return "flat", int(np.prod(shape)) // N


def flat_sums(got, want, N: int, X: int):
    """Per row of a flat layout: (sum of (got - want)^2, sum of want^2), each of N values. numpy arrays or torch
    tensors (the MUL_MAT recompute on a GPU), whichever both are."""
    g, w = got.reshape(-1)[:N * X].reshape(N, X), want.reshape(-1)[:N * X].reshape(N, X)
    d = g - w
    if isinstance(d, np.ndarray):       # einsum makes no temporaries (each fresh array costs page faults)
        return np.einsum("ij,ij->i", d, d), np.einsum("ij,ij->i", w, w)
    return (d * d).sum(-1), (w * w).sum(-1)


def window_sums(got: np.ndarray, want: np.ndarray, K: int):
    """CONCAT: per (sequence, token) the sums over the K columns the conv reads for that token, every channel."""
    d = got - want
    cols = np.einsum("sdc,sdc->sc", d[0], d[0]), np.einsum("sdc,sdc->sc", want[0], want[0])    # (S, K-1+T) each
    return tuple(np.lib.stride_tricks.sliding_window_view(c, K, axis=-1).sum(-1) for c in cols)


def ratio(num2, den2) -> np.ndarray:
    """sqrt(num2) / sqrt(den2) elementwise, as local.rel_l2: 0 where both are 0, inf where only want is 0. A row the
    node made non-finite from finite inputs (want finite, got not) is inf: born here; a row whose recompute is
    non-finite (its inputs were) stays NaN: inherited, past no limit."""
    num2, den2 = np.asarray(num2, dtype=np.float64), np.asarray(den2, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.sqrt(num2) / np.sqrt(den2)
    out = np.where(den2 == 0, np.where(num2 == 0, 0.0, np.inf), out)
    return np.where(np.isfinite(den2) & ~np.isfinite(num2), np.inf, out)


def rows_and_whole(got: np.ndarray, want: np.ndarray, lay, S: int, T: int):
    """(per-token errors (S, T), the whole-node error, or None where the rows do not cover the whole output)."""
    if lay[0] == "window":
        num2, den2 = window_sums(got, want, lay[1])
        return ratio(num2, den2), None
    num2, den2 = flat_sums(got, want, S * T, lay[1])
    rows = ratio(num2, den2).reshape(S, T)
    if S * T * lay[1] != got.size:              # SSM_SCAN: the states follow y
        return rows, None
    return rows, float(ratio(num2.sum(), den2.sum()))
