"""The shared SwiGLU feed-forward that follows the mixer in Granite-4.0-H's blocks, with Granite's residual
multiplier. Used by the `mamba2` (when the config has d_ff > 0) and `attention` layer types.

    ffn_inp = h + m * mixer_out -> ffn_norm -> ffn_up [2F] (gate | up) -> ffn_act = silu(gate) * up
            -> ffn_out -> resid = ffn_inp + m * ffn_out
"""
from __future__ import annotations

import torch

from ..config import ModelConfig

SITES = ("ffn_inp", "ffn_norm", "ffn_up", "ffn_act", "ffn_out", "resid")


def param_shapes(cfg: ModelConfig) -> dict:
    E, F = cfg.d_model, cfg.d_ff
    shapes = {"ffn_norm": (E,), "ffn_up": (2 * F, E), "ffn_down": (E, F)}
    if cfg.mlp_bias:
        shapes.update(ffn_up_bias=(2 * F,), ffn_down_bias=(E,))
    return shapes


def site_elements(cfg: ModelConfig) -> dict:
    E, F = cfg.d_model, cfg.d_ff
    return {"ffn_inp": E, "ffn_norm": E, "ffn_up": 2 * F, "ffn_act": F, "ffn_out": E, "resid": E}


def residual(cfg: ModelConfig, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """h + m * out (m = residual_multiplier; no multiply when it is 1, so Mamba-style models stay bit-exact)."""
    return h + out if cfg.residual_multiplier == 1.0 else h + cfg.residual_multiplier * out


def block(ctx, h: torch.Tensor, mixer_out: torch.Tensor) -> torch.Tensor:
    """The residual after the mixer, then the feed-forward and its residual; returns the block output."""
    c, w, ops, site = ctx.cfg, ctx.w, ctx.ops, ctx.site
    F = c.d_ff
    ffn_inp = residual(c, h, mixer_out);                               site("ffn_inp", ffn_inp)
    fn = ops.rms_norm(ffn_inp, w["ffn_norm"], c.rms_eps);              site("ffn_norm", fn)
    up = ops.linear(fn, w["ffn_up"], w.get("ffn_up_bias"));            site("ffn_up", up)
    act = ops.silu(up[..., :F]) * up[..., F:];                         site("ffn_act", act)
    fo = ops.linear(act, w["ffn_down"], w.get("ffn_down_bias"));       site("ffn_out", fo)
    resid = residual(c, ffn_inp, fo);                                  site("resid", resid)
    return resid
