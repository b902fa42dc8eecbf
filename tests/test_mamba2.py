"""Mamba-2 and Granite-4.0-H-style hybrids on the float64 reference: the ops against independent forms, the
config, and the invariances (ubatch, sequences, prefill vs decode, offload, float32 device) on random models."""
from __future__ import annotations

import random

import pytest
import torch

from mamba_debug import ops
from mamba_debug.arch import layer_type, param_shapes, site_order
from mamba_debug.backends import Backend, cpu_backend, reference_backend
from mamba_debug.config import MambaConfig
from mamba_debug.errors import MambaDebugError
from mamba_debug.model import Model, Runner
from mamba_debug.placement import Placement

from conftest import random_params

f64 = dict(dtype=torch.float64)


def mamba2_model(seed=0, **kw):
    base = dict(d_model=16, n_layer=3, vocab_size=53, d_state=8, d_conv=4, head_dim=4, n_groups=2, chunk_size=4,
                layer_types=("mamba2",) * 3)
    base.update(kw)
    cfg = MambaConfig(**base)
    return Model(cfg, random_params(cfg, seed), source=f"random mamba2(seed={seed})")


def hybrid_model(seed=0, **kw):
    base = dict(d_model=16, n_layer=4, vocab_size=53, d_state=8, d_conv=3, head_dim=8, n_groups=2, chunk_size=5,
                layer_types=("mamba2", "attention", "mamba2", "attention"), n_attn_heads=4, n_kv_heads=2, d_ff=24,
                embedding_multiplier=2.0, residual_multiplier=0.6, attention_multiplier=0.4, logits_scaling=1.7)
    base.update(kw)
    cfg = MambaConfig(**base)
    return Model(cfg, random_params(cfg, seed), source=f"random hybrid(seed={seed})")


MODELS = {"mamba2": mamba2_model, "hybrid": hybrid_model}


def _scan_inputs(S=2, T=11, H=6, G=3, P=4, N=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, **f64)  # noqa: E731
    return (r(S, H, P, N), r(S, T, H, P), r(S, T, H) - 1, -torch.rand(H, generator=g, **f64) - 0.3,
            r(S, T, G, N), r(S, T, G, N))


def _naive_scan(state, x, dt, A, B, C):
    """Per sequence, token, head: the equations written out with the group index h // (H/G)."""
    S, T, H, P = x.shape
    G = B.shape[2]
    y = torch.zeros_like(x)
    h = state.clone()
    for s in range(S):
        for t in range(T):
            for hd in range(H):
                g = hd // (H // G)
                d = torch.nn.functional.softplus(dt[s, t, hd])
                h[s, hd] = torch.exp(d * A[hd]) * h[s, hd] + d * torch.outer(x[s, t, hd], B[s, t, g])
                y[s, t, hd] = h[s, hd] @ C[s, t, g]
    return y, h


def test_ssd_scan_is_the_written_out_recurrence():
    args = _scan_inputs(T=6)
    y, h = ops.ssd_scan(*args)
    y0, h0 = _naive_scan(*args)
    torch.testing.assert_close(y, y0, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h, h0, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("Q", [1, 3, 4, 11, 16])
def test_chunked_ssd_equals_the_sequential_scan(Q):
    args = _scan_inputs(T=11)
    S, T, H, P = args[1].shape
    st_a, st_b = (torch.empty(S, T, H, P, args[0].shape[-1], **f64) for _ in range(2))
    y, h = ops.ssd_scan(*args, states_out=st_a)
    yc, hc = ops.ssd_scan_chunked(*args, chunk_size=Q, states_out=st_b)
    torch.testing.assert_close(yc, y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hc, h, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st_b, st_a, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(st_a[:, -1], h, rtol=0, atol=0)


def test_ssd_scan_splits_across_calls_and_takes_strided_views():
    state, x, dt, A, B, C = _scan_inputs(T=10)
    y, h = ops.ssd_scan(state, x, dt, A, B, C)
    y1, h1 = ops.ssd_scan(state, x[:, :7], dt[:, :7], A, B[:, :7], C[:, :7])
    y2, h2 = ops.ssd_scan(h1, x[:, 7:], dt[:, 7:], A, B[:, 7:], C[:, 7:])
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(h2, h, rtol=1e-12, atol=1e-12)
    big = torch.randn(2, 10, 3, 6, 4, **f64)                     # x as a non-contiguous view
    big[:, :, 1] = x
    xv = big[:, :, 1]
    yv, _ = ops.ssd_scan(state, xv, dt, A, B, C)
    torch.testing.assert_close(yv, ops.ssd_scan(state, xv.contiguous(), dt, A, B, C)[0], rtol=0, atol=0)


def test_grouped_gated_norm():
    g = torch.Generator().manual_seed(1)
    x, z = torch.randn(2, 3, 12, generator=g, **f64), torch.randn(2, 3, 12, generator=g, **f64)
    w = torch.randn(12, generator=g, **f64)
    y = ops.rms_norm_gated(x, z, w, 1e-5, 3)
    v = x * torch.nn.functional.silu(z)
    for q in range(3):
        part = v[..., 4 * q:4 * q + 4]
        expect = part / torch.sqrt(part.pow(2).mean(-1, keepdim=True) + 1e-5) * w[4 * q:4 * q + 4]
        torch.testing.assert_close(y[..., 4 * q:4 * q + 4], expect, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(y, ops.rms_norm_gated(x, z, w, 1e-5, 1))     # the ungrouped norm differs


def test_attention_against_torch_sdpa():
    g = torch.Generator().manual_seed(2)
    S, T, Tk, Hq, Hk, Dh = 2, 3, 7, 4, 2, 5
    q = torch.randn(S, T, Hq, Dh, generator=g, **f64)
    k, v = torch.randn(S, Tk, Hk, Dh, generator=g, **f64), torch.randn(S, Tk, Hk, Dh, generator=g, **f64)
    out = ops.attention(q, k, v, 0.37)
    kk, vv = (t.repeat_interleave(Hq // Hk, 2).transpose(1, 2) for t in (k, v))
    mask = torch.ones(T, Tk, dtype=torch.bool).tril(Tk - T)
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=mask, scale=0.37)
    torch.testing.assert_close(out, ref.transpose(1, 2), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", ["ssd_scan", "rms_norm_gated", "attention"])
def test_example_inputs_meet_the_output_contract(op):
    args = ops.example_inputs(op)
    out = ops.TORCH_OPS[op](*args)
    outs = list(out) if isinstance(out, tuple) else [out]
    assert [(o.shape, o.dtype) for o in outs] == [(s, d) for s, d, _ in ops.output_contract(op, args)]


def test_config_keeps_mamba1_dict_and_checks_mamba2():
    assert "layer_types" not in MambaConfig(d_model=8, n_layer=2, vocab_size=9).to_dict()
    cfg = MambaConfig(d_model=8, n_layer=2, vocab_size=9, head_dim=4, n_groups=2, layer_types=["mamba2"] * 2)
    assert (cfg.n_heads, cfg.conv_dim) == (4, 16 + 2 * 2 * 16)
    assert MambaConfig(**cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="n_groups"):
        MambaConfig(d_model=8, n_layer=1, vocab_size=9, head_dim=4, n_groups=3, layer_types=["mamba2"])
    with pytest.raises(ValueError, match="n_attn_heads"):
        MambaConfig(d_model=8, n_layer=1, vocab_size=9, layer_types=["attention"])
    with pytest.raises(ValueError, match="layer_types"):
        MambaConfig(d_model=8, n_layer=2, vocab_size=9, layer_types=["mamba1"])
    with pytest.raises(MambaDebugError, match="rwkv"):
        layer_type(MambaConfig(d_model=8, n_layer=1, vocab_size=9, layer_types=["rwkv"]), 0)


def test_sites_and_params_follow_the_layer_types():
    cfg = hybrid_model().config
    keys = site_order(cfg)
    assert keys[0] == (0, "norm") and (0, "y_norm") in keys and (1, "attn") in keys and (0, "ffn_act") in keys
    assert [s for i, s in keys if i == 0][-1] == "resid" and [s for i, s in keys if i == 1][-1] == "resid"
    assert param_shapes(cfg)["layers.0.A"] == (cfg.n_heads,)
    pure = mamba2_model().config
    assert "ffn_inp" not in [s for _, s in site_order(pure)]


def _prompts(model, S=3, P=13, seed=1):
    return torch.randint(0, model.config.vocab_size, (S, P), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", MODELS)
def test_ubatch_size_does_not_change_logits(kind):
    model = MODELS[kind](seed=2)
    tokens = _prompts(model)
    whole = model.logits(tokens)
    for ub in (1, 2, 4, 5, 7):
        torch.testing.assert_close(model.logits(tokens, ubatch=ub), whole, rtol=0, atol=1e-12, msg=f"ubatch {ub}")


@pytest.mark.parametrize("kind", MODELS)
def test_sequences_together_equal_one_by_one_and_decode(kind):
    model = MODELS[kind](seed=3)
    tokens = _prompts(model, S=3)
    together = model.logits(tokens, ubatch=4)
    for s in range(3):
        torch.testing.assert_close(together[s:s + 1], model.logits(tokens[s:s + 1], ubatch=6), rtol=0, atol=1e-12)
    runner = Runner(model, reference_backend())
    first = runner.prefill(tokens[:, :5], ubatch=5)
    steps = [runner.forward(tokens[:, t:t + 1]) for t in range(5, tokens.shape[1])]
    torch.testing.assert_close(torch.cat([first] + steps, dim=1), together, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", MODELS)
def test_offload_keeps_logits_and_states_live_on_their_layer(kind):
    model = MODELS[kind](seed=4)
    tokens = _prompts(model, S=2)
    whole = model.logits(tokens)
    same = Backend("device:same", ops.OpTable("same", ops.TORCH_OPS), torch.float64, torch.device("cpu"), "same")
    L = model.config.n_layer
    for offload in range(0, L + 2):
        runner = Runner(model, reference_backend(), same, Placement(L, offload))
        torch.testing.assert_close(runner.prefill(tokens, 3), whole, rtol=0, atol=1e-12, msg=f"offload {offload}")
    # a float32 device: states take the layer's dtype, results stay close
    runner = Runner(model, reference_backend(), cpu_backend(), Placement(L, 2))
    out = runner.prefill(tokens, 4)
    assert {v.dtype for st in runner.states[-2:] for v in st.values()} == {torch.float32}
    assert {v.dtype for st in runner.states[:-2] for v in st.values()} == {torch.float64}
    assert (out - whole).abs().max() / whole.abs().max() < 1e-4


def test_per_token_states_are_observed():
    model = hybrid_model(seed=5)
    seen = {}

    class Obs:
        def site(self, layer, name, value, per_token):
            seen[(layer, name)] = (value.shape, per_token)

    Runner(model, reference_backend(), observer=Obs()).prefill(_prompts(model, S=2, P=6), 6)
    c = model.config
    assert seen[(0, "ssm_state")] == (torch.Size([2, 6, c.n_heads, c.head_dim, c.d_state]), True)
    assert seen[(0, "conv_state")] == (torch.Size([2, c.d_conv - 1, c.conv_dim]), False)
    assert seen[(1, "attn")][0] == torch.Size([2, 6, c.n_attn_heads * c.attn_head_dim])
