"""The scan's per-token states measured where they are born: kernels/triton.py's `ssm_scan(..., states_ref=ref)`.

Tracing a comparison needs every h_t of the device's scan against the reference's, token by token. Written out
(`states_out`, [S, T, D, N]) and measured afterwards, that costs a write and a read of the biggest tensor of a
layer, twice the size of all its other sites together (2.8B shape: 168 MB a layer per 512-token ubatch, float32);
it was most of what metrics-only tracing still cost on an H200 (issue #18). Here the step schedule's program, holding
h_t of its BLOCK_D channels in registers, reads the reference's h_t and reduces the pair in float64 into the seven
sums of `mamba_debug/_site_metrics.py` (num, den, aa, ab, mx, a_bad, b_bad), one piece per channel block. Nothing
of the state is written; the engine turns the pieces into metrics (`metrics.errors_of_sums`: the metrics kernel's
deterministic combine, in block order).

Not a plug-in (the leading underscore keeps it off the list): kernels/triton.py executes it.
"""
import os

import torch
import triton.language as tl

from mamba_debug.triton_launch import check as _check, helper_jit

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_device_function = helper_jit(INTERPRET)     # plain functions under the interpreter (see triton_launch)

INF = tl.constexpr(float("inf"))
N_SUMS = 7                                   # num, den, aa, ab, mx, a_bad, b_bad (as _site_metrics.N_PARTS)


@_device_function
def _sum(v, PIECES: tl.constexpr, BLOCK_D: tl.constexpr):
    """A [BLOCK_D, BLOCK_N] tile summed to [PIECES] values, one per group of BLOCK_D / PIECES channels (tl.reduce's
    fixed trees). Two helpers, not one taking the combine: compiled, a function argument arrives as a constexpr,
    which tl.reduce cannot call."""
    rows = tl.reduce(v, 1, tl.standard._sum_combine)
    return tl.reduce(tl.reshape(rows, (PIECES, BLOCK_D // PIECES)), 1, tl.standard._sum_combine)


@_device_function
def _max(v, PIECES: tl.constexpr, BLOCK_D: tl.constexpr):
    """A [BLOCK_D, BLOCK_N] tile's maxima over each group of BLOCK_D / PIECES channels."""
    rows = tl.reduce(v, 1, tl.standard._elementwise_max)
    return tl.reduce(tl.reshape(rows, (PIECES, BLOCK_D // PIECES)), 1, tl.standard._elementwise_max)


@_device_function
def first_ref(rf_p, n_tok, mask_dn):
    """The reference's tile of the chunk's first token (0 past the chunk)."""
    return tl.load(rf_p, mask=tl.where(n_tok > 0, mask_dn, False), other=0.0)


@_device_function
def measure_token(h, r, rf_p, pp, j, n_tok, stride_ref_t, PS, ST, mask_dn, PIECES: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """Token j of the chunk: h [BLOCK_D, BLOCK_N] (fp32, padded lanes 0) against r, the reference's tile of that
    token, the seven sums in float64 stored at pp + j + q * PS + g * ST (the sums' q-th quantity, this block's g-th
    piece of PIECES: fewer lanes to combine per token, more pieces for the combine to add); returns the next
    token's tile. The same arithmetic as _site_metrics._row_sums on this block's elements; a non-finite
    difference counts as 0 in num and mx, and the flags say which side had a non-finite.

    The tile is loaded a step ahead: the step schedule is one dependent chain per program, and a load used at once
    stalled it every token (an H200, 2.8B shape, 512 tokens: the scan 111 -> 495 us; states_out and the metrics
    kernel after it, 250 us)."""
    b = r.to(tl.float64)
    nxt = tl.load(rf_p + (j + 1) * stride_ref_t, mask=tl.where(j + 1 < n_tok, mask_dn, False), other=0.0)
    a = h.to(tl.float64)
    d = a - b
    d = tl.where(tl.abs(d) < INF, d, 0.0)     # isfinite: False for +-inf and NaN
    flags = tl.where(tl.abs(a) < INF, 0, 1) | tl.where(tl.abs(b) < INF, 0, 2)
    g = tl.arange(0, PIECES).to(tl.int64)
    p = pp + j + g * ST
    ok = (j + g * 0) < n_tok                  # a [PIECES] mask (the interpreter takes no scalar one for a block)
    tl.store(p, _sum(d * d, PIECES, BLOCK_D), mask=ok)
    tl.store(p + PS, _sum(b * b, PIECES, BLOCK_D), mask=ok)
    tl.store(p + 2 * PS, _sum(a * a, PIECES, BLOCK_D), mask=ok)
    tl.store(p + 3 * PS, _sum(a * b, PIECES, BLOCK_D), mask=ok)
    tl.store(p + 4 * PS, _max(tl.abs(d), PIECES, BLOCK_D), mask=ok)
    tl.store(p + 5 * PS, _max(flags & 1, PIECES, BLOCK_D).to(tl.float64), mask=ok)
    tl.store(p + 6 * PS, _max(flags & 2, PIECES, BLOCK_D).to(tl.float64), mask=ok)
    return nxt


def sums_for(states_ref, x: torch.Tensor, N: int, block_d: int, pieces: int):
    """The checked states_ref and the sums it is measured into ([7, D / block_d * pieces, S * T] float64 on x's
    device), or (None, None) without one."""
    if states_ref is None:
        return None, None
    S, T, D = x.shape
    _check("ssm_scan", tuple(states_ref.shape) == (S, T, D, N), "states_ref must be [S, T, D, N]",
           x=x, states_ref=states_ref)
    _check("ssm_scan", states_ref.device == x.device and states_ref.is_floating_point(),
           "states_ref must be a floating-point tensor on x's device", x=x, states_ref=states_ref)
    _check("ssm_scan", block_d % pieces == 0, f"the plan's MEASURE_PIECES ({pieces}) must divide its BLOCK_D", x=x)
    return states_ref, torch.empty((N_SUMS, -(-D // block_d) * pieces, S * T), dtype=torch.float64, device=x.device)
