"""Prototype: kernels/triton.py's step scan with K token slots loaded K tokens ahead (the loop unrolled by K, so no
register is moved: a slot's load is read K steps after it was issued). A token past the end loads dt = -inf, which
makes delta exactly 0: decay 1, input 0, h unchanged, so no step needs a branch."""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _softplus(dt):
    u = tl.exp(tl.minimum(dt, 20.0))
    w = 1.0 + u
    return tl.where(dt > 20.0, dt, tl.log(w) - ((w - 1.0) - u) / w)


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
    decay_t = tl.exp2(delta[:, None] * A)
    h = decay_t * h + B_t[None, :] * (delta * x_t)[:, None]
    if SUMMARY:
        decay = decay * decay_t
    else:
        y_t = tl.reduce(h * C_t[None, :], 1, tl.standard._sum_combine)
        tl.store(y_p + j * sy, y_t, mask=tl.where(j < n_tok, mask_d, False))
    return h, decay


@triton.jit
def scan_deep_kernel(
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
    SUMMARY: tl.constexpr, CHUNKED: tl.constexpr, SLOTS: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_s = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    pid_c = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64) + pid_d * BLOCK_D
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    mask_d = offs_d < D
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]
    A = tl.load(A_ptr + offs_d[:, None] * stride_A_d + offs_n[None, :] * stride_A_n,
                mask=mask_dn, other=0.0).to(tl.float32) * LOG2E
    if CHUNKED:
        summary_offs = (pid_s * N_CHUNKS) * D * N + offs_d[:, None] * N + offs_n[None, :]
    decay = tl.full([BLOCK_D, BLOCK_N], 1.0, dtype=tl.float32)
    if SUMMARY:
        h = tl.full([BLOCK_D, BLOCK_N], 0.0, tl.float32)
    else:
        h = tl.load(state_ptr + pid_s * stride_state_s
                    + offs_d[:, None] * stride_state_d + offs_n[None, :] * stride_state_n,
                    mask=mask_dn, other=0.0).to(tl.float32)
        if CHUNKED:
            c = 0
            while c < pid_c:
                h = (tl.load(decay_ptr + summary_offs + c * D * N, mask=mask_dn, other=0.0) * h
                     + tl.load(end_ptr + summary_offs + c * D * N, mask=mask_dn, other=0.0))
                c += 1
    t0 = 0
    n_tok = T
    if CHUNKED:
        t0 = pid_c * CHUNK_T
        n_tok = tl.minimum(T - t0, CHUNK_T)
    x_p = x_ptr + pid_s * stride_x_s + offs_d * stride_x_d + t0 * stride_x_t
    dt_p = dt_ptr + pid_s * stride_dt_s + offs_d * stride_dt_d + t0 * stride_dt_t
    B_p = B_ptr + pid_s * stride_B_s + offs_n * stride_B_n + t0 * stride_B_t
    C_p = C_ptr + pid_s * stride_C_s + offs_n * stride_C_n + t0 * stride_C_t
    y_p = y_ptr + pid_s * stride_y_s + offs_d * stride_y_d + t0 * stride_y_t
    st = (stride_x_t, stride_dt_t, stride_B_t, stride_C_t)
    x0, dt0, B0, C0 = _tok(x_p, dt_p, B_p, C_p, 0, n_tok, *st, mask_d, mask_n)
    x1, dt1, B1, C1 = _tok(x_p, dt_p, B_p, C_p, 1, n_tok, *st, mask_d, mask_n)
    if SLOTS >= 4:
        x2, dt2, B2, C2 = _tok(x_p, dt_p, B_p, C_p, 2, n_tok, *st, mask_d, mask_n)
        x3, dt3, B3, C3 = _tok(x_p, dt_p, B_p, C_p, 3, n_tok, *st, mask_d, mask_n)
    i = 0
    while i < n_tok:
        h, decay = _step(h, decay, A, x0, dt0, B0, C0, y_p, i, n_tok, stride_y_t, mask_d, SUMMARY)
        x0, dt0, B0, C0 = _tok(x_p, dt_p, B_p, C_p, i + SLOTS, n_tok, *st, mask_d, mask_n)
        h, decay = _step(h, decay, A, x1, dt1, B1, C1, y_p, i + 1, n_tok, stride_y_t, mask_d, SUMMARY)
        x1, dt1, B1, C1 = _tok(x_p, dt_p, B_p, C_p, i + 1 + SLOTS, n_tok, *st, mask_d, mask_n)
        if SLOTS >= 4:
            h, decay = _step(h, decay, A, x2, dt2, B2, C2, y_p, i + 2, n_tok, stride_y_t, mask_d, SUMMARY)
            x2, dt2, B2, C2 = _tok(x_p, dt_p, B_p, C_p, i + 2 + SLOTS, n_tok, *st, mask_d, mask_n)
            h, decay = _step(h, decay, A, x3, dt3, B3, C3, y_p, i + 3, n_tok, stride_y_t, mask_d, SUMMARY)
            x3, dt3, B3, C3 = _tok(x_p, dt_p, B_p, C_p, i + 3 + SLOTS, n_tok, *st, mask_d, mask_n)
        i += SLOTS
    if SUMMARY:
        so = (pid_s * N_CHUNKS + pid_c) * D * N + offs_d[:, None] * N + offs_n[None, :]
        tl.store(end_ptr + so, h, mask=mask_dn)
        tl.store(decay_ptr + so, decay, mask=mask_dn)
    else:
        store_mask = mask_dn
        if CHUNKED:
            store_mask = tl.where(pid_c == N_CHUNKS - 1, mask_dn, False)
        tl.store(new_state_ptr + pid_s * stride_new_s + offs_d[:, None] * stride_new_d
                 + offs_n[None, :] * stride_new_n, h, mask=store_mask)


def launch(h0, x, dt, A, B, C, *, block_d=64, warps=2, n_chunks=1, slots=4):
    import torch
    S, T, D = x.shape
    N = A.shape[1]
    y = torch.empty_like(x)
    new = torch.empty_like(h0)
    chunk_t = -(-T // n_chunks)
    n_chunks = -(-T // chunk_t)
    summ = torch.empty((2, S, n_chunks, D, N), dtype=torch.float32, device=x.device) if n_chunks > 1 else None
    nb = -(-D // block_d)
    args = (h0, x, dt, A, B, C, y, new, summ[0] if n_chunks > 1 else new, summ[1] if n_chunks > 1 else new,
            T, D, N, chunk_t, n_chunks, *h0.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(),
            *C.stride(), *y.stride(), *new.stride())
    bn = 1 << (N - 1).bit_length()
    if n_chunks > 1:
        scan_deep_kernel[(S, nb, n_chunks - 1)](*args, SUMMARY=True, CHUNKED=True, SLOTS=slots, BLOCK_D=block_d,
                                                BLOCK_N=bn, num_warps=warps)
    scan_deep_kernel[(S, nb, n_chunks)](*args, SUMMARY=False, CHUNKED=n_chunks > 1, SLOTS=slots, BLOCK_D=block_d,
                                        BLOCK_N=bn, num_warps=warps)
    return y, new
