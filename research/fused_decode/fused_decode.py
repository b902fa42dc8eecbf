"""One-launch fused single-token decode step of a Mamba-1 layer, in Triton: from `xz` to `y_gated`.

What it fuses: everything `mamba_debug.model.Runner._layer` does for one token between the in_proj output `xz`
and the gated output `y_gated`, for S sequences at once:

    x, z = xz[:, :D], xz[:, D:]                                   (xz [S, 2D], any strides)
    conv_act = silu(sum_k conv_w[:, k] * concat(conv_state, x)[k] + conv_b)      new conv_state = window[1:]
    dt_low, B, C = split(conv_act @ x_proj.T, [R, N, N])
    dt = dt_low @ dt_proj.T + dt_bias ;  delta = softplus(dt)  (= dt above 20, like mamba_debug.ops)
    h = exp(delta * A) * h + (delta * B) * conv_act ;  y = h @ C  (new ssm_state = h)
    y_gated = (y + conv_act * D) * silu(z)

that is the engine's ssm_conv + bias + silu + linear(x_proj) + linear(dt_proj) + ssm_scan + skip + gate, which
today is two Triton launches and about ten torch kernels per layer (the reference kernels causal_conv1d_update
and selective_state_update alone cost 1.9 + 1.7 µs per layer at batch 1 on an H200).

The phases (`PHASE`, a constexpr of the one kernel `_fused_decode_kernel`):
  0  conv: per block of channels, the K taps + bias + silu into a float32 scratch `act` [S, D], and the new conv
     state. Program p owns channel block p (for every sequence).
  1  x_proj: per (block of ROWS rows of x_proj, slice of D_SPLIT columns), the partial dot products of those
     rows with conv_act for every sequence, into a float32 scratch `part` [KS, S, R + 2N] (KS column slices;
     the slices' partial sums are added in phase 2 in a fixed order: no float atomics, bitwise reproducible).
  2  per channel block (the same blocks as phase 0): dt_proj rows + dt_bias, softplus, the state update, y, the
     D skip and the gate; stores y_gated and the new ssm state.
  With `CONV_PHASE = False` (config conv="recompute") there is no phase 0: phases 1 and 2 each compute the few
  conv_act values they need from xz and the conv state (the same elementwise arithmetic, so the same bits), phase 2
  writes the new conv state, and one grid barrier remains instead of two.

PHASE = -1 runs all phases in ONE launch, separated by grid-wide barriers. The phases need each other's results
(phase 1 needs every channel of conv_act, phase 2 every row of x_proj @ conv_act), so without a barrier they
would be separate launches. The barrier is an atomic counter in global memory that only grows (so it never needs
a reset, and replaying a CUDA graph works): each program arrives with an acq_rel atomic add, then spins on an
acquire read until the count reaches the next multiple of the grid size. That requires every program of the grid
to be resident at once, hence a grid of at most one program per SM (a persistent grid: program p has channel
block p and phase-1 item p, and loops over the blocks of sequences; the plan never makes more of either). Data
written before a barrier by one program and read after it by another is loaded with cache_modifier=".cg" (L2,
never a stale L1 line). Everything a phase reads that no earlier phase writes (the weights, the ssm state, z) is
loaded early, right after phase 0's few loads and stores, so its latency hides behind the barriers.

Under Triton's interpreter (TRITON_INTERPRET=1) programs run one after another, so the first program would wait
forever at a grid barrier for programs that only start after it ends. There, and as the "one launch per phase"
variant on a GPU, the launcher runs PHASE = 0, 1, 2 as separate launches of the same kernel with the same grid
and the same plan: the same code and arithmetic. Interpreted, the results are the same bits. Compiled, the
compiler may contract a multiply and an add into an FMA in one variant and not in the other: on an H200 they
agreed bit for bit at batch 8 and 64 and to NMSE ~1e-14 at batch 1, each as close to float64
(test_fused_decode.py, beside this file, checks both against float64 and against each other with
MAMBA_DEBUG_TEST_DEVICE=cuda; repeated one-launch steps give the same bits, which a barrier race would break).

Measured on an H200 (results/fused_decode.json beside this file, d_inner 5120, CUDA graphs): 6.9 µs per layer at
batch 1 (the unfused sequence: 20.5 µs), 25.7 µs at batch 8 (37.7), but 160 µs at batch 64 (65.6): there the
GEMVs of x_proj and dt_proj, done by CUDA cores inside the kernel, lose to cuBLAS. Each grid barrier costs about
1.1 µs (grid_barrier_probe.py), a launch about 1.5 µs, so one launch of three phases stays above the issue's
2.5 µs goal.

This is not an op plug-in, and it lives outside kernels/ (in research/fused_decode/): DESIGN.md's op contract has
per-op entries (ssm_conv, ssm_scan, linear, ...) and no fused layer op, so the engine does not call it.
`decode_step_reference` is the float64 torch reference built from mamba_debug.ops, in `_layer`'s order.
It is timed against the unfused sequence by bench.py beside this file (`bench_rows`).

Rules as in kernels/triton.py: every tensor is read through its strides (xz is a strided view in the engine),
offsets are 64-bit, inputs are never written (except the states when the caller passes them as the outputs:
in-place, as mamba_ssm's decode does; each program reads the state elements it owns before it writes them,
and no other program touches them), compute is float32, every sum has a fixed order.
"""
import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# See kernels/triton.py: under the interpreter the kernels use only builtins (and tl.reduce with triton's sum
# combine), so they run whichever way triton's library was imported; compiling needs the library compiled.
if INTERPRET:
    import triton.experimental.gluon  # noqa: F401
elif not isinstance(tl.standard._sum_combine, triton.runtime.JITFunction):
    raise ImportError("triton was first imported with TRITON_INTERPRET=1 in this process, so its library is "
                      "interpreted and cannot be compiled for cuda; run the cuda kernels in another process")


def _device_function(fn):
    """@triton.jit for a helper called from the kernel; under the interpreter the plain function (kernels/triton.py)."""
    return fn if INTERPRET else triton.jit(fn)


SOFTPLUS_THRESHOLD = tl.constexpr(20.0)


# %%
# Device helpers
# --------------

@_device_function
def _sum(x, axis):
    return tl.reduce(x, axis, tl.standard._sum_combine)     # tl.sum(x, axis), see the top of kernels/triton.py


@_device_function
def _silu(v):
    """v * sigmoid(v), as mamba_debug.ops.silu."""
    return v * (1.0 / (1.0 + tl.exp(-v)))


@_device_function
def _softplus(dt):
    """log(1 + exp(dt)) in fp32 with the log1p correction of kernels/triton.py, and dt itself above 20."""
    u = tl.exp(tl.minimum(dt, SOFTPLUS_THRESHOLD))
    w = 1.0 + u
    return tl.where(dt > SOFTPLUS_THRESHOLD, dt, tl.log(w) - ((w - 1.0) - u) / w)


@_device_function
def _grid_barrier(cnt_ptr):
    """Wait until every program of the grid has arrived here. GPU only (the interpreter would deadlock).

    cnt_ptr: an int64 counter that only grows; it is a multiple of the grid size between launches (one counter per
    grid size, see `_counter`). The scalar atomics are executed by one thread of the program; the block barriers
    around them order the other threads' stores before the arrival and their loads after the departure."""
    tl.debug_barrier()
    n = tl.num_programs(0).to(tl.int64)
    old = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu")
    target = (old // n + 1) * n
    cur = old + 1
    while cur < target:
        cur = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@_device_function
def _conv_act(xz_ptr, cs_ptr, cw_ptr, cb_ptr, s_idx, d_idx, mask, mask_d,
              s_xz_s, s_xz_d, s_cs_s, s_cs_t, s_cs_d, s_cw_d, s_cw_k, s_cb_d, K: tl.constexpr):
    """silu(conv + bias) at sequences s_idx and channels d_idx (broadcastable index tensors; mask: their shape,
    mask_d: d_idx's shape). Elementwise, taps added in order 0..K-1 as mamba_debug.ops.ssm_conv: the same bits
    whatever the tile shape, so every phase that computes a channel's conv_act gets the same value."""
    for k in tl.static_range(K):
        if k < K - 1:
            win = tl.load(cs_ptr + s_idx * s_cs_s + k * s_cs_t + d_idx * s_cs_d, mask=mask, other=0.0)
        else:
            win = tl.load(xz_ptr + s_idx * s_xz_s + d_idx * s_xz_d, mask=mask, other=0.0)
        wk = tl.load(cw_ptr + d_idx * s_cw_d + k * s_cw_k, mask=mask_d, other=0.0).to(tl.float32)
        if k == 0:
            conv = wk * win.to(tl.float32)
        else:
            conv = conv + wk * win.to(tl.float32)
    conv = conv + tl.load(cb_ptr + d_idx * s_cb_d, mask=mask_d, other=0.0).to(tl.float32)
    return _silu(conv)


@_device_function
def _conv_state_next(xz_ptr, cs_ptr, s_idx, d_idx, mask2,
                     s_xz_s, s_xz_d, s_cs_s, s_cs_t, s_cs_d, K: tl.constexpr, BLOCK_KM1: tl.constexpr):
    """The new conv state rows 0..K-2 = window rows 1..K-1 (old rows 1..K-2, then x) as [BS, BLOCK_KM1, BD];
    s_idx [BS, 1], d_idx [1, BD], mask2 [BS, BD]. Also returns the row index [1, BLOCK_KM1, 1] and the 3D mask."""
    r3 = tl.arange(0, BLOCK_KM1).to(tl.int64)[None, :, None]
    m3 = mask2[:, None, :] & (r3 < K - 1)
    old = tl.load(cs_ptr + s_idx[:, :, None] * s_cs_s + (r3 + 1) * s_cs_t + d_idx[:, None, :] * s_cs_d,
                  mask=m3 & (r3 + 1 < K - 1), other=0.0)
    x = tl.load(xz_ptr + s_idx * s_xz_s + d_idx * s_xz_d, mask=mask2, other=0.0)
    return tl.where(r3 + 1 < K - 1, old, x[:, None, :]), r3, m3


@_device_function
def _channels(pid, CH, D, N_CB, BLOCK_D: tl.constexpr):
    """Channel block `pid` (CH channels, padded to BLOCK_D): offsets and mask (empty past the last block).

    Masks never combine a tensor with a scalar condition by `&`: Triton 3.9's interpreter then returns an int32
    array that its load rejects ("mask has unsupported dtype"); tl.where(cond, mask, False) is used instead."""
    offs = tl.arange(0, BLOCK_D)
    d = pid.to(tl.int64) * CH + offs
    return d, (offs < CH) & (d < D)                # past the last block: d >= D


@_device_function
def _xproj_rows(pid, R, N, D, D_SPLIT, N_RK, KS: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Phase-1 item `pid`: ROWS rows of x_proj x one slice of D_SPLIT columns (slice ks = pid % KS)."""
    rows = (pid // KS).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cl = tl.arange(0, BLOCK_C)
    ks = pid % KS
    cols = ks.to(tl.int64) * D_SPLIT + cl
    mask_c = (cl < D_SPLIT) & (cols < D)
    return rows, rows < R + 2 * N, ks, cols, mask_c       # past the last item: rows >= R + 2N


@_device_function
def _xproj_weights(xp_ptr, pid, R, N, D, D_SPLIT, N_RK, s_xp_r, s_xp_d,
                   KS: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    rows, mask_r, ks, cols, mask_c = _xproj_rows(pid, R, N, D, D_SPLIT, N_RK, KS, ROWS, BLOCK_C)
    return tl.load(xp_ptr + rows[:, None] * s_xp_r + cols[None, :] * s_xp_d,
                   mask=mask_r[:, None] & mask_c[None, :], other=0.0).to(tl.float32)    # [ROWS, BLOCK_C]


@_device_function
def _scan_weights(dtp_ptr, dtb_ptr, A_ptr, Dsk_ptr, pid, CH, D, R, N, N_CB,
                  s_dtp_d, s_dtp_r, s_dtb_d, s_A_d, s_A_n, s_Dsk_d,
                  BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R1: tl.constexpr, BLOCK_R2: tl.constexpr):
    """dt_proj rows of channel block pid, split along R into a power-of-two part and the rest (R = 160 is
    128 + 32: no padded lanes), and A, D, dt_bias of the block."""
    d, mask_d = _channels(pid, CH, D, N_CB, BLOCK_D)
    r1 = tl.arange(0, BLOCK_R1)
    w2a = tl.load(dtp_ptr + d[:, None] * s_dtp_d + r1[None, :] * s_dtp_r,
                  mask=mask_d[:, None] & (r1 < R)[None, :], other=0.0).to(tl.float32)
    w2b = w2a                    # placeholder when R is a power of two
    if BLOCK_R2 > 0:
        r2 = BLOCK_R1 + tl.arange(0, BLOCK_R2)
        w2b = tl.load(dtp_ptr + d[:, None] * s_dtp_d + r2[None, :] * s_dtp_r,
                      mask=mask_d[:, None] & (r2 < R)[None, :], other=0.0).to(tl.float32)
    n = tl.arange(0, BLOCK_N)
    A = tl.load(A_ptr + d[:, None] * s_A_d + n[None, :] * s_A_n,
                mask=mask_d[:, None] & (n < N)[None, :], other=0.0).to(tl.float32)
    dsk = tl.load(Dsk_ptr + d * s_Dsk_d, mask=mask_d, other=0.0).to(tl.float32)
    dtb = tl.load(dtb_ptr + d * s_dtb_d, mask=mask_d, other=0.0).to(tl.float32)
    return w2a, w2b, A, dsk, dtb


@_device_function
def _scan_inputs(xz_ptr, cs_ptr, ss_ptr, cw_ptr, cb_ptr, s0, pid, S, D, N, CH, N_CB,
                 s_xz_s, s_xz_d, s_cs_s, s_cs_t, s_cs_d, s_ss_s, s_ss_d, s_ss_n, s_cw_d, s_cw_k, s_cb_d,
                 CONV_PHASE: tl.constexpr, K: tl.constexpr, BLOCK_KM1: tl.constexpr,
                 BS2: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """What phase 2 reads for sequences s0..s0+BS2-1 that no earlier phase writes: h [BS2, BD, BN], z [BS2, BD];
    without a conv phase also conv_act [BS2, BD] and the new conv state (placeholders otherwise)."""
    d, mask_d = _channels(pid, CH, D, N_CB, BLOCK_D)
    s = s0 + tl.arange(0, BS2).to(tl.int64)
    mask2 = (s < S)[:, None] & mask_d[None, :]
    n = tl.arange(0, BLOCK_N)
    h = tl.load(ss_ptr + s[:, None, None] * s_ss_s + d[None, :, None] * s_ss_d + n[None, None, :] * s_ss_n,
                mask=mask2[:, :, None] & (n < N)[None, None, :], other=0.0).to(tl.float32)
    z = tl.load(xz_ptr + s[:, None] * s_xz_s + (D + d[None, :]) * s_xz_d, mask=mask2, other=0.0).to(tl.float32)
    x = z                        # placeholders when phase 0 computes conv_act and the new conv state
    new_conv = h
    if not CONV_PHASE:
        x = _conv_act(xz_ptr, cs_ptr, cw_ptr, cb_ptr, s[:, None], d[None, :], mask2, mask_d[None, :],
                      s_xz_s, s_xz_d, s_cs_s, s_cs_t, s_cs_d, s_cw_d, s_cw_k, s_cb_d, K)
        new_conv, r3, m3 = _conv_state_next(xz_ptr, cs_ptr, s[:, None], d[None, :], mask2,
                                            s_xz_s, s_xz_d, s_cs_s, s_cs_t, s_cs_d, K, BLOCK_KM1)
    return h, z, x, new_conv


# %%
# The kernel
# ----------

@triton.jit
def _fused_decode_kernel(
    # inputs
    xz_ptr,             # [S, 2D]: x | z
    cs_ptr,             # conv state [S, K-1, D]
    ss_ptr,             # ssm state [S, D, N]
    cw_ptr, cb_ptr,     # conv_w [D, K], conv_b [D]
    xp_ptr,             # x_proj [R + 2N, D]
    dtp_ptr, dtb_ptr,   # dt_proj [D, R], dt_bias [D]
    A_ptr, Dsk_ptr,     # A [D, N], D [D]
    # outputs
    y_ptr,              # y_gated [S, D]
    cso_ptr, sso_ptr,   # new conv state [S, K-1, D], new ssm state [S, D, N] (may be cs_ptr / ss_ptr: in place)
    # scratch (float32, contiguous) and the barrier counter
    act_ptr,            # conv_act [S, D] (phase 0 -> phases 1, 2)
    part_ptr,           # x_proj partial sums [KS, S, R + 2N] (phase 1 -> phase 2)
    cnt_ptr,            # int64 [1], grows by the grid size at each barrier
    # sizes and the plan's runtime numbers
    S, D, R, N,
    CH, N_CB,           # channels per block of phases 0 and 2, number of blocks (program p has block p)
    D_SPLIT, N_RK,      # columns per phase-1 slice, number of phase-1 items (program p has item p)
    # strides, in elements
    s_xz_s, s_xz_d,
    s_cs_s, s_cs_t, s_cs_d,
    s_ss_s, s_ss_d, s_ss_n,
    s_cw_d, s_cw_k, s_cb_d,
    s_xp_r, s_xp_d,
    s_dtp_d, s_dtp_r, s_dtb_d,
    s_A_d, s_A_n, s_Dsk_d,
    s_y_s, s_y_d,
    s_cso_s, s_cso_t, s_cso_d,
    s_sso_s, s_sso_d, s_sso_n,
    # meta-parameters
    PHASE: tl.constexpr,        # -1: all phases, grid barriers between them (GPU only); 0, 1, 2: that phase only
    CONV_PHASE: tl.constexpr,   # True: phase 0 writes conv_act; False: phases 1 and 2 recompute it (no phase 0)
    K: tl.constexpr,
    BLOCK_KM1: tl.constexpr,    # K-1 rounded up to a power of two
    KS: tl.constexpr,           # phase-1 column slices (partial sums added in phase 2)
    ROWS: tl.constexpr,         # x_proj rows per phase-1 item
    BLOCK_C: tl.constexpr,      # D_SPLIT rounded up to a power of two
    BLOCK_D: tl.constexpr,      # CH rounded up to a power of two
    BLOCK_N: tl.constexpr,
    BLOCK_R1: tl.constexpr,     # R = BLOCK_R1 + (rest <= BLOCK_R2), both powers of two (BLOCK_R2 = 0: R = BLOCK_R1)
    BLOCK_R2: tl.constexpr,
    BS0: tl.constexpr,          # sequences per step of phase 0, 1, 2
    BS1: tl.constexpr,
    BS2: tl.constexpr,
    ONE_SBLOCK2: tl.constexpr,  # S <= BS2: phase 2 reads its state and z early, with the weights
):
    pid = tl.program_id(0)
    RP = R + 2 * N
    d, mask_d = _channels(pid, CH, D, N_CB, BLOCK_D)

    # -- phase 0: conv + bias + silu -> act scratch, new conv state ----------------------------------------------
    if CONV_PHASE & ((PHASE == 0) | (PHASE == -1)):
        if pid < N_CB:
            s0 = 0
            while s0 < S:           # `while`: Triton 3.6's interpreter cannot take a runtime range() bound
                s = s0 + tl.arange(0, BS0).to(tl.int64)
                mask2 = (s < S)[:, None] & mask_d[None, :]
                act = _conv_act(xz_ptr, cs_ptr, cw_ptr, cb_ptr, s[:, None], d[None, :], mask2, mask_d[None, :],
                                s_xz_s, s_xz_d, s_cs_s, s_cs_t, s_cs_d, s_cw_d, s_cw_k, s_cb_d, K)
                new_conv0, r3, m3 = _conv_state_next(xz_ptr, cs_ptr, s[:, None], d[None, :], mask2,
                                                     s_xz_s, s_xz_d, s_cs_s, s_cs_t, s_cs_d, K, BLOCK_KM1)
                tl.debug_barrier()  # in place: every thread has read the old state before any thread writes
                tl.store(cso_ptr + s[:, None, None] * s_cso_s + r3 * s_cso_t + d[None, None, :] * s_cso_d,
                         new_conv0.to(cso_ptr.dtype.element_ty), mask=m3)
                tl.store(act_ptr + s[:, None] * D + d[None, :], act, mask=mask2)
                s0 += BS0
    # -- The loads of what no phase writes (weights, the ssm state, z) are issued here, after phase 0's few loads
    #    and stores, so that in one launch their latency overlaps the barrier. With one launch per phase they sit
    #    before the phase's work: the same code, only the launch differs. (Loading everything at the start, or each
    #    phase's weights just before the barrier in front of it, was no faster on an H200:
    #    research/fused_decode/results/fused_decode_run1.json.) ----------------------------------------------
    if (PHASE == 1) | (PHASE == -1):
        w1 = _xproj_weights(xp_ptr, pid, R, N, D, D_SPLIT, N_RK, s_xp_r, s_xp_d, KS, ROWS, BLOCK_C)
    if (PHASE == 2) | (PHASE == -1):
        w2a, w2b, A, dsk, dtb = _scan_weights(dtp_ptr, dtb_ptr, A_ptr, Dsk_ptr, pid, CH, D, R, N, N_CB,
                                              s_dtp_d, s_dtp_r, s_dtb_d, s_A_d, s_A_n, s_Dsk_d,
                                              BLOCK_D, BLOCK_N, BLOCK_R1, BLOCK_R2)
        if ONE_SBLOCK2:
            h, z, x2, new_conv = _scan_inputs(xz_ptr, cs_ptr, ss_ptr, cw_ptr, cb_ptr, 0, pid, S, D, N, CH, N_CB,
                                              s_xz_s, s_xz_d, s_cs_s, s_cs_t, s_cs_d, s_ss_s, s_ss_d, s_ss_n,
                                              s_cw_d, s_cw_k, s_cb_d, CONV_PHASE, K, BLOCK_KM1, BS2, BLOCK_D, BLOCK_N)
    if CONV_PHASE & (PHASE == -1):
        _grid_barrier(cnt_ptr)

    # -- phase 1: partial x_proj rows for every sequence -> part scratch -----------------------------------------
    if (PHASE == 1) | (PHASE == -1):
        if pid < N_RK:
            rows, mask_r, ks, cols, mask_c = _xproj_rows(pid, R, N, D, D_SPLIT, N_RK, KS, ROWS, BLOCK_C)
            offs_j = tl.arange(0, BS1)
            s0 = 0
            while s0 < S:
                P = tl.zeros([BS1, ROWS], dtype=tl.float32)
                for j in tl.static_range(BS1):
                    sj = (s0 + j).to(tl.int64)
                    mj = tl.where(sj < S, mask_c, False)     # (not `mask & scalar`: see _channels)
                    if CONV_PHASE:
                        a = tl.load(act_ptr + sj * D + cols, mask=mj, other=0.0, cache_modifier=".cg")
                    else:
                        a = _conv_act(xz_ptr, cs_ptr, cw_ptr, cb_ptr, sj, cols, mj, mask_c,
                                      s_xz_s, s_xz_d, s_cs_s, s_cs_t, s_cs_d, s_cw_d, s_cw_k, s_cb_d, K)
                    p = _sum(w1 * a[None, :], 1)                                    # [ROWS]
                    P = tl.where(offs_j[:, None] == j, p[None, :], P)
                s = s0 + offs_j.to(tl.int64)
                tl.store(part_ptr + (ks * S).to(tl.int64) * RP + s[:, None] * RP + rows[None, :], P,
                         mask=(s < S)[:, None] & mask_r[None, :])
                s0 += BS1
    if PHASE == -1:
        _grid_barrier(cnt_ptr)

    # -- phase 2: dt_proj + dt_bias, softplus, state update, y, skip, gate ---------------------------------------
    if (PHASE == 2) | (PHASE == -1):
        if pid < N_CB:
            offs_j = tl.arange(0, BS2)
            n = tl.arange(0, BLOCK_N)
            r1 = tl.arange(0, BLOCK_R1)
            s0 = 0
            while s0 < S:
                if not ONE_SBLOCK2:
                    h, z, x2, new_conv = _scan_inputs(xz_ptr, cs_ptr, ss_ptr, cw_ptr, cb_ptr, s0, pid, S, D, N, CH,
                                                      N_CB, s_xz_s, s_xz_d, s_cs_s, s_cs_t, s_cs_d,
                                                      s_ss_s, s_ss_d, s_ss_n, s_cw_d, s_cw_k, s_cb_d,
                                                      CONV_PHASE, K, BLOCK_KM1, BS2, BLOCK_D, BLOCK_N)
                s = s0 + offs_j.to(tl.int64)
                mask_s = s < S
                mask2 = mask_s[:, None] & mask_d[None, :]
                if CONV_PHASE:
                    x = tl.load(act_ptr + s[:, None] * D + d[None, :], mask=mask2, other=0.0, cache_modifier=".cg")
                else:
                    x = x2
                # dt_low of each sequence = the KS partial sums, added in slice order; then its dt_proj rows
                dt = tl.zeros([BS2, BLOCK_D], dtype=tl.float32)
                for j in tl.static_range(BS2):
                    sj = (s0 + j).to(tl.int64)
                    base = part_ptr + sj * RP
                    dl1 = tl.zeros([BLOCK_R1], dtype=tl.float32)
                    for ks in tl.static_range(KS):
                        dl1 += tl.load(base + ks * S * RP + r1, mask=tl.where(sj < S, r1 < R, False), other=0.0,
                                       cache_modifier=".cg")
                    dt_j = _sum(w2a * dl1[None, :], 1)
                    if BLOCK_R2 > 0:
                        r2 = BLOCK_R1 + tl.arange(0, BLOCK_R2)
                        dl2 = tl.zeros([BLOCK_R2], dtype=tl.float32)
                        for ks in tl.static_range(KS):
                            dl2 += tl.load(base + ks * S * RP + r2, mask=tl.where(sj < S, r2 < R, False), other=0.0,
                                           cache_modifier=".cg")
                        dt_j = dt_j + _sum(w2b * dl2[None, :], 1)
                    dt = tl.where(offs_j[:, None] == j, dt_j[None, :], dt)
                dt = dt + dtb[None, :]
                mask_sn = mask_s[:, None] & (n < N)[None, :]
                Bm = tl.zeros([BS2, BLOCK_N], dtype=tl.float32)
                Cm = tl.zeros([BS2, BLOCK_N], dtype=tl.float32)
                for ks in tl.static_range(KS):
                    pb = part_ptr + (ks * S + s[:, None]) * RP + R + n[None, :]
                    Bm += tl.load(pb, mask=mask_sn, other=0.0, cache_modifier=".cg")
                    Cm += tl.load(pb + N, mask=mask_sn, other=0.0, cache_modifier=".cg")
                # the state update in mamba_debug.ops.ssm_scan's order: exp(delta*A)*h + (delta*B)*x
                delta = _softplus(dt)[:, :, None]                                   # [BS2, BD, 1]
                h = tl.exp(delta * A[None, :, :]) * h + (delta * Bm[:, None, :]) * x[:, :, None]
                y = _sum(h * Cm[:, None, :], 2)                                     # [BS2, BD]
                out = (y + x * dsk[None, :]) * _silu(z)
                tl.debug_barrier()  # in place: every thread has read the old states before any thread writes
                tl.store(y_ptr + s[:, None] * s_y_s + d[None, :] * s_y_d, out.to(y_ptr.dtype.element_ty), mask=mask2)
                tl.store(sso_ptr + s[:, None, None] * s_sso_s + d[None, :, None] * s_sso_d
                         + n[None, None, :] * s_sso_n, h.to(sso_ptr.dtype.element_ty),
                         mask=mask2[:, :, None] & (n < N)[None, None, :])
                if not CONV_PHASE:
                    r3 = tl.arange(0, BLOCK_KM1).to(tl.int64)[None, :, None]
                    tl.store(cso_ptr + s[:, None, None] * s_cso_s + r3 * s_cso_t + d[None, None, :] * s_cso_d,
                             new_conv.to(cso_ptr.dtype.element_ty), mask=mask2[:, None, :] & (r3 < K - 1))
                s0 += BS2


# %%
# Plan and launcher
# -----------------

@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(1, int(n)))


def _r_split(R: int) -> tuple[int, int]:
    """R = r1 + rest with r1 the largest power of two <= R and rest <= r2 (a power of two, or 0)."""
    r1 = 1 << (R.bit_length() - 1)
    rest = R - r1
    return r1, (_pow2(rest) if rest else 0)


# Register budget of the per-program weight tiles (float32 elements): 8192 = 32 registers a thread at 8 warps.
MAX_TILE = 8192


def plan(S: int, D: int, N: int, R: int, K: int, *, device=None, **overrides) -> dict:
    """How the fused step is cut, for S sequences of a layer (D, N, R, K). Keys (any can be overridden):

    conv:      "phase" (phase 0 writes conv_act, two barriers) or "recompute" (no phase 0, one barrier)
    grid:      programs; at most the SM count on a GPU (one launch needs them all resident)
    channels:  channels per block of phases 0 and 2 (block p is program p's)
    rows, ks:  phase 1's items: `rows` x_proj rows x one of `ks` column slices (item p is program p's)
    bs0, bs1, bs2: sequences handled together in phases 0, 1, 2
    num_warps

    GPU: one channel block per SM; phase-1 items chosen to balance what each program reads (its x_proj tile, its
    conv_act slices, and in phase 2 the KS partial sums of every sequence). Interpreter: 3 programs (each program is
    slow Python there), still several of everything so that cross-program hand-offs are exercised."""
    RP = R + 2 * N
    if INTERPRET:
        sms = 3
    else:
        idx = device.index if device is not None and device.index is not None else torch.cuda.current_device()
        sms = _sm_count(idx)
    # 8 warps, but 4 for one sequence (H200, d_inner 5120: 6.9 us against 8.2 at batch 1; at batch 8, 8 warps
    # 25.7 us against 34.8; research/fused_decode/results/fused_decode.json)
    p = dict(conv="phase", num_warps=4 if S == 1 else 8)
    grid = overrides.get("grid")
    cap = min(sms, grid) if grid else sms
    p["channels"] = overrides.get("channels") or triton.cdiv(D, min(cap, triton.cdiv(D, 16 if not INTERPRET else 1)))
    if "rows" in overrides or "ks" in overrides:
        rows = overrides.get("rows", 8)
        ks = overrides.get("ks", 1)
    else:
        best = None
        for rows in (1, 2, 4, 8, 16, 32, 64):
            n_rb = triton.cdiv(RP, rows)
            for ks in range(1, max(1, cap // n_rb) + 1):
                d_split = _d_split(D, ks)
                ks_eff = triton.cdiv(D, d_split)
                if n_rb * ks_eff > cap or (rows * _pow2(d_split) > MAX_TILE and not INTERPRET):
                    continue
                cost = rows * d_split + S * d_split + ks_eff * S * RP
                if best is None or cost < best[0]:
                    best = (cost, rows, ks_eff)
        if best is None:                # tiny grids (interpreter, or a forced small grid): fewest items
            best = (0, _pow2(triton.cdiv(RP, max(1, cap))), 1)
        rows, ks = best[1], best[2]
    p["rows"], p["ks"] = rows, ks
    bs = _pow2(min(S, 16))
    p.update(bs0=bs, bs1=bs, bs2=_pow2(min(S, 8)))
    p.update({k: v for k, v in overrides.items() if v is not None})
    return p


def _d_split(D: int, ks: int) -> int:
    """Columns per phase-1 slice: a multiple of 16 when D allows (aligned, vectorizable loads)."""
    d_split = triton.cdiv(D, ks)
    return triton.cdiv(d_split, 16) * 16 if D >= 16 * ks else d_split


def _empty(shape, like: torch.Tensor, dtype=None) -> torch.Tensor:
    """Every output is allocated here (a test fills them with NaN to prove each element gets written)."""
    return torch.empty(shape, dtype=dtype or like.dtype, device=like.device)


def _check(ok: bool, what: str, **tensors):
    if not ok:
        shapes = ", ".join(f"{k}={list(v.shape)}" for k, v in tensors.items())
        raise ValueError(f"fused_decode_step: {what} (got {shapes})")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [lo, hi) a tensor view can touch."""
    if t.numel() == 0:
        return (t.data_ptr(), t.data_ptr())
    lo = hi = 0
    for size, stride in zip(t.shape, t.stride()):
        if stride >= 0:
            hi += (size - 1) * stride
        else:
            lo += (size - 1) * stride
    e = t.element_size()
    return (t.data_ptr() + lo * e, t.data_ptr() + (hi + 1) * e)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a.device == b.device and a0 < b1 and b0 < a1


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


_COUNTERS: dict = {}


def _counter(device: torch.device, grid: int) -> torch.Tensor:
    """The barrier counter of (device, grid size): allocated once, zero, and only ever grown by kernels.

    One per grid size, because a barrier waits for the next multiple of the grid size: a launch with another grid
    size would find the count at a multiple of the wrong number. Launches sharing a counter must not run
    concurrently (on two streams at once): they would count each other's arrivals."""
    key = (device.index, grid)
    if key not in _COUNTERS:
        if torch.cuda.is_current_stream_capturing():
            raise ValueError("fused_decode_step: run the one-launch step once outside CUDA graph capture first "
                             "(it compiles the kernel and allocates its grid-barrier counter, which must not live "
                             "in the graph's memory pool)")
        _COUNTERS[key] = torch.zeros(1, dtype=torch.int64, device=device)
    return _COUNTERS[key]


WEIGHT_SHAPES = ("conv_w", "conv_b", "x_proj", "dt_proj", "dt_bias", "A", "D")


def fused_decode_step(xz: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, w: dict, *,
                      conv_state_out: torch.Tensor | None = None, ssm_state_out: torch.Tensor | None = None,
                      one_launch: bool | None = None, config: dict | None = None):
    """One decode token of one Mamba-1 layer, from xz to y_gated (see the module docstring).

    xz [S, 2D] (or [S, 1, 2D]), conv_state [S, K-1, D], ssm_state [S, D, N]; w: conv_w [D, K], conv_b [D],
    x_proj [R+2N, D], dt_proj [D, R], dt_bias [D], A [D, N], D [D] (mamba_debug's layer weight names).
    Returns (y_gated [S, D] (or [S, 1, D]), new conv state, new ssm state). conv_state_out / ssm_state_out: where to
    write the new states (may be conv_state / ssm_state themselves: in place). one_launch: None = one launch on a
    GPU, one launch per phase under the interpreter. config: overrides of `plan`."""
    missing = [k for k in WEIGHT_SHAPES if k not in w]
    if missing:
        raise ValueError(f"fused_decode_step: weights {missing} missing from w (need {list(WEIGHT_SHAPES)})")
    if xz.dim() == 3:
        _check(xz.shape[1] == 1, "xz must be [S, 2D] or [S, 1, 2D] (one token)", xz=xz)
        y_shape_3d = True
        xz = xz[:, 0]
    else:
        y_shape_3d = False
    _check(xz.dim() == 2 and xz.shape[1] % 2 == 0 and xz.shape[1] > 0, "xz must be [S, 2D]", xz=xz)
    S, D = xz.shape[0], xz.shape[1] // 2
    cw, cb, xp, dtp, dtb, A, Dsk = (w[k] for k in WEIGHT_SHAPES)
    _check(cw.dim() == 2 and cw.shape[0] == D and cw.shape[1] >= 2, "conv_w must be [D, K] with K >= 2",
           xz=xz, conv_w=cw)
    K = cw.shape[1]
    _check(A.dim() == 2 and A.shape[0] == D and A.shape[1] >= 1, "A must be [D, N]", xz=xz, A=A)
    N = A.shape[1]
    _check(dtp.dim() == 2 and dtp.shape[0] == D and dtp.shape[1] >= 1, "dt_proj must be [D, R]", xz=xz, dt_proj=dtp)
    R = dtp.shape[1]
    _check(tuple(xp.shape) == (R + 2 * N, D), "x_proj must be [R + 2N, D]", x_proj=xp, dt_proj=dtp, A=A)
    for name, t in (("conv_b", cb), ("dt_bias", dtb), ("D", Dsk)):
        _check(tuple(t.shape) == (D,), f"{name} must be [D]", xz=xz, **{name: t})
    _check(tuple(conv_state.shape) == (S, K - 1, D), "conv_state must be [S, K-1, D]",
           conv_state=conv_state, xz=xz, conv_w=cw)
    _check(tuple(ssm_state.shape) == (S, D, N), "ssm_state must be [S, D, N]", ssm_state=ssm_state, xz=xz, A=A)
    if conv_state_out is not None:
        _check(conv_state_out.shape == conv_state.shape, "conv_state_out must be [S, K-1, D]",
               conv_state_out=conv_state_out, conv_state=conv_state)
    if ssm_state_out is not None:
        _check(ssm_state_out.shape == ssm_state.shape, "ssm_state_out must be [S, D, N]",
               ssm_state_out=ssm_state_out, ssm_state=ssm_state)
    tensors = dict(xz=xz, conv_state=conv_state, ssm_state=ssm_state, conv_w=cw, conv_b=cb, x_proj=xp,
                   dt_proj=dtp, dt_bias=dtb, A=A, D=Dsk)
    outs = dict(conv_state_out=conv_state_out, ssm_state_out=ssm_state_out)
    want = "cpu" if INTERPRET else "cuda"
    for k, v in {**tensors, **{k: v for k, v in outs.items() if v is not None}}.items():
        if not v.is_floating_point():
            raise ValueError(f"fused_decode_step: {k} must be a floating-point tensor, got {v.dtype}")
        if v.device.type != want:
            mode = "Triton's interpreter (TRITON_INTERPRET=1)" if INTERPRET else "a CUDA GPU"
            raise ValueError(f"fused_decode_step: this copy of the kernel was loaded for {mode} and takes {want} "
                             f"tensors, but {k} is on {v.device}")
        if v.device != xz.device:
            raise ValueError(f"fused_decode_step: {k} is on {v.device} but xz is on {xz.device}")
    # Outputs given by the caller: either exactly their input state (in place) or memory nobody else reads.
    for name, out, own in (("conv_state_out", conv_state_out, "conv_state"), ("ssm_state_out", ssm_state_out,
                                                                            "ssm_state")):
        if out is None:
            continue
        for k, v in tensors.items():
            if _overlap(out, v) and not (k == own and _same_view(out, v)):
                raise ValueError(f"fused_decode_step: {name} overlaps {k}; it may only be {own} itself (the "
                                 f"same view: in place) or separate memory")
    if conv_state_out is not None and ssm_state_out is not None and _overlap(conv_state_out, ssm_state_out):
        raise ValueError("fused_decode_step: conv_state_out and ssm_state_out overlap")

    if one_launch is None:
        one_launch = not INTERPRET
    if one_launch and INTERPRET:
        raise ValueError("fused_decode_step: one_launch=True cannot run under Triton's interpreter: it runs the "
                         "programs one after another, so the first would wait forever at the grid-wide barrier "
                         "for programs that start only after it ends. Use one_launch=False (one launch per phase, "
                         "the same arithmetic)")
    grid, args, meta, (y, cso, sso) = _prepare(xz, conv_state, ssm_state, w, conv_state_out, ssm_state_out,
                                               config, one_launch)
    if one_launch:
        _fused_decode_kernel[(grid,)](*args, PHASE=-1, **meta)
    else:
        for phase in ((0, 1, 2) if meta["CONV_PHASE"] else (1, 2)):
            _fused_decode_kernel[(grid,)](*args, PHASE=phase, **meta)
    if y_shape_3d:
        y = y[:, None]
    return y, cso, sso


def _prepare(xz, conv_state, ssm_state, w, conv_state_out, ssm_state_out, config, one_launch):
    """Plan, outputs, scratch and the kernel's arguments for validated inputs (xz [S, 2D]):
    (grid, args, meta, (y, new conv state, new ssm state))."""
    S, D = xz.shape[0], xz.shape[1] // 2
    cw, cb, xp, dtp, dtb, A, Dsk = (w[k] for k in WEIGHT_SHAPES)
    K, N, R = cw.shape[1], A.shape[1], dtp.shape[1]
    cfg = plan(S, D, N, R, K, device=xz.device, **(config or {}))
    if cfg["conv"] not in ("phase", "recompute"):
        raise ValueError(f"fused_decode_step: config conv must be 'phase' or 'recompute', got {cfg['conv']!r}")
    conv_phase = cfg["conv"] == "phase"
    CH = int(cfg["channels"])
    n_cb = triton.cdiv(D, CH)
    rows, ks = int(cfg["rows"]), int(cfg["ks"])
    d_split = _d_split(D, ks)
    ks = triton.cdiv(D, d_split)                      # no empty slice at the end
    n_rk = triton.cdiv(R + 2 * N, rows) * ks
    grid = int(cfg.get("grid") or max(n_cb, n_rk))
    if grid < max(n_cb, n_rk):
        raise ValueError(f"fused_decode_step: grid {grid} is smaller than the {n_cb} channel blocks or the {n_rk} "
                         f"x_proj items of the plan (program p does block p and item p)")
    if one_launch:
        sms = _sm_count(xz.device.index if xz.device.index is not None else torch.cuda.current_device())
        if grid > sms:
            raise ValueError(f"fused_decode_step: one launch needs every program resident at once (grid barrier), "
                             f"but the plan's grid has {grid} programs for {sms} SMs")

    y = _empty((S, D), xz)
    cso = conv_state_out if conv_state_out is not None else _empty((S, K - 1, D), conv_state)
    sso = ssm_state_out if ssm_state_out is not None else _empty((S, D, N), ssm_state)
    act = torch.empty((S, D) if conv_phase else (1,), dtype=torch.float32, device=xz.device)
    part = torch.empty((ks, S, R + 2 * N), dtype=torch.float32, device=xz.device)
    cnt = _counter(xz.device, grid) if one_launch else part      # the per-phase launches never touch it
    r1, r2 = _r_split(R)
    args = (xz, conv_state, ssm_state, cw, cb, xp, dtp, dtb, A, Dsk, y, cso, sso, act, part, cnt,
            S, D, R, N, CH, n_cb, d_split, n_rk,
            *xz.stride(), *conv_state.stride(), *ssm_state.stride(), *cw.stride(), *cb.stride(), *xp.stride(),
            *dtp.stride(), *dtb.stride(), *A.stride(), *Dsk.stride(), *y.stride(), *cso.stride(), *sso.stride())
    meta = dict(CONV_PHASE=conv_phase, K=K, BLOCK_KM1=_pow2(K - 1), KS=ks, ROWS=rows, BLOCK_C=_pow2(d_split),
                BLOCK_D=_pow2(CH), BLOCK_N=_pow2(N), BLOCK_R1=r1, BLOCK_R2=r2,
                BS0=int(cfg["bs0"]), BS1=int(cfg["bs1"]), BS2=int(cfg["bs2"]), ONE_SBLOCK2=S <= int(cfg["bs2"]),
                num_warps=int(cfg["num_warps"]))
    return grid, args, meta, (y, cso, sso)


# %%
# Reference
# ---------

def decode_step_reference(xz: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, w: dict,
                          dtype=torch.float64):
    """The same step with mamba_debug.ops in `dtype` (float64: the ground truth), in `_layer`'s order, on the
    inputs' device: returns (y_gated [S, D], new conv state [S, K-1, D], new ssm state [S, D, N])."""
    from mamba_debug import ops        # here, so that the kernels load without mamba_debug on the path
    if xz.dim() == 3:
        xz = xz[:, 0]
    c = {k: w[k].to(dtype) for k in WEIGHT_SHAPES}
    D, N, R = c["A"].shape[0], c["A"].shape[1], c["dt_proj"].shape[1]
    xz = xz.to(dtype)[:, None, :]                                  # [S, 1, 2D]
    x, z = xz[..., :D], xz[..., D:]
    conv, new_conv = ops.ssm_conv(conv_state.to(dtype), x, c["conv_w"])
    conv_act = ops.silu(conv + c["conv_b"])
    dbc = ops.linear(conv_act, c["x_proj"])
    dt, B, C = dbc[..., :R], dbc[..., R:R + N], dbc[..., R + N:]
    dt = ops.linear(dt, c["dt_proj"], c["dt_bias"])
    y_scan, new_ssm = ops.ssm_scan(ssm_state.to(dtype), conv_act, dt, c["A"], B, C)
    y = (y_scan + conv_act * c["D"]) * ops.silu(z)
    return y[:, 0], new_conv, new_ssm
