"""The op table of the layer types (Mamba-1, Mamba-2, attention) and their plain-torch implementations.

Every op of the layer graph (DESIGN.md "Op plug-ins") is looked up by name in an `OpTable`, so a
back-end (the float64 reference, the float32 CPU port, or a device plug-in) is just a table.
The torch functions below are the ground truth: the `reference` back-end runs them in float64 on
the CPU, the `cpu` back-end runs them in float32. They honour any strides, as ops must: the layer
hands them non-contiguous views (x, z, dt, B, C are slices of projections, as in llama.cpp).
"""
from __future__ import annotations

import functools
import warnings
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.nn.functional as F

from .errors import MambaDebugError
from .triton_env import exec_file, mode

OP_NAMES = ("rms_norm", "linear", "silu", "ssm_conv", "ssm_scan", "ssd_scan", "rms_norm_gated", "attention",
            "transfer")

# softplus switches to the identity above this dt, as llama.cpp and the reference Triton kernels do.
SOFTPLUS_THRESHOLD = 20.0


def _settle_vector_math():
    """Call torch's vectorized transcendentals once, on one thread, before any real work.

    Seen with torch 2.13 on a 2-core Intel CPU with AVX-512 and AMX (2026-12-05): in about half the processes, the
    first exp or log of the process, split over two threads, gave the second thread's half of the elements from
    another vector routine (2040 of 4096 float64 values 1 ulp apart from every later call). Loading a model computes
    A = -exp(A_log) first thing, so a model's A, and with it every error the engine measures, changed from run to
    run (an exact golden and a save/load round trip failed that way). After one call on a tensor too small to
    split, every later call gave the same bits in 0 of 40 processes."""
    for dtype in (torch.float32, torch.float64):
        x = torch.linspace(-1.0, 1.0, 16, dtype=dtype)
        for f in (torch.exp, torch.log1p, torch.expm1, torch.tanh, torch.sigmoid):
            f(x)
        torch.log(x.abs() + 1.0)


_settle_vector_math()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dim."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias, weight [out, in]."""
    return F.linear(x, weight, bias)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def softplus(dt: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(dt)), and dt itself above the threshold (no overflow, same as llama.cpp)."""
    return torch.where(dt > SOFTPLUS_THRESHOLD, dt, torch.log1p(torch.exp(dt.clamp(max=SOFTPLUS_THRESHOLD))))


def ssm_conv(conv_state: torch.Tensor, x: torch.Tensor, weight: torch.Tensor):
    """Causal depthwise convolution over one ubatch.

    conv_state [S, K-1, D], x [S, T, D], weight [D, K] -> (out [S, T, D], new_conv_state [S, K-1, D]).
    window = concat(conv_state, x) over time; out[s,t,d] = sum_k weight[d,k] * window[s,t+k,d].
    No bias, no activation (the layer adds them).
    """
    T = x.shape[1]
    K = weight.shape[1]
    window = torch.cat([conv_state, x], dim=1)                     # [S, K-1+T, D]
    out = torch.zeros_like(x, memory_format=torch.contiguous_format)
    for k in range(K):
        out = out + weight[:, k] * window[:, k:k + T, :]
    return out, window[:, T:, :].clone()


def _scan_block(T: int, per_token_bytes: int) -> int:
    """Tokens per block of the vectorised scans: their per-token buffers stay near 256 MB. (64 MB blocks were 6
    tokens of mamba2-2.7b's float64 states, 5.2 MB a token: a 32-token call took 1.12 ms against 0.59 on an H100;
    32 tokens of a 2.8B Mamba-1's, a 64-token call 0.58 against 0.32 ms. The bits do not depend on it.)"""
    return max(1, min(T, (256 << 20) // max(1, per_token_bytes)))


def _recurrence_loop(dA, dBx, h, hs):
    """hs[:, t] = dA[:, t] * h_{t-1} + dBx[:, t] (a multiply, then an add: no fused multiply-add); the last h."""
    for t in range(dA.shape[1]):
        torch.mul(dA[:, t], h, out=dA[:, t])                        # dA[:, t] is not read again
        h = torch.add(dA[:, t], dBx[:, t], out=hs[:, t])
    return h


# Where the recurrence runs as one Triton launch a block (`_recurrence_kernel.py`, the same bits as the loop):
# "cuda" on GPU tensors (the default), "off" nowhere, "always" on CPU tensors too, interpreted (tests).
RECURRENCE_KERNEL = "cuda"


def _recurrence(dA, dBx, h, hs):
    """`_recurrence_loop`; on a GPU one launch of `_recurrence_kernel.py` a block: the loop's 2 x L launches each
    pass over a token's whole state (the reference sides' cost on a GPU)."""
    kernel = _kernel_for(dA)
    last = None if kernel is None else kernel.recurrence(dA, dBx, h, hs, 1)
    return _recurrence_loop(dA, dBx, h, hs) if last is None else last


def _recurrence_heads(decay, h, hs, tmp):
    """Mamba-2's recurrence over a block: hs[:, t] = decay[:, t] * h_{t-1} + hs[:, t] in place (a multiply into
    tmp, then an add), decay [S, L, H, 1, 1]; the last h. On a GPU one launch, as `_recurrence`."""
    kernel = _kernel_for(hs)
    last = None if kernel is None else kernel.recurrence(decay, hs, h, hs, hs.shape[2])
    if last is not None:
        return last
    for t in range(hs.shape[1]):
        torch.mul(decay[:, t], h, out=tmp)
        h = torch.add(tmp, hs[:, t], out=hs[:, t])
    return h


def _kernel_for(t: torch.Tensor):
    """The recurrence kernel's module for t's device under RECURRENCE_KERNEL, or None (the torch loop)."""
    if RECURRENCE_KERNEL == "off" or (not t.is_cuda and RECURRENCE_KERNEL != "always"):
        return None
    return _kernel_copy(not t.is_cuda)


@functools.lru_cache(maxsize=None)
def _kernel_copy(interpret: bool):
    """_recurrence_kernel.py executed for one mode, once per process (as metrics._fused_copy does). Where Triton
    cannot compile it (not installed, or its library imported interpreted) the torch loop runs: the same bits,
    slower, and a warning says so once."""
    try:
        if interpret:
            import triton  # noqa: F401, PLC0415
        with mode(interpret):
            return exec_file(Path(__file__).with_name("_recurrence_kernel.py"),
                             f"mamba_debug._recurrence_kernel_{'interpret' if interpret else 'cuda'}")
    except ImportError as exc:
        warnings.warn(f"the reference scans' recurrence runs as torch's per-token loop (the same bits, slower): "
                      f"its Triton kernel cannot be loaded here ({exc})", stacklevel=3)
        return None


def ssm_scan(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor, *, states_out: torch.Tensor | None = None):
    """Selective scan, one token after the other (the plain recurrence, no parallel tricks).

    ssm_state [S, D, N], x [S, T, D], dt [S, T, D] (before softplus), A [D, N] (negative),
    B [S, T, N], C [S, T, N] -> (y [S, T, D], new_ssm_state [S, D, N]).
    h_t = exp(delta_t * A) * h_{t-1} + delta_t * B_t * x_t ;  y_t = h_t @ C_t.
    When states_out [S, T, D, N] is given, every h_t is written into it.

    Only the recurrence is a loop over tokens. The per-token factors and y are taken a block of tokens at a time
    with the same elementwise operations in the same order, so every bit is what a loop of ~9 ops per token
    gives, at 2 op launches per token (on a GPU those launches were the reference sides' whole cost).
    """
    S, T, D = x.shape
    N = A.shape[-1]
    delta = softplus(dt)[..., None]                                 # [S, T, D, 1]
    h, ys = ssm_state, []
    blk = _scan_block(T, 3 * S * D * N * h.element_size())
    for t0 in range(0, T, blk):
        sl = slice(t0, min(t0 + blk, T))
        dA = torch.exp(delta[:, sl] * A)                            # [S, L, D, N]
        dBx = delta[:, sl] * B[:, sl, None, :] * x[:, sl, :, None]  # [S, L, D, N]
        hs = torch.empty_like(dA)
        h = _recurrence(dA, dBx, h, hs)
        ys.append((hs * C[:, sl, None, :]).sum(-1))                 # [S, L, D]
        if states_out is not None:
            states_out[:, sl] = hs
    return (torch.cat(ys, dim=1) if ys else x.new_zeros(S, 0, D, dtype=h.dtype)), h.clone()


def _per_head(BC: torch.Tensor, H: int) -> torch.Tensor:
    """B or C [S, T, G, N] -> [S, T, H, N]: head h reads group h // (H/G) (a contiguous block of heads per group,
    as mamba_ssm, transformers and llama.cpp since #15625; the tiled h % G was the Codestral bug)."""
    return BC.repeat_interleave(H // BC.shape[2], dim=2)


def ssd_scan(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor, *, states_out: torch.Tensor | None = None):
    """Mamba-2 scan, one token after the other (the oracle; the chunked SSD form must agree with it).

    ssm_state [S, H, P, N], x [S, T, H, P], dt [S, T, H] (dt_bias included, before softplus), A [H] (negative),
    B, C [S, T, G, N] -> (y [S, T, H, P], new_ssm_state [S, H, P, N]). With δ = softplus(dt), g = h // (H/G):
    S_h ← exp(δ_h A_h) S_h + δ_h x_h ⊗ B_g ;  y_h = S_h C_g. D, the gate and the norm stay outside.
    When states_out [S, T, H, P, N] is given, every S_t is written into it.
    The loop holds the recurrence only; the rest is taken a block of tokens at a time, bit for bit (ssm_scan).
    """
    S, T, H, P = x.shape
    N = B.shape[-1]
    delta = softplus(dt)                                            # [S, T, H]
    Bh, Ch = _per_head(B, H), _per_head(C, H)                       # [S, T, H, N]
    decay = torch.exp(delta * A)[..., None, None]                   # [S, T, H, 1, 1]
    dx = (delta[..., None] * x)[..., None]                          # [S, T, H, P, 1]
    h, ys = ssm_state, []
    tmp = torch.empty_like(h)
    blk = _scan_block(T, 2 * S * H * P * N * h.element_size())
    for t0 in range(0, T, blk):
        sl = slice(t0, min(t0 + blk, T))
        hs = dx[:, sl] * Bh[:, sl, :, None, :]                      # [S, L, H, P, N]: δ x ⊗ B, then S_t in place
        h = _recurrence_heads(decay[:, sl], h, hs, tmp)
        ys.append((hs * Ch[:, sl, :, None, :]).sum(-1))             # [S, L, H, P]
        if states_out is not None:
            states_out[:, sl] = hs
    return (torch.cat(ys, dim=1) if ys else x.new_zeros(S, 0, H, P, dtype=h.dtype)), h.clone()


def ssd_scan_chunked(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                     B: torch.Tensor, C: torch.Tensor, *, chunk_size: int = 256,
                     states_out: torch.Tensor | None = None):
    """The same contract as `ssd_scan`, computed the way the chunked kernels do (docs/mamba2.md, "SSD"): per chunk
    of Q tokens, Λ = cumsum(δA); y = Σ_{s≤t} (C_t·B_s) e^{Λ_t-Λ_s} δ_s x_s + e^{Λ_t} C_t·S̄; the state passed on is
    e^{Λ_last} S̄ + Σ_s e^{Λ_last-Λ_s} δ_s x_s ⊗ B_s. The last chunk may be short. Exact in float64."""
    S, T, H, P = x.shape
    delta = softplus(dt)
    Bh, Ch = _per_head(B, H), _per_head(C, H)
    h = ssm_state
    ys = []
    for c0 in range(0, T, chunk_size):
        sl = slice(c0, min(c0 + chunk_size, T))
        d, xs, Bc, Cc = delta[:, sl], x[:, sl], Bh[:, sl], Ch[:, sl]
        lam = torch.cumsum(d * A, dim=1)                            # [S, L, H]
        L = lam.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()[None, :, :, None]
        seg = (lam[:, :, None, :] - lam[:, None, :, :]).masked_fill(~causal, float("-inf"))
        M = torch.einsum("sthn,suhn->stuh", Cc, Bc) * torch.exp(seg) * d[:, None]   # [S, t, s, H]
        y = torch.einsum("stuh,suhp->sthp", M, xs) + torch.einsum("sthn,shpn->sthp", Cc * torch.exp(lam)[..., None], h)
        if states_out is not None:
            w = torch.exp(seg) * d[:, None]                          # [S, t, s, H]
            states_out[:, sl] = (torch.einsum("stuh,suhp,suhn->sthpn", w, xs, Bc)
                                 + torch.exp(lam)[..., None, None] * h[:, None])
        w_last = torch.exp(lam[:, -1:] - lam) * d                    # [S, L, H]
        h = torch.exp(lam[:, -1])[..., None, None] * h + torch.einsum("suh,suhp,suhn->shpn", w_last, xs, Bc)
        ys.append(y)
    return torch.cat(ys, dim=1), h.clone()


def rms_norm_gated(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, n_groups: int) -> torch.Tensor:
    """Mamba-2's gated norm, gate then norm: v = x * silu(z), RMS-normalised within each of n_groups contiguous
    groups of the last dim, times weight. x, z [..., Dn], weight [Dn] -> [..., Dn]."""
    v = x * silu(z)
    g = v.unflatten(-1, (n_groups, v.shape[-1] // n_groups))
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return g.flatten(-2) * weight


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal grouped-query attention of T new queries over a sequence's cache (no positional encoding).

    q [S, T, Hq, Dh], k_cache [S, Tk, Hk, Dh], v_cache [S, Tk, Hk, Dv] whose last T rows are the new tokens
    -> [S, T, Hq, Dv]. Query t sits at position Tk-T+t and sees cache rows <= it; query head h reads kv head
    h // (Hq/Hk). softmax(scale * q·k) · v."""
    T, Hq, Tk = q.shape[1], q.shape[2], k_cache.shape[1]
    k = k_cache.repeat_interleave(Hq // k_cache.shape[2], dim=2)
    v = v_cache.repeat_interleave(Hq // v_cache.shape[2], dim=2)
    scores = torch.einsum("sthd,sjhd->shtj", q, k) * scale        # [S, Hq, T, Tk]
    pos = torch.arange(T, device=q.device)[:, None] + (Tk - T)
    scores = scores.masked_fill(torch.arange(Tk, device=q.device)[None, :] > pos, float("-inf"))
    return torch.einsum("shtj,sjhd->sthd", torch.softmax(scores, dim=-1), v)


def transfer(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The hand-off between two devices of a split placement: x [S, T, E] (the hidden state) as a new tensor on
    `device`, same shape and dtype. Called by the receiving device's op table at each device boundary (never at the
    host | device one); a copy even where both are the same torch device (CPU stand-ins)."""
    return x.to(device=device, copy=True)


def output_contract(op: str, args: tuple) -> list:
    """Each output's expected (shape, dtype, device), from an op's inputs: what a plug-in's op must return."""
    if op in ("rms_norm", "silu", "rms_norm_gated"):
        x = args[0]
        return [(x.shape, x.dtype, x.device)]
    if op == "linear":
        x, w = args[0], args[1]
        return [(x.shape[:-1] + (w.shape[0],), x.dtype, x.device)]
    if op == "attention":
        q, v = args[0], args[2]
        return [(q.shape[:-1] + v.shape[-1:], q.dtype, q.device)]
    if op == "transfer":
        x = args[0]
        return [(x.shape, x.dtype, torch.device(args[1]))]
    if op in ("ssm_conv", "ssm_scan", "ssd_scan"):
        state, x = args[0], args[1]
        return [(x.shape, x.dtype, x.device), (state.shape, state.dtype, state.device)]
    raise KeyError(op)


TORCH_OPS: dict[str, Callable] = {
    "rms_norm": rms_norm, "linear": linear, "silu": silu, "ssm_conv": ssm_conv, "ssm_scan": ssm_scan,
    "ssd_scan": ssd_scan, "rms_norm_gated": rms_norm_gated, "attention": attention, "transfer": transfer,
}


def example_inputs(op: str, *, S: int = 2, T: int = 16, D: int = 64, N: int = 8, K: int = 4, seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> tuple:
    """Random inputs of realistic scale for one op's contract (an op test's starting point: fresh inputs, several
    sequences). For ssm_scan: (ssm_state, x, dt, A, B, C) with dt around -2 (softplus ~0.1) and A negative."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    if op == "ssm_scan":
        return (torch.zeros(S, D, N, dtype=dtype), r(S, T, D), r(S, T, D) - 2,
                -torch.rand(D, N, generator=g, dtype=dtype) - 0.5, r(S, T, N), r(S, T, N))
    if op == "ssd_scan":                                   # D = H * P with P = 8, G = 2 groups
        H, G = D // 8, 2
        return (torch.zeros(S, H, 8, N, dtype=dtype), r(S, T, H, 8), r(S, T, H) - 2,
                -torch.rand(H, generator=g, dtype=dtype) - 0.5, r(S, T, G, N), r(S, T, G, N))
    if op == "rms_norm_gated":
        return r(S, T, D), r(S, T, D), 1 + 0.1 * r(D), 1e-5, 2
    if op == "attention":
        return r(S, T, 4, 8), r(S, T + 3, 2, 8), r(S, T + 3, 2, 8), 8 ** -0.5
    if op == "ssm_conv":
        return r(S, K - 1, D), r(S, T, D), r(D, K) / K ** 0.5
    if op == "rms_norm":
        return r(S, T, D), 1 + 0.1 * r(D), 1e-5
    if op == "linear":
        return r(S, T, D), r(N, D) / D ** 0.5
    if op == "silu":
        return (r(S, T, D),)
    if op == "transfer":
        return r(S, T, D), torch.device("cpu")
    raise MambaDebugError(f"no example inputs for op {op!r}; the ops are {', '.join(OP_NAMES)}")


class OpTable:
    """A named mapping op name -> callable; `supports_states_out` says whether ssm_scan/ssd_scan fill states_out."""

    def __init__(self, name: str, ops: Mapping[str, Callable], supports_states_out: bool = True):
        missing = [op for op in OP_NAMES if op not in ops]
        if missing:
            raise ValueError(f"op table {name!r} lacks {missing}")
        self.name = name
        self.ops = dict(ops)
        self.supports_states_out = supports_states_out

    def __getattr__(self, op: str) -> Callable:
        try:
            return self.__dict__["ops"][op]
        except KeyError:
            raise AttributeError(op) from None

    def __repr__(self) -> str:
        return f"OpTable({self.name!r})"
