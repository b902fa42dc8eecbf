"""`site_errors` as one fused Triton kernel: dev and ref are read once, every sum is taken in float64.

The torch version (`metrics._site_errors_torch`, the reference implementation) converts both [S, T, ...] tensors
to float64 and makes about ten passes over them. With the reference sides on a GPU that was the whole cost of
tracing (14x an untraced 2.8B prefill, almost all of it the per-token SSM states). Here each (s, t) row is read
once, in its own dtype and strides, and reduced in float64 into

    num = sum (a-b)^2 over the finite differences    den = sum b^2    aa = sum a^2    ab = sum a*b
    mx  = max |a-b| over the finite differences       flags: a has a non-finite, b has a non-finite

from which the kernel also computes the four metrics with `_site_errors_torch`'s where/clamp rules: one launch per
group of like sites (a layer's, read where they lie), then one that turns every site's piece sums into metrics.

Do not import this file directly: `metrics._fused_module` executes it once per mode, like the kernel plug-ins.
`triton.jit` decides interpreted-or-compiled from TRITON_INTERPRET when it runs (once, at execution), so the copy
for CUDA tensors is compiled and the copy for CPU tensors runs under Triton's interpreter (how CI, which has no
GPU, exercises every index, stride and mask of the kernels). The kernels use only Triton builtins and tl.reduce
with the standard sum/max combines, which the interpreter recognises, so the interpreted copy also works in a
process whose Triton library was imported compiled (see kernels/triton.py). Loops are `while` loops: Triton
3.6's interpreter cannot take a runtime int as a range() bound with numpy >= 2.

Determinism: no atomics. Each element lane accumulates its own column in a fixed order, lanes are combined by
tl.reduce's fixed tree, and a row split over several programs (few or long rows: a state taken at the end of a
ubatch, the per-token states) is combined by a second kernel walking the pieces in order. Same shapes and plan, same
bits, however the pairs are grouped.
"""
import contextlib
import os

import numpy as np
import torch
import triton
import triton.language as tl

from mamba_debug.metric_block import METRICS, SiteErrors   # METRICS: the order of a site's rows in `out`
from mamba_debug.site_layout import plan, row_layout as _row_layout, vec as _vec
from mamba_debug.triton_launch import Launch, cdiv, check_mode, helper_jit, on_device, sm_count

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

check_mode(INTERPRET, "the metrics kernel")


_device_function = helper_jit(INTERPRET)     # the helpers below: plain functions under the interpreter


INF = tl.constexpr(float("inf"))
TINY = tl.constexpr(1e-300)          # the torch version's clamp_min; a float64 constant for Triton (< float32 range)
N_PARTS = 7                          # num, den, aa, ab, mx, a_bad, b_bad: what each piece's program hands over

SUPPORTED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@_device_function
def _offsets(row, x, X2, sx1, sx2, TWO: tl.constexpr, VEC: tl.constexpr):
    """Element offsets of flat indices x (int64) of rows starting at `row`: one run of unit stride whose rows start
    at multiples of VEC elements (VEC > 0: written so that the compiler can prove both and load 16 bytes at a
    time), one strided run, or two (x = x1 * X2 + x2)."""
    if VEC > 0:
        return (row // VEC * VEC)[:, None] + x[None, :]
    if TWO:
        x1 = x // X2
        return row[:, None] + (x1 * sx1 + (x - x1 * X2) * sx2)[None, :]
    return row[:, None] + (x * sx1)[None, :]


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
def _row_sums(a_ptr, b_ptr, f, rows, row_ok, step0, n_steps, A_TWO: tl.constexpr, A_VEC: tl.constexpr,
              B_TWO: tl.constexpr, B_VEC: tl.constexpr, X_VEC: tl.constexpr, ROWS: tl.constexpr,
              BLOCK_X: tl.constexpr):
    """num, den, aa, ab, mx, a_bad, b_bad of `rows` (row = s * T + t) of the site at table row f, over their steps
    [step0, step0 + n_steps) of BLOCK_X elements clipped to X, each [ROWS]: per-lane float64 sums (and non-finite
    flags, bit 0: a, bit 1: b) in a fixed order, then the lanes combined by tl.reduce's fixed tree (tl.sum(..,
    axis=1), see the module docstring). A step's offset is `(step0 + i) * BLOCK_X`, not a loop-carried pointer, and
    an aligned row's start and X (a multiple of X_VEC: _vec) are multiples by construction: the compiler then knows
    the alignment of the loads and the masks (nothing loaded from the table or carried by a while loop has any) and
    loads 16 bytes at a time. Unproven alignment cost about 3/4 of the bandwidth (single 4-byte loads) on an H200."""
    T, X = tl.load(f + 1), tl.load(f + 2) // X_VEC * X_VEC
    s = rows // T
    t = rows - s * T
    a_row = s * tl.load(f + 3) + t * tl.load(f + 4)
    b_row = s * tl.load(f + 8) + t * tl.load(f + 9)
    a_X2, a_sx1, a_sx2 = tl.load(f + 5), tl.load(f + 6), tl.load(f + 7)
    b_X2, b_sx1, b_sx2 = tl.load(f + 10), tl.load(f + 11), tl.load(f + 12)
    cols = tl.arange(0, BLOCK_X).to(tl.int64)
    num = tl.full([ROWS, BLOCK_X], 0.0, tl.float64)
    den = tl.full([ROWS, BLOCK_X], 0.0, tl.float64)
    aa = tl.full([ROWS, BLOCK_X], 0.0, tl.float64)
    ab = tl.full([ROWS, BLOCK_X], 0.0, tl.float64)
    mx = tl.full([ROWS, BLOCK_X], 0.0, tl.float64)
    flags = tl.full([ROWS, BLOCK_X], 0, tl.int32)
    i = 0
    while i < n_steps:
        x = (step0 + i) * BLOCK_X + cols
        m = row_ok[:, None] & (x < X)[None, :]
        a = tl.load(a_ptr + _offsets(a_row, x, a_X2, a_sx1, a_sx2, A_TWO, A_VEC), mask=m, other=0.0)
        b = tl.load(b_ptr + _offsets(b_row, x, b_X2, b_sx1, b_sx2, B_TWO, B_VEC), mask=m, other=0.0)
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


@_device_function
def _store_parts(p, rows, ok, step, num, den, aa, ab, mx, a_bad, b_bad):
    """A piece's sums of `rows` for _combine_kernel: quantity q of the piece at p + q * step."""
    tl.store(p + rows, num, mask=ok)
    tl.store(p + step + rows, den, mask=ok)
    tl.store(p + 2 * step + rows, aa, mask=ok)
    tl.store(p + 3 * step + rows, ab, mask=ok)
    tl.store(p + 4 * step + rows, mx, mask=ok)
    tl.store(p + 5 * step + rows, a_bad.to(tl.float64), mask=ok)
    tl.store(p + 6 * step + rows, b_bad.to(tl.float64), mask=ok)


@_device_function
def _site_of(table_ptr, n_sites, pid, N_COLS: tl.constexpr, FIRST: tl.constexpr):
    """The table row (site) of program pid: the last of its n_sites rows whose first program is not after pid, by
    binary search."""
    lo = n_sites * 0
    hi = n_sites
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go = tl.load(table_ptr + mid * N_COLS + FIRST) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return table_ptr + lo * N_COLS, lo


# Fields of one site in `_sites_kernel`'s table (int64): rows R = S * T and T, elements per row X, both tensors'
# strides (X = X1 * X2 when a row is two strided runs: a_X2, a_sx1, a_sx2), its first program, the pieces per row
# and the steps of BLOCK_X elements per piece, and where its pieces' sums start in `part`. Nothing in it depends on
# where the tensors lie (they are the launch's arguments), so a kept plan uploads it once. `_combine_kernel`'s
# table: COMBINE_FIELDS.
FIELDS = ("R", "T", "X", "a_ss", "a_st", "a_X2", "a_sx1", "a_sx2", "b_ss", "b_st", "b_X2", "b_sx1", "b_sx2",
          "first", "split", "steps", "part_off")
COMBINE_FIELDS = ("R", "split", "part_off", "out_off", "first")
NF = tl.constexpr(len(FIELDS))       # the kernels' copies: a jit function reads only constexpr globals
NC = tl.constexpr(len(COMBINE_FIELDS))
SITES_PER_LAUNCH = 16                # pointer arguments of `_sites_kernel` per side
BLOCK_R = 1024 if INTERPRET else 128   # rows per program of `_combine_kernel` (interpreter: fewest programs)


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
    table_ptr,                # [n_sites, NF] int64 (FIELDS)
    part_ptr,                 # float64: each site's [N_PARTS, split, R] piece sums at its part_off
    n_sites,                  # at most SITES_PER_LAUNCH
    A_TWO: tl.constexpr, A_VEC: tl.constexpr, B_TWO: tl.constexpr, B_VEC: tl.constexpr,   # row layouts (_offsets)
    X_VEC: tl.constexpr,      # X is a multiple of it (_vec)
    ROWS: tl.constexpr, BLOCK_X: tl.constexpr,
):
    """Many (dev, ref) sites in one launch, each row read where it lies (no stacking copy). A program sums ROWS rows
    of its site over one piece of their elements (a whole row, or a piece of a long one) for _combine_kernel; the
    pieces of a row are adjacent programs. The metrics are left to _combine_kernel even for a row of one piece: with
    their formulas here too the kernel took 96 registers instead of 74 (at 1024 elements over 8 warps: 2 programs an
    SM instead of 3 on an H200)."""
    pid = tl.program_id(0).to(tl.int64)     # 64-bit from the start: no offset product can overflow
    f, site = _site_of(table_ptr, n_sites, pid, NF, 13)
    R, X = tl.load(f), tl.load(f + 2)
    split, steps = tl.load(f + 14), tl.load(f + 15)
    local = pid - tl.load(f + 13)
    block = local // split
    piece = local - block * split
    rows = block * ROWS + tl.arange(0, ROWS).to(tl.int64)
    row_ok = rows < R
    step0 = piece * steps
    a_ptr = _pick(site,
                  a0_ptr, a1_ptr, a2_ptr, a3_ptr, a4_ptr, a5_ptr, a6_ptr, a7_ptr,
                  a8_ptr, a9_ptr, a10_ptr, a11_ptr, a12_ptr, a13_ptr, a14_ptr, a15_ptr)
    b_ptr = _pick(site,
                  b0_ptr, b1_ptr, b2_ptr, b3_ptr, b4_ptr, b5_ptr, b6_ptr, b7_ptr,
                  b8_ptr, b9_ptr, b10_ptr, b11_ptr, b12_ptr, b13_ptr, b14_ptr, b15_ptr)
    num, den, aa, ab, mx, a_bad, b_bad = _row_sums(
        a_ptr, b_ptr, f, rows, row_ok, step0, tl.minimum(steps, (X + BLOCK_X - 1) // BLOCK_X - step0),
        A_TWO, A_VEC, B_TWO, B_VEC, X_VEC, ROWS, BLOCK_X)
    _store_parts(part_ptr + tl.load(f + 16) + piece * R, rows, row_ok, split * R,
                 num, den, aa, ab, mx, a_bad, b_bad)


@triton.jit
def _combine_kernel(table_ptr, part_ptr, out_ptr, n_sites, BLOCK_R: tl.constexpr):
    """The sites' pieces, row by row in piece order from the first (deterministic; one piece: its sums as they are),
    then their metrics; table: [n_sites, NC] int64 (COMBINE_FIELDS)."""
    pid = tl.program_id(0).to(tl.int64)
    f, _ = _site_of(table_ptr, n_sites, pid, NC, 4)
    R, split = tl.load(f), tl.load(f + 1)
    rows = (pid - tl.load(f + 4)) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    ok = rows < R
    step = split * R
    p = part_ptr + tl.load(f + 2) + rows
    num = tl.load(p, mask=ok, other=0.0)
    den = tl.load(p + step, mask=ok, other=0.0)
    aa = tl.load(p + 2 * step, mask=ok, other=0.0)
    ab = tl.load(p + 3 * step, mask=ok, other=0.0)
    mx = tl.load(p + 4 * step, mask=ok, other=0.0)
    a_bad = tl.load(p + 5 * step, mask=ok, other=0.0)
    b_bad = tl.load(p + 6 * step, mask=ok, other=0.0)
    k = split * 0 + 1
    p += R
    while k < split:
        num += tl.load(p, mask=ok, other=0.0)
        den += tl.load(p + step, mask=ok, other=0.0)
        aa += tl.load(p + 2 * step, mask=ok, other=0.0)
        ab += tl.load(p + 3 * step, mask=ok, other=0.0)
        mx = tl.maximum(mx, tl.load(p + 4 * step, mask=ok, other=0.0))
        a_bad = tl.maximum(a_bad, tl.load(p + 5 * step, mask=ok, other=0.0))
        b_bad = tl.maximum(b_bad, tl.load(p + 6 * step, mask=ok, other=0.0))
        p += R
        k += 1
    _store_metrics(out_ptr + tl.load(f + 3), rows, ok, R, num, den, aa, ab, mx, a_bad, b_bad)


# %%
# Host side
# ---------

# Triton's per-call host work (argument binding, its specialization key) done once per argument key
_launch_table, _launch_combine = (Launch(k, INTERPRET) for k in (_sites_kernel, _combine_kernel))


def site_errors_fused(dev: torch.Tensor, ref: torch.Tensor, config: dict | None = None) -> dict[str, torch.Tensor]:
    """dev, ref [S, T, ...] -> rel_l2, max_abs, nmse, cosine, each [S, T] float64 on ref's device.

    The same values as `metrics._site_errors_torch` (up to float64 rounding of the sums: the order differs).
    dev is moved to ref's device in its own dtype (the float64 conversion happens in the kernel). dev and ref must
    have the same S, T and number of elements per (s, t) (the torch version would broadcast a single element).
    config: BLOCK_X, ROWS, SPLIT, num_warps instead of `plan`'s (tests and benchmarks); without one, the pair is
    `site_errors_sites`'s, so its bits are the same however it is measured. A plain dict (one pair: its views cost
    nothing worth saving; site_errors_sites hands out lazy `SiteErrors`)."""
    if config is None:
        return dict(site_errors_sites([(dev, ref)])[0])
    a, b = _prepared(dev, ref)
    la, lb = _row_layout(a), _row_layout(b)
    ready = [(la[0], lb[0])]
    return dict(_Plan(ready, [(la[1:], lb[1:])], config).run(ready)[0])


_PLANS: dict = {}                    # the pairs' signature -> their _Plan (site_errors_sites)
MAX_PLANS = 512


def site_errors_sites(pairs: list) -> list:
    """`site_errors_fused` of many (dev, ref) pairs without stacking them: one `_sites_kernel` launch per group of
    pairs that share dtypes, block sizes and row layout, each row read in place and cut as `plan` cuts it alone
    (then one `_combine_kernel` launch): each pair's bits are those it gets alone, however the pairs are grouped.

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
    SITES_PER_LAUNCH like pairs: their indices, options and table, on the device from the first call on), one
    combine launch that turns every site's piece sums into its metrics, and where each pair's [4, S, T] metrics lie
    in the one result block. A call hands each launch its pairs' tensors. config: one cut for every pair instead of
    `plan`'s."""

    def __init__(self, ready: list, lays: list, config: dict | None = None):
        self.shapes = [tuple(b.shape[:2]) for _, b in ready]
        self.device = ready[0][1].device if ready else None
        self.launches, self.order, self.total, self.parts, combine = [], [], 0, 0, []
        for key, items in self._groups(ready, lays, config).items():
            for k in range(0, len(items), SITES_PER_LAUNCH):
                self._add_launch(key, items[k:k + SITES_PER_LAUNCH], combine)
        self.combine = None
        if combine:
            self.combine = dict(grid=(combine[-1][4] + cdiv(combine[-1][0], BLOCK_R),), n=len(combine),
                                table=torch.tensor(combine, dtype=torch.int64))

    def _groups(self, ready: list, lays: list, config) -> dict:
        """The pairs by what a launch fixes for all its sites (dtypes, cut, row layouts): each pair's table fields
        but where its results go, and its pieces per row."""
        sms = 0 if INTERPRET or config is not None else sm_count(self.device)
        groups: dict = {}
        for i, ((a, b), (a_lay, b_lay)) in enumerate(zip(ready, lays)):
            S, T = self.shapes[i]
            if S * T == 0:
                continue
            X = b.numel() // (S * T)
            cut = config or plan(S * T, X, sms)
            key = (a.dtype, b.dtype, cut["BLOCK_X"], cut["ROWS"], cut.get("num_warps", 4),
                   a_lay[3], _vec(a, a_lay, X), b_lay[3], _vec(b, b_lay, X))
            groups.setdefault(key, []).append((i, S * T, T, X, a.stride(0), a.stride(1), *a_lay[:3],
                                               b.stride(0), b.stride(1), *b_lay[:3], cut["SPLIT"]))
        return groups

    def _add_launch(self, key: tuple, items: list, combine: list):
        """One `_sites_kernel` launch of up to SITES_PER_LAUNCH like pairs: its table, grid and options; where each
        pair's metrics (and pieces) go; the pairs cut into pieces added to the combine launch's table."""
        _, _, block_x, rows, warps, a_two, a_vec, b_two, b_vec = key
        table, first = [], 0
        for i, R, T, X, *strides, split in items:
            steps = cdiv(cdiv(X, block_x), split)
            split = cdiv(cdiv(X, block_x), steps)       # no empty piece
            c_first = combine[-1][4] + cdiv(combine[-1][0], BLOCK_R) if combine else 0
            combine.append([R, split, self.parts, self.total, c_first])
            table.append([R, T, X, *strides, first, split, steps, self.parts])
            self.parts += N_PARTS * split * R
            self.order.append((i, 4 * R))
            self.total += 4 * R
            first += cdiv(R, rows) * split
        idx = [it[0] for it in items]
        self.launches.append(dict(
            idx=idx + idx[:1] * (SITES_PER_LAUNCH - len(idx)), n=len(idx), grid=(first,),
            table=torch.tensor(table, dtype=torch.int64),
            meta=dict(A_TWO=a_two, A_VEC=a_vec, B_TWO=b_two, B_VEC=b_vec, X_VEC=max(a_vec, b_vec, 1), ROWS=rows,
                      BLOCK_X=block_x, num_warps=warps)))

    def run(self, pairs: list) -> list:
        res = torch.empty(self.total, dtype=torch.float64, device=self.device) if self.total else None
        part = torch.empty(self.parts, dtype=torch.float64, device=self.device) if self.total else None
        with on_device(self.device, INTERPRET), _quiet():
            for g in self.launches:
                a = [pairs[i][0] for i in g["idx"]]
                b = [pairs[i][1] for i in g["idx"]]
                _launch_table(g["grid"], (*a, *b, self._table(g), part), (g["n"],), g["meta"])
            if self.combine is not None:
                _launch_combine(self.combine["grid"], (self._table(self.combine), part, res), (self.combine["n"],),
                                dict(BLOCK_R=BLOCK_R, num_warps=1 if INTERPRET else 4))
        out: list = [None] * len(pairs)
        for i, (S, T) in enumerate(self.shapes):
            if S * T == 0:
                out[i] = dict(zip(METRICS, torch.empty((4, S, T), dtype=torch.float64,
                                                       device=pairs[i][1].device).unbind(0)))
        offset = 0
        for i, n in self.order:             # views made when read (metric_block: most of the host time here)
            out[i] = SiteErrors(res, offset, self.shapes[i])
            offset += n
        return out

    def _table(self, g: dict) -> torch.Tensor:
        """A launch's table on the device: the first call makes its one trip there, without a wait."""
        if g["table"].device != self.device:
            t = g["table"]
            g["table"] = t.to(self.device) if INTERPRET else t.pin_memory().to(self.device, non_blocking=True)
        return g["table"]


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


def _quiet():
    """Under the interpreter numpy warns about the NaN and inf results the torch version gives silently."""
    return np.errstate(all="ignore") if INTERPRET else contextlib.nullcontext()
