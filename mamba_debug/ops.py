"""The op table of a Mamba-1 layer and its plain-torch implementations.

Every op of the layer graph (DESIGN.md "Op plug-ins") is looked up by name in an `OpTable`, so a
back-end (the float64 reference, the float32 CPU port, or a device plug-in) is just a table.
The torch functions below are the ground truth: the `reference` back-end runs them in float64 on
the CPU, the `cpu` back-end runs them in float32. They honour any strides, as ops must: the layer
hands them non-contiguous views (x, z, dt, B, C are slices of projections, as in llama.cpp).
"""
from __future__ import annotations

from typing import Callable, Mapping

import torch
import torch.nn.functional as F

OP_NAMES = ("rms_norm", "linear", "silu", "ssm_conv", "ssm_scan")

# softplus switches to the identity above this dt, as llama.cpp and the reference Triton kernels do.
SOFTPLUS_THRESHOLD = 20.0


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


def ssm_scan(ssm_state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
             B: torch.Tensor, C: torch.Tensor, *, states_out: torch.Tensor | None = None):
    """Selective scan, one token after the other (the plain recurrence, no parallel tricks).

    ssm_state [S, D, N], x [S, T, D], dt [S, T, D] (before softplus), A [D, N] (negative),
    B [S, T, N], C [S, T, N] -> (y [S, T, D], new_ssm_state [S, D, N]).
    h_t = exp(delta_t * A) * h_{t-1} + delta_t * B_t * x_t ;  y_t = h_t @ C_t.
    When states_out [S, T, D, N] is given, every h_t is written into it.
    """
    delta = softplus(dt)                                            # [S, T, D]
    h = ssm_state
    ys = []
    for t in range(x.shape[1]):
        d_t = delta[:, t, :, None]                                  # [S, D, 1]
        h = torch.exp(d_t * A) * h + d_t * B[:, t, None, :] * x[:, t, :, None]
        ys.append((h * C[:, t, None, :]).sum(-1))                   # [S, D]
        if states_out is not None:
            states_out[:, t] = h
    return torch.stack(ys, dim=1), h.clone()


def output_contract(op: str, args: tuple) -> list:
    """Each output's expected (shape, dtype, device), from an op's inputs: what a plug-in's op must return."""
    if op in ("rms_norm", "silu"):
        x = args[0]
        return [(x.shape, x.dtype, x.device)]
    if op == "linear":
        x, w = args[0], args[1]
        return [(x.shape[:-1] + (w.shape[0],), x.dtype, x.device)]
    if op in ("ssm_conv", "ssm_scan"):
        state, x = args[0], args[1]
        return [(x.shape, x.dtype, x.device), (state.shape, state.dtype, state.device)]
    raise KeyError(op)


TORCH_OPS: dict[str, Callable] = {
    "rms_norm": rms_norm, "linear": linear, "silu": silu, "ssm_conv": ssm_conv, "ssm_scan": ssm_scan,
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
    if op == "ssm_conv":
        return r(S, K - 1, D), r(S, T, D), r(D, K) / K ** 0.5
    if op == "rms_norm":
        return r(S, T, D), 1 + 0.1 * r(D), 1e-5
    if op == "linear":
        return r(S, T, D), r(N, D) / D ** 0.5
    if op == "silu":
        return (r(S, T, D),)
    raise KeyError(f"no example inputs for op {op!r}; ops: {OP_NAMES}")


class OpTable:
    """A named mapping op name -> callable; `supports_states_out` says whether ssm_scan fills states_out."""

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
