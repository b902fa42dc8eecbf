"""The interpreter's schedules of kernels/triton.py's `ssm_conv` and `ssm_scan`, and the softplus both files use.

Not a plug-in (the leading underscore keeps it off the list): kernels/triton.py executes it and its launchers pick
these kernels where `_conv_config` / `scan_plan` say so, that is under Triton's interpreter only. There every tl
operation costs 20-200 us of Python (Triton's semantic layer: type checks, broadcasts, casts) whatever its block
size, so these kernels are written for the fewest operations: one program for many sequences and channels, 64-bit
indices (an int32 product or sum costs an overflow check of its own), shapes broadcast from the start rather than
expanded later. Each output element is the same arithmetic, in the same order, as in triton.py's kernels, so every
schedule gives the same bits on the CPU (numpy sums a contiguous last axis pairwise, another axis in order: the
sums here reduce the axes the other kernels reduce, over arrays of the same layout). They compile for a GPU too
(tests/test_kernels_compile.py), but no GPU plan uses them.
"""
import os

import triton
import triton.language as tl

from mamba_debug.triton_launch import helper_jit

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_device_function = helper_jit(INTERPRET)     # plain functions under the interpreter (see triton_launch)

SOFTPLUS_THRESHOLD = tl.constexpr(20.0)   # as mamba_debug.ops and llama.cpp: softplus(dt) = dt above it
LOG2E = tl.constexpr(1.4426950408889634)


@_device_function
def _softplus(dt):
    """log(1 + exp(dt)), and dt itself above the threshold, in fp32.

    tl has no log1p, and log(1 + u) loses the low bits of small u = exp(dt) (dt around -4 is common). With
    w = fl(1 + u) = 1 + u + e, log(1 + u) = log(w) - e/w to first order, and e = (w - 1) - u exactly (w - 1 is
    exact for w in [1, 2]): within 6 ulps of float64's softplus over dt in [-30, 25], like torch's."""
    u = tl.exp(tl.minimum(dt, SOFTPLUS_THRESHOLD))
    w = 1.0 + u
    return tl.where(dt > SOFTPLUS_THRESHOLD, dt, tl.log(w) - ((w - 1.0) - u) / w)


def scan_one_token_layout(block_d: int, block_n: int, state, x, dt, A, B, C, y, new_state, states_out) -> dict:
    """The one-token scan's layout constexprs, from the host: EVEN_D, EVEN_N (the blocks fit: no masks on that axis),
    DENSE (unit last strides for the [.., D] and [.., N] operands, (N, 1) for the [.., D, N] ones: one offset
    tile shared by all) and ONE_SEQ (one sequence: no sequence offsets)."""
    D, N = A.shape
    tiles = (state, A, new_state) + ((states_out,) if states_out is not None else ())
    dense = all(t.stride(-1) == 1 for t in (x, dt, y, B, C)) and all(t.stride()[-2:] == (N, 1) for t in tiles)
    return dict(EVEN_D=D == block_d, EVEN_N=N == block_n, DENSE=dense, ONE_SEQ=x.shape[0] == 1)


def conv_one_token_layout(block_s: int, block_d: int, state, x, new_state) -> dict:
    """The one-token conv's layout constexprs, from the host: EVEN (the blocks fit), ONE_SEQ (one sequence: no
    sequence offsets, no sequence mask) and SAME_STATE (new_state's window-row and channel strides are state's:
    one offset tile for both; each keeps its own sequence stride)."""
    S, _, D = x.shape
    one = S == 1
    return dict(EVEN=D == block_d and (one or S % block_s == 0), ONE_SEQ=one,
                SAME_STATE=state.stride()[1:] == new_state.stride()[1:])


@_device_function
def _load(ptr, mask):
    """tl.load, masked (fill 0) only where a block overhangs its tensor (mask None: it does not): under the
    interpreter each mask and fill value is an operation of its own (the fill a splat to the block's shape)."""
    if mask is None:
        v = tl.load(ptr)
    else:
        v = tl.load(ptr, mask=mask, other=0.0)
    return v


@_device_function
def _store(ptr, value, mask):
    if mask is None:
        tl.store(ptr, value)
    else:
        tl.store(ptr, value, mask=mask)


@_device_function
def _row(ptr, s, stride):
    """The start of sequence s: ptr + s * stride, or ptr itself for s None (ONE_SEQ: nothing to add)."""
    if s is None:
        r = ptr
    else:
        r = ptr + s * stride
    return r


@triton.jit
def _ssm_conv_one_token_kernel(
    state_ptr, x_ptr, w_ptr, out_ptr, new_state_ptr,
    S, D,
    stride_state_s, stride_state_t, stride_state_d,
    stride_x_s, stride_x_d,                 # x's token stride is not needed: one token
    stride_w_d, stride_w_k,
    stride_out_s, stride_out_d,
    stride_new_s, stride_new_t, stride_new_d,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN: tl.constexpr,                     # the blocks fit: S a multiple of BLOCK_S, D == BLOCK_D (no s, d masks)
    ONE_SEQ: tl.constexpr,                  # S == 1: no sequence offsets (BLOCK_S is then ignored)
    SAME_STATE: tl.constexpr,               # new_state has state's strides: its offsets are state's, one row up
):
    # One token per sequence (decode): the window is the K-1 state rows, then x. A program holds BLOCK_S sequences
    # x BLOCK_K taps x BLOCK_D channels. The taps past K are 0 (from the state load), as in _ssm_conv_kernel.
    if ONE_SEQ:
        s = None
    else:
        s = (tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S))[:, None, None]
    k = tl.arange(0, BLOCK_K).to(tl.int64)[None, :, None]
    d = tl.arange(0, BLOCK_D).to(tl.int64)[None, None, :]
    in_state = k < K - 1
    mask_k = k < K
    if EVEN:
        ok = None
        state_mask = in_state
        new_mask = (k >= 1) & mask_k
        if K == BLOCK_K:                    # no tap past K: the weights need no mask
            w_mask = None
        else:
            w_mask = mask_k
    else:
        mask_d = d < D
        if ONE_SEQ:
            ok = mask_d                                                                     # [1, 1, BD]
        else:
            ok = (s < S) & mask_d                                                           # [BS, 1, BD]
        state_mask = ok & in_state
        new_mask = ok & (k >= 1) & mask_k
        w_mask = mask_k & mask_d
    o_state = k * stride_state_t + d * stride_state_d                                       # [1, BK, BD]
    if SAME_STATE:                          # row k - 1 of the new state: row k's offsets, one row up
        o_new = o_state - stride_state_t
    else:
        o_new = (k - 1) * stride_new_t + d * stride_new_d
    window = tl.where(k == K - 1,                                                           # [BS, BK, BD]
                      _load(_row(x_ptr, s, stride_x_s) + d * stride_x_d, ok),
                      tl.load(_row(state_ptr, s, stride_state_s) + o_state, mask=state_mask, other=0.0))
    w = _load(w_ptr + k * stride_w_k + d * stride_w_d, w_mask).to(tl.float32)
    acc = tl.reduce(window.to(tl.float32) * w, 1, tl.standard._sum_combine, keep_dims=True)   # tl.sum, see triton.py
    _store(_row(out_ptr, s, stride_out_s) + d * stride_out_d, acc.to(out_ptr.dtype.element_ty), ok)
    # the new state is window rows 1..K-1: the window itself, one row up
    tl.store(_row(new_state_ptr, s, stride_new_s) + o_new, window.to(new_state_ptr.dtype.element_ty), mask=new_mask)


@triton.jit
def _ssm_scan_one_token_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, y_ptr, new_state_ptr, states_out_ptr,
    S, D, N,
    stride_state_s, stride_state_d, stride_state_n,
    stride_x_s, stride_x_d,                 # no token strides: one token
    stride_dt_s, stride_dt_d,
    stride_A_d, stride_A_n,
    stride_B_s, stride_B_n,
    stride_C_s, stride_C_n,
    stride_y_s, stride_y_d,
    stride_new_s, stride_new_d, stride_new_n,
    stride_so_s, stride_so_d, stride_so_n,
    HAS_STATES_OUT: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_N: tl.constexpr,     # D == BLOCK_D, N == BLOCK_N: no mask on that axis
    DENSE: tl.constexpr,        # unit d strides (x, dt, y), unit n strides (B, C), (N, 1) for every [D, N] operand
    ONE_SEQ: tl.constexpr,      # S == 1: no sequence offsets
):
    # One token per sequence (decode): one step of _ssm_scan_kernel without its loop, one program per sequence
    # (a block of sequences as a third dimension costs more in broadcasts than it saves in programs).
    if ONE_SEQ:
        s = None
    else:
        s = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    d = offs_d[:, None]
    n = offs_n[None, :]
    if EVEN_D:
        mask_d = None
    else:
        mask_d = offs_d < D
    if EVEN_N:
        mask_n = None
    else:
        mask_n = offs_n < N
    if EVEN_D:                              # [BLOCK_D, BLOCK_N] tiles: tl.load broadcasts a mask to the pointers
        if EVEN_N:
            mask = None
        else:
            mask = mask_n[None, :]
    elif EVEN_N:
        mask = mask_d[:, None]
    else:
        mask = mask_d[:, None] & mask_n[None, :]
    if DENSE:                               # the usual layouts: the offsets within a sequence are shared
        o_state = d * N + n
        o_A, o_new, o_so = o_state, o_state, o_state
        o_x, o_dt, o_y = offs_d, offs_d, offs_d
        o_B, o_C = offs_n, offs_n
    else:
        o_state = d * stride_state_d + n * stride_state_n
        o_A = d * stride_A_d + n * stride_A_n
        o_new = d * stride_new_d + n * stride_new_n
        o_so = d * stride_so_d + n * stride_so_n
        o_x, o_dt, o_y = offs_d * stride_x_d, offs_d * stride_dt_d, offs_d * stride_y_d
        o_B, o_C = offs_n * stride_B_n, offs_n * stride_C_n
    h = _load(_row(state_ptr, s, stride_state_s) + o_state, mask).to(tl.float32)
    A = _load(A_ptr + o_A, mask).to(tl.float32) * LOG2E
    x = _load(_row(x_ptr, s, stride_x_s) + o_x, mask_d).to(tl.float32)
    dt = _load(_row(dt_ptr, s, stride_dt_s) + o_dt, mask_d).to(tl.float32)
    B = _load(_row(B_ptr, s, stride_B_s) + o_B, mask_n).to(tl.float32)
    C = _load(_row(C_ptr, s, stride_C_s) + o_C, mask_n).to(tl.float32)
    delta = _softplus(dt)
    h = tl.exp2(delta[:, None] * A) * h + B[None, :] * (delta * x)[:, None]
    y = tl.reduce(h * C[None, :], 1, tl.standard._sum_combine)                 # tl.sum, see triton.py
    _store(_row(y_ptr, s, stride_y_s) + o_y, y.to(y_ptr.dtype.element_ty), mask_d)
    _store(_row(new_state_ptr, s, stride_new_s) + o_new, h.to(new_state_ptr.dtype.element_ty), mask)
    if HAS_STATES_OUT:
        _store(_row(states_out_ptr, s, stride_so_s) + o_so, h.to(states_out_ptr.dtype.element_ty), mask)


@triton.jit
def _ssm_scan_tiled_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, y_ptr, new_state_ptr, states_out_ptr,
    hs_ptr,                                 # scratch: [S, cdiv(D, BLOCK_D), TILE_T, BLOCK_D, BLOCK_N] fp32
    T, D, N,
    stride_state_s, stride_state_d, stride_state_n,
    stride_x_s, stride_x_t, stride_x_d,
    stride_dt_s, stride_dt_t, stride_dt_d,
    stride_A_d, stride_A_n,
    stride_B_s, stride_B_t, stride_B_n,
    stride_C_s, stride_C_t, stride_C_n,
    stride_y_s, stride_y_t, stride_y_d,
    stride_new_s, stride_new_d, stride_new_n,
    stride_so_s, stride_so_t, stride_so_d, stride_so_n,
    HAS_STATES_OUT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILE_T: tl.constexpr,           # tokens whose inputs are loaded and prepared together
    STEPS: tl.constexpr,            # steps walked per tile: T when one tile holds the prompt, else TILE_T
):
    # A prompt: the recurrence of _ssm_scan_kernel, with the work that does not depend on h (loads, softplus, the
    # decays exp(delta*A), the inputs delta*B*x, y = h.C, the stores) done for TILE_T tokens at once, as
    # [TILE_T, BLOCK_D, BLOCK_N] tiles. The step over the tile's tokens keeps only h = decay_t * h + input_t: row t
    # of the tiles comes out by a gather, and h_t goes to the program's scratch, read back as one tile for y and
    # states_out. Rows past T are the identity step (decay 1, input -0.0: h unchanged, bit for bit), so the step
    # loop has a constant length, STEPS: a prompt within one tile walks its T rows only (the scratch rows past them
    # are zeros from the host, read and masked off). No GPU plan uses this schedule (the scratch round trip and
    # TILE_T x the work per token); the tests also run it compiled, hence the barriers around the scratch.
    pid_s = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    dl = tl.arange(0, BLOCK_D).to(tl.int64)[None, :, None]                  # channel in the block
    d = dl + pid_d.to(tl.int64) * BLOCK_D
    n = tl.arange(0, BLOCK_N).to(tl.int64)[None, None, :]
    r = tl.arange(0, TILE_T).to(tl.int64)[:, None, None]                    # token in the tile
    mask_d = d < D
    mask_dn = mask_d & (n < N)
    h = tl.load(state_ptr + pid_s * stride_state_s + d * stride_state_d + n * stride_state_n,
                mask=mask_dn, other=0.0).to(tl.float32)                      # [1, BLOCK_D, BLOCK_N]
    A = tl.load(A_ptr + d * stride_A_d + n * stride_A_n, mask=mask_dn, other=0.0).to(tl.float32) * LOG2E
    hs_row = hs_ptr + (pid_s * tl.num_programs(1) + pid_d) * (TILE_T * BLOCK_D * BLOCK_N) + dl * BLOCK_N + n
    hs_tile = hs_row + r * (BLOCK_D * BLOCK_N)
    # one row of the scratch on: a tile, so that each step's pointer moves by one operation (a scalar offset is a
    # splat and an add under the interpreter)
    hs_next = tl.full([1, BLOCK_D, BLOCK_N], BLOCK_D * BLOCK_N, tl.int64)

    t0 = 0
    while t0 < T:
        rows = t0 + r
        valid = rows < T                                                     # [TILE_T, 1, 1]
        mask_td = valid & mask_d
        mask_tn = valid & (n < N)
        x = tl.load(x_ptr + pid_s * stride_x_s + rows * stride_x_t + d * stride_x_d,
                    mask=mask_td, other=0.0).to(tl.float32)                  # [TILE_T, BLOCK_D, 1]
        dt = tl.load(dt_ptr + pid_s * stride_dt_s + rows * stride_dt_t + d * stride_dt_d,
                     mask=mask_td, other=0.0).to(tl.float32)
        Bt = tl.load(B_ptr + pid_s * stride_B_s + rows * stride_B_t + n * stride_B_n,
                     mask=mask_tn, other=0.0).to(tl.float32)                 # [TILE_T, 1, BLOCK_N]
        Ct = tl.load(C_ptr + pid_s * stride_C_s + rows * stride_C_t + n * stride_C_n,
                     mask=mask_tn, other=0.0).to(tl.float32)
        delta = _softplus(dt)
        decays = tl.where(valid, tl.exp2(delta * A), 1.0)                   # [TILE_T, BLOCK_D, BLOCK_N]
        inputs = tl.where(valid, Bt * (delta * x), -0.0)
        hs_j = hs_row
        for j in tl.static_range(STEPS):
            pick = tl.full([1, BLOCK_D, BLOCK_N], j, tl.int64)
            h = tl.gather(decays, pick, 0) * h + tl.gather(inputs, pick, 0)
            tl.store(hs_j, h)
            hs_j += hs_next
        tl.debug_barrier()      # compiled, other threads wrote parts of the tile (a no-op under the interpreter)
        hs = tl.load(hs_tile)                                                # every h_t of the tile
        tl.debug_barrier()      # ... and the next tile's steps must not overwrite it before every thread has read it
        y = tl.reduce(hs * Ct, 2, tl.standard._sum_combine, keep_dims=True)  # [TILE_T, BLOCK_D, 1]
        tl.store(y_ptr + pid_s * stride_y_s + rows * stride_y_t + d * stride_y_d,
                 y.to(y_ptr.dtype.element_ty), mask=mask_td)
        if HAS_STATES_OUT:
            tl.store(states_out_ptr + pid_s * stride_so_s + rows * stride_so_t + d * stride_so_d + n * stride_so_n,
                     hs.to(states_out_ptr.dtype.element_ty), mask=mask_td & mask_tn)
        t0 += TILE_T

    tl.store(new_state_ptr + pid_s * stride_new_s + d * stride_new_d + n * stride_new_n,
             h.to(new_state_ptr.dtype.element_ty), mask=mask_dn)
