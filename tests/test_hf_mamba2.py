"""transformers' pure-torch forward as the oracle for Mamba-2 and Granite-4.0-H-style dense hybrids, on configs the
test draws (several groups, chunk boundaries inside the prompt, conv widths 2-4, tied and untied embeddings,
attention/Mamba-2 patterns, Granite's multipliers). mamba_ssm and causal_conv1d must stay out of this environment,
or transformers runs their Triton kernels instead of the oracle."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from mamba_debug.arch import param_shapes
from mamba_debug.errors import CheckpointError
from mamba_debug.io.hf_mamba2 import config_from_hf, config_to_hf, params_from_hf, params_to_hf
from mamba_debug.model import Model

from hf_mamba2_models import build, draw_granite_config, draw_mamba2_config, hf_logits

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(m) for m in ("mamba_ssm", "causal_conv1d")),
    reason="mamba_ssm/causal_conv1d installed: transformers would run their kernels, not the torch oracle")

SEEDS = [101, 202, 303, 404]
DRAWS = {"mamba2": draw_mamba2_config, "granite": draw_granite_config}


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _ours(hf_config, hf_model):
    raw = json.loads(hf_config.to_json_string())           # what config.json holds (Infinity spelled the 5.x way)
    cfg, _ = config_from_hf(raw)
    return Model(cfg, params_from_hf(cfg, hf_model.state_dict(), param_shapes(cfg)))


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", DRAWS)
def test_logits_match_transformers(kind, seed):
    hf_config = DRAWS[kind](seed)
    m = build(hf_config, seed)
    ours = _ours(hf_config, m)
    assert ours.config.chunk_size < 17                       # chunk boundaries fall inside the prompt
    ids = torch.randint(0, ours.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(seed))
    assert _rel(ours.logits(ids), hf_logits(m, ids)) < 1e-4
    assert _rel(ours.logits(ids, ubatch=3), hf_logits(m, ids)) < 1e-4


@pytest.mark.parametrize("kind", DRAWS)
def test_written_state_dict_loads_in_transformers(kind):
    from transformers import AutoConfig, AutoModelForCausalLM
    hf_config = DRAWS[kind](7)
    ours = _ours(hf_config, build(hf_config, 7))
    raw = config_to_hf(ours.config)
    back = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw)).eval()
    missing, unexpected = back.load_state_dict(params_to_hf(ours.config, ours.params), strict=False)
    assert not unexpected and all(k == "lm_head.weight" for k in missing)
    if ours.config.tie_embeddings:
        back.tie_weights()
    ids = torch.randint(0, ours.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(1))
    assert _rel(ours.logits(ids), hf_logits(back, ids)) < 1e-4
    assert config_from_hf(raw)[0] == ours.config


def test_mixture_of_experts_and_rope_are_refused_by_field():
    raw = json.loads(draw_granite_config(1).to_json_string())
    with pytest.raises(CheckpointError, match="num_local_experts"):
        config_from_hf({**raw, "num_local_experts": 4})
    with pytest.raises(CheckpointError, match="position_embedding_type"):
        config_from_hf({**raw, "position_embedding_type": "rope"})


def test_time_step_limit_spellings():
    raw = json.loads(draw_mamba2_config(1).to_json_string())
    for limit in ([0.0, float("inf")], [0.0, {"__float__": "Infinity"}], None):
        assert config_from_hf({**raw, "time_step_limit": limit})[1] == []
    assert "time_step_limit" in config_from_hf({**raw, "time_step_limit": [0.0, 0.1]})[1][0]


@pytest.mark.parametrize("kind,seed", [("mamba2", 505), ("granite", 606), ("granite", 707)])
def test_save_pretrained_folder_loads_without_tokenizer_and_saves_back(tmp_path, kind, seed):
    import mamba_debug as md
    hf_config = DRAWS[kind](seed)
    m = build(hf_config, seed)
    m.save_pretrained(tmp_path / "hf")
    model = md.load_model(tmp_path / "hf")
    assert model.tokenizer is None and any("token ids" in n for n in model.notes)
    ids = torch.randint(0, model.config.vocab_size, (2, 15), generator=torch.Generator().manual_seed(seed))
    assert _rel(model.logits(ids), hf_logits(m, ids)) < 1e-4
    md.save_hf(model, tmp_path / "ours")
    again = md.load_model(tmp_path / "ours")
    assert again.config == model.config
    torch.testing.assert_close(again.logits(ids), model.logits(ids), rtol=1e-6, atol=1e-6)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    import mamba_debug as md
    m = build(draw_mamba2_config(9), 9)
    m.save_pretrained(tmp_path)
    sd = load_file(str(tmp_path / "model.safetensors"))
    del sd["backbone.layers.0.mixer.dt_bias"]
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"backbone\.layers\.0\.mixer\.dt_bias"):
        md.load_model(tmp_path)


@pytest.mark.parametrize("seed", [808, 909])
def test_mamba_ssm_layout_loads(tmp_path, seed):
    """state-spaces' own Mamba-2 folder (config d_model/n_layer/ssm_cfg, pytorch_model.bin, `backbone.embedding`,
    vocabulary padded to a multiple of 8), built from a transformers model with the same weights."""
    import mamba_debug as md
    hf_config = draw_mamba2_config(seed)
    m = build(hf_config, seed)
    c = hf_config
    V = c.vocab_size
    Vp = -(-V // 8) * 8
    sd = {k.replace("backbone.embeddings.", "backbone.embedding."): v.clone() for k, v in m.state_dict().items()}
    for k in ("backbone.embedding.weight", "lm_head.weight"):
        sd[k] = torch.cat([sd[k], torch.zeros(Vp - V, c.hidden_size)])
    torch.save(sd, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({
        "d_model": c.hidden_size, "n_layer": c.num_hidden_layers, "vocab_size": V, "d_intermediate": 0,
        "ssm_cfg": {"layer": "Mamba2", "d_state": c.state_size, "d_conv": c.conv_kernel, "expand": c.expand,
                    "headdim": c.head_dim, "ngroups": c.n_groups, "chunk_size": c.chunk_size,
                    "conv_bias": c.use_conv_bias},
        "attn_layer_idx": [], "rms_norm": True, "residual_in_fp32": True, "norm_epsilon": c.layer_norm_epsilon,
        "tie_embeddings": c.tie_word_embeddings, "pad_vocab_size_multiple": 8}))
    model = md.load_model(tmp_path)
    assert model.config.vocab_size == Vp
    ids = torch.randint(0, V, (2, 13), generator=torch.Generator().manual_seed(seed))
    assert _rel(model.logits(ids)[..., :V], hf_logits(m, ids)) < 1e-4


def test_a_conv_bias_the_config_disowns_is_ignored_as_transformers_does(tmp_path):
    """use_conv_bias false with a conv1d.bias left in the file: transformers builds conv1d without a bias and drops
    the tensor; mamba-debug added it (logits 2.8% apart in a user's case). Now the same logits, and a note."""
    from safetensors.torch import load_file, save_file

    import mamba_debug as md
    hf_config = draw_mamba2_config(9)
    hf_config.use_conv_bias = True
    m = build(hf_config, 9)
    m.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["use_conv_bias"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(tmp_path / "model.safetensors"))
    sd = {k: v + 0.5 if k.endswith("conv1d.bias") else v for k, v in sd.items()}    # a bias that would show
    save_file(sd, str(tmp_path / "model.safetensors"))
    from transformers import AutoModelForCausalLM
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ours = md.load_model(tmp_path)
    assert any("conv1d.bias" in n for n in ours.notes)
    ids = torch.randint(0, ours.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(2))
    assert _rel(ours.logits(ids), hf_logits(theirs, ids)) < 1e-4
