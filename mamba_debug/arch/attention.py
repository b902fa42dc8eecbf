"""Grouped-query attention as Granite-4.0-H's attention layers use it (no positional encoding, scale =
attention_multiplier), followed by the shared SwiGLU feed-forward (arch/ffn.py).

    norm -> q, k, v -> (k, v appended to k_cache, v_cache) -> attn (softmax(scale q·k) v) -> out
         -> ffn_inp -> ffn_norm -> ffn_up -> ffn_act -> ffn_out -> resid

States per sequence: k_cache [tokens so far, Hk, Dh] and v_cache, allocated empty and growing by T rows per
ubatch (so a ubatch boundary is no state hand-off for attention: the cache only grows). Parameters: q_proj
[Ha*Dh, E], k_proj / v_proj [Hk*Dh, E], o_proj [E, Ha*Dh] (+ biases with attn_bias), the FFN's.
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from . import ffn
from .base import LayerContext, StateSpec


class Attention:
    name = "attention"
    sites = ("norm", "q", "k", "v", "attn", "out") + ffn.SITES
    states = (StateSpec("k_cache", lambda c: (0, c.n_kv_heads, c.attn_head_dim), grows=True),
              StateSpec("v_cache", lambda c: (0, c.n_kv_heads, c.attn_head_dim), grows=True))
    ops = ("rms_norm", "linear", "silu", "attention")
    working_copies = 8      # not measured alone (its largest site is small); the hybrid's peaks are Mamba-2's

    def param_shapes(self, cfg: ModelConfig) -> dict:
        E, Hq, Hk, Dh = cfg.d_model, cfg.n_attn_heads, cfg.n_kv_heads, cfg.attn_head_dim
        shapes = {"norm": (E,), "q_proj": (Hq * Dh, E), "k_proj": (Hk * Dh, E), "v_proj": (Hk * Dh, E),
                  "o_proj": (E, Hq * Dh)}
        if cfg.attn_bias:
            shapes.update(q_proj_bias=(Hq * Dh,), k_proj_bias=(Hk * Dh,), v_proj_bias=(Hk * Dh,), o_proj_bias=(E,))
        return {**shapes, **ffn.param_shapes(cfg)}

    def site_elements(self, cfg: ModelConfig) -> dict:
        E, Hq, Hk, Dh = cfg.d_model, cfg.n_attn_heads, cfg.n_kv_heads, cfg.attn_head_dim
        return {"norm": E, "q": Hq * Dh, "k": Hk * Dh, "v": Hk * Dh, "attn": Hq * Dh, "out": E,
                **ffn.site_elements(cfg)}

    def layer(self, ctx: LayerContext, h: torch.Tensor) -> torch.Tensor:
        c, w, ops, st, site = ctx.cfg, ctx.w, ctx.ops, ctx.states, ctx.site
        Hq, Hk, Dh = c.n_attn_heads, c.n_kv_heads, c.attn_head_dim
        scale = c.attention_multiplier or Dh ** -0.5

        norm = ops.rms_norm(h, w["norm"], c.rms_eps);                          site("norm", norm)
        q = ops.linear(norm, w["q_proj"], w.get("q_proj_bias"));              site("q", q)
        k = ops.linear(norm, w["k_proj"], w.get("k_proj_bias"));              site("k", k)
        v = ops.linear(norm, w["v_proj"], w.get("v_proj_bias"));              site("v", v)
        st["k_cache"] = torch.cat([st["k_cache"], k.unflatten(-1, (Hk, Dh))], dim=1)
        st["v_cache"] = torch.cat([st["v_cache"], v.unflatten(-1, (Hk, Dh))], dim=1)
        attn = ops.attention(q.unflatten(-1, (Hq, Dh)), st["k_cache"], st["v_cache"], scale).flatten(-2)
        site("attn", attn)
        out = ops.linear(attn, w["o_proj"], w.get("o_proj_bias"));           site("out", out)
        return ffn.block(ctx, h, out)
