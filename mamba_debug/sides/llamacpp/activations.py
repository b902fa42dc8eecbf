"""ggml's CPU rounding of a MUL_MAT's activations before the dot products with narrower weights, emulated.

ggml's CPU back-end converts a matmul's activations (src1) to its weights' dot-product type first (vec_dot_type):
f16 weights -> f16, bf16 -> bf16, q8_0 -> blocks of 32 values as int8 with one f16 scale each (d = amax / 127,
q = x / d rounded to an integer). The dot products are then exact in the integers (q8_0) or float32 sums of exact
products (f16, bf16). So the float64 product of the dequantized weights with the activations rounded this way is
what the node computes, up to float32 sums: a clean node's local error against it is FP32-sized (1e-7 on the
shipped model at -ub 1 and 8, 2026-12-06), against the plain float64 product 1e-4 (f16) to 1e-2 (q8_0). A node's
error past k x the FP32 floor against the emulation is its own fault, however small beside the rounding.

Only the types verified against a CPU build are emulated (`ACTIVATIONS`: f16, bf16; q8_0, q4_0, q5_0 whose
activations are q8_0 blocks; the K-quants q2_K to q6_K, whose activations are q8_K blocks of 256 with a float32
scale; q4_1 and q5_1, whose activations are q8_1 blocks: q8_0's values plus an f16 sum s = d * sum(q) that the dot
product multiplies by the weights' block minimum m, so their node is the product with the rounded x plus
sum over blocks of m * (s - f16(d) * sum(q)): `with_block_sums`); others keep their family's floor
(local.WEIGHT_FLOORS).

A CUDA build: a quantized MUL_MAT of at most 8 columns runs mul_mat_vec_q (mmvq), which rounds the activations to
q8_1 blocks of 32 (quantize.cu: d = amax / 127, q = roundf(x / d), d kept as f16) and multiplies them in integers
(vecdotq.cuh). q8_0 and the K-quants meet them through their integers alone (the plain product with the rounded x);
q4_0 and q5_0 subtract their constant offset times the block's f16 sum of the unrounded x (`cuda_sums`); q4_1 and
q5_1 multiply their block scale d and minimum m by q8_1's f16 scale and sum in f16 (`__hmul2`: each product rounded
to f16, `f16_products`). Those are emulated on a CUDA node of a CUDA build (`CUDA_MMVQ`; measured on an H100). Its
other paths (MMQ at more columns; f16 weights) keep their family's floor (emulation(): None).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

# weight type -> the type ggml's CPU rounds the activations to (its vec_dot_type), for the types verified against a
# CPU build (llama-cpp-python 0.3.36's, AVX-512: clean nodes within 1.2e-7 of the emulation)
ACTIVATIONS = {"f16": "f16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0", "q4_1": "q8_1",
               "q5_1": "q8_1", **{f"q{b}_K": "q8_K" for b in (2, 3, 4, 5, 6)}}
Q8_BLOCK = 32
QK_K = 256                              # the K-quants' super-block: q8_K activations come in blocks of 256


# ggml's quantize_row_q8_0 in its three forms: x86's SIMD (1 / d as 127 / amax, halves to even), ARM's NEON (1 / d,
# halves to even), the scalar reference (1 / d, C's roundf: halves away from zero). A build uses one; they differ only
# where x / d lands within an ulp of a half (one value in ~10^5: on the shipped model at ubatch 512 one token's row).
Q8_FORMS = ("x86", "arm", "scalar")
# CUDA's quantize_q8_1: roundf(x / d) (a division, halves away from zero); the other two forms differ from it only at
# halves as well, and are tried after it the same way (a build compiled with fast math divides approximately).
CUDA_FORMS = ("cuda", "arm", "x86")


# A CUDA build's mul_mat_vec_q (MMVQ_MAX_BATCH_SIZE: a quantized MUL_MAT of at most 8 columns, src1's ne[1]) by
# weight type: "sums" where its dot product meets q8_1's f16 block sum of the unrounded x (q4_0's -8 d and q5_0's
# -16 d offsets), "f16" where it also multiplies the scales in f16 (q4_1, q5_1: f16_products), None where the
# integers alone meet the activations (the plain product with the rounded x).
CUDA_MMVQ = {"q8_0": None, "q4_0": "sums", "q5_0": "sums", "q4_1": "f16", "q5_1": "f16",
             **{f"q{b}_K": None for b in (2, 3, 4, 5, 6)}}
MMVQ_MAX_COLS = 8
# Its two float parts that may cancel: q4_0 / q5_0 in each block's d * (d8 * sum(q) - offset * s8), the K-quants
# with minima in sumf_d and sumf_m per super-block (q3_K and q6_K subtract their offsets in the integers).
CUDA_SPLIT_BLOCK = {"q4_0": Q8_BLOCK, "q5_0": Q8_BLOCK, "q4_1": Q8_BLOCK, "q5_1": Q8_BLOCK, "q2_K": QK_K,
                    "q4_K": QK_K, "q5_K": QK_K}


def emulation(build: Optional[str], weights: Optional[str], node) -> Optional[str]:
    """How a MUL_MAT node of `weights` (a WEIGHT_TYPES name) rounded its activations, where that is emulated: "cpu"
    for a node that ran on the CPU (every node of a CPU build; a CUDA build's layers left on the CPU, whose outputs
    lie in host memory: a node sent to the GPU by op offload has its output there), "cuda" for a CUDA build's node
    in device memory that ran mmvq; else None."""
    kernel = kernel_of(build, node)
    if kernel == "cpu" and weights in ACTIVATIONS:
        return "cpu"
    if kernel == "cuda" and weights in CUDA_MMVQ and node.ne[1] <= MMVQ_MAX_COLS:
        return "cuda"
    return None


def kernel_of(build: Optional[str], tensor) -> Optional[str]:
    """"cpu" or "cuda": whose rounding a tensor of that build met (by the memory it lies in), None for another."""
    if build == "cuda":
        return "cuda" if on_cuda(tensor) else "cpu"
    return build if build == "cpu" else None


def on_cuda(node) -> bool:
    """Did the node run on a CUDA device (its output in device memory, not CUDA_Host's pinned host memory)?"""
    return node.backend.startswith("CUDA") and node.backend != "CUDA_Host"


def wants_offsets(build: Optional[str], weights: Optional[str], weight) -> bool:
    """Does that build's emulation of `weights` read the offsets (nodes.read_offsets) of the weight tensor `weight`
    (on a CUDA build its matmul runs where the weight lies, or is sent to the GPU at 32 columns, never emulated)?"""
    kernel = kernel_of(build, weight)
    if kernel == "cpu":
        return weights in SPLIT_BLOCK or ACTIVATIONS.get(weights) == "q8_1"
    return kernel == "cuda" and weights in CUDA_SPLIT_BLOCK


def wants_scales(build: Optional[str], weights: Optional[str], weight) -> bool:
    """Does that build's emulation of `weights` read the block scales (nodes.read_scales) of the weight `weight`?"""
    return kernel_of(build, weight) == "cuda" and CUDA_MMVQ.get(weights) == "f16"


def roundings(kernel: str, weights: str, x: np.ndarray) -> list:
    """The activations x (..., K) as `kernel` ("cpu" or "cuda", emulation()) rounds them for `weights`: one
    (rounded x, block sums or None) per quantizer form it may use (a build uses one), or [] where K does not fit."""
    if kernel == "cuda":
        if x.shape[-1] % Q8_BLOCK:
            return []
        sums = cuda_sums(x) if CUDA_MMVQ[weights] else None
        return [(_q8_0(np.ascontiguousarray(x, dtype=np.float32), f), sums) for f in CUDA_FORMS]
    to = ACTIVATIONS[weights]
    out = []
    for form in (Q8_FORMS if to in ("q8_0", "q8_1") else Q8_FORMS[:1]):
        xr = rounded(x, weights, form)
        if xr is not None:
            out.append((xr, q8_1_sums(x, form) if to == "q8_1" else None))
    return out


# ggml-cuda is built with -use_fast_math: quantize_q8_1's x / d and amax / 127 are approximate divisions (within 2
# ulp), so a value within a few ulp of a half may round the other way than the emulation, and a scale within a few ulp
# of an f16 rounding midpoint may keep the other f16 (measured on an H100, 2026-12-06: one clean q6_K head node of 24
# cells read 1e-3 past its emulation from one such value). These are the changes such a value or block may make.
TIE_ULPS = 2.0 ** -20           # 8 float32 ulps, relative


def cuda_ties(x: np.ndarray) -> list:
    """Where CUDA's rounding of x (..., K) may differ from `_q8_0(x, "cuda")`: (row of x flattened to (N, K), block,
    the change to that block's 32 rounded values if it does), for each value within TIE_ULPS of a half (the integer on
    x / d's other side) and each block whose scale lies within TIE_ULPS of an f16 midpoint (the other f16)."""
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    if x32.shape[-1] % Q8_BLOCK:
        return []
    nb = x32.shape[-1] // Q8_BLOCK
    q, d32 = _q8_blocks(x32, "cuda")            # the emulation's own integers and scales, one row per block
    d, h = d32.astype(np.float64), d32.astype(np.float16)
    v = np.divide(x32.reshape(-1, Q8_BLOCK).astype(np.float64), d, out=np.zeros(q.shape), where=d > 0)
    a = np.abs(v)
    ties = []
    for f, i in zip(*np.nonzero(np.abs(a - np.floor(a) - 0.5) <= TIE_ULPS * np.maximum(a, 1.0))):
        dx = np.zeros(Q8_BLOCK)
        dx[i] = np.sign(v[f, i] - q[f, i]) * float(h[f, 0])
        ties.append((*divmod(int(f), nb), dx))
    h2 = np.nextafter(h, np.where(d > h.astype(np.float64), np.inf, -np.inf).astype(np.float16))
    mid = (h.astype(np.float64) + h2.astype(np.float64)) / 2
    for f in np.nonzero(((np.abs(d - mid) <= TIE_ULPS * d) & (d > 0))[:, 0])[0]:
        ties.append((*divmod(int(f), nb), q[f] * (float(h2[f, 0]) - float(h[f, 0]))))
    return ties


def settle_ties(got: np.ndarray, want: np.ndarray, w: np.ndarray, x: np.ndarray, offs=None) -> Optional[float]:
    """The rel. L2 of got against the emulation `want` once each of cuda_ties(x) is taken the other way where that
    brings its row closer (the product's change is the weights' columns times the values' change: the scaled part
    alone, w less its offsets, where the block sums carry the offsets); None where the shapes do not fit. A fault
    spread over a node is no such rank-one change and stays."""
    w2 = w.reshape(-1, w.shape[-1])
    if want.size != got.size or want.shape[-1] != w2.shape[0]:
        return None
    if offs is not None:
        w2 = w2 - np.repeat(offs, w2.shape[1] // offs.shape[-1], axis=1)
    r = (got.astype(np.float64) - want).reshape(-1, w2.shape[0])
    for n, k, dx in cuda_ties(x):
        c = w2[:, k * Q8_BLOCK:(k + 1) * Q8_BLOCK] @ dx
        if np.dot(r[n] - c, r[n] - c) < np.dot(r[n], r[n]):
            r[n] -= c
    return float(np.linalg.norm(r) / max(np.linalg.norm(want), 1e-300))


def split_block(kernel: str, weights: str) -> Optional[int]:
    """The values one float32 term of the kernel's split sums covers (split_sum_reach), None where it keeps one."""
    return (CUDA_SPLIT_BLOCK if kernel == "cuda" else SPLIT_BLOCK).get(weights)


def cuda_sums(x: np.ndarray) -> Optional[np.ndarray]:
    """quantize_q8_1's f16 block sums on CUDA, (..., K / 32) float64: each block's float32 values summed by the
    warp's butterfly (warp_reduce_sum: lane i adds lane i ^ 16, ^ 8, ^ 4, ^ 2, ^ 1), then rounded to f16."""
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    if x32.shape[-1] % Q8_BLOCK:
        return None
    v = x32.reshape(-1, Q8_BLOCK)
    lanes = np.arange(Q8_BLOCK)
    for step in (16, 8, 4, 2, 1):
        v = v + v[:, lanes ^ step]
    return v[:, 0].astype(np.float16).astype(np.float64).reshape(*x32.shape[:-1], -1)


def f16_products(w: np.ndarray, xr: np.ndarray, sums, offs, scales) -> Optional[np.ndarray]:
    """CUDA mmvq's q4_1 / q5_1 product (vecdotq.cuh with FAST_FP16_AVAILABLE: every sm from 60 but 61), (..., rows)
    float64: per block of 32, the integer dot product of the weights' integers with q8_1's, times f16(d * d8), plus
    f16(m * s8): `__hmul2` rounds both products to f16 (5e-4 apart each; the f16 subnormals below 6.1e-5 keep 2^-24
    apart), before float32 sums. w (rows, K): the dequantized weights; xr (..., K): the activations as rounded
    (roundings); sums (..., K / 32): q8_1's f16 block sums (cuda_sums); offs, scales (rows, K / 32): the weights'
    minima m and scales d (nodes.read_offsets, read_scales). None where the shapes do not meet."""
    w = w.reshape(-1, w.shape[-1])
    rows, K = w.shape
    nb = K // Q8_BLOCK
    if sums is None or offs is None or scales is None or K % Q8_BLOCK or xr.shape[-1] != K \
            or offs.shape != (rows, nb) or scales.shape != (rows, nb) or sums.shape != (*xr.shape[:-1], nb):
        return None
    X = xr.reshape(-1, nb, Q8_BLOCK)
    d8 = np.abs(X).max(axis=-1) / 127                   # q8_1's f16 scale: each block's largest value is +-127 d8
    q = np.rint(np.divide(X, d8[..., None], out=np.zeros_like(X), where=d8[..., None] > 0))
    W = (w - np.repeat(offs, Q8_BLOCK, axis=1)).reshape(rows, nb, Q8_BLOCK)
    ints = np.rint(np.divide(W, scales[..., None], out=np.zeros_like(W), where=scales[..., None] != 0))
    S = sums.reshape(-1, nb)
    out = np.zeros((X.shape[0], rows))
    for b in range(nb):                                 # one block's f16 products at a time: (columns, rows)
        dd = (d8[:, b, None] * scales[None, :, b]).astype(np.float16).astype(np.float64)
        ms = (S[:, b, None] * offs[None, :, b]).astype(np.float16).astype(np.float64)
        out += (q[:, b] @ ints[:, b].T) * dd + ms
    return out.reshape(*xr.shape[:-1], rows)


def rounded(x: np.ndarray, weights: str, form: str = "x86") -> Optional[np.ndarray]:
    """x (..., K) as float64 after ggml's CPU rounds it for weights of type `weights`, or None when not emulated.
    form: q8_0's quantizer (Q8_FORMS)."""
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    to = ACTIVATIONS.get(weights)
    if to == "f16":
        return x32.astype(np.float16).astype(np.float64)
    if to == "bf16":
        return _bf16(x32)
    if to in ("q8_0", "q8_1") and x32.shape[-1] % Q8_BLOCK == 0:       # q8_1's values are q8_0's
        return _q8_0(x32, form)
    if to == "q8_K" and x32.shape[-1] % QK_K == 0:
        return _q8_k(x32)
    return None


def _bf16(x32: np.ndarray) -> np.ndarray:
    """float32 -> bf16 by round-to-nearest-even (ggml_compute_fp32_to_bf16; NaN stays NaN), as float64."""
    u = x32.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    out = r.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(np.isnan(x32), np.nan, out)


def _q8_0(x32: np.ndarray, form: str) -> np.ndarray:
    """quantize_row_q8_0 then dequantized: per block of 32, d = amax / 127 (float32), q = round(x * (1 / d)), the
    block's scale kept as f16."""
    q, d = _q8_blocks(x32, form)
    return (q * d.astype(np.float16).astype(np.float64)).reshape(x32.shape)


def _q8_blocks(x32: np.ndarray, form: str) -> tuple:
    """q8_0's (and q8_1's) quantizer: per block of 32, the integers q (float64) and the float32 scale d."""
    b = x32.reshape(-1, Q8_BLOCK)
    amax = np.abs(b).max(axis=1, keepdims=True)
    d = amax / np.float32(127)
    if form == "cuda":
        v = np.divide(b, d, out=np.zeros_like(b), where=amax > 0)
    else:
        top, den = (np.float32(127), amax) if form == "x86" else (np.float32(1), d)
        v = b * np.divide(top, den, out=np.zeros_like(d), where=amax > 0)
    q = np.sign(v) * np.floor(np.abs(v.astype(np.float64)) + 0.5) if form in ("scalar", "cuda") else np.rint(v)
    return q.astype(np.float64), d


def q8_1_sums(x: np.ndarray, form: str = "x86") -> Optional[np.ndarray]:
    """q8_1's f16 block sums s = f16(d * sum(q)) (quantize_row_q8_1: d float32, the sum an integer), (..., K / 32)
    float64; None where K is not a multiple of 32."""
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    if x32.shape[-1] % Q8_BLOCK:
        return None
    q, d = _q8_blocks(x32, form)
    s = (d * q.sum(axis=1, keepdims=True).astype(np.float32)).astype(np.float16).astype(np.float64)
    return s.reshape(*x32.shape[:-1], -1)


def with_block_sums(want: np.ndarray, xr: np.ndarray, sums: Optional[np.ndarray], offs: np.ndarray):
    """A q4_1 / q5_1 product with the rounded activations xr, want (..., T, rows), plus what ggml's dot product adds:
    the weights' offsets m (rows, blocks) times q8_1's f16 block sums (sums, `q8_1_sums`) past what xr's blocks add
    up to (f16(d) * sum(q)); None where the shapes do not meet."""
    if sums is None or sums.shape[-1] != offs.shape[-1] or want.shape[-1] != offs.shape[0]:
        return None
    excess = sums - xr.reshape(*xr.shape[:-1], -1, Q8_BLOCK).sum(axis=-1)
    return want + (excess @ offs.T).reshape(want.shape)


# ggml-cpu's dot product of weights that are an offset plus a scaled integer (nodes.OFFSET_LAYOUT) with their q8
# activations keeps two float32 sums over the blocks of a row, the scaled part and the offsets' part, and adds them
# at the end (ggml_vec_dot_q4_1_q8_1, _q4_K_q8_K, ...). Where activations are mostly positive (after SiLU: x_proj's
# input) the two nearly cancel and float32 errs past the FP32 floor on a clean node: 1.0e-5 to 1.2e-5 at d_model 2048
# and 2560 (random Mamba-1, Q4_1 and Q4_K_M, 2026-12-06), read DIVERGED until judged against this. By weight type:
# the values one float32 term of those sums covers. (x86's q2_K kernel adds both parts into one sum as it goes, so
# the replay over-states its float32 error: a looser limit there, never a false alarm.)
SPLIT_BLOCK = {"q4_1": 32, "q5_1": 32, "q2_K": QK_K, "q4_K": QK_K, "q5_K": QK_K}


def split_sum_reach(w: np.ndarray, xr: np.ndarray, offs: np.ndarray, block: int, sums=None) -> float:
    """float32's own error on these inputs, summing as ggml does: rel. L2 of a float32 replay (each block's scaled
    and offset terms added to their own float32 sums, then the two sums added) against float64.
    w (rows, K): the dequantized weights; xr (..., K): the activations as rounded (`rounded`); offs (rows, K / span):
    the weights' offsets; sums (..., K / 32): q8_1's f16 block sums (q4_1, q5_1: the offsets' part is m * s)."""
    K = w.shape[-1]
    w_off = np.repeat(offs, K // offs.shape[-1], axis=1)
    w_sc, X = w - w_off, xr.reshape(-1, K)
    S = None if sums is None else sums.reshape(X.shape[0], -1)
    a32 = np.zeros((X.shape[0], w.shape[0]), np.float32)
    m32, exact = np.zeros_like(a32), np.zeros(a32.shape)
    for b in range(K // block):
        cols = slice(b * block, (b + 1) * block)
        p = X[:, cols] @ w_sc[:, cols].T
        q = X[:, cols] @ w_off[:, cols].T if S is None else np.outer(S[:, b], offs[:, b])
        a32 += p.astype(np.float32)
        m32 += q.astype(np.float32)
        exact += p + q
    diff = np.linalg.norm((a32 + m32).astype(np.float64) - exact)
    return float(diff / max(np.linalg.norm(exact), 1e-300))


def _q8_k(x32: np.ndarray) -> np.ndarray:
    """quantize_row_q8_K_ref then dequantized: per block of 256, the value of largest magnitude `max` (signed),
    iscale = -127 / max, q = nearest_int(iscale * x) (halves to even) capped at 127, d = 1 / iscale in float32."""
    b = x32.reshape(-1, QK_K)
    top = b[np.arange(b.shape[0]), np.abs(b).argmax(axis=1)][:, None]
    iscale = np.divide(np.float32(-127), top, out=np.zeros_like(top), where=top != 0)
    q = np.minimum(np.rint(iscale * b), 127)
    d = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=iscale != 0)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x32.shape)
