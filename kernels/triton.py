"""Triton kernels for Mamba-1's `ssm_conv` and `ssm_scan`: the default device plug-in.

The same file runs compiled on a GPU (`device="cuda"`) and, where there is none, under Triton's interpreter on
CPU tensors (`TRITON_INTERPRET=1`, set by `mamba_debug.plugins` before it executes this file). Every pointer,
stride and mask is therefore exercised on a laptop and in CI; only the launch sizes differ (`_launch_config`).

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
import functools
import os

import torch
import triton
import triton.language as tl

NAME = "triton"
DESCRIPTION = "Triton ssm_conv and ssm_scan (the default device kernels; compiled on cuda, interpreted on CPU)"
SUPPORTS_STATES_OUT = True

# Decided once, when the plug-in loader executes this file: `triton.jit` below then builds interpreted or
# compiled kernels, and the launchers pick block sizes and check tensor devices to match.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

# Triton decides interpreted-or-compiled for its own library (tl.sum, tl.zeros, ... are @triton.jit functions)
# when `triton` is first imported, once per process. The kernels below use only builtins (and tl.reduce with
# triton's sum combine, which the interpreter recognises and never calls), so they run under the interpreter
# whichever way triton was imported; compiling needs the library compiled, so say so plainly.
if INTERPRET:
    # The first launch imports triton.experimental.gluon, which asserts that TRITON_INTERPRET is still set if
    # triton's library was built interpreted; the loader unsets it after executing this file, so import it now.
    import triton.experimental.gluon  # noqa: F401
elif not isinstance(tl.standard._sum_combine, triton.runtime.JITFunction):
    raise ImportError("triton was first imported with TRITON_INTERPRET=1 in this process, so its library is "
                      "interpreted and cannot be compiled for cuda; run the cuda kernels in another process")

SOFTPLUS_THRESHOLD = tl.constexpr(20.0)   # as mamba_debug.ops and llama.cpp: softplus(dt) = dt above it


# %%
# Compute kernels
# ---------------
# Layout is token-major, as the projections produce it: for a fixed token, the D channels are (usually)
# adjacent, so each program owns a block of channels of one sequence and loads them in one go.

@triton.jit
def _load_window(state_base, x_base, rows, offs_d, mask,
                 stride_state_t, stride_state_d, stride_x_t, stride_x_d,
                 KM1: tl.constexpr):
    """Rows `rows` x channels `offs_d` of window = concat(conv_state, x) over time, as fp32.

    Window rows < K-1 come from the old conv state, the others from x (row j is token j-(K-1)). The window is
    never materialised: that would be a copy of x per call, and it is what the op is asked to avoid."""
    in_state = (rows < KM1)[:, None]
    from_state = tl.load(state_base + rows[:, None] * stride_state_t + offs_d[None, :] * stride_state_d,
                         mask=mask & in_state, other=0.0)
    from_x = tl.load(x_base + (rows - KM1)[:, None] * stride_x_t + offs_d[None, :] * stride_x_d,
                     mask=mask & ~in_state, other=0.0)
    return tl.where(in_state, from_state, from_x).to(tl.float32)


@triton.jit
def _ssm_conv_kernel(
    # pointers
    state_ptr,          # conv_state [S, K-1, D] (read only)
    x_ptr,              # x [S, T, D] (read only)
    w_ptr,              # weight [D, K] (read only)
    out_ptr,            # out [S, T, D]
    new_state_ptr,      # new conv state [S, K-1, D]
    # sizes
    T, D,
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
    pid_d = tl.program_id(1)
    pid_t = tl.program_id(2)
    # Offsets are 64-bit from the start: no index product can overflow, and Triton's interpreter then skips its
    # per-operation int32 overflow checks, which otherwise dominate the cost of a launch on the CPU.
    offs_d = (pid_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
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

    # New state = the last K-1 window rows, i.e. rows T .. T+K-2. When T < K-1 some of them are old state rows:
    # _load_window takes care of that. The first token tile of each channel block writes it (once).
    if pid_t == 0:
        offs_r = tl.arange(0, BLOCK_KM1).to(tl.int64)
        mask_r = (offs_r < K - 1)[:, None] & mask_d[None, :]
        tail = _load_window(state_base, x_base, T + offs_r, offs_d, mask_r,
                            stride_state_t, stride_state_d, stride_x_t, stride_x_d, K - 1)
        new_ptrs = (new_state_ptr + pid_s * stride_new_s
                    + offs_r[:, None] * stride_new_t + offs_d[None, :] * stride_new_d)
        tl.store(new_ptrs, tail.to(new_state_ptr.dtype.element_ty), mask=mask_r)


@triton.jit
def _softplus(dt):
    """log(1 + exp(dt)), and dt itself above the threshold, in fp32.

    tl has no log1p, and log(1 + u) loses the low bits of small u = exp(dt) (dt around -4 is common). The
    classic correction log(w) * u / (w - 1) with w = 1 + u restores them; w == 1 means log1p(u) == u."""
    u = tl.exp(tl.minimum(dt, SOFTPLUS_THRESHOLD))
    w = 1.0 + u
    log1p_u = tl.where(w == 1.0, u, tl.log(w) * (u / tl.where(w == 1.0, 1.0, w - 1.0)))
    return tl.where(dt > SOFTPLUS_THRESHOLD, dt, log1p_u)


@triton.jit
def _load_token(x_ptrs, dt_ptrs, B_ptrs, C_ptrs, mask_d, mask_n):
    """x_t, dt_t [BLOCK_D] and B_t, C_t [BLOCK_N] of one token, as fp32 (masked lanes read 0)."""
    x_t = tl.load(x_ptrs, mask=mask_d, other=0.0).to(tl.float32)
    dt_t = tl.load(dt_ptrs, mask=mask_d, other=0.0).to(tl.float32)
    B_t = tl.load(B_ptrs, mask=mask_n, other=0.0).to(tl.float32)
    C_t = tl.load(C_ptrs, mask=mask_n, other=0.0).to(tl.float32)
    return x_t, dt_t, B_t, C_t


@triton.jit
def _ssm_scan_kernel(
    # pointers
    state_ptr,          # ssm_state [S, D, N] (read only)
    x_ptr,              # x [S, T, D] (read only)
    dt_ptr,             # dt [S, T, D], before softplus (read only)
    A_ptr,              # A [D, N] (read only)
    B_ptr,              # B [S, T, N] (read only)
    C_ptr,              # C [S, T, N] (read only)
    y_ptr,              # y [S, T, D]
    new_state_ptr,      # new ssm state [S, D, N]
    states_out_ptr,     # every h_t [S, T, D, N]; not touched unless HAS_STATES_OUT
    # sizes
    T, D, N,
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
    HAS_STATES_OUT: tl.constexpr,   # write every h_t into states_out
    BLOCK_D: tl.constexpr,          # channels per program
    BLOCK_N: tl.constexpr,          # N rounded up to a power of two; padded lanes stay exactly 0
):
    # One program: one sequence, BLOCK_D channels, all N states, walking the tokens in order with the state
    # h [BLOCK_D, BLOCK_N] held in registers. B_t and C_t are loaded once per program and shared by its channels.
    pid_s = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1)
    offs_d = (pid_d * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)   # 64-bit: see _ssm_conv_kernel
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    mask_d = offs_d < D
    mask_n = offs_n < N
    mask_dn = mask_d[:, None] & mask_n[None, :]

    h = tl.load(state_ptr + pid_s * stride_state_s
                + offs_d[:, None] * stride_state_d + offs_n[None, :] * stride_state_n,
                mask=mask_dn, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + offs_d[:, None] * stride_A_d + offs_n[None, :] * stride_A_n,
                mask=mask_dn, other=0.0).to(tl.float32)

    # Per-token pointers; they advance by one token stride per step (pointer arithmetic is 64-bit, so even
    # t * stride never overflows).
    x_ptrs = x_ptr + pid_s * stride_x_s + offs_d * stride_x_d
    dt_ptrs = dt_ptr + pid_s * stride_dt_s + offs_d * stride_dt_d
    B_ptrs = B_ptr + pid_s * stride_B_s + offs_n * stride_B_n
    C_ptrs = C_ptr + pid_s * stride_C_s + offs_n * stride_C_n
    y_ptrs = y_ptr + pid_s * stride_y_s + offs_d * stride_y_d
    so_ptrs = states_out_ptr + pid_s * stride_so_s + offs_d[:, None] * stride_so_d + offs_n[None, :] * stride_so_n

    # The time loop is latency-bound (each step waits on the previous h), so the loads of token t+1 are issued
    # before the math of token t and overlap it. It is a `while` loop: Triton 3.6's interpreter cannot take a
    # runtime int as a range() bound under numpy >= 2.5.
    x_t, dt_t, B_t, C_t = _load_token(x_ptrs, dt_ptrs, B_ptrs, C_ptrs, mask_d, mask_n)
    t = 0
    while t < T:
        x_ptrs += stride_x_t
        dt_ptrs += stride_dt_t
        B_ptrs += stride_B_t
        C_ptrs += stride_C_t
        # Token t+1 exists? (tl.where rather than `mask & more`: the interpreter types scalar & block as int32.)
        more = t + 1 < T
        x_n, dt_n, B_n, C_n = _load_token(x_ptrs, dt_ptrs, B_ptrs, C_ptrs,
                                          tl.where(more, mask_d, False), tl.where(more, mask_n, False))

        delta = _softplus(dt_t)[:, None]                              # [BLOCK_D, 1]
        # Same operation order as mamba_debug.ops.ssm_scan: exp(delta*A)*h + (delta*B)*x.
        h = tl.exp(delta * A) * h + (delta * B_t[None, :]) * x_t[:, None]
        y_t = tl.reduce(h * C_t[None, :], 1, tl.standard._sum_combine)   # tl.sum(.., axis=1), see top
        tl.store(y_ptrs, y_t.to(y_ptr.dtype.element_ty), mask=mask_d)
        y_ptrs += stride_y_t
        if HAS_STATES_OUT:
            tl.store(so_ptrs, h.to(states_out_ptr.dtype.element_ty), mask=mask_dn)
            so_ptrs += stride_so_t

        x_t, dt_t, B_t, C_t = x_n, dt_n, B_n, C_n
        t += 1

    tl.store(new_state_ptr + pid_s * stride_new_s
             + offs_d[:, None] * stride_new_d + offs_n[None, :] * stride_new_n,
             h.to(new_state_ptr.dtype.element_ty), mask=mask_dn)


# %%
# Launch parameters
# -----------------
# The one place that differs between the GPU and the interpreter. Block sizes change speed, not the arithmetic:
# every output element is the same sum in the same order whatever the blocks are. (Compiled, the scan's sum over
# N may be split across threads differently for other blocks or strides: a rounding difference, no more.)

@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch_config(op: str, S: int, T: int, D: int, N: int = 1, device=None) -> dict:
    """Block sizes and warps for `op` ("ssm_conv" or "ssm_scan") on an [S, T, D] input with N states.

    Interpreter: each program instance costs a large fixed Python overhead (a 64-token scan at D=512 took
    2.2 s with 64-channel blocks, 0.3 s with one 512-channel block), so use as few programs as possible.
    GPU: small channel blocks so that S * D / BLOCK_D programs keep every SM busy even at batch 1."""
    if INTERPRET:
        block_d = min(triton.next_power_of_2(D), 1024)
        block_t = min(triton.next_power_of_2(T), max(1, 2 ** 16 // block_d))   # conv tiles up to 64K elements
        return dict(BLOCK_D=block_d, BLOCK_T=block_t, num_warps=1)
    if op == "ssm_conv":
        # 128 channels x up to 16 tokens x the K taps: 512-byte coalesced rows, and programs along T for long
        # prompts (the K taps are a block dimension too, so 16 tokens keep as many values live as 32 did before).
        block_d, block_t = 128, min(triton.next_power_of_2(T), 16)
    else:
        # The scan is sequential in T, so parallelism comes from S x D only: the largest channel block that
        # still gives about two programs per SM (the reference decode kernel uses 32).
        sms = _sm_count(device.index if device is not None and device.index is not None else 0)
        block_d = next((b for b in (64, 32) if S * triton.cdiv(D, b) >= 2 * sms), 16)
        block_t = 1
    elements = block_d * block_t * N
    num_warps = max(1, min(8, elements // 512))   # about 4-16 fp32 values per thread
    return dict(BLOCK_D=block_d, BLOCK_T=block_t, num_warps=num_warps)


# %%
# Launchers
# ---------

def _empty(shape, like: torch.Tensor) -> torch.Tensor:
    """Every output is allocated here (a test fills them with NaN to prove each element gets written)."""
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def _check(op: str, ok: bool, what: str, **tensors):
    if not ok:
        shapes = ", ".join(f"{k}={list(v.shape)}" for k, v in tensors.items())
        raise ValueError(f"{op}: {what} (got {shapes})")


def _check_device(op: str, **tensors):
    """No silent fallback: interpreted kernels take CPU tensors, compiled kernels take CUDA tensors."""
    want = "cpu" if INTERPRET else "cuda"
    for k, v in tensors.items():
        if v.device.type != want:
            mode = "Triton's interpreter (TRITON_INTERPRET=1)" if INTERPRET else "a CUDA GPU"
            raise ValueError(f"{op}: this copy of the triton kernels was loaded for {mode} and takes {want} "
                             f"tensors, but {k} is on {v.device}; load the plug-in for the matching device")


def ssm_conv(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    """Causal depthwise convolution of one ubatch; see the module docstring for shapes."""
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
    cfg = _launch_config("ssm_conv", S, T, D, device=x.device)
    grid = (S, triton.cdiv(D, cfg["BLOCK_D"]), triton.cdiv(T, cfg["BLOCK_T"]))
    _ssm_conv_kernel[grid](
        conv_state, x, weight, out, new_state,
        T, D,
        *conv_state.stride(), *x.stride(), *weight.stride(), *out.stride(), *new_state.stride(),
        K=K, BLOCK_KM1=triton.next_power_of_2(K - 1), BLOCK_K=triton.next_power_of_2(K),
        BLOCK_T=cfg["BLOCK_T"], BLOCK_D=cfg["BLOCK_D"], num_warps=cfg["num_warps"],
    )
    return out, new_state


def ssm_scan(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor, *, states_out: torch.Tensor | None = None):
    """Selective scan of one ubatch; see the module docstring for shapes."""
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
    cfg = _launch_config("ssm_scan", S, T, D, triton.next_power_of_2(N), device=x.device)
    has_states_out = states_out is not None
    # Without states_out the kernel still needs a pointer argument; it is never dereferenced.
    so, so_strides = (states_out, states_out.stride()) if has_states_out else (new_state, (0, 0, 0, 0))
    grid = (S, triton.cdiv(D, cfg["BLOCK_D"]))
    _ssm_scan_kernel[grid](
        ssm_state, x, dt, A, B, C, y, new_state, so,
        T, D, N,
        *ssm_state.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(),
        *y.stride(), *new_state.stride(), *so_strides,
        HAS_STATES_OUT=has_states_out, BLOCK_D=cfg["BLOCK_D"], BLOCK_N=triton.next_power_of_2(N),
        num_warps=cfg["num_warps"],
    )
    return y, new_state


OPS = {"ssm_conv": ssm_conv, "ssm_scan": ssm_scan}
