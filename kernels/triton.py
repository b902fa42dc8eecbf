"""Triton kernels for Mamba-1's `ssm_conv` and `ssm_scan`: the default device plug-in.

The same file runs compiled on a GPU (`device="cuda"`) and, where there is none, under Triton's interpreter on
CPU tensors (`TRITON_INTERPRET=1`, set by `mamba_debug.plugins` before it executes this file). Every pointer,
stride and mask is therefore exercised on a laptop and in CI. What differs is how the work is cut (`_conv_config`,
`scan_plan`): the scan has a GPU schedule (token steps, time chunks on a long prompt) and interpreter schedules
(token tiles, one-token forms of both ops: fewest operations, in _triton_interpret.py beside this file), and the
tests run every schedule wherever they run.

Contract (DESIGN.md "Op plug-ins"); the plain-torch reference is `mamba_debug.ops`:

    ssm_conv(conv_state[S,K-1,D], x[S,T,D], weight[D,K]) -> (out[S,T,D], new_conv_state[S,K-1,D])
    ssm_scan(ssm_state[S,D,N], x[S,T,D], dt[S,T,D], A[D,N], B[S,T,N], C[S,T,N], *, states_out=None)
        -> (y[S,T,D], new_ssm_state[S,D,N])

Rules every kernel here follows, because each one is a bug seen in a real port (research/seed-semantics.md §8):
* inputs may be non-contiguous views (x and z are halves of one projection, B and C slices of another), so
  every stride goes to the kernel and nothing is made `.contiguous()` behind the caller's back (#6758);
* strides are in elements, never bytes, and sequence offsets are 64-bit (the bytes-vs-elements bug);
* inputs are never written; outputs are fresh contiguous tensors of the input dtype, computed in fp32;
* the state is read at the start of the call and written at its end, so splitting a prompt into ubatches
  and carrying the state gives the same result as one call.
"""
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from mamba_debug.triton_launch import (Launch, cdiv as _cdiv, check as _check, check_device, helper_jit,
                                       next_pow2 as _pow2)
from mamba_debug.triton_env import exec_file

NAME = "triton"
DESCRIPTION = "Triton ssm_conv and ssm_scan, and Mamba-2's ssd_scan and rms_norm_gated (the default device kernels)"
SUPPORTS_STATES_OUT = True

# Decided once, when the plug-in loader executes this file: `triton.jit` below then builds interpreted or
# compiled kernels, and the launchers pick block sizes and check tensor devices to match.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Triton decides interpreted-or-compiled for its own library (tl.sum, ... are jit functions) at its first import in
# a process. The kernels below use only builtins (and tl.reduce with triton's sum combine, which the interpreter
# never calls), so they run interpreted either way; compiling needs the library compiled: say so plainly.
if INTERPRET:
    # The first launch imports triton.experimental.gluon, which asserts that TRITON_INTERPRET is still set if
    # triton's library was built interpreted; the loader unsets it after executing this file, so import it now.
    import triton.experimental.gluon  # noqa: F401
elif not isinstance(tl.standard._sum_combine, triton.runtime.JITFunction):
    raise ImportError("triton was first imported with TRITON_INTERPRET=1 in this process, so its library is "
                      "interpreted and cannot be compiled for cuda; run the cuda kernels in another process")

_device_function = helper_jit(INTERPRET)     # the helpers below: plain functions under the interpreter

# The interpreter's schedules live beside this file (executed, not imported: see mamba_debug.triton_env), with the
# softplus every schedule shares, so that they compute each element alike.
_schedules = exec_file(Path(__file__).with_name("_triton_interpret.py"), f"{__name__}_interpret_schedules")
_softplus, LOG2E = _schedules._softplus, _schedules.LOG2E
NEG_INF = tl.constexpr(float("-inf"))

# %%
# Compute kernels
# ---------------
# Layout is token-major, as the projections produce it: for a fixed token, the D channels are (usually)
# adjacent, so each program owns a block of channels of one sequence and loads them in one go.

@triton.jit
def _ssm_conv_kernel(
    state_ptr, x_ptr, w_ptr,    # conv_state [S, K-1, D], x [S, T, D], weight [D, K] (read only)
    out_ptr, new_state_ptr,     # out [S, T, D], new conv state [S, K-1, D]
    T, D,                       # sizes
    # strides, in elements: how far the pointer moves for +1 along each dim
    stride_state_s, stride_state_t, stride_state_d,
    stride_x_s, stride_x_t, stride_x_d,
    stride_w_d, stride_w_k,
    stride_out_s, stride_out_t, stride_out_d,
    stride_new_s, stride_new_t, stride_new_d,
    # meta-parameters
    K: tl.constexpr,            # kernel width (d_conv)
    BLOCK_KM1: tl.constexpr,    # K-1 rounded up to a power of two (tl.arange needs one)
    BLOCK_K: tl.constexpr,      # K rounded up to a power of two
    BLOCK_T: tl.constexpr,      # tokens per program
    BLOCK_D: tl.constexpr,      # channels per program
):
    # One program: one sequence, BLOCK_T tokens x BLOCK_D channels. Outputs of different tokens do not depend on
    # each other (the window holds inputs only), so tokens are tiled like channels, no loop over time.
    pid_s = tl.program_id(0).to(tl.int64)   # 64-bit: S * stride can pass 2**31 elements
    pid_d = tl.program_id(1).to(tl.int64)
    pid_t = tl.program_id(2).to(tl.int64)
    # Offsets are 64-bit from the start: no index product can overflow, and Triton's interpreter then skips its
    # per-operation int32 overflow checks, which otherwise dominate the cost of a launch on the CPU.
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64) + pid_d * BLOCK_D
    offs_t = tl.arange(0, BLOCK_T).to(tl.int64) + pid_t * BLOCK_T
    mask_d = offs_d < D
    mask = (offs_t < T)[:, None] & mask_d[None, :]
    state_base = state_ptr + pid_s * stride_state_s
    x_base = x_ptr + pid_s * stride_x_s

    # out[t] = sum_k w[k] * window[t + k]: the K taps are a third block dimension, so the window is read
    # with one pair of loads (fewer, larger operations: also what keeps the interpreter fast).
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    mask_k = offs_k < K
    w = tl.load(w_ptr + offs_k[:, None] * stride_w_k + offs_d[None, :] * stride_w_d,
                mask=mask_k[:, None] & mask_d[None, :], other=0.0).to(tl.float32)          # [BLOCK_K, BLOCK_D]
    rows = offs_t[:, None] + offs_k[None, :]                                                # [BLOCK_T, BLOCK_K]
    in_state = (rows < K - 1)[:, :, None]
    mask3 = mask[:, None, :] & mask_k[None, :, None]
    from_state = tl.load(state_base + rows[:, :, None] * stride_state_t + offs_d[None, None, :] * stride_state_d,
                         mask=mask3 & in_state, other=0.0)
    from_x = tl.load(x_base + (rows - (K - 1))[:, :, None] * stride_x_t + offs_d[None, None, :] * stride_x_d,
                     mask=mask3 & ~in_state, other=0.0)
    window = tl.where(in_state, from_state, from_x).to(tl.float32)                          # [T, K, D]
    acc = tl.reduce(window * w[None, :, :], 1, tl.standard._sum_combine)   # tl.sum(.., axis=1), see top
    out_ptrs = out_ptr + pid_s * stride_out_s + offs_t[:, None] * stride_out_t + offs_d[None, :] * stride_out_d
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)

    # New state = the last K-1 window rows, i.e. rows T .. T+K-2. When T < K-1 some of them are old state rows.
    # The first token tile of each channel block writes it (once).
    if pid_t == 0:
        offs_r = tl.arange(0, BLOCK_KM1).to(tl.int64)
        mask_r = (offs_r < K - 1)[:, None] & mask_d[None, :]
        tail_rows = T + offs_r[:, None]
        tail_in_state = tail_rows < K - 1
        tail_state = tl.load(state_base + tail_rows * stride_state_t + offs_d[None, :] * stride_state_d,
                             mask=mask_r & tail_in_state, other=0.0)
        tail_x = tl.load(x_base + (tail_rows - (K - 1)) * stride_x_t + offs_d[None, :] * stride_x_d,
                         mask=mask_r & ~tail_in_state, other=0.0)
        new_ptrs = (new_state_ptr + pid_s * stride_new_s
                    + offs_r[:, None] * stride_new_t + offs_d[None, :] * stride_new_d)
        tl.store(new_ptrs, tl.where(tail_in_state, tail_state, tail_x).to(new_state_ptr.dtype.element_ty), mask=mask_r)


@_device_function
def _col(v, TILES: tl.constexpr):
    """A per-channel value as a [BLOCK_D, 1] column (TILES: it is one already)."""
    return v if TILES else v[:, None]


@_device_function
def _row(v, TILES: tl.constexpr):
    """A per-state value as a [1, BLOCK_N] row (TILES: it is one already)."""
    return v if TILES else v[None, :]


@_device_function
def _tile(p, sn, m, N, BLOCK_N: tl.constexpr):
    """[BLOCK_D, BLOCK_N] fp32 of p + n * sn (p, m: [BLOCK_D, 1] row starts and mask), 0 past N."""
    offs_n = tl.arange(0, BLOCK_N)[None, :]
    return tl.load(p + offs_n * sn, mask=m & (offs_n < N), other=0.0).to(tl.float32)


@_device_function
def _summary(decay_ptr, end_ptr, rows, c, D, N, mask_rows, BLOCK_N: tl.constexpr):
    """Chunk c's decay product P_c and final state E_c (pass 1's summaries), [BLOCK_D, BLOCK_N] fp32."""
    return (_tile(decay_ptr + rows + c * D * N, 1, mask_rows, N, BLOCK_N),
            _tile(end_ptr + rows + c * D * N, 1, mask_rows, N, BLOCK_N))


@_device_function
def _token(x_p, dt_p, B_p, C_p, j, n_tok, stride_x_t, stride_dt_t, stride_B_t, stride_C_t, mask_d, mask_n,
           IS_DELTA: tl.constexpr):
    """Token j of the chunk as fp32: x, dt per channel (IS_DELTA: delta, stored by pass 1), B, C per state. Past the
    chunk dt is -inf (IS_DELTA: delta is 0), so delta is exactly 0 (decay 1, input 0): a step on it leaves h as it
    was, bit for bit, with no branch."""
    ok = j < n_tok      # tl.where, not `mask & ok`: the interpreter types block & scalar as int32
    mask_d = tl.where(ok, mask_d, False)
    mask_n = tl.where(ok, mask_n, False)
    x = tl.load(x_p + j * stride_x_t, mask=mask_d, other=0.0).to(tl.float32)
    dt = tl.load(dt_p + j * stride_dt_t, mask=mask_d, other=0.0 if IS_DELTA else NEG_INF).to(tl.float32)
    B = tl.load(B_p + j * stride_B_t, mask=mask_n, other=0.0).to(tl.float32)
    C = tl.load(C_p + j * stride_C_t, mask=mask_n, other=0.0).to(tl.float32)
    return x, dt, B, C


@_device_function
def _step(h, dsum, A, x, dt, B, C, y_p, so_p, dl_p, j, n_tok, stride_y_t, stride_so_t, mask_d, mask_dn,
          SUMMARY: tl.constexpr, HAS_STATES_OUT: tl.constexpr, TILES: tl.constexpr, DELTA: tl.constexpr):
    """One token: h = exp(delta*A)*h + B*(delta*x), as llama.cpp's ssm_scan (x*delta first; A holds A*log2 e);
    then y (or, in pass 1, the sum of the deltas, and with DELTA the delta itself at dl_p) and h into states_out.
    With DELTA pass 2's dt is already delta."""
    delta = dt if DELTA and not SUMMARY else _softplus(dt)
    decay_t = tl.exp2(_col(delta, TILES) * A)
    h = decay_t * h + _row(B, TILES) * _col(delta * x, TILES)
    if SUMMARY:
        dsum = dsum + delta       # the chunk's decay product is exp(A * sum delta): one exp, at its end
        if DELTA:
            tl.store(dl_p + j * stride_y_t, delta, mask=tl.where(j < n_tok, mask_d, False))
    else:
        ok = j < n_tok
        y = tl.reduce(h * _row(C, TILES), 1, tl.standard._sum_combine, keep_dims=TILES)   # tl.sum, see top
        tl.store(y_p + j * stride_y_t, y.to(y_p.dtype.element_ty), mask=tl.where(ok, mask_d, False))
        if HAS_STATES_OUT:
            tl.store(so_p + j * stride_so_t, h.to(so_p.dtype.element_ty), mask=tl.where(ok, mask_dn, False))
    return h, dsum


@triton.jit
def _ssm_scan_kernel(
    state_ptr, x_ptr, dt_ptr,   # ssm_state [S, D, N], x [S, T, D], dt [S, T, D] before softplus (read only)
    A_ptr, B_ptr, C_ptr,        # A [D, N], B [S, T, N], C [S, T, N] (read only)
    y_ptr, new_state_ptr,       # y [S, T, D], new ssm state [S, D, N]
    states_out_ptr,     # every h_t [S, T, D, N]; not touched unless HAS_STATES_OUT
    end_ptr,            # chunk summaries [S, N_CHUNKS, D, N], fp32 contiguous: the chunk's final state from h = 0
    decay_ptr,          # ... and the product of its decays, exp(A * sum of delta); unused when N_CHUNKS == 1
    delta_ptr,          # DELTA: softplus(dt) [S, T, D] fp32 with y's strides, written by pass 1, read by pass 2
    T, D, N, CHUNK_T, N_CHUNKS,     # sizes
    # strides, in elements
    stride_state_s, stride_state_d, stride_state_n,
    stride_x_s, stride_x_t, stride_x_d,
    stride_dt_s, stride_dt_t, stride_dt_d,
    stride_A_d, stride_A_n,
    stride_B_s, stride_B_t, stride_B_n,
    stride_C_s, stride_C_t, stride_C_n,
    stride_y_s, stride_y_t, stride_y_d,
    stride_new_s, stride_new_d, stride_new_n,
    stride_so_s, stride_so_t, stride_so_d, stride_so_n,
    # meta-parameters
    SUMMARY: tl.constexpr,          # pass 1 of a chunked scan: write the chunk summaries, no y
    SLOTS: tl.constexpr,            # 1, 4 or 8 tokens in flight (loaded SLOTS tokens before their step)
    TILES: tl.constexpr,            # per-channel and per-state values as [BLOCK_D, 1] and [1, BLOCK_N] tiles
    CHUNKED: tl.constexpr,          # N_CHUNKS > 1
    HAS_STATES_OUT: tl.constexpr,   # write every h_t into states_out
    DELTA: tl.constexpr,            # chunked: pass 1 runs every chunk and stores delta; pass 2 reads it (no softplus)
    REVERSE: tl.constexpr,          # pass 2 starts the last chunks (the longest carries) first
    CARRY2: tl.constexpr,           # the carry loads two chunks' summaries before combining them
    BLOCK_D: tl.constexpr,          # channels per program
    BLOCK_N: tl.constexpr,          # N rounded up to a power of two; padded lanes stay exactly 0
):
    # The GPU schedule. One program: one sequence, BLOCK_D channels, all N states, one chunk of CHUNK_T tokens
    # walked in order with the state h [BLOCK_D, BLOCK_N] in registers; B_t and C_t are loaded once per program
    # and shared by its channels. With one chunk (N_CHUNKS == 1) this is the whole scan in one pass.
    #
    # Chunked over time (N_CHUNKS > 1, when S * D alone gives too few programs to fill the GPU): pass 1
    # (SUMMARY) runs every chunk but the last from h = 0 and keeps its final state E_c and decay product P_c;
    # pass 2 starts chunk c from h_c = P_{c-1} h_{c-1} + E_{c-1} (h_0 = the old state), the same recurrence
    # applied chunk-wise, then walks the chunk again writing y. Each token's exp is computed twice, but the
    # chunks run in parallel instead of one after another.
    pid_s = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    pid_c = tl.program_id(2)
    if REVERSE and not SUMMARY:
        pid_c = N_CHUNKS - 1 - pid_c
    # TILES: per-channel values as [BLOCK_D, 1] tiles, per-state ones as [1, BLOCK_N]: Triton lays them out as the
    # state's rows and columns, with no exchange between lanes at each step (batch 8 on an H200: 844 us, 976 over
    # 1-D blocks), but converts the state tile in and out: not worth it for one token (batch 64: 13.6 us, 11.4).
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64) + pid_d * BLOCK_D    # 64-bit: see _ssm_conv_kernel
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    if TILES:
        offs_d = offs_d[:, None]
        offs_n = offs_n[None, :]
    mask_d = offs_d < D
    mask_n = offs_n < N
    rows, mask_rows = _col(offs_d, TILES), _col(mask_d, TILES)
    mask_dn = mask_rows & _row(mask_n, TILES)
    A = _tile(A_ptr + rows * stride_A_d, stride_A_n, mask_rows, N, BLOCK_N) * LOG2E
    dsum = offs_d.to(tl.float32) * 0.0      # pass 1: each channel's sum of delta
    if CHUNKED:
        summary_rows = (pid_s * N_CHUNKS) * D * N + rows * N
    if SUMMARY:
        h = A * 0.0
    else:
        h = _tile(state_ptr + pid_s * stride_state_s + rows * stride_state_d, stride_state_n, mask_rows, N, BLOCK_N)
        if CHUNKED:
            c = 0
            if CARRY2:                  # two chunks' loads in flight: the carry's loads do not depend on h
                while c + 1 < pid_c:
                    d0, e0 = _summary(decay_ptr, end_ptr, summary_rows, c, D, N, mask_rows, BLOCK_N)
                    d1, e1 = _summary(decay_ptr, end_ptr, summary_rows, c + 1, D, N, mask_rows, BLOCK_N)
                    h = d1 * (d0 * h + e0) + e1
                    c += 2
            while c < pid_c:            # carry the state over the chunks before this one
                d0, e0 = _summary(decay_ptr, end_ptr, summary_rows, c, D, N, mask_rows, BLOCK_N)
                h = d0 * h + e0
                c += 1

    t = 0                       # this program's tokens: [t, t + n_tok)
    n_tok = T
    if CHUNKED:
        t = pid_c * CHUNK_T
        n_tok = tl.minimum(T - t, CHUNK_T)
    x_p = x_ptr + pid_s * stride_x_s + offs_d * stride_x_d + t * stride_x_t
    dl_p = delta_ptr + pid_s * stride_y_s + offs_d * stride_y_d + t * stride_y_t
    dt_p = dt_ptr + pid_s * stride_dt_s + offs_d * stride_dt_d + t * stride_dt_t
    IS_DELTA: tl.constexpr = DELTA and not SUMMARY      # pass 2 of DELTA reads delta where it would read dt
    if IS_DELTA:
        dt_p, stride_dt_t = dl_p, stride_y_t
    B_p = B_ptr + pid_s * stride_B_s + offs_n * stride_B_n + t * stride_B_t
    C_p = C_ptr + pid_s * stride_C_s + offs_n * stride_C_n + t * stride_C_t
    y_p = y_ptr + pid_s * stride_y_s + offs_d * stride_y_d + t * stride_y_t
    out = (y_p, states_out_ptr + pid_s * stride_so_s + rows * stride_so_d + _row(offs_n, TILES) * stride_so_n
           + t * stride_so_t, dl_p)    # where y, states_out and (DELTA) delta get token 0
    strides_t = (stride_x_t, stride_dt_t, stride_B_t, stride_C_t)
    # SLOTS tokens in flight: the loop is unrolled SLOTS times, each slot read SLOTS steps after its load (a rotation
    # x0, x1 = x1, x_next waits on each load a step after issuing it: 1.1-1.5k clocks a step on an H200). `while`:
    # Triton 3.6's interpreter cannot take a runtime int as a range() bound under numpy >= 2.5.
    x0, dt0, B0, C0 = _token(x_p, dt_p, B_p, C_p, 0, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)
    if SLOTS >= 4:
        x1, dt1, B1, C1 = _token(x_p, dt_p, B_p, C_p, 1, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)
        x2, dt2, B2, C2 = _token(x_p, dt_p, B_p, C_p, 2, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)
        x3, dt3, B3, C3 = _token(x_p, dt_p, B_p, C_p, 3, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)
    if SLOTS == 8:
        x4, dt4, B4, C4 = _token(x_p, dt_p, B_p, C_p, 4, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)
        x5, dt5, B5, C5 = _token(x_p, dt_p, B_p, C_p, 5, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)
        x6, dt6, B6, C6 = _token(x_p, dt_p, B_p, C_p, 6, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)
        x7, dt7, B7, C7 = _token(x_p, dt_p, B_p, C_p, 7, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)
    i = 0
    while i < n_tok:
        h, dsum = _step(h, dsum, A, x0, dt0, B0, C0, *out, i, n_tok, stride_y_t, stride_so_t, mask_d, mask_dn,
                         SUMMARY, HAS_STATES_OUT, TILES, DELTA)
        x0, dt0, B0, C0 = _token(x_p, dt_p, B_p, C_p, i + SLOTS, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)
        if SLOTS >= 4:
            h, dsum = _step(h, dsum, A, x1, dt1, B1, C1, *out, i + 1, n_tok, stride_y_t, stride_so_t, mask_d,
                             mask_dn, SUMMARY, HAS_STATES_OUT, TILES, DELTA)
            x1, dt1, B1, C1 = _token(x_p, dt_p, B_p, C_p, i + SLOTS + 1, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)
            h, dsum = _step(h, dsum, A, x2, dt2, B2, C2, *out, i + 2, n_tok, stride_y_t, stride_so_t, mask_d,
                             mask_dn, SUMMARY, HAS_STATES_OUT, TILES, DELTA)
            x2, dt2, B2, C2 = _token(x_p, dt_p, B_p, C_p, i + SLOTS + 2, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)
            h, dsum = _step(h, dsum, A, x3, dt3, B3, C3, *out, i + 3, n_tok, stride_y_t, stride_so_t, mask_d,
                             mask_dn, SUMMARY, HAS_STATES_OUT, TILES, DELTA)
            x3, dt3, B3, C3 = _token(x_p, dt_p, B_p, C_p, i + SLOTS + 3, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)
        if SLOTS == 8:
            h, dsum = _step(h, dsum, A, x4, dt4, B4, C4, *out, i + 4, n_tok, stride_y_t, stride_so_t, mask_d,
                             mask_dn, SUMMARY, HAS_STATES_OUT, TILES, DELTA)
            x4, dt4, B4, C4 = _token(x_p, dt_p, B_p, C_p, i + SLOTS + 4, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)
            h, dsum = _step(h, dsum, A, x5, dt5, B5, C5, *out, i + 5, n_tok, stride_y_t, stride_so_t, mask_d,
                             mask_dn, SUMMARY, HAS_STATES_OUT, TILES, DELTA)
            x5, dt5, B5, C5 = _token(x_p, dt_p, B_p, C_p, i + SLOTS + 5, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)
            h, dsum = _step(h, dsum, A, x6, dt6, B6, C6, *out, i + 6, n_tok, stride_y_t, stride_so_t, mask_d,
                             mask_dn, SUMMARY, HAS_STATES_OUT, TILES, DELTA)
            x6, dt6, B6, C6 = _token(x_p, dt_p, B_p, C_p, i + SLOTS + 6, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)
            h, dsum = _step(h, dsum, A, x7, dt7, B7, C7, *out, i + 7, n_tok, stride_y_t, stride_so_t, mask_d,
                             mask_dn, SUMMARY, HAS_STATES_OUT, TILES, DELTA)
            x7, dt7, B7, C7 = _token(x_p, dt_p, B_p, C_p, i + SLOTS + 7, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)
        i += SLOTS

    if SUMMARY:
        summary = (pid_s * N_CHUNKS + pid_c) * D * N + rows * N + _row(offs_n, TILES)
        tl.store(end_ptr + summary, h, mask=mask_dn)
        tl.store(decay_ptr + summary, tl.exp2(_col(dsum, TILES) * A), mask=mask_dn)
    else:
        store_mask = mask_dn
        if CHUNKED:             # the new state is the last chunk's final state
            store_mask = tl.where(pid_c == N_CHUNKS - 1, mask_dn, False)
        tl.store(new_state_ptr + pid_s * stride_new_s + rows * stride_new_d + _row(offs_n, TILES) * stride_new_n,
                 h.to(new_state_ptr.dtype.element_ty), mask=store_mask)


# %%
# Launch parameters: kernels/_triton_plans.py (the one place that differs between the GPU and the interpreter)
_plans = exec_file(Path(__file__).with_name("_triton_plans.py"), f"{__name__}_plans")
_conv_config, scan_plan = _plans.conv_config, _plans.scan_plan


# %%
# Launchers
# ---------
# Triton's own per-call host work (binding ~50 arguments, its specialization key) done once per argument key.
_launch_conv, _launch_scan = Launch(_ssm_conv_kernel, INTERPRET), Launch(_ssm_scan_kernel, INTERPRET)
_launch_conv_one_token, _launch_scan_one_token, _launch_tiled = (Launch(k, INTERPRET) for k in (
    _schedules._ssm_conv_one_token_kernel, _schedules._ssm_scan_one_token_kernel, _schedules._ssm_scan_tiled_kernel))


def _empty(shape, like: torch.Tensor) -> torch.Tensor:
    """Every output is allocated here (a test fills them with NaN to prove each element gets written)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _check_device(op: str, **tensors):
    check_device(op, INTERPRET, **tensors)


def ssm_conv(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, *, config: dict | None = None):
    """Causal depthwise convolution of one ubatch; see the module docstring for shapes.

    config: block sizes and warps (see `_conv_config`, the default); benchmarks pass one to try others."""
    S, T, D = x.shape
    K = weight.shape[1]
    _check("ssm_conv", weight.dim() == 2 and weight.shape[0] == D and K >= 2, "weight must be [D, K] with K >= 2",
           x=x, weight=weight)
    _check("ssm_conv", tuple(conv_state.shape) == (S, K - 1, D), "conv_state must be [S, K-1, D]",
           conv_state=conv_state, x=x, weight=weight)
    _check_device("ssm_conv", conv_state=conv_state, x=x, weight=weight)

    out = _empty((S, T, D), x)
    new_state = _empty((S, K - 1, D), conv_state)
    if T == 0:                       # nothing to convolve; the state is unchanged
        new_state.copy_(conv_state)
        return out, new_state
    cfg = dict(config) if config is not None else _conv_config(S, T, D, device=x.device)
    if cfg.get("schedule") == "one_token":
        _launch_conv_one_token((_cdiv(S, cfg["BLOCK_S"]),), (conv_state, x, weight, out, new_state), (
            S, D, *conv_state.stride(), *_but_t(x), *weight.stride(), *_but_t(out), *new_state.stride()),
            dict(K=K, BLOCK_K=_pow2(K), BLOCK_S=cfg["BLOCK_S"], BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"],
                 **_schedules.conv_one_token_layout(cfg["BLOCK_S"], cfg["BLOCK_D"], conv_state, x, new_state)))
        return out, new_state
    grid = (S, _cdiv(D, cfg["BLOCK_D"]), _cdiv(T, cfg["BLOCK_T"]))
    _launch_conv(grid, (conv_state, x, weight, out, new_state),
                 (T, D, *conv_state.stride(), *x.stride(), *weight.stride(), *out.stride(), *new_state.stride()),
                 dict(K=K, BLOCK_KM1=_pow2(K - 1), BLOCK_K=_pow2(K),
                      BLOCK_T=cfg["BLOCK_T"], BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"]))
    return out, new_state


def ssm_scan(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor, *, states_out: torch.Tensor | None = None, plan: dict | None = None):
    """Selective scan of one ubatch; see the module docstring for shapes.

    plan: how to run it (see `scan_plan`, the default); tests and benchmarks pass one to force a schedule."""
    S, T, D = x.shape
    N = A.shape[-1]
    _check("ssm_scan", A.dim() == 2 and A.shape[0] == D, "A must be [D, N]", x=x, A=A)
    _check("ssm_scan", tuple(ssm_state.shape) == (S, D, N), "ssm_state must be [S, D, N]",
           ssm_state=ssm_state, x=x, A=A)
    _check("ssm_scan", dt.shape == x.shape, "dt must have the shape of x", x=x, dt=dt)
    _check("ssm_scan", tuple(B.shape) == (S, T, N) and tuple(C.shape) == (S, T, N), "B and C must be [S, T, N]",
           x=x, A=A, B=B, C=C)
    if states_out is not None:
        _check("ssm_scan", tuple(states_out.shape) == (S, T, D, N), "states_out must be [S, T, D, N]",
               x=x, A=A, states_out=states_out)
    _check_device("ssm_scan", ssm_state=ssm_state, x=x, dt=dt, A=A, B=B, C=C,
                  **({} if states_out is None else {"states_out": states_out}))

    y = _empty((S, T, D), x)
    new_state = _empty((S, D, N), ssm_state)
    if T == 0:
        new_state.copy_(ssm_state)
        return y, new_state
    plan = dict(plan) if plan is not None else scan_plan(S, T, D, N, device=x.device)
    # Without states_out the kernels still need a pointer argument; it is never dereferenced.
    so, so_strides = (states_out, states_out.stride()) if states_out is not None else (new_state, (0, 0, 0, 0))
    tensors = (ssm_state, x, dt, A, B, C, y, new_state, so)
    meta = dict(HAS_STATES_OUT=states_out is not None, BLOCK_D=plan["BLOCK_D"], BLOCK_N=_pow2(N),
                num_warps=plan["num_warps"])
    if plan["schedule"] == "one_token":
        _launch_scan_one_token((S,), tensors, (
            S, D, N, *ssm_state.stride(), *_but_t(x), *_but_t(dt), *A.stride(), *_but_t(B), *_but_t(C),
            *_but_t(y), *new_state.stride(), *_but_t(so_strides)),
            dict(meta, **_schedules.scan_one_token_layout(plan["BLOCK_D"], meta["BLOCK_N"], ssm_state, x, dt, A, B, C,
                                                           y, new_state, states_out)))
        return y, new_state
    strides = (*ssm_state.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(),
               *y.stride(), *new_state.stride(), *so_strides)
    n_blocks = _cdiv(D, plan["BLOCK_D"])
    if plan["schedule"] == "tiled":
        tile = plan["TILE_T"]       # scratch zeros: the rows a one-tile prompt does not reach are read, masked off
        hs = torch.zeros((S, n_blocks, tile, plan["BLOCK_D"], meta["BLOCK_N"]), dtype=torch.float32, device=x.device)
        _launch_tiled((S, n_blocks), (*tensors, hs), (T, D, N, *strides), dict(meta, TILE_T=tile, STEPS=min(T, tile)))
        return y, new_state
    _scan_steps(plan, S, T, D, N, tensors, strides, meta)
    return y, new_state


def _but_t(t) -> tuple:
    """The strides of a tensor (or a stride tuple) [S, T, ...] without the token's: for one-token kernels."""
    s = t.stride() if isinstance(t, torch.Tensor) else t
    return (s[0], *s[2:])


def _scan_steps(plan: dict, S: int, T: int, D: int, N: int, tensors: tuple, strides: tuple, meta: dict):
    """The step schedule: one pass, or time chunks (pass 1 the chunk summaries, pass 2 the carry and y).

    Chunked plans may also set DELTA (pass 1 hands each token's softplus to pass 2: 22% fewer instructions in pass 2's
    loop, pass 1 runs one chunk more and writes 4 bytes a channel and token), REVERSE (pass 2's longest carries are
    started first), CARRY2 (two chunks' summaries loaded at once), BLOCK_D_PASS1 and SLOTS_PASS1 (pass 1's block and
    tokens in flight); none changes a bit. The first four are off: timed on an H100 (2026-12-05), none faster than
    the plain plans. SLOTS_PASS1 8 is scan_plan's (1-12% faster, H100, 2026-12-06: scan_rows/tune.py lead)."""
    n_chunks = plan["n_chunks"]
    for key in ("SLOTS", "SLOTS_PASS1"):     # the step loop is written for these; another count would skip tokens
        _check("ssm_scan", plan.get(key, 1) in (1, 4, 8), f"a plan's {key} is 1, 4 or 8, not {plan.get(key)!r}")
    chunk_t = _cdiv(T, n_chunks)
    n_chunks = _cdiv(T, chunk_t)          # no empty chunk at the end
    y, new_state = tensors[6], tensors[7]
    delta = n_chunks > 1 and bool(plan.get("DELTA", False))
    # Scratch only where a pass reads it: the chunk summaries, and with DELTA softplus(dt) in fp32 with y's strides (y
    # is fresh and contiguous). Otherwise the kernel's pointers are never dereferenced and get new_state: no
    # allocation (a direct call pays for each, ~6 us of host time on the H200 machine).
    end, decay = (torch.empty((2, S, n_chunks, D, N), dtype=torch.float32, device=y.device) if n_chunks > 1
                  else (new_state, new_state))
    deltas = torch.empty(y.shape, dtype=torch.float32, device=y.device) if delta else new_state
    args = ((*tensors, end, decay, deltas), (T, D, N, chunk_t, n_chunks, *strides))
    meta = dict(meta, SLOTS=int(plan.get("SLOTS", 1)), TILES=bool(plan.get("TILES", True)), CHUNKED=n_chunks > 1,
                SUMMARY=True, DELTA=delta, REVERSE=bool(plan.get("REVERSE", False)),
                CARRY2=bool(plan.get("CARRY2", False)))
    if n_chunks > 1:    # pass 1: every chunk but the last, from h = 0 (DELTA: the last too, for its deltas)
        block_1 = int(plan.get("BLOCK_D_PASS1", plan["BLOCK_D"]))    # summaries and deltas are per channel
        meta_1 = dict(meta, BLOCK_D=block_1, SLOTS=int(plan.get("SLOTS_PASS1", meta["SLOTS"])))
        _launch_scan((S, _cdiv(D, block_1), n_chunks - (0 if delta else 1)), *args, meta_1)
    meta["SUMMARY"] = False
    _launch_scan((S, _cdiv(D, plan["BLOCK_D"]), n_chunks), *args, meta)


OPS = {"ssm_conv": ssm_conv, "ssm_scan": ssm_scan}

# Mamba-2's ops (ssd_scan, rms_norm_gated) live beside this file in triton_mamba2.py; the default plug-in offers
# them too, so a Mamba-2 or hybrid model runs on Triton kernels with the default `--kernels triton`.
from mamba_debug.plugins import sibling as _sibling  # noqa: E402

OPS.update(_sibling("triton_mamba2").module.OPS)
