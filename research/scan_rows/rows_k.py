"""Prototype: the step scan with each lane owning whole state rows (all 16 n of its channels in registers)."""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _softplus(dt):
    u = tl.exp(tl.minimum(dt, 20.0))
    w = 1.0 + u
    return tl.where(dt > 20.0, dt, tl.log(w) - ((w - 1.0) - u) / w)


@triton.jit
def _r1(p, s: tl.constexpr, m):
    return tl.load(p, mask=m, other=0.0).to(tl.float32)


@triton.jit
def _r2(p, sn, s: tl.constexpr, m):
    return tl.join(_r1(p, s, m), _r1(p + s * sn, s, m))


@triton.jit
def _r4(p, sn, s: tl.constexpr, m):
    return tl.join(_r2(p, sn, 2 * s, m), _r2(p + s * sn, sn, 2 * s, m))


@triton.jit
def _r8(p, sn, s: tl.constexpr, m):
    return tl.join(_r4(p, sn, 2 * s, m), _r4(p + s * sn, sn, 2 * s, m))


@triton.jit
def _r16(p, sn, s: tl.constexpr, m):
    return tl.join(_r8(p, sn, 2 * s, m), _r8(p + s * sn, sn, 2 * s, m))


@triton.jit
def _rows(p, sn, m, BLOCK_D: tl.constexpr):
    """[BLOCK_D, 16]: p[d] + n * sn, each lane holding whole rows (joins put their new axis in a lane's registers)."""
    return tl.reshape(_r16(p, sn, 1, m), [BLOCK_D, 16])


@triton.jit
def _tok(x_p, dt_p, B_p, C_p, j, n_tok, sx, sdt, sB, sC, mask_d, mask_n):
    ok = j < n_tok
    md = tl.where(ok, mask_d, False)
    mn = tl.where(ok, mask_n, False)
    x = tl.load(x_p + j * sx, mask=md, other=0.0).to(tl.float32)
    dt = tl.load(dt_p + j * sdt, mask=md, other=float("-inf")).to(tl.float32)
    B = tl.load(B_p + j * sB, mask=mn, other=0.0).to(tl.float32)
    C = tl.load(C_p + j * sC, mask=mn, other=0.0).to(tl.float32)
    return x, dt, B, C


@triton.jit
def _step(h, decay, A, x_t, dt_t, B_t, C_t, y_p, j, n_tok, sy, mask_d, SUMMARY: tl.constexpr):
    delta = _softplus(dt_t)
    decay_t = tl.exp2(delta * A)
    h = decay_t * h + B_t * (delta * x_t)
    if SUMMARY:
        decay = decay * decay_t
    else:
        tl.store(y_p + j * sy, tl.sum(h * C_t, 1, keep_dims=True), mask=tl.where(j < n_tok, mask_d, False))
    return h, decay


@triton.jit
def scan_rows_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, y_ptr, new_state_ptr, end_ptr, decay_ptr,
    T, D, N, CHUNK_T, N_CHUNKS,
    stride_state_s, stride_state_d, stride_state_n,
    stride_x_s, stride_x_t, stride_x_d,
    stride_dt_s, stride_dt_t, stride_dt_d,
    stride_A_d, stride_A_n,
    stride_B_s, stride_B_t, stride_B_n,
    stride_C_s, stride_C_t, stride_C_n,
    stride_y_s, stride_y_t, stride_y_d,
    stride_new_s, stride_new_d, stride_new_n,
    SUMMARY: tl.constexpr, CHUNKED: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_s = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    pid_c = tl.program_id(2)
    d1 = tl.arange(0, BLOCK_D).to(tl.int64) + pid_d * BLOCK_D      # [BLOCK_D]
    m1 = d1 < D
    offs_d = d1[:, None]                                            # [BLOCK_D, 1]
    mask_d = offs_d < D
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)[None, :]            # [1, BLOCK_N]
    mask_n = offs_n < N
    A = _rows(A_ptr + d1 * stride_A_d, stride_A_n, m1, BLOCK_D) * LOG2E
    if CHUNKED:
        summary = (pid_s * N_CHUNKS) * D * N + d1 * N
    if SUMMARY:
        h = A * 0.0
    else:
        h = _rows(state_ptr + pid_s * stride_state_s + d1 * stride_state_d, stride_state_n, m1, BLOCK_D)
        if CHUNKED:
            c = 0
            while c < pid_c:
                h = (_rows(decay_ptr + summary + c * D * N, 1, m1, BLOCK_D) * h
                     + _rows(end_ptr + summary + c * D * N, 1, m1, BLOCK_D))
                c += 1
    t0 = 0
    n_tok = T
    if CHUNKED:
        t0 = pid_c * CHUNK_T
        n_tok = tl.minimum(T - t0, CHUNK_T)
    x_ptrs = x_ptr + pid_s * stride_x_s + offs_d * stride_x_d + t0 * stride_x_t
    dt_ptrs = dt_ptr + pid_s * stride_dt_s + offs_d * stride_dt_d + t0 * stride_dt_t
    B_ptrs = B_ptr + pid_s * stride_B_s + offs_n * stride_B_n + t0 * stride_B_t
    C_ptrs = C_ptr + pid_s * stride_C_s + offs_n * stride_C_n + t0 * stride_C_t
    y_ptrs = y_ptr + pid_s * stride_y_s + offs_d * stride_y_d + t0 * stride_y_t
    st = (stride_x_t, stride_dt_t, stride_B_t, stride_C_t)
    x0, dt0, B0, C0 = _tok(x_ptrs, dt_ptrs, B_ptrs, C_ptrs, 0, n_tok, *st, mask_d, mask_n)
    x1, dt1, B1, C1 = _tok(x_ptrs, dt_ptrs, B_ptrs, C_ptrs, 1, n_tok, *st, mask_d, mask_n)
    x2, dt2, B2, C2 = _tok(x_ptrs, dt_ptrs, B_ptrs, C_ptrs, 2, n_tok, *st, mask_d, mask_n)
    x3, dt3, B3, C3 = _tok(x_ptrs, dt_ptrs, B_ptrs, C_ptrs, 3, n_tok, *st, mask_d, mask_n)
    decay = A * 0.0 + 1.0
    i = 0
    while i < n_tok:
        h, decay = _step(h, decay, A, x0, dt0, B0, C0, y_ptrs, i, n_tok, stride_y_t, mask_d, SUMMARY)
        x0, dt0, B0, C0 = _tok(x_ptrs, dt_ptrs, B_ptrs, C_ptrs, i + 4, n_tok, *st, mask_d, mask_n)
        h, decay = _step(h, decay, A, x1, dt1, B1, C1, y_ptrs, i + 1, n_tok, stride_y_t, mask_d, SUMMARY)
        x1, dt1, B1, C1 = _tok(x_ptrs, dt_ptrs, B_ptrs, C_ptrs, i + 5, n_tok, *st, mask_d, mask_n)
        h, decay = _step(h, decay, A, x2, dt2, B2, C2, y_ptrs, i + 2, n_tok, stride_y_t, mask_d, SUMMARY)
        x2, dt2, B2, C2 = _tok(x_ptrs, dt_ptrs, B_ptrs, C_ptrs, i + 6, n_tok, *st, mask_d, mask_n)
        h, decay = _step(h, decay, A, x3, dt3, B3, C3, y_ptrs, i + 3, n_tok, stride_y_t, mask_d, SUMMARY)
        x3, dt3, B3, C3 = _tok(x_ptrs, dt_ptrs, B_ptrs, C_ptrs, i + 7, n_tok, *st, mask_d, mask_n)
        i += 4
    mask_dn = mask_d & mask_n
    if SUMMARY:
        so = (pid_s * N_CHUNKS + pid_c) * D * N + offs_d * N + offs_n
        tl.store(end_ptr + so, h, mask=mask_dn)
        tl.store(decay_ptr + so, decay, mask=mask_dn)
    else:
        store_mask = mask_dn
        if CHUNKED:
            store_mask = tl.where(pid_c == N_CHUNKS - 1, mask_dn, False)
        tl.store(new_state_ptr + pid_s * stride_new_s + offs_d * stride_new_d + offs_n * stride_new_n, h,
                 mask=store_mask)


def launch(h0, x, dt, A, B, C, *, block_d=64, warps=1, n_chunks=1):
    import torch
    S, T, D = x.shape
    N = A.shape[1]
    assert N == 16
    y = torch.empty_like(x)
    new = torch.empty_like(h0)
    chunk_t = -(-T // n_chunks)
    n_chunks = -(-T // chunk_t)
    summ = torch.empty((2, S, n_chunks, D, N), dtype=torch.float32, device=x.device) if n_chunks > 1 else new
    nb = -(-D // block_d)
    args = (h0, x, dt, A, B, C, y, new, summ[0] if n_chunks > 1 else new, summ[1] if n_chunks > 1 else new,
            T, D, N, chunk_t, n_chunks, *h0.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(),
            *C.stride(), *y.stride(), *new.stride())
    if n_chunks > 1:
        scan_rows_kernel[(S, nb, n_chunks - 1)](*args, SUMMARY=True, CHUNKED=True, BLOCK_D=block_d, BLOCK_N=16,
                                                num_warps=warps)
    scan_rows_kernel[(S, nb, n_chunks)](*args, SUMMARY=False, CHUNKED=n_chunks > 1, BLOCK_D=block_d, BLOCK_N=16,
                                        num_warps=warps)
    return y, new
