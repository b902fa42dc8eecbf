"""What the reference says llama.cpp's op-named nodes should hold: each is recomputed from the reference side's own
sites of the same ubatch (in that side's precision), so they are compared like any site, with a noise floor from
ref32 vs ref64. DESIGN.md's sites need nothing here: the reference reports them itself."""
from __future__ import annotations

import torch


def derived_sites(sites: dict, tokens: torch.Tensor, params: dict, cfg, prev_conv: dict) -> dict:
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
    for i in range(cfg.n_layer):
        p = f"layers.{i}."
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


def _rms(h: torch.Tensor, eps: float) -> torch.Tensor:
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
