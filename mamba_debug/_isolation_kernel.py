"""The plug-in isolation check (isolation.py) on a GPU as one launch before an op call and one after it.

Torch's way takes three launches per input: a copy before the call, `ne` and `any` after it. A 2.8B prefill makes
~7000 of them (35.7 ms of an H100's 374.6 ms, ~76 ms of host time; benchmarks/README.md, twenty-seventh session).
Here `_isolation_kernel` reads each input where it lies, strided views included, and either copies its elements
into one snapshot buffer (CHECK=False) or compares them bit for bit with that buffer, setting the input's flag
when any differ (CHECK=True). The inputs are their integer bit views (isolation._bits): NaN == NaN, -0.0 != 0.0.

A kernel input is any tensor that is rows of unit-stride elements once its dimensions are merged (contiguous
tensors, slices of a wider projection such as x, z, B and C, rows repeated by `expand`). Others (a transposed view)
are left to the torch way. Inputs of one dtype and alignment share a launch, up to SLOTS at a time.

Do not import this file: isolation.py executes it once per mode, like _site_metrics.py (see that file's docstring
for why, and for the `while` loops).
"""
import os

import torch
import triton
import triton.language as tl

from mamba_debug.triton_launch import Launch, cdiv, check_mode, helper_jit, next_pow2, on_device

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

check_mode(INTERPRET, "the isolation kernel")

_device_function = helper_jit(INTERPRET)

SLOTS = 8                            # input tensors per launch
TILE = 4096 if INTERPRET else 1024   # elements per program (interpreter: fewest programs)
# One input's row of the launch table (int64): rows and elements per row, the rows' stride, tiles across a row,
# its first program, where its copy starts in the snapshot, its argument slot and its flag's index. `owner`: each
# program's table row (int32; a lookup, not a search: the interpreter replays kernels that do not branch on loaded
# values).
FIELDS = ("R", "C", "srow", "pieces", "first", "snap", "arg", "flag")
NF = tl.constexpr(len(FIELDS))


@_device_function
def _pick(i, p0, p1, p2, p3, p4, p5, p6, p7):
    """p_i (a kernel cannot index its arguments)."""
    p = tl.where(i == 1, p1, p0)
    p = tl.where(i == 2, p2, p)
    p = tl.where(i == 3, p3, p)
    p = tl.where(i == 4, p4, p)
    p = tl.where(i == 5, p5, p)
    p = tl.where(i == 6, p6, p)
    return tl.where(i == 7, p7, p)


@triton.jit
def _isolation_kernel(p0, p1, p2, p3, p4, p5, p6, p7,   # the inputs' bit views (fewer: slot 0's repeated)
                      snap_ptr, table_ptr, flags_ptr, owner_ptr,
                      CHECK: tl.constexpr, VEC: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr):
    """A tile of RB rows x CB elements of one input: copied to the snapshot, or compared with it (its flag set if
    any bits differ). VEC: every input's address, row stride and row length are multiples of it (written so that
    the compiler can prove it and move 16 bytes at a time, as in _site_metrics.py)."""
    pid = tl.program_id(0).to(tl.int64)
    f = table_ptr + tl.load(owner_ptr + pid) * NF
    R, C, srow, pieces = tl.load(f), tl.load(f + 1), tl.load(f + 2), tl.load(f + 3)
    local = pid - tl.load(f + 4)
    block = local // pieces
    rows = block * RB + tl.arange(0, RB).to(tl.int64)
    cols = (local - block * pieces) * CB + tl.arange(0, CB).to(tl.int64)
    src = rows * srow
    dst = tl.load(f + 5) + rows * C
    if VEC > 1:
        C = C // VEC * VEC
        src = src // VEC * VEC
        dst = dst // VEC * VEC
    m = (rows < R)[:, None] & (cols < C)[None, :]
    p = _pick(tl.load(f + 6), p0, p1, p2, p3, p4, p5, p6, p7)
    x = tl.load(p + src[:, None] + cols[None, :], mask=m, other=0)
    if CHECK:
        s = tl.load(snap_ptr + dst[:, None] + cols[None, :], mask=m, other=0)
        bad = tl.where(x != s, 1, 0)          # tl.max is a jit function, which the interpreter cannot call here
        bad = tl.reduce(tl.reduce(bad, 1, tl.standard._elementwise_max), 0, tl.standard._elementwise_max)
        tl.store(flags_ptr + tl.load(f + 7), bad, mask=bad > 0)
    else:
        tl.store(snap_ptr + dst[:, None] + cols[None, :], x, mask=m)


_launch = Launch(_isolation_kernel, INTERPRET)


def layout(t: torch.Tensor):
    """(rows, row stride, row length) of t's elements with its dimensions merged, or None when they are not rows of
    unit-stride elements (the torch way then)."""
    dims = [(n, s) for n, s in zip(t.shape, t.stride()) if n != 1]
    merged: list = []
    for n, s in dims:
        if merged and merged[-1][1] == n * s:
            merged[-1] = (merged[-1][0] * n, s)
        else:
            merged.append((n, s))
    if not merged:
        return 1, 0, 1
    if merged[-1][1] != 1 or len(merged) > 2:
        return None
    return (1, 0, merged[0][0]) if len(merged) == 1 else (merged[0][0], merged[0][1], merged[1][0])


class Plan:
    """How one signature of kernel inputs (bit views of one device, with their layouts) is copied and checked: the
    launches (inputs of one dtype and alignment, SLOTS at a time) with their tables, and the snapshot's size per
    launch. Kept per signature by isolation.py (shapes repeat layer after layer and ubatch after ubatch)."""

    def __init__(self, views: list, lays: list, flags: list):
        groups: dict = {}
        for i, (v, lay) in enumerate(zip(views, lays)):
            groups.setdefault((v.dtype, _vec(v, lay)), []).append(i)
        self.device = views[0].device
        self.launches = []
        for (dtype, vec), idx in groups.items():
            for k in range(0, len(idx), SLOTS):
                part = idx[k:k + SLOTS]
                tile = _tile(max(lays[i][2] for i in part))
                self.launches.append(self._launch(dtype, vec, tile, part, lays, flags))

    def _launch(self, dtype, vec: int, tile: tuple, idx: list, lays: list, flags: list) -> dict:
        table, counts, first, snap = [], [], 0, 0
        rb, cb = tile
        for slot, i in enumerate(idx):
            rows, srow, C = lays[i]
            pieces = cdiv(C, cb)
            table.append([rows, C, srow, pieces, first, snap, slot, flags[i]])
            counts.append(cdiv(rows, rb) * pieces)
            first += counts[-1]
            snap += rows * C                      # a multiple of vec too: C is one
        owner = torch.repeat_interleave(torch.arange(len(table), dtype=torch.int32), torch.tensor(counts))
        return dict(idx=idx + idx[:1] * (SLOTS - len(idx)), grid=(first,), table=self._up(torch.tensor(table)),
                    owner=self._up(owner), dtype=dtype, size=snap, vec=vec, RB=rb, CB=cb)

    def _up(self, t: torch.Tensor) -> torch.Tensor:
        """A kept plan's table on the device: one trip, without a wait."""
        return t.to(self.device) if INTERPRET else t.pin_memory().to(self.device, non_blocking=True)

    def copy(self, views: list) -> list:
        """Queue the snapshot of every input: one buffer per launch."""
        snaps = []
        for g in self.launches:
            snap = torch.empty(g["size"], dtype=g["dtype"], device=self.device)
            self._run(g, views, snap, g["table"], False)       # no flags: the table stands in for them
            snaps.append(snap)
        return snaps

    def check(self, views: list, snaps: list, flags: torch.Tensor):
        """Queue the comparison: flags[input's flag index] set to 1 for each input whose bits differ."""
        for g, snap in zip(self.launches, snaps):
            self._run(g, views, snap, flags, True)

    def _run(self, g: dict, views: list, snap, flags, check: bool):
        tensors = [views[i] for i in g["idx"]]
        with on_device(self.device, INTERPRET):
            _launch(g["grid"], (*tensors, snap, g["table"], flags, g["owner"]), (),
                    dict(CHECK=check, VEC=g["vec"], RB=g["RB"], CB=g["CB"], num_warps=4))


def _tile(C: int) -> tuple:
    """(rows, elements) of a launch's tile for rows of at most C elements: TILE elements, as many rows as fit. One
    tile for all of a launch's inputs: the short rows of B and C share a launch with x's long ones (a launch costs
    ~20 us of host time; 2 x 512 programs of 16 elements each cost the GPU a few)."""
    cb = min(TILE, next_pow2(C))
    return TILE // cb, cb


def _vec(v: torch.Tensor, lay) -> int:
    """Elements per 16 bytes if v's address, row stride and row length are multiples of them, else 1."""
    vec = 16 // v.element_size()
    rows, srow, C = lay
    ok = v.data_ptr() % 16 == 0 and C % vec == 0 and (rows == 1 or srow % vec == 0)
    return vec if ok else 1
