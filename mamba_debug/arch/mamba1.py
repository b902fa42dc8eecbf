"""The Mamba-1 block (DESIGN.md's graph, llama.cpp order): its sites, states, parameter shapes and `layer()`.

    norm -> xz -> (x, z views) -> conv (+ conv_state) -> conv_act -> dt, B, C -> y_scan (+ ssm_state)
         -> y_skip -> gate -> y_gated -> out -> resid

Parameters (names without "layers.{i}."): `A` is stored as -exp(A_log) (llama.cpp's `ssm_a`), `conv_w` is [D, K]
(the conv1d weight squeezed). States per sequence: conv_state [K-1, D] (the previous K-1 inputs x, oldest first),
ssm_state [D, N] (h after the last processed token).
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from .base import LayerContext, StateSpec


class Mamba1:
    name = "mamba1"
    sites = ("norm", "xz", "conv", "conv_state", "conv_act", "dt", "B", "C", "y_scan", "ssm_state",
             "y_skip", "gate", "y_gated", "out", "resid")
    states = (StateSpec("conv_state", lambda c: (c.d_conv - 1, c.d_inner)),
              StateSpec("ssm_state", lambda c: (c.d_inner, c.d_state), per_token=True))
    ops = ("rms_norm", "linear", "silu", "ssm_conv", "ssm_scan")
    working_copies = 56     # 2.8B shape, ubatch 64-256: the peaks' 0.176 GB a token less the captures' 0.140 (H100)

    def param_shapes(self, cfg: ModelConfig) -> dict:
        E, D, N, K, R = cfg.d_model, cfg.d_inner, cfg.d_state, cfg.d_conv, cfg.dt_rank
        shapes = {"norm": (E,), "in_proj": (2 * D, E), "conv_w": (D, K), "conv_b": (D,), "x_proj": (R + 2 * N, D),
                  "dt_proj": (D, R), "dt_bias": (D,), "A": (D, N), "D": (D,), "out_proj": (E, D)}
        if cfg.proj_bias:
            shapes.update(in_proj_bias=(2 * D,), out_proj_bias=(E,))
        return shapes

    def site_elements(self, cfg: ModelConfig) -> dict:
        """Elements per token and sequence of each site (conv_state is taken at ubatch ends only, so 0 here)."""
        E, D, N = cfg.d_model, cfg.d_inner, cfg.d_state
        return {"norm": E, "xz": 2 * D, "conv": D, "conv_state": 0, "conv_act": D, "dt": D, "B": N, "C": N,
                "y_scan": D, "ssm_state": D * N, "y_skip": D, "gate": D, "y_gated": D, "out": E, "resid": E}

    def layer(self, ctx: LayerContext, h: torch.Tensor) -> torch.Tensor:
        """One block; h [S, T, E]. Views stay views (llama.cpp hands ops strided views: that is how #6758 was born)."""
        c, w, ops, st, site = ctx.cfg, ctx.w, ctx.ops, ctx.states, ctx.site
        D, N, R = c.d_inner, c.d_state, c.dt_rank

        norm = ops.rms_norm(h, w["norm"], c.rms_eps);                 site("norm", norm)
        xz = ops.linear(norm, w["in_proj"], w.get("in_proj_bias"));   site("xz", xz)
        x, z = xz[..., :D], xz[..., D:]                                # strided views, row stride 2D
        conv, st["conv_state"] = ops.ssm_conv(st["conv_state"], x, w["conv_w"])
        conv = conv + w["conv_b"];                                     site("conv", conv)
        site("conv_state", st["conv_state"], False)
        conv_act = ops.silu(conv);                                     site("conv_act", conv_act)
        dbc = ops.linear(conv_act, w["x_proj"])
        dt, B, C = dbc[..., :R], dbc[..., R:R + N], dbc[..., R + N:]   # strided views of one projection
        dt = ops.linear(dt, w["dt_proj"], w["dt_bias"]);               site("dt", dt)
        site("B", B)
        site("C", C)
        states = None
        if ctx.want_states_out:
            states = torch.empty(h.shape[0], h.shape[1], D, N, dtype=ctx.dtype, device=ctx.device)
        y_scan, st["ssm_state"] = ops.ssm_scan(st["ssm_state"], conv_act, dt, w["A"], B, C, states_out=states)
        site("y_scan", y_scan)
        if states is not None:
            # the last row is the state actually handed to the next ubatch, so a kernel that returns another
            # state than its last h_t is caught at the token where it happens
            states[:, -1] = st["ssm_state"]
            site("ssm_state", states, True)
        else:
            site("ssm_state", st["ssm_state"], False)
        y_skip = y_scan + conv_act * w["D"];                           site("y_skip", y_skip)
        gate = ops.silu(z);                                            site("gate", gate)
        y_gated = y_skip * gate;                                       site("y_gated", y_gated)
        out = ops.linear(y_gated, w["out_proj"], w.get("out_proj_bias")); site("out", out)
        resid = h + out;                                               site("resid", resid)
        return resid
