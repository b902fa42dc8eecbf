"""What the reference says llama.cpp's op-named nodes should hold: each is recomputed from the reference side's own
sites of the same ubatch (in that side's precision), so they are compared like any site, with a noise floor from
ref32 vs ref64. DESIGN.md's sites need nothing here: the reference reports them itself."""
from __future__ import annotations

from typing import Optional

import torch

from .maps import roles


def derived_sites(sites: dict, tokens: torch.Tensor, params: dict, cfg, prev_conv: dict,
                  kinds: Optional[list] = None) -> dict:
    """(layer, op-named site) -> (value [S, T, ...], per_token) for the nodes of nodes.LAYER_SITES that are not
    DESIGN.md sites. sites: a reference side's StepOutput.sites; params: the model's float64 masters; prev_conv:
    layer -> that side's conv_state at the end of its previous ubatch (updated here; empty after a reset).

    Two ubatch-wide nodes are given per token so that a fault is placed at the first token it can affect:
    GET_ROWS (the prior conv state, gathered from the cache) is repeated at every token, and CONCAT (the conv
    window, prior state then this ubatch's x) is, at token t, the K rows the conv reads for t."""
    some = sites[(None, "logits")][0]
    dtype, dev = some.dtype, some.device
    w = lambda name: params[name].to(device=dev, dtype=dtype)  # noqa: E731
    R, D, K = cfg.dt_rank, cfg.d_inner, cfg.d_conv
    S, T = tokens.shape
    out = {}
    h = w("embed")[tokens.to(dev)]
    if cfg.embedding_multiplier != 1.0:
        h = h * cfg.embedding_multiplier
    for i in range(cfg.n_layer):
        p = f"layers.{i}."
        kind = kinds[i] if kinds else "mamba1"
        if kind != "mamba1":
            if (i, "resid") not in sites:
                break
            out.update(_other(i, kind, sites, h, w, cfg, prev_conv, S, T))
            h = sites[(i, "resid")][0]
            continue
        if (i, "xz") not in sites:
            break
        prev = prev_conv.get(i)
        if prev is None or prev.shape[0] != S:
            prev = torch.zeros(S, K - 1, D, dtype=dtype, device=dev)
        out[(i, "GET_ROWS")] = (prev.reshape(S, 1, -1).expand(S, T, (K - 1) * D), True)
        out[(i, "RMS_NORM")] = (_rms(h, cfg.rms_eps), True)
        window = torch.cat([prev, sites[(i, "xz")][0][..., :D]], dim=1)        # [S, K-1+T, D]
        out[(i, "CONCAT")] = (window.unfold(1, K, 1).transpose(2, 3).reshape(S, T, K * D), True)
        prev_conv[i] = sites[(i, "conv_state")][0]
        out[(i, "SSM_CONV")] = (sites[(i, "conv")][0] - w(p + "conv_b"), True)
        conv_act = sites[(i, "conv_act")][0]
        dbc = conv_act @ w(p + "x_proj").T
        out[(i, "MUL_MAT#2")] = (dbc, True)
        out[(i, "CONT")] = (dbc[..., :R], True)
        out[(i, "MUL_MAT#3")] = (dbc[..., :R] @ w(p + "dt_proj").T, True)
        out[(i, "CONT#2")] = (sites[(i, "xz")][0][..., D:], True)
        out[(i, "MUL#2")] = (conv_act * w(p + "D"), True)
        h = sites[(i, "resid")][0]
    return out


def _other(i: int, kind: str, sites: dict, h, w, cfg, prev_conv: dict, S: int, T: int) -> dict:
    """(i, op-named site) -> (value, per_token) for a Mamba-2 or attention layer, from the reference's own sites."""
    p = f"layers.{i}."
    site = lambda name: sites[(i, name)][0]  # noqa: E731
    m = cfg.residual_multiplier
    val = {"rms_in": lambda: _rms(h, cfg.rms_eps)}
    if kind.startswith("mamba2"):
        D, H, P, G, K, cd = cfg.d_inner, cfg.n_heads, cfg.head_dim, cfg.n_groups, cfg.d_conv, cfg.conv_dim
        zx = site("zxbcdt")
        prev = prev_conv.get(i)
        if prev is None or prev.shape[0] != S:
            prev = torch.zeros(S, K - 1, cd, dtype=zx.dtype, device=zx.device)
        window = torch.cat([prev, zx[..., D:D + cd]], dim=1)                  # [S, K-1+T, conv_dim]
        prev_conv[i] = site("conv_state")
        gated = torch.nn.functional.silu(zx[..., :D]) * site("y_skip")        # SWIGLU: silu(z) * y (gate alone)
        val.update(prior_conv=lambda: prev.reshape(S, 1, -1).expand(S, T, (K - 1) * cd),
                   conv_window=lambda: window.unfold(1, K, 1).transpose(2, 3).reshape(S, T, K * cd),
                   conv_nobias=lambda: site("conv") - w(p + "conv_b"),
                   dt_raw=lambda: zx[..., D + cd:], z=lambda: zx[..., :D],
                   x_D=lambda: (site("conv_act")[..., :D].unflatten(-1, (H, P)) * w(p + "D")[:, None]).flatten(-2),
                   gated=lambda: gated,
                   rms_grouped=lambda: _rms(gated.unflatten(-1, (G, D // G)), cfg.rms_eps).flatten(-2))
    if kind != "mamba2":                # the shared feed-forward (arch/ffn.py), Granite's multiplier m
        F = cfg.d_ff
        val.update(scaled_out=lambda: site("out") * m, rms_ffn=lambda: _rms(site("ffn_inp"), cfg.rms_eps),
                   ffn_gate=lambda: site("ffn_up")[..., :F], ffn_up_half=lambda: site("ffn_up")[..., F:],
                   scaled_ffn_out=lambda: site("ffn_out") * m)
    return {(i, name): (val[role](), True) for name, role in roles(kind).items()}


def _rms(h: torch.Tensor, eps: float) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
