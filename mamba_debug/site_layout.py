"""How the metric kernels (`_site_metrics.py`) see a site's rows: the layout of a row in memory, how rows are cut
into programs, steps and pieces, and what alignment the compiler may be told. Plain Python, no Triton: the exec'd
kernel file imports it, and the tests and benchmarks read the cuts through it."""
import functools

import torch

from mamba_debug.triton_launch import cdiv, next_pow2


def row_layout(t: torch.Tensor):
    """How the trailing dims of t [S, T, ...] flatten into X per row, without a copy when possible.

    Returns (t, X2, sx1, sx2, two): flat index x is at x * sx1 (one strided run), or at (x // X2) * sx1 +
    (x % X2) * sx2 (two runs, e.g. transposed trailing dims). Size-1 dims are dropped and adjacent dims that
    continue each other's strides are merged first."""
    layout = _layout(t.shape[2:], t.stride()[2:])
    # Three or more separate strided runs (e.g. a permuted 5-D view): the kernel walks at most two, so this view
    # is copied once. No site of the engine is such a view.
    return (t, *layout) if layout is not None else row_layout(t.contiguous())


@functools.lru_cache(maxsize=4096)
def _layout(shape: tuple, strides: tuple):
    """row_layout's (X2, sx1, sx2, two) of trailing dims, None for three or more runs (cached: every site of a
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
    GPU (sms: the device's SM count): steps of 512 elements over 4 warps (4 per thread: 16-byte loads of float32,
    64 registers on sm_90), short rows packed several per program. Rows are cut into pieces of whole steps, combined
    in order by a second kernel, when there are too few programs to keep every SM busy: the per-token states of a
    ubatch of 512 (3 pieces per row, 1536 programs instead of 512, about 1.3 waves of resident programs otherwise),
    and rows fewer than the SMs, such as a state taken at the end of a ubatch (S rows of 81920), in pieces of 1024
    elements. The combine kernel walks a row's pieces one after another, so one-step pieces (160 for such a state)
    made that walk the longest program of a 2.8B layer's measurement: 281-283 us a layer on an H100, 252-255 with
    pieces of 1024 (80). Steps of 1024 over 4 or 8 warps, of 2048, and loads issued two or four steps ahead of
    their arithmetic were no faster (benchmarks/README.md, twenty-seventh session)."""
    bx = next_pow2(max(X, 1))
    if not sms:
        block_x = min(bx, 2 ** 14)
        rows = max(1, min(next_pow2(R), 2 ** 16 // block_x))
        return dict(BLOCK_X=block_x, ROWS=rows, SPLIT=1, num_warps=1)
    block_x = min(bx, 512)
    rows = max(1, min(next_pow2(R), 512 // block_x))
    programs = cdiv(R, rows)
    split = 1
    if programs < 8 * sms:
        # fewer rows than SMs: pieces of 1024 elements at least (the combine kernel walks a row's pieces in order);
        # enough programs already: long pieces only
        min_piece = 1024 if programs < sms else 16 * block_x
        split = max(1, min(cdiv(X, min_piece), cdiv(8 * sms, programs)))
    return dict(BLOCK_X=block_x, ROWS=rows, SPLIT=split, num_warps=max(1, min(8, rows * block_x // 128)))


def vec(t: torch.Tensor, lay: tuple, X: int) -> int:
    """_offsets' VEC of t's rows of X elements: 0 unless one run of unit stride; else the elements of 16 bytes when
    X and every row's start are multiples of them (the strides say so; the pointer's own alignment is Triton's to
    check, in its specialization), else 1."""
    if lay[3] or lay[1] != 1:
        return 0
    v = 16 // t.element_size()
    return v if X % v == 0 and all(st % v == 0 for n, st in zip(t.shape[:2], t.stride()[:2]) if n > 1) else 1
