"""`site_errors` as one fused Triton kernel: dev and ref are read once, every sum is taken in float64.

The torch version (`metrics._site_errors_torch`, the reference implementation) converts both [S, T, ...] tensors
to float64 and makes about ten passes over them. With the reference sides on a GPU that was the whole cost of
tracing (14x an untraced 2.8B prefill, almost all of it the per-token SSM states). Here each (s, t) row is read
once, in its own dtype and strides, and reduced in float64 into

    num = sum (a-b)^2 over the finite differences    den = sum b^2    aa = sum a^2    ab = sum a*b
    mx  = max |a-b| over the finite differences       flags: a has a non-finite, b has a non-finite

from which the kernel also computes the four metrics with `_site_errors_torch`'s where/clamp rules, so one launch
(two for a split row, below) per site and ubatch does everything.

Do not import this file directly: `metrics._fused_module` executes it once per mode, like the kernel plug-ins.
`triton.jit` decides interpreted-or-compiled from TRITON_INTERPRET when it runs (once, at execution), so the copy
for CUDA tensors is compiled and the copy for CPU tensors runs under Triton's interpreter (how CI, which has no
GPU, exercises every index, stride and mask of the kernels). The kernels use only Triton builtins and tl.reduce
with the standard sum/max combines, which the interpreter recognises, so the interpreted copy also works in a
process whose Triton library was imported compiled (see kernels/triton.py). Loops are `while` loops: Triton
3.6's interpreter cannot take a runtime int as a range() bound with numpy >= 2.

Determinism: no atomics. Each element lane accumulates its own column in a fixed order, lanes are combined by
tl.reduce's fixed tree, and a row split over several programs (few long rows: a state taken at the end of a
ubatch) is combined by a second kernel walking the parts in order. Same shapes and plan, same bits.
"""
import contextlib
import functools
import os

import numpy as np
import torch
import triton
import triton.language as tl

from mamba_debug.triton_launch import Launch, cdiv, helper_jit, next_pow2, sm_count

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

if INTERPRET:
    # The first interpreted launch imports triton.experimental.gluon, which asserts that TRITON_INTERPRET is still
    # set if triton's library was built interpreted; the loader restores the variable after executing this file.
    import triton.experimental.gluon  # noqa: F401
elif not isinstance(tl.standard._sum_combine, triton.runtime.JITFunction):
    raise ImportError("triton was first imported with TRITON_INTERPRET=1 in this process, so its library is "
                      "interpreted and the metrics kernel cannot be compiled for cuda; run the GPU comparison in a "
                      "process started without TRITON_INTERPRET=1")


_device_function = helper_jit(INTERPRET)     # the helpers below: plain functions under the interpreter


INF = tl.constexpr(float("inf"))
TINY = tl.constexpr(1e-300)          # the torch version's clamp_min; a float64 constant for Triton (< float32 range)
N_PARTS = 7                          # num, den, aa, ab, mx, a_bad, b_bad: what a split row's programs hand over
METRICS = ("rel_l2", "max_abs", "nmse", "cosine")   # the order of the rows of `out` (as metrics.METRICS)

SUPPORTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@_device_function
def _offsets(x, X2, sx1, sx2, TWO: tl.constexpr):
    """Element offsets of flat indices x (int64) within a row: one strided run, or two (x = x1 * X2 + x2)."""
    if TWO:
        x1 = x // X2
        return x1 * sx1 + (x - x1 * X2) * sx2
    return x * sx1


@_device_function
def _store_metrics(out_ptr, rows, ok, R, num, den, aa, ab, mx, a_bad, b_bad):
    """The torch version's formulas, branch for branch, on [ROWS] float64 sums; out is [4, R] float64."""
    bad = (a_bad > 0) & (b_bad == 0)          # dev non-finite where ref is finite: always a divergence
    rden = tl.sqrt(den)
    pos = den > 0                             # False for NaN too, as in torch
    zero_den = tl.where(num > 0, INF, 0.0)    # ref's norm is 0 (or NaN): inf if dev differs at all, else 0
    rel = tl.where(pos, tl.sqrt(num) / tl.maximum(rden, TINY), zero_den)
    nmse = tl.where(pos, num / tl.maximum(den, TINY), zero_den)
    an = tl.sqrt(aa)
    cos = tl.where((an > 0) & pos, ab / tl.maximum(an * rden, TINY), 1.0)   # a zero (or NaN) norm: cosine 1
    tl.store(out_ptr + rows, tl.where(bad, INF, rel), mask=ok)
    tl.store(out_ptr + R + rows, tl.where(bad, INF, mx), mask=ok)
    tl.store(out_ptr + 2 * R + rows, tl.where(bad, INF, nmse), mask=ok)
    # NaN as inf - inf: a NaN global would fail Triton's "global changed since compiled" check (nan != nan)
    tl.store(out_ptr + 3 * R + rows, tl.where(bad, INF - INF, cos), mask=ok)


@_device_function
def _row_sums(a_ptr, b_ptr, rows, row_ok, T, a_ss, a_st, a_X2, a_sx1, a_sx2, b_ss, b_st, b_X2, b_sx1, b_sx2,
              base, n_steps, X, A_TWO: tl.constexpr, B_TWO: tl.constexpr, ROWS: tl.constexpr,
              BLOCK_X: tl.constexpr):
    """num, den, aa, ab, mx, a_bad, b_bad of `rows` (row = s * T + t) over their elements [base, base + n_steps *
    BLOCK_X) clipped to X, each [ROWS]: per-lane float64 sums (and non-finite flags, bit 0: a, bit 1: b) in a fixed
    order, then the lanes combined by tl.reduce's fixed tree (tl.sum(.., axis=1), see the module docstring). The
    offset of a step is `base + i * BLOCK_X`, not a loop-carried pointer: the compiler then knows its alignment (a
    while loop's carried values have none) and can load 16 bytes at a time."""
    s = rows // T
    t = rows - s * T
    a_row = (s * a_ss + t * a_st)[:, None]
    b_row = (s * b_ss + t * b_st)[:, None]
    cols = tl.arange(0, BLOCK_X).to(tl.int64)
    num = tl.full([ROWS, BLOCK_X], 0.0, tl.float64)
    den = tl.full([ROWS, BLOCK_X], 0.0, tl.float64)
    aa = tl.full([ROWS, BLOCK_X], 0.0, tl.float64)
    ab = tl.full([ROWS, BLOCK_X], 0.0, tl.float64)
    mx = tl.full([ROWS, BLOCK_X], 0.0, tl.float64)
    flags = tl.full([ROWS, BLOCK_X], 0, tl.int32)
    i = 0
    while i < n_steps:
        x = base + i * BLOCK_X + cols
        m = row_ok[:, None] & (x < X)[None, :]
        a = tl.load(a_ptr + a_row + _offsets(x, a_X2, a_sx1, a_sx2, A_TWO)[None, :], mask=m, other=0.0)
        b = tl.load(b_ptr + b_row + _offsets(x, b_X2, b_sx1, b_sx2, B_TWO)[None, :], mask=m, other=0.0)
        a = a.to(tl.float64)                  # exact for every supported dtype; all arithmetic below in float64
        b = b.to(tl.float64)
        d = a - b
        d_fin = tl.abs(d) < INF               # isfinite: False for +-inf and NaN
        d = tl.where(d_fin, d, 0.0)
        num += d * d
        den += b * b
        aa += a * a
        ab += a * b
        mx = tl.maximum(mx, tl.abs(d))        # never NaN: non-finite differences are 0 here
        flags = flags | tl.where(tl.abs(a) < INF, 0, 1) | tl.where(tl.abs(b) < INF, 0, 2)
        i += 1
    return (tl.reduce(num, 1, tl.standard._sum_combine), tl.reduce(den, 1, tl.standard._sum_combine),
            tl.reduce(aa, 1, tl.standard._sum_combine), tl.reduce(ab, 1, tl.standard._sum_combine),
            tl.reduce(mx, 1, tl.standard._elementwise_max), tl.reduce(flags & 1, 1, tl.standard._elementwise_max),
            tl.reduce(flags & 2, 1, tl.standard._elementwise_max))


@triton.jit
def _row_stats_kernel(
    a_ptr, b_ptr,             # dev and ref, any float dtype, [S, T, X] through the strides below (read only)
    out_ptr,                  # [4, R] float64: rel_l2, max_abs, nmse, cosine (FINAL)
    part_ptr,                 # [N_PARTS, SPLIT, R] float64 partial sums of each piece of a row (not FINAL)
    R, T, X, CHUNK, SPLIT,    # rows = S * T; elements per row; elements per piece (a multiple of BLOCK_X); pieces
    a_ss, a_st, a_X2, a_sx1, a_sx2,   # strides in elements; X = X1 * X2 when the row is two strided runs (A_TWO)
    b_ss, b_st, b_X2, b_sx1, b_sx2,
    A_TWO: tl.constexpr, B_TWO: tl.constexpr,
    FINAL: tl.constexpr,      # SPLIT == 1: write the metrics; else the partial sums, for _combine_kernel
    ROWS: tl.constexpr,       # rows per program (short rows)
    BLOCK_X: tl.constexpr,    # elements of a row per step
):
    pid_r = tl.program_id(0).to(tl.int64)
    pid_k = tl.program_id(1).to(tl.int64)
    # 64-bit from the start: no offset product can overflow (and the interpreter skips its overflow checks)
    rows = pid_r * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_ok = rows < R
    # This program's piece of the rows: [base, base + CHUNK) clipped to X
    base = pid_k * CHUNK
    n_steps = (tl.minimum(CHUNK, X - base) + BLOCK_X - 1) // BLOCK_X
    num_r, den_r, aa_r, ab_r, mx_r, a_bad, b_bad = _row_sums(
        a_ptr, b_ptr, rows, row_ok, T, a_ss, a_st, a_X2, a_sx1, a_sx2, b_ss, b_st, b_X2, b_sx1, b_sx2,
        base, n_steps, X, A_TWO, B_TWO, ROWS, BLOCK_X)
    if FINAL:
        _store_metrics(out_ptr, rows, row_ok, R, num_r, den_r, aa_r, ab_r, mx_r, a_bad, b_bad)
    else:
        p = part_ptr + pid_k * R + rows
        step = SPLIT * R
        tl.store(p, num_r, mask=row_ok)
        tl.store(p + step, den_r, mask=row_ok)
        tl.store(p + 2 * step, aa_r, mask=row_ok)
        tl.store(p + 3 * step, ab_r, mask=row_ok)
        tl.store(p + 4 * step, mx_r, mask=row_ok)
        tl.store(p + 5 * step, a_bad.to(tl.float64), mask=row_ok)
        tl.store(p + 6 * step, b_bad.to(tl.float64), mask=row_ok)


@triton.jit
def _combine_kernel(part_ptr, out_ptr, R, SPLIT, BLOCK_R: tl.constexpr):
    """The pieces of each row in order (deterministic), then the metrics."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    ok = rows < R
    step = SPLIT * R
    num = tl.full([BLOCK_R], 0.0, tl.float64)
    den = tl.full([BLOCK_R], 0.0, tl.float64)
    aa = tl.full([BLOCK_R], 0.0, tl.float64)
    ab = tl.full([BLOCK_R], 0.0, tl.float64)
    mx = tl.full([BLOCK_R], 0.0, tl.float64)
    a_bad = tl.full([BLOCK_R], 0.0, tl.float64)
    b_bad = tl.full([BLOCK_R], 0.0, tl.float64)
    k = 0
    while k < SPLIT:
        p = part_ptr + k * R + rows
        num += tl.load(p, mask=ok, other=0.0)
        den += tl.load(p + step, mask=ok, other=0.0)
        aa += tl.load(p + 2 * step, mask=ok, other=0.0)
        ab += tl.load(p + 3 * step, mask=ok, other=0.0)
        mx = tl.maximum(mx, tl.load(p + 4 * step, mask=ok, other=0.0))
        a_bad = tl.maximum(a_bad, tl.load(p + 5 * step, mask=ok, other=0.0))
        b_bad = tl.maximum(b_bad, tl.load(p + 6 * step, mask=ok, other=0.0))
        k += 1
    _store_metrics(out_ptr, rows, ok, R, num, den, aa, ab, mx, a_bad, b_bad)


# Fields of one site in `_sites_kernel`'s table (int64): rows R = S * T and T, elements per row X, both tensors'
# strides as in _row_stats_kernel, where its four metric rows start in `out`, and the first program of the site.
# Nothing in it depends on where the tensors lie (they are the launch's arguments), so a kept plan uploads it once.
FIELDS = ("R", "T", "X", "a_ss", "a_st", "a_X2", "a_sx1", "a_sx2", "b_ss", "b_st", "b_X2", "b_sx1", "b_sx2",
          "out_off", "first")
N_FIELDS = len(FIELDS)
NF = tl.constexpr(N_FIELDS)          # the kernel's copy: a jit function reads only constexpr globals
SITES_PER_LAUNCH = 16                # pointer arguments of `_sites_kernel` per side


@_device_function
def _pick(i, p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15):
    """p_i (a kernel cannot index its arguments)."""
    p = tl.where(i == 1, p1, p0)
    p = tl.where(i == 2, p2, p)
    p = tl.where(i == 3, p3, p)
    p = tl.where(i == 4, p4, p)
    p = tl.where(i == 5, p5, p)
    p = tl.where(i == 6, p6, p)
    p = tl.where(i == 7, p7, p)
    p = tl.where(i == 8, p8, p)
    p = tl.where(i == 9, p9, p)
    p = tl.where(i == 10, p10, p)
    p = tl.where(i == 11, p11, p)
    p = tl.where(i == 12, p12, p)
    p = tl.where(i == 13, p13, p)
    p = tl.where(i == 14, p14, p)
    return tl.where(i == 15, p15, p)


@triton.jit
def _sites_kernel(
    # each site's dev tensor, then its ref (a launch of fewer sites repeats site 0's)
    a0_ptr, a1_ptr, a2_ptr, a3_ptr, a4_ptr, a5_ptr, a6_ptr, a7_ptr,
    a8_ptr, a9_ptr, a10_ptr, a11_ptr, a12_ptr, a13_ptr, a14_ptr, a15_ptr,
    b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr,
    b8_ptr, b9_ptr, b10_ptr, b11_ptr, b12_ptr, b13_ptr, b14_ptr, b15_ptr,
    table_ptr,                # [n_sites + 1, NF] int64 (FIELDS), the last row a sentinel
    out_ptr,                  # float64: each site's [4, R] metrics at its out_off
    n_sites,                  # at most SITES_PER_LAUNCH
    A_TWO: tl.constexpr, B_TWO: tl.constexpr, ROWS: tl.constexpr, BLOCK_X: tl.constexpr,
):
    """Many (dev, ref) sites in one launch, each row read where it lies (no stacking copy): the program's site is the
    last whose first program is not after it; its rows are then summed as _row_stats_kernel sums a row it does not
    split (never split here: the launch's many sites keep the GPU busy)."""
    pid = tl.program_id(0).to(tl.int64)
    lo = n_sites * 0          # binary search: first[lo] <= pid < first[hi] (row n_sites is a sentinel past the grid)
    hi = n_sites
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go = tl.load(table_ptr + mid * NF + 14) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    f = table_ptr + lo * NF
    R, T, X = tl.load(f), tl.load(f + 1), tl.load(f + 2)
    rows = (pid - tl.load(f + 14)) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_ok = rows < R
    a_ptr = _pick(lo,
                  a0_ptr, a1_ptr, a2_ptr, a3_ptr, a4_ptr, a5_ptr, a6_ptr, a7_ptr,
                  a8_ptr, a9_ptr, a10_ptr, a11_ptr, a12_ptr, a13_ptr, a14_ptr, a15_ptr)
    b_ptr = _pick(lo,
                  b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr,
                  b8_ptr, b9_ptr, b10_ptr, b11_ptr, b12_ptr, b13_ptr, b14_ptr, b15_ptr)
    num_r, den_r, aa_r, ab_r, mx_r, a_bad, b_bad = _row_sums(
        a_ptr, b_ptr, rows, row_ok, T,
        tl.load(f + 3), tl.load(f + 4), tl.load(f + 5), tl.load(f + 6), tl.load(f + 7),
        tl.load(f + 8), tl.load(f + 9), tl.load(f + 10), tl.load(f + 11), tl.load(f + 12),
        0, (X + BLOCK_X - 1) // BLOCK_X, X, A_TWO, B_TWO, ROWS, BLOCK_X)
    _store_metrics(out_ptr + tl.load(f + 13), rows, row_ok, R, num_r, den_r, aa_r, ab_r, mx_r, a_bad, b_bad)


# %%
# Host side
# ---------

# Triton's per-call host work (argument binding, its specialization key) done once per argument key
_launch_rows, _launch_combine, _launch_table = (Launch(k, INTERPRET) for k in (
    _row_stats_kernel, _combine_kernel, _sites_kernel))


def _row_layout(t: torch.Tensor):
    """How the trailing dims of t [S, T, ...] flatten into X per row, without a copy when possible.

    Returns (t, X2, sx1, sx2, two): flat index x is at x * sx1 (one strided run), or at (x // X2) * sx1 +
    (x % X2) * sx2 (two runs, e.g. transposed trailing dims). Size-1 dims are dropped and adjacent dims that
    continue each other's strides are merged first."""
    layout = _layout(t.shape[2:], t.stride()[2:])
    # Three or more separate strided runs (e.g. a permuted 5-D view): the kernel walks at most two, so this view
    # is copied once. No site of the engine is such a view.
    return (t, *layout) if layout is not None else _row_layout(t.contiguous())


@functools.lru_cache(maxsize=4096)
def _layout(shape: tuple, strides: tuple):
    """_row_layout's (X2, sx1, sx2, two) of trailing dims, None for three or more runs (cached: every site of a
    layer has the same few shapes, layer after layer)."""
    runs = []
    for n, st in zip(shape, strides):
        if n == 1:
            continue
        if runs and runs[-1][1] == n * st:
            runs[-1] = (runs[-1][0] * n, st)
        else:
            runs.append((n, st))
    if not runs:
        return 1, 1, 0, False
    if len(runs) == 1:
        return 1, runs[0][1], 0, False
    if len(runs) == 2:
        return runs[1][0], runs[0][1], runs[1][1], True
    return None


@functools.lru_cache(maxsize=4096)
def plan(R: int, X: int, sms: int = 0) -> dict:
    """How R rows of X elements are cut: BLOCK_X elements per step, ROWS rows per program, SPLIT pieces per row.

    Interpreter (sms == 0): each block operation costs ~50 us of Python whatever its size, so the fewest and
    largest blocks (up to 64K elements), one piece per row.
    GPU (sms: the device's SM count): steps of 1024 elements over 8 warps (4 per thread: ~72 registers on sm_90,
    16-byte loads), short rows packed several per program. Rows are cut into pieces of whole steps, combined in
    order by a second kernel, when there are too few programs to keep every SM busy: a state taken at the end of
    a ubatch (S rows of 81920: 80 one-step pieces per row) or the per-token states of a ubatch of 512 (3 pieces
    per row, 1536 programs instead of 512, about 1.3 waves of resident programs otherwise).
    benchmarks/site_metrics_bench.py times other cuts."""
    bx = next_pow2(max(X, 1))
    if not sms:
        block_x = min(bx, 2 ** 14)
        rows = max(1, min(next_pow2(R), 2 ** 16 // block_x))
        return dict(BLOCK_X=block_x, ROWS=rows, SPLIT=1, num_warps=1)
    block_x = min(bx, 1024)
    rows = max(1, min(next_pow2(R), 1024 // block_x))
    programs = cdiv(R, rows)
    split = 1
    if programs < 8 * sms:
        min_piece = block_x if programs < sms else 16 * block_x    # enough programs already: long pieces only
        split = max(1, min(cdiv(X, min_piece), cdiv(8 * sms, programs)))
    return dict(BLOCK_X=block_x, ROWS=rows, SPLIT=split, num_warps=max(1, min(8, rows * block_x // 128)))


def site_errors_fused(dev: torch.Tensor, ref: torch.Tensor, config: dict | None = None) -> dict[str, torch.Tensor]:
    """dev, ref [S, T, ...] -> rel_l2, max_abs, nmse, cosine, each [S, T] float64 on ref's device.

    The same values as `metrics._site_errors_torch` (up to float64 rounding of the sums: the order differs).
    dev is moved to ref's device in its own dtype (the float64 conversion happens in the kernel). dev and ref must
    have the same S, T and number of elements per (s, t) (the torch version would broadcast a single element).
    config: BLOCK_X, ROWS, SPLIT, num_warps instead of `plan`'s (tests and benchmarks)."""
    a, b = _prepared(dev, ref)
    S, T = b.shape[0], b.shape[1]
    out = torch.empty((4, S, T), dtype=torch.float64, device=b.device)
    R = S * T
    if R == 0:
        return dict(zip(METRICS, out.unbind(0)))
    X = b.numel() // R
    a, a_X2, a_sx1, a_sx2, a_two = _row_layout(a)
    b, b_X2, b_sx1, b_sx2, b_two = _row_layout(b)
    if config is None:
        config = plan(R, X, 0 if INTERPRET else sm_count(b.device))
    block_x, rows, split = config["BLOCK_X"], config["ROWS"], config["SPLIT"]
    chunk = cdiv(cdiv(X, split), block_x) * block_x
    split = cdiv(X, chunk)         # no empty piece
    part = out if split == 1 else torch.empty((N_PARTS, split, R), dtype=torch.float64, device=b.device)
    with _on(b.device), _quiet():
        _launch_rows((cdiv(R, rows), split), (a, b, out, part),
                     (R, T, X, chunk, split, a.stride(0), a.stride(1), a_X2, a_sx1, a_sx2,
                      b.stride(0), b.stride(1), b_X2, b_sx1, b_sx2),
                     dict(A_TWO=a_two, B_TWO=b_two, FINAL=split == 1, ROWS=rows, BLOCK_X=block_x,
                          num_warps=config.get("num_warps", 4)))
        if split > 1:
            block_r = min(next_pow2(R), 1024 if INTERPRET else 128)
            _launch_combine((cdiv(R, block_r),), (part, out), (R, split),
                            dict(BLOCK_R=block_r, num_warps=1 if INTERPRET else 4))
    return dict(zip(METRICS, out.unbind(0)))


_PLANS: dict = {}                    # the pairs' signature -> their _Plan (site_errors_sites)
MAX_PLANS = 512


def site_errors_sites(pairs: list) -> list[dict]:
    """`site_errors_fused` of many (dev, ref) pairs without stacking them: one `_sites_kernel` launch per group of
    pairs that share dtypes, block sizes and row layout, each row read in place and never split into pieces. The
    values of `site_errors_fused` pair by pair: bit for bit under the interpreter (whose plan never splits); on a GPU
    within float64 rounding (a row it would split, or the compiler contracting a multiply-add differently), and bit
    for bit however the pairs are grouped.

    A layer's sites have the same shapes, strides and dtypes layer after layer and ubatch after ubatch, so how they
    are grouped and cut (their `_Plan`) is kept per signature: a call then launches with the pairs' tensors and cuts
    one result block (issue #18: building and uploading the tables per call was most of the host work of measuring
    a 2.8B prefill at birth). Pairs that need a copy first (another device, a dtype the kernel does not read, a view
    of three strided runs) are copied on every call, then measured by their kept plan."""
    sig = tuple((d.shape, d.stride(), d.dtype, d.device, r.shape, r.stride(), r.dtype, r.device) for d, r in pairs)
    kept = _PLANS.get(sig)
    if kept is not None and kept[1]:
        return kept[0].run(pairs)
    devices: dict = {}
    for i, (_, ref) in enumerate(pairs):
        devices.setdefault(ref.device, []).append(i)
    if len(devices) > 1:             # a placement over GPUs: each device's pairs by their own plan
        out: list = [None] * len(pairs)
        for idx in devices.values():
            for i, e in zip(idx, site_errors_sites([pairs[i] for i in idx])):
                out[i] = e
        return out
    lays = [(_row_layout(a), _row_layout(b)) for a, b in (_prepared(dev, ref) for dev, ref in pairs)]
    ready = [(la[0], lb[0]) for la, lb in lays]
    if kept is None:                 # the copies made above depend on the signature only: the plan is kept either way
        as_is = all(a.data_ptr() == d.data_ptr() and a.dtype == d.dtype and a.device == d.device and
                    b.data_ptr() == r.data_ptr() and b.dtype == r.dtype for (a, b), (d, r) in zip(ready, pairs))
        if len(_PLANS) >= MAX_PLANS:
            _PLANS.clear()
        kept = _PLANS[sig] = (_Plan(ready, [(la[1:], lb[1:]) for la, lb in lays]), as_is)
    return kept[0].run(ready)


class _Plan:
    """How a list of (dev, ref) pairs, ready for the kernel, is measured: the launches (each at most
    SITES_PER_LAUNCH like pairs: their indices, options and table, on the device from the first call on), and where
    each pair's [4, S, T] metrics lie in the one result block. A call hands each launch its pairs' tensors."""

    def __init__(self, ready: list, lays: list):
        sms = 0 if INTERPRET else None
        groups: dict = {}
        self.shapes = [tuple(b.shape[:2]) for _, b in ready]
        self.device = ready[0][1].device if ready else None
        for i, ((a, b), (a_lay, b_lay)) in enumerate(zip(ready, lays)):
            S, T = self.shapes[i]
            if S * T == 0:
                continue
            sms = sm_count(b.device) if sms is None else sms
            X = b.numel() // (S * T)
            cfg = plan(S * T, X, sms)
            key = (a.dtype, b.dtype, cfg["BLOCK_X"], cfg["ROWS"], cfg["num_warps"], a_lay[3], b_lay[3])
            groups.setdefault(key, []).append((i, S * T, T, X, a.stride(0), a.stride(1), *a_lay[:3],
                                               b.stride(0), b.stride(1), *b_lay[:3]))
        self.launches, self.order, off = [], [], 0
        for (_, _, block_x, rows, warps, a_two, b_two), items in groups.items():
            for k in range(0, len(items), SITES_PER_LAUNCH):
                table, first = [], 0
                for i, R, *fields in items[k:k + SITES_PER_LAUNCH]:
                    table.append([R, *fields, off, first])
                    self.order.append((i, 4 * R))
                    off += 4 * R
                    first += cdiv(R, rows)
                table.append([0] * (N_FIELDS - 1) + [1 << 62])     # the sentinel: starts past every program
                idx = [it[0] for it in items[k:k + SITES_PER_LAUNCH]]
                self.launches.append(dict(
                    idx=idx + idx[:1] * (SITES_PER_LAUNCH - len(idx)), n=len(idx), grid=(first,),
                    table=torch.tensor(table, dtype=torch.int64), meta=dict(A_TWO=a_two, B_TWO=b_two, ROWS=rows,
                                                                           BLOCK_X=block_x, num_warps=warps)))
        self.total = off

    def run(self, pairs: list) -> list[dict]:
        res = torch.empty(self.total, dtype=torch.float64, device=self.device) if self.total else None
        with _on(self.device), _quiet():
            for g in self.launches:
                if g["table"].device != self.device:    # the first call: the table's one trip, without a wait
                    t = g["table"]
                    g["table"] = t.to(self.device) if INTERPRET else t.pin_memory().to(self.device, non_blocking=True)
                a = [pairs[i][0] for i in g["idx"]]
                b = [pairs[i][1] for i in g["idx"]]
                _launch_table(g["grid"], (*a, *b, g["table"], res), (g["n"],), g["meta"])
        out: list = [None] * len(pairs)
        for i, (S, T) in enumerate(self.shapes):
            if S * T == 0:
                out[i] = dict(zip(METRICS, torch.empty((4, S, T), dtype=torch.float64,
                                                       device=pairs[i][1].device).unbind(0)))
        if res is not None:
            for (i, _), part in zip(self.order, res.split([n for _, n in self.order])):
                out[i] = dict(zip(METRICS, part.view(4, *self.shapes[i]).unbind(0)))
        return out


def _prepared(dev: torch.Tensor, ref: torch.Tensor):
    """One pair checked and made ready for the kernels: ref on this copy's device kind, the shapes [S, T, ...] alike,
    dev on ref's device, dtypes the kernels do not read widened (integers, bool: the torch version's float64
    conversion, a copy), at least one element per (s, t) unless there are no rows."""
    want = "cpu" if INTERPRET else "cuda"
    if ref.device.type != want:
        mode = "Triton's interpreter (CPU tensors)" if INTERPRET else "CUDA (compiled)"
        raise ValueError(f"site_errors_fused: this copy of the metrics kernel was built for {mode}, but ref is on "
                         f"{ref.device}; use mamba_debug.metrics.fused_site_errors, which picks the copy")
    if dev.dim() < 2 or ref.dim() < 2 or dev.shape[:2] != ref.shape[:2] or dev.numel() != ref.numel():
        raise ValueError(f"site_errors: dev {list(dev.shape)} and ref {list(ref.shape)} must be [S, T, ...] with "
                         f"the same S, T and elements per (s, t)")
    a, b = dev.detach(), ref.detach()
    a = a.to(b.device) if a.device != b.device else a
    a = a if a.dtype in SUPPORTED else a.to(torch.float64)
    b = b if b.dtype in SUPPORTED else b.to(torch.float64)
    if b.numel() == 0 and b.shape[0] * b.shape[1]:
        raise ValueError(f"site_errors: no elements per (s, t) (ref {list(ref.shape)}): max_abs is undefined")
    return a, b


def _on(device):
    """Launches on `device` when it is a GPU other than the current one (Triton launches on the current device)."""
    if INTERPRET or device is None or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def _quiet():
    """Under the interpreter numpy warns about the NaN and inf results the torch version gives silently."""
    return np.errstate(all="ignore") if INTERPRET else contextlib.nullcontext()
