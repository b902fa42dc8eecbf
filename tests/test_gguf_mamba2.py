"""GGUF `mamba2` and `granitehybrid`: mamba-debug writes them, reads them back, and stock llama.cpp
(llama-cpp-python 0.3.36, CPU) loads them and matches the float64 reference within 1e-4 relative at several
n_ubatch. Configs drawn per seed: several groups, other conv widths, tied and untied embeddings, attention/Mamba-2
patterns, grouped-query attention, no tokenizer (token ids only)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

import mamba_debug as md
from mamba_debug.errors import MambaDebugError
from mamba_debug.io import export_gguf, load_gguf

from test_mamba2 import hybrid_model, mamba2_model


def _draw(seed):
    g = torch.Generator().manual_seed(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    G, L = pick([1, 2, 4]), pick([1, 2, 3])
    return mamba2_model(seed, d_model=pick([16, 32]), n_layer=L, layer_types=("mamba2",) * L, d_conv=pick([2, 3, 4]),
                        d_state=pick([8, 16]), head_dim=pick([4, 8]), n_groups=G, vocab_size=pick([61, 64]),
                        tie_embeddings=bool(seed % 2))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_roundtrip(tmp_path, seed):
    model = _draw(seed)
    back = load_gguf(export_gguf(model, tmp_path / "m.gguf"))
    assert back.config.layer_types == model.config.layer_types and back.config.n_groups == model.config.n_groups
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(back.logits(ids), model.logits(ids), rtol=1e-5, atol=1e-5)
    assert md.load_model(tmp_path / "m.gguf").config == back.config


def test_hybrid_expand_other_than_two_is_refused_clearly(tmp_path):
    """llama.cpp's granitehybrid graph asserts d_inner == 2 * n_embd and aborts the process otherwise."""
    wide = hybrid_model(7, expand=4)
    assert wide.config.d_inner == 4 * wide.config.d_model
    with pytest.raises(MambaDebugError, match="expand 2 only"):
        export_gguf(wide, tmp_path / "w.gguf")
    assert not (tmp_path / "w.gguf").exists()
    no_attention = hybrid_model(7, layer_types=("mamba2",) * 4)
    with pytest.raises(MambaDebugError, match="no attention layer"):
        export_gguf(no_attention, tmp_path / "n.gguf")


def test_biases_are_refused_clearly(tmp_path):
    with pytest.raises(MambaDebugError, match="biases"):
        export_gguf(hybrid_model(attn_bias=True), tmp_path / "h.gguf")


def _draw_hybrid(seed):
    g = torch.Generator().manual_seed(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    kinds = pick([("mamba2", "attention", "mamba2"), ("attention", "mamba2"), ("mamba2", "mamba2", "attention")])
    return hybrid_model(seed, n_layer=len(kinds), layer_types=kinds, n_kv_heads=pick([1, 2, 4]),
                        n_groups=pick([1, 2]), d_conv=pick([3, 4]), tie_embeddings=bool(seed % 2))


@pytest.mark.parametrize("seed", [1, 2])
def test_hybrid_roundtrip(tmp_path, seed):
    model = _draw_hybrid(seed)
    back = load_gguf(export_gguf(model, tmp_path / "h.gguf"))
    assert replace(back.config, chunk_size=model.config.chunk_size) == model.config     # Q is not in a GGUF
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(seed))
    torch.testing.assert_close(back.logits(ids), model.logits(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,seed", [("mamba2", 4), ("mamba2", 5), ("mamba2", 6), ("hybrid", 7), ("hybrid", 8)])
def test_llamacpp_runs_the_export_like_the_reference(tmp_path, kind, seed):
    llama_cpp = pytest.importorskip("llama_cpp")
    model = _draw(seed) if kind == "mamba2" else _draw_hybrid(seed)
    path = export_gguf(model, tmp_path / "m.gguf")
    ids = torch.randint(0, model.config.vocab_size, (23,), generator=torch.Generator().manual_seed(seed)).tolist()
    ref = model.logits(torch.tensor([ids]))[0].numpy()
    for ub in (1, 4, 23):
        # type_k/type_v 0 = GGML_TYPE_F32: llama.cpp's default f16 KV cache alone costs ~3e-4 on the hybrids
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=ub, n_ubatch=ub, logits_all=True,
                              type_k=0, type_v=0,
                              verbose=False, n_threads=1, n_threads_batch=1)
        try:
            llm.eval(ids)
            got = np.array(llm.scores[:len(ids)], dtype=np.float64)
        finally:
            llm.close()
        err = float((np.abs(got - ref).max(-1) / np.abs(ref).max(-1)).max())
        assert err < 1e-4, (seed, ub, err)


@pytest.mark.parametrize("name", ["tiny-mamba2", "tiny-granite-hybrid"])
def test_shipped_models_export_with_their_tokenizer(tmp_path, name):
    llama_cpp = pytest.importorskip("llama_cpp")
    try:
        model = md.load_model(name)
    except md.CheckpointError:
        pytest.skip(f"data/{name} is not there")
    text = "It was a fine morning, and she could not help"
    ids = model.encode(text)
    path = export_gguf(model, tmp_path / f"{name}.gguf")
    ref = model.logits(torch.tensor([ids]))[0].numpy()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=4, n_ubatch=4, logits_all=True, type_k=0, type_v=0,
                          verbose=False, n_threads=1, n_threads_batch=1)
    try:
        assert llm.tokenize(text.encode(), add_bos=False) == ids
        llm.eval(ids)
        got = np.array(llm.scores[:len(ids)], dtype=np.float64)
    finally:
        llm.close()
    assert float((np.abs(got - ref).max(-1) / np.abs(ref).max(-1)).max()) < 1e-4


@pytest.mark.parametrize("eps", [0.0, -1e-5, float("nan")])
def test_a_norm_epsilon_out_of_range_is_refused_by_its_key(tmp_path, eps):
    """As for Mamba-1 GGUFs and every config.json: a damaged epsilon is named, not computed with."""
    from mamba_debug.errors import CheckpointError
    model = _draw(1)
    model = md.MambaModel(replace(model.config, rms_eps=eps), model.params, source="eps")
    with pytest.raises(CheckpointError, match=r"mamba2\.attention\.layer_norm_rms_epsilon = .*: the norm's epsilon"):
        load_gguf(export_gguf(model, tmp_path / "m.gguf"))


@pytest.mark.parametrize("field, value, match", [
    ("logits_scaling", float("nan"), r"granitehybrid\.logit_scale = nan should be a finite number and above 0"),
    ("logits_scaling", 0.0, r"granitehybrid\.logit_scale = 0\.0 should be a finite number and above 0"),
    ("residual_multiplier", float("inf"), r"granitehybrid\.residual_scale = inf should be a finite number"),
    ("attention_multiplier", -1.0, r"granitehybrid\.attention\.scale = -1\.0 .* at least 0"),
])
def test_a_damaged_hybrid_multiplier_is_refused_by_its_key(tmp_path, field, value, match):
    from mamba_debug.errors import CheckpointError
    model = hybrid_model(3)
    model = md.MambaModel(replace(model.config, **{field: value}), model.params, source="damaged")
    with pytest.raises(CheckpointError, match=match):
        load_gguf(export_gguf(model, tmp_path / "h.gguf"))


@pytest.mark.parametrize("key, value, match", [
    ("mamba2.block_count", 7, r"tensors of block\(s\) 7 but mamba2\.block_count is 7"),
    ("granitehybrid.attention.head_count_kv", [], r"head_count_kv should be a count of KV heads, or one per layer"),
    ("granitehybrid.feed_forward_length", 0, "feed_forward_length must be at least 1, found .* and 0"),
])
def test_damaged_metadata_is_refused_by_its_key(tmp_path, monkeypatch, key, value, match):
    """The file's metadata as the reader sees it once each value's type is checked (a KeyError, TypeError or
    ValueError before, or a block silently dropped)."""
    from mamba_debug.errors import CheckpointError
    from mamba_debug.io import gguf as gguf1
    model = md.load_model("tiny-granite-hybrid" if key.startswith("granite") else "tiny-mamba2")
    path = export_gguf(model, tmp_path / "m.gguf")
    field = gguf1._field
    monkeypatch.setattr(gguf1, "_field", lambda r, k, *a, **kw: value if k == key else field(r, k, *a, **kw))
    with pytest.raises(CheckpointError, match=match):
        load_gguf(path)


def test_an_architecture_that_is_not_a_name_is_refused(tmp_path):
    """A GGUF whose general.architecture is an array (of uint32 1, 2) raised a TypeError (unhashable list)."""
    import struct
    from mamba_debug.errors import CheckpointError
    key = b"general.architecture"
    kv = struct.pack("<Q", len(key)) + key + struct.pack("<IIQII", 9, 4, 2, 1, 2)   # ARRAY of UINT32: [1, 2]
    path = tmp_path / "a.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv)
    with pytest.raises(CheckpointError, match=r"general.architecture should be a name such as 'mamba', found \[1, 2\]"):
        md.load_model(path)
