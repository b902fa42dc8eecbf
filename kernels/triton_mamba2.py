"""Triton kernels for Mamba-2's `ssd_scan` and `rms_norm_gated` (merged into the default `triton` plug-in).

Same rules and modes as kernels/triton.py (compiled on cuda, interpreted on CPU tensors): every stride goes to the
kernel (x, B, C are views of the conv output, z a view of the in_proj output), strides in elements with 64-bit
sequence offsets, inputs never written, fp32 math, the state read at the start and written at the end of a call.

    ssd_scan(ssm_state[S,H,P,N], x[S,T,H,P], dt[S,T,H], A[H], B[S,T,G,N], C[S,T,G,N], *, states_out=None)
        -> (y[S,T,H,P], new_state[S,H,P,N])        δ = softplus(dt) (threshold 20), head h reads group h // (H/G)
    rms_norm_gated(x[S,T,Dn], z[S,T,Dn], weight[Dn], eps, n_groups) -> y   (gate, then the norm per group)

Three schedules for the scan (`scan_plan` picks one):
* `steps` (every compiled call): the recurrence token by token, a program per (sequence, head, BLOCK_P rows of its
  state), the rows in registers. A head's decay is one number a token, so a step is two multiply-adds a state
  element; a prompt's many programs, and loads issued STAGES tokens ahead, hide each step's latency.
* `chunked` (interpreted prompts), a program per (sequence, head): the SSD form. Per chunk of Q tokens
  Λ = cumsum(δA); y = (C Bᵀ ∘ e^{Λt-Λs} δs, lower) x + e^{Λt} C Sᵀ; S ← e^{Λlast} S + (x ∘ e^{Λlast-Λ} δ)ᵀ B. Chunks
  start at the ubatch start; the state carries over chunk to chunk and ubatch to ubatch.
* `heads` (interpreted decode and per-token states): the steps for every head of a sequence in one program (the
  interpreter's cost is per operation, not per element: 4-17x less time for the same bits on the shipped shape).
The norm likewise: a program per token and group (`row`), interpreted many tokens and every group at once (`rows`).
"""
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from mamba_debug.triton_env import exec_file
from mamba_debug.triton_launch import Launch, cdiv, check as _check, check_device, helper_jit, next_pow2

NAME = "triton_mamba2"
DESCRIPTION = ("Triton ssd_scan (compiled: the recurrence, every call; interpreted: chunked SSD prompts) and grouped "
               "gated RMSNorm for Mamba-2")
SUPPORTS_STATES_OUT = True

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
if INTERPRET:
    import triton.experimental.gluon  # noqa: F401  (see kernels/triton.py)


# Helpers are plain functions under the interpreter (triton_launch.helper_jit). For the same reason the kernels sum
# with tl.reduce / tl.associative_scan and the standard sum combine (which the interpreter runs as numpy) instead of
# tl.sum / tl.cumsum (jit functions): the same operations when compiled.
_device_function = helper_jit(INTERPRET)


# Mamba-1's softplus (kernels/_triton_interpret.py): log(1 + exp(dt)) as written lost the low bits of exp(dt) for
# the small δ trained models have (δ 1e-3: 1e-5 relative in y and the state, 100x float32's; a clean layer read as
# DIVERGED until 2026-12-06); corrected, within 6 ulps of float64's.
_softplus = exec_file(Path(__file__).with_name("_triton_interpret.py"), f"{__name__}_softplus")._softplus


@triton.jit
def _ssd_steps_kernel(
    s0_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, y_ptr, s1_ptr, so_ptr,
    T, P, N, heads_per_group,
    s0_s, s0_h, s0_p, s0_n, x_s, x_t, x_h, x_p, dt_s, dt_t, dt_h, A_h,
    B_s, B_t, B_g, B_n, C_s, C_t, C_g, C_n, y_s, y_t, y_h, y_p, s1_s, s1_h, s1_p, s1_n,
    so_s, so_t, so_h, so_p, so_n,
    HAS_STATES_OUT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    g = h // heads_per_group
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)     # this program's rows of the head's state
    offs_n = tl.arange(0, BLOCK_N)
    mp, mn = offs_p < P, offs_n < N
    m2 = mp[:, None] & mn[None, :]
    st = tl.load(s0_ptr + s * s0_s + h * s0_h + offs_p[:, None] * s0_p + offs_n[None, :] * s0_n,
                 mask=m2, other=0.0).to(tl.float32)
    a = tl.load(A_ptr + h * A_h).to(tl.float32)
    for t in tl.range(T, num_stages=STAGES):
        d = _softplus(tl.load(dt_ptr + s * dt_s + t * dt_t + h * dt_h).to(tl.float32))
        xv = tl.load(x_ptr + s * x_s + t * x_t + h * x_h + offs_p * x_p, mask=mp, other=0.0).to(tl.float32)
        bv = tl.load(B_ptr + s * B_s + t * B_t + g * B_g + offs_n * B_n, mask=mn, other=0.0).to(tl.float32)
        cv = tl.load(C_ptr + s * C_s + t * C_t + g * C_g + offs_n * C_n, mask=mn, other=0.0).to(tl.float32)
        st = tl.exp(d * a) * st + (d * xv)[:, None] * bv[None, :]
        yv = tl.reduce(st * cv[None, :], 1, tl.standard._sum_combine)
        tl.store(y_ptr + s * y_s + t * y_t + h * y_h + offs_p * y_p, yv, mask=mp)
        if HAS_STATES_OUT:
            tl.store(so_ptr + s * so_s + t * so_t + h * so_h + offs_p[:, None] * so_p + offs_n[None, :] * so_n,
                     st, mask=m2)
    tl.store(s1_ptr + s * s1_s + h * s1_h + offs_p[:, None] * s1_p + offs_n[None, :] * s1_n, st, mask=m2)


@triton.jit
def _ssd_chunked_kernel(
    s0_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, y_ptr, s1_ptr,
    T, P, N, heads_per_group, Q,
    s0_s, s0_h, s0_p, s0_n, x_s, x_t, x_h, x_p, dt_s, dt_t, dt_h, A_h,
    B_s, B_t, B_g, B_n, C_s, C_t, C_g, C_n, y_s, y_t, y_h, y_p, s1_s, s1_h, s1_p, s1_n,
    BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    g = h // heads_per_group
    offs_q = tl.arange(0, BLOCK_Q)
    offs_p = tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mp, mn = offs_p < P, offs_n < N
    st = tl.load(s0_ptr + s * s0_s + h * s0_h + offs_p[:, None] * s0_p + offs_n[None, :] * s0_n,
                 mask=mp[:, None] & mn[None, :], other=0.0).to(tl.float32)            # [P, N]
    a = tl.load(A_ptr + h * A_h).to(tl.float32)
    for c0 in range(0, T, Q):
        tt = c0 + offs_q
        mq = (offs_q < Q) & (tt < T)
        d = _softplus(tl.load(dt_ptr + s * dt_s + tt * dt_t + h * dt_h, mask=mq, other=0.0).to(tl.float32))
        d = tl.where(mq, d, 0.0)                          # padded tokens add nothing and do not decay
        lam = tl.associative_scan(d * a, 0, tl.standard._sum_combine)    # [Q], a cumsum
        lam_last = tl.reduce(tl.where(offs_q == tl.minimum(Q, T - c0) - 1, lam, 0.0), 0, tl.standard._sum_combine)
        xs = tl.load(x_ptr + s * x_s + tt[:, None] * x_t + h * x_h + offs_p[None, :] * x_p,
                     mask=mq[:, None] & mp[None, :], other=0.0).to(tl.float32)        # [Q, P]
        bs = tl.load(B_ptr + s * B_s + tt[:, None] * B_t + g * B_g + offs_n[None, :] * B_n,
                     mask=mq[:, None] & mn[None, :], other=0.0).to(tl.float32)        # [Q, N]
        cs = tl.load(C_ptr + s * C_s + tt[:, None] * C_t + g * C_g + offs_n[None, :] * C_n,
                     mask=mq[:, None] & mn[None, :], other=0.0).to(tl.float32)        # [Q, N]
        cb = tl.dot(cs, tl.trans(bs), input_precision="ieee")                        # [Q, Q]
        causal = offs_q[:, None] >= offs_q[None, :]
        seg = tl.where(causal, lam[:, None] - lam[None, :], 0.0)   # masked before exp: no overflow above
        m = tl.where(causal, cb * tl.exp(seg), 0.0) * d[None, :]
        y = tl.dot(m, xs, input_precision="ieee")                                     # [Q, P]
        y += tl.exp(lam)[:, None] * tl.dot(cs, tl.trans(st), input_precision="ieee")
        tl.store(y_ptr + s * y_s + tt[:, None] * y_t + h * y_h + offs_p[None, :] * y_p, y,
                 mask=mq[:, None] & mp[None, :])
        w = tl.where(mq, tl.exp(lam_last - lam) * d, 0.0)                            # [Q]
        st = tl.exp(lam_last) * st + tl.dot(tl.trans(xs * w[:, None]), bs, input_precision="ieee")
    tl.store(s1_ptr + s * s1_s + h * s1_h + offs_p[:, None] * s1_p + offs_n[None, :] * s1_n, st,
             mask=mp[:, None] & mn[None, :])


@triton.jit
def _gated_norm_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr, T, group, eps,
    x_s, x_t, x_d, z_s, z_t, z_d, w_d, y_s, y_t, y_d,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    s, t = row // T, row % T
    q = tl.program_id(1).to(tl.int64)
    offs = q * group + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < group
    xv = tl.load(x_ptr + s * x_s + t * x_t + offs * x_d, mask=m, other=0.0).to(tl.float32)
    zv = tl.load(z_ptr + s * z_s + t * z_t + offs * z_d, mask=m, other=0.0).to(tl.float32)
    v = xv * zv / (1.0 + tl.exp(-zv))
    inv = 1.0 / tl.sqrt(tl.reduce(v * v, 0, tl.standard._sum_combine) / group + eps)
    wv = tl.load(w_ptr + offs * w_d, mask=m, other=0.0).to(tl.float32)
    tl.store(y_ptr + s * y_s + t * y_t + offs * y_d, v * inv * wv, mask=m)


# The interpreter's schedules (scan_plan and rms_norm_gated pick them under TRITON_INTERPRET only): there every tl
# operation costs 20-200 us of Python whatever its tile, so one program takes every head, or every row, at once. Each
# element is the same fp32 arithmetic in the same order as in the kernels above and each sum runs over the same
# contiguous last axis, so they give the same bits on the CPU (tests/test_triton_mamba2.py). They compile for a GPU
# too; no GPU plan uses them.
@triton.jit
def _ssd_steps_heads_kernel(
    s0_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, y_ptr, s1_ptr, so_ptr,
    T, H, P, N, heads_per_group,
    s0_s, s0_h, s0_p, s0_n, x_s, x_t, x_h, x_p, dt_s, dt_t, dt_h, A_h,
    B_s, B_t, B_g, B_n, C_s, C_t, C_g, C_n, y_s, y_t, y_h, y_p, s1_s, s1_h, s1_p, s1_n,
    so_s, so_t, so_h, so_p, so_n,
    HAS_STATES_OUT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # _ssd_steps_kernel for every head of sequence s: the state as an [H, P, N] tile, per-head values as [H, 1, 1]
    s = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H).to(tl.int64)[:, None, None]
    p = tl.arange(0, BLOCK_P).to(tl.int64)[None, :, None]
    n = tl.arange(0, BLOCK_N).to(tl.int64)[None, None, :]
    g = h // heads_per_group
    mh = h < H
    mhp, mhn = mh & (p < P), mh & (n < N)
    m3 = mhp & (n < N)
    st = tl.load(s0_ptr + s * s0_s + h * s0_h + p * s0_p + n * s0_n, mask=m3, other=0.0).to(tl.float32)
    a = tl.load(A_ptr + h * A_h, mask=mh, other=0.0).to(tl.float32)
    # each operand's offsets at token 0, moved on by its token stride each step (one operation each)
    dt_p = dt_ptr + s * dt_s + h * dt_h
    x_q = x_ptr + s * x_s + h * x_h + p * x_p
    B_q = B_ptr + s * B_s + g * B_g + n * B_n
    C_q = C_ptr + s * C_s + g * C_g + n * C_n
    y_q = y_ptr + s * y_s + h * y_h + p * y_p
    so_q = so_ptr + s * so_s + h * so_h + p * so_p + n * so_n
    for _ in range(T):
        d = _softplus(tl.load(dt_p, mask=mh, other=0.0).to(tl.float32))                   # [H, 1, 1]
        xv = tl.load(x_q, mask=mhp, other=0.0).to(tl.float32)                             # [H, P, 1]
        bv = tl.load(B_q, mask=mhn, other=0.0).to(tl.float32)                             # [H, 1, N]
        cv = tl.load(C_q, mask=mhn, other=0.0).to(tl.float32)
        st = tl.exp(d * a) * st + (d * xv) * bv
        yv = tl.reduce(st * cv, 2, tl.standard._sum_combine, keep_dims=True)              # [H, P, 1]
        tl.store(y_q, yv, mask=mhp)
        if HAS_STATES_OUT:
            tl.store(so_q, st, mask=m3)
            so_q += so_t
        dt_p += dt_t
        x_q += x_t
        B_q += B_t
        C_q += C_t
        y_q += y_t
    tl.store(s1_ptr + s * s1_s + h * s1_h + p * s1_p + n * s1_n, st, mask=m3)


@triton.jit
def _gated_norm_rows_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr, R, T, group, n_groups, eps,
    x_s, x_t, x_d, z_s, z_t, z_d, w_d, y_s, y_t, y_d,
    BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK: tl.constexpr,
):
    # _gated_norm_kernel for BLOCK_R rows (s, t) and every group q at once: [BLOCK_R, BLOCK_Q, BLOCK] tiles
    row = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)[:, None, None]
    s, t = row // T, row % T
    q = tl.arange(0, BLOCK_Q).to(tl.int64)[None, :, None]
    e = tl.arange(0, BLOCK)[None, None, :]
    offs = q * group + e
    mw = (q < n_groups) & (e < group)
    m = (row < R) & mw
    xv = tl.load(x_ptr + s * x_s + t * x_t + offs * x_d, mask=m, other=0.0).to(tl.float32)
    zv = tl.load(z_ptr + s * z_s + t * z_t + offs * z_d, mask=m, other=0.0).to(tl.float32)
    v = xv * zv / (1.0 + tl.exp(-zv))
    inv = 1.0 / tl.sqrt(tl.reduce(v * v, 2, tl.standard._sum_combine, keep_dims=True) / group + eps)
    wv = tl.load(w_ptr + offs * w_d, mask=mw, other=0.0).to(tl.float32)
    tl.store(y_ptr + s * y_s + t * y_t + offs * y_d, v * inv * wv, mask=m)


def _check_device(op, **tensors):
    check_device(op, INTERPRET, **tensors)


# Triton's per-call host work (argument binding, its specialization key) done once per argument key
_launch_steps, _launch_chunked, _launch_norm, _launch_heads, _launch_norm_rows = (Launch(k, INTERPRET) for k in (
    _ssd_steps_kernel, _ssd_chunked_kernel, _gated_norm_kernel, _ssd_steps_heads_kernel, _gated_norm_rows_kernel))
NORM_TILE = 1 << 16         # elements of one interpreted norm program's tiles (rows x groups x group block)


SCHEDULES = ("steps", "heads", "chunked")


def scan_plan(S, T, H, P, N, states_out: bool) -> dict:
    """Compiled: `steps` for every call, a program per (sequence, head, BLOCK_P rows of its state). Timed on an H100
    (benchmarks/mamba2_gpu.py, 2026-12-06, mamba2-2.7b's heads) it beat `chunked` 46-60x on prompts (1 x 2048
    tokens 1.01 ms against 47.5) and the plain torch chunked form 5-10x; three launches of the chunked form with
    every chunk at once were slower than it at every shape (its inner products run on FMA units in fp32, and the
    state's carry from chunk to chunk stays sequential). Eight rows in one warp, the loop's loads pipelined four
    tokens deep from four tokens on (STAGES 4: 33-63% faster than 1); one plan with per-token states or without,
    so y and the state are the same bits whatever a compare captures (with states the writes bound it).
    Interpreted (the cost is per operation, not per element): `heads` for decode and per-token states (every head
    of a sequence in one program), `chunked` SSD with Q 16 otherwise."""
    if not INTERPRET:                   # a loop of 1-3 tokens has nothing to pipeline
        return dict(schedule="steps", BLOCK_P=8, num_warps=1, STAGES=4 if T >= 4 else 1)
    if states_out or T <= 2:
        return dict(schedule="heads")
    return dict(schedule="chunked", chunk_size=16)


def ssd_scan(ssm_state, x, dt, A, B, C, *, states_out=None, plan: dict | None = None):
    """Mamba-2 scan of one ubatch (module docstring). plan: {"schedule": "steps" | "heads" | "chunked",
    "chunk_size": Q}."""
    S, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    _check("ssd_scan", tuple(ssm_state.shape) == (S, H, P, N), "ssm_state must be [S, H, P, N]",
           ssm_state=ssm_state, x=x, B=B)
    _check("ssd_scan", tuple(dt.shape) == (S, T, H) and tuple(A.shape) == (H,), "dt must be [S, T, H], A [H]",
           x=x, dt=dt, A=A)
    _check("ssd_scan", tuple(B.shape) == (S, T, G, N) and C.shape == B.shape and H % G == 0,
           "B and C must be [S, T, G, N] with G dividing H", x=x, B=B, C=C)
    if states_out is not None:
        _check("ssd_scan", tuple(states_out.shape) == (S, T, H, P, N), "states_out must be [S, T, H, P, N]",
               x=x, states_out=states_out)
    _check_device("ssd_scan", ssm_state=ssm_state, x=x, dt=dt, A=A, B=B, C=C)
    y = torch.empty((S, T, H, P), dtype=x.dtype, device=x.device)
    new_state = torch.empty((S, H, P, N), dtype=ssm_state.dtype, device=ssm_state.device)
    if T == 0:
        new_state.copy_(ssm_state)
        return y, new_state
    plan = dict(plan) if plan is not None else scan_plan(S, T, H, P, N, states_out is not None)
    _check("ssd_scan", plan.get("schedule") in SCHEDULES, f"plan's schedule must be one of {', '.join(SCHEDULES)}, "
           f"not {plan.get('schedule')!r}")
    block_p, block_n = next_pow2(P), next_pow2(N)
    common = (T, P, N, H // G)
    strides = (*ssm_state.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(),
               *y.stride(), *new_state.stride())
    so = states_out if states_out is not None else new_state
    so_strides = states_out.stride() if states_out is not None else (0,) * 5
    if plan["schedule"] == "heads":
        _launch_heads((S,), (ssm_state, x, dt, A, B, C, y, new_state, so), (T, H, P, N, H // G, *strides, *so_strides),
                      dict(HAS_STATES_OUT=states_out is not None, BLOCK_H=next_pow2(H), BLOCK_P=block_p,
                           BLOCK_N=block_n))
        return y, new_state
    if plan["schedule"] == "steps" or states_out is not None:
        bp = min(block_p, next_pow2(int(plan.get("BLOCK_P", block_p))))
        _launch_steps((S, H, cdiv(P, bp)), (ssm_state, x, dt, A, B, C, y, new_state, so),
                      (*common, *strides, *so_strides),
                      dict(HAS_STATES_OUT=states_out is not None, BLOCK_P=bp, BLOCK_N=block_n,
                           STAGES=int(plan.get("STAGES", 1)), num_warps=int(plan.get("num_warps", 4))))
        return y, new_state
    Q = int(plan["chunk_size"])
    lo = 1 if INTERPRET else 16                    # tl.dot needs 16-wide tiles when compiled
    _launch_chunked((S, H), (ssm_state, x, dt, A, B, C, y, new_state), (*common, Q, *strides),
                    dict(BLOCK_Q=max(lo, next_pow2(Q)), BLOCK_P=max(lo, block_p),
                         BLOCK_N=max(lo, block_n)))
    return y, new_state


def rms_norm_gated(x, z, weight, eps, n_groups, *, plan: dict | None = None):
    """Gate then grouped RMSNorm (module docstring); x, z [S, T, Dn] (any strides), weight [Dn].
    plan: {"schedule": "row" (a program per token and group) | "rows" (interpreted: many tokens, every group)}."""
    _check("rms_norm_gated", x.dim() == 3 and z.shape == x.shape and tuple(weight.shape) == (x.shape[-1],)
           and x.shape[-1] % n_groups == 0, "x, z must be [S, T, Dn], weight [Dn], n_groups dividing Dn",
           x=x, z=z, weight=weight)
    _check_device("rms_norm_gated", x=x, z=z, weight=weight)
    S, T, Dn = x.shape
    y = torch.empty((S, T, Dn), dtype=x.dtype, device=x.device)
    group = Dn // n_groups
    schedule = (plan or {}).get("schedule", "rows" if INTERPRET else "row")
    if S * T and schedule == "rows":
        block, block_q = next_pow2(group), next_pow2(n_groups)
        rows = min(next_pow2(S * T), max(1, NORM_TILE // (block * block_q)))
        _launch_norm_rows((triton.cdiv(S * T, rows),), (x, z, weight, y),
                          (S * T, T, group, n_groups, float(eps), *x.stride(), *z.stride(), *weight.stride(),
                           *y.stride()), dict(BLOCK_R=rows, BLOCK_Q=block_q, BLOCK=block))
    elif S * T:
        _launch_norm((S * T, n_groups), (x, z, weight, y),
                     (T, group, float(eps), *x.stride(), *z.stride(), *weight.stride(), *y.stride()),
                     dict(BLOCK=next_pow2(group)))
    return y


OPS = {"ssd_scan": ssd_scan, "rms_norm_gated": rms_norm_gated}
