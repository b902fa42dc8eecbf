"""The Mamba-2 block (llama.cpp's graph order; docs/mamba2.md), alone (Mamba2ForCausalLM) or followed by Granite's
shared feed-forward (a hybrid's SSM layers, when the config has d_ff > 0).

    norm -> zxbcdt -> (z, xBC, dt views) -> conv (+ conv_state, over xBC) -> conv_act -> (x, B, C views)
         -> dt (+ dt_bias) -> y_scan (+ ssm_state) -> y_skip (+ D x) -> y_norm (gate then grouped norm)
         -> out -> resid                      (with d_ff > 0: out -> ffn_inp ... resid, see arch/ffn.py)

Parameters (names without "layers.{i}."): `A` [H] is stored as -exp(A_log) (llama.cpp's `ssm_a`), `conv_w`
[D+2GN, K] (conv1d squeezed), `ssm_norm` [D] (the gated norm's weight). States per sequence: conv_state
[K-1, D+2GN] (the previous K-1 xBC rows, oldest first), ssm_state [H, P, N].
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from . import ffn
from .base import LayerContext, StateSpec

MIXER_SITES = ("norm", "zxbcdt", "conv", "conv_state", "conv_act", "dt", "y_scan", "ssm_state", "y_skip",
               "y_norm", "out")


class Mamba2:
    name = "mamba2"
    states = (StateSpec("conv_state", lambda c: (c.d_conv - 1, c.conv_dim)),
              StateSpec("ssm_state", lambda c: (c.n_heads, c.head_dim, c.d_state), per_token=True))
    ops = ("rms_norm", "linear", "silu", "ssm_conv", "ssd_scan", "rms_norm_gated")
    working_copies = 26     # a 1.4B Mamba-2, ubatch 16-64: 0.540 GB a token less the captures' 0.431 (H100); 20 in a
    #                         hybrid with attention and a feed-forward

    def __init__(self, with_ffn: bool = False):
        self.with_ffn = with_ffn
        self.sites = MIXER_SITES + (ffn.SITES if with_ffn else ("resid",))

    def for_config(self, cfg: ModelConfig) -> "Mamba2":
        """The variant this config needs: followed by the shared feed-forward when d_ff > 0."""
        return _WITH_FFN if cfg.d_ff > 0 else _ALONE

    def param_shapes(self, cfg: ModelConfig) -> dict:
        E, D, H, K = cfg.d_model, cfg.d_inner, cfg.n_heads, cfg.d_conv
        cd = cfg.conv_dim
        shapes = {"norm": (E,), "in_proj": (D + cd + H, E), "conv_w": (cd, K), "conv_b": (cd,), "dt_bias": (H,),
                  "A": (H,), "D": (H,), "ssm_norm": (D,), "out_proj": (E, D)}
        if cfg.proj_bias:
            shapes.update(in_proj_bias=(D + cd + H,), out_proj_bias=(E,))
        if self.with_ffn:
            shapes.update(ffn.param_shapes(cfg))
        return shapes

    def site_elements(self, cfg: ModelConfig) -> dict:
        """Elements per token and sequence of each site (conv_state is taken at ubatch ends only, so 0 here)."""
        E, D, H, P, N = cfg.d_model, cfg.d_inner, cfg.n_heads, cfg.head_dim, cfg.d_state
        cd = cfg.conv_dim
        out = {"norm": E, "zxbcdt": D + cd + H, "conv": cd, "conv_state": 0, "conv_act": cd, "dt": H, "y_scan": D,
               "ssm_state": H * P * N, "y_skip": D, "y_norm": D, "out": E, "resid": E}
        if self.with_ffn:
            out.update(ffn.site_elements(cfg))
        return out

    def layer(self, ctx: LayerContext, h: torch.Tensor) -> torch.Tensor:
        """One block; h [S, T, E]. z, xBC, dt and x, B, C stay strided views of their projections (as in llama.cpp)."""
        c, w, ops, st, site = ctx.cfg, ctx.w, ctx.ops, ctx.states, ctx.site
        D, H, P, G, N, cd = c.d_inner, c.n_heads, c.head_dim, c.n_groups, c.d_state, c.conv_dim

        norm = ops.rms_norm(h, w["norm"], c.rms_eps);                          site("norm", norm)
        zxbcdt = ops.linear(norm, w["in_proj"], w.get("in_proj_bias"));       site("zxbcdt", zxbcdt)
        z, xBC, dt_raw = zxbcdt[..., :D], zxbcdt[..., D:D + cd], zxbcdt[..., D + cd:]
        conv, st["conv_state"] = ops.ssm_conv(st["conv_state"], xBC, w["conv_w"])
        conv = conv + w["conv_b"];                                             site("conv", conv)
        site("conv_state", st["conv_state"], False)
        conv_act = ops.silu(conv);                                             site("conv_act", conv_act)
        x = conv_act[..., :D].unflatten(-1, (H, P))
        B = conv_act[..., D:D + G * N].unflatten(-1, (G, N))
        C = conv_act[..., D + G * N:].unflatten(-1, (G, N))
        dt = dt_raw + w["dt_bias"];                                            site("dt", dt)
        states = None
        if ctx.want_states_out:
            states = torch.empty(h.shape[0], h.shape[1], H, P, N, dtype=ctx.dtype, device=ctx.device)
        y_scan, st["ssm_state"] = ops.ssd_scan(st["ssm_state"], x, dt, w["A"], B, C, states_out=states)
        site("y_scan", y_scan.flatten(-2))
        if states is not None:
            states[:, -1] = st["ssm_state"]      # the state handed on, so a wrong hand-off shows at its token
            site("ssm_state", states, True)
        else:
            site("ssm_state", st["ssm_state"], False)
        y_skip = (y_scan + x * w["D"][:, None]).flatten(-2);                  site("y_skip", y_skip)
        y_norm = ops.rms_norm_gated(y_skip, z, w["ssm_norm"], c.rms_eps, G);   site("y_norm", y_norm)
        out = ops.linear(y_norm, w["out_proj"], w.get("out_proj_bias"));      site("out", out)
        if self.with_ffn:
            return ffn.block(ctx, h, out)
        resid = ffn.residual(c, h, out);                                       site("resid", resid)
        return resid


_ALONE, _WITH_FFN = Mamba2(False), Mamba2(True)
