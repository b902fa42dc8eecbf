"""Independent oracle: transformers' own MambaForCausalLM (its slow torch path) must agree with our loader +
reference forward, for both HF layouts on disk."""
from __future__ import annotations

import json

import pytest
import torch

import mamba_debug as md

transformers = pytest.importorskip("transformers")

CONFIGS = [  # tied/untied, d_conv 3/4, d_state 8/16, odd vocab sizes, proj biases
    dict(vocab_size=101, hidden_size=32, state_size=8, num_hidden_layers=3, conv_kernel=3, tie_word_embeddings=True),
    dict(vocab_size=257, hidden_size=48, state_size=16, num_hidden_layers=2, conv_kernel=4, tie_word_embeddings=False),
    dict(vocab_size=67, hidden_size=40, state_size=16, num_hidden_layers=3, conv_kernel=3, tie_word_embeddings=False,
         time_step_rank=5, use_bias=True),
    dict(vocab_size=33, hidden_size=24, state_size=8, num_hidden_layers=2, conv_kernel=4, tie_word_embeddings=True,
         expand=3),
]


def _hf_model(kw, seed):
    torch.manual_seed(seed)
    model = transformers.MambaForCausalLM(transformers.MambaConfig(**kw)).eval()
    with torch.no_grad():   # move every weight off its symmetric init (A_log is the same for all channels)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _to_state_spaces(hf_dir, out_dir, kw, pad_multiple=8):
    """Rewrite an HF checkpoint the way state-spaces/mamba stores it: pytorch_model.bin, d_model/n_layer/ssm_cfg,
    backbone.embedding, dt_rank 'auto', vocab padded to a multiple of 8."""
    from safetensors.torch import load_file
    sd = load_file(str(hf_dir / "model.safetensors"))
    tied = kw.get("tie_word_embeddings", True)
    emb = sd.pop("backbone.embeddings.weight", None)
    emb = emb if emb is not None else sd["lm_head.weight"]
    V = emb.shape[0]
    Vp = -(-V // pad_multiple) * pad_multiple
    pad = torch.randn(Vp - V, emb.shape[1])
    sd["backbone.embedding.weight"] = torch.cat([emb, pad])
    if tied:
        sd.pop("lm_head.weight", None)
    else:
        sd["lm_head.weight"] = torch.cat([sd["lm_head.weight"], torch.randn(Vp - V, emb.shape[1])])
    out_dir.mkdir()
    torch.save(sd, out_dir / "pytorch_model.bin")
    ssm_cfg = {"d_state": kw["state_size"], "d_conv": kw["conv_kernel"], "expand": kw.get("expand", 2)}
    if "time_step_rank" in kw:
        ssm_cfg["dt_rank"] = kw["time_step_rank"]
    if kw.get("use_bias"):
        ssm_cfg["bias"] = True
    (out_dir / "config.json").write_text(json.dumps({
        "d_model": kw["hidden_size"], "n_layer": kw["num_hidden_layers"], "vocab_size": Vp, "ssm_cfg": ssm_cfg,
        "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": pad_multiple,
        "tie_embeddings": tied}))
    return V


@pytest.mark.parametrize("i", range(len(CONFIGS)))
def test_logits_match_transformers_and_state_spaces_layout(tmp_path, i):
    kw = CONFIGS[i]
    hf = _hf_model(kw, seed=i)
    hf.save_pretrained(tmp_path / "hf")
    tokens = torch.randint(0, kw["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(i))
    with torch.no_grad():
        expected = hf(tokens).logits                      # float32, transformers' slow path

    model = md.load_model(tmp_path / "hf")
    assert model.config.n_layer == kw["num_hidden_layers"] and model.config.d_conv == kw["conv_kernel"]
    assert _rel(model.logits(tokens), expected) < 1e-5                     # float64 reference
    assert _rel(model.logits(tokens, backend="cpu"), expected) < 1e-5      # float32 CPU port

    V = _to_state_spaces(tmp_path / "hf", tmp_path / "ss", kw)
    ss = md.load_model(tmp_path / "ss")
    assert ss.config.vocab_size % 8 == 0
    torch.testing.assert_close(ss.logits(tokens)[..., :V], model.logits(tokens), rtol=0, atol=1e-12)


def test_transformers_generation_matches_ours(tmp_path):
    kw = CONFIGS[1]
    hf = _hf_model(kw, seed=7)
    hf.save_pretrained(tmp_path / "hf")
    model = md.load_model(tmp_path / "hf")
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    with torch.no_grad():
        hf_ids = hf.generate(prompt, max_new_tokens=12, do_sample=False)[0, 5:]
    ours = model.generate(prompt, 12, ubatch=2)[0]
    assert ours.tolist() == hf_ids.tolist()
