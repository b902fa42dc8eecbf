"""GGUF (llama.cpp, architecture `mamba`): export, load, round trips and damaged files."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from conftest import random_model  # noqa: E402
from mamba_debug.cli import build_parser  # noqa: E402
from mamba_debug.errors import CheckpointError, MambaDebugError  # noqa: E402
from mamba_debug.io import gguf as io_gguf  # noqa: E402
from mamba_debug.io import DEFAULT_MODEL, describe_gguf, export_gguf, load_gguf, load_model, save_hf  # noqa: E402

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
        "want of a wife. However little known the feelings or views of such a man may be on his first entering a "
        "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
        "considered the rightful property of some one or other of their daughters.\n")
SAMPLE = "A single man, in want of a wife? Ünïcode → 42 ok!<|endoftext|>"


def byte_bpe(vocab_size: int = 300):
    """A small byte-level BPE tokenizer like the shipped model's (tokenizers' ByteLevel + one special token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TEXT.split("\n") * 3, trainer=trainer)
    return tok


def f32_model(seed=0, **kw):
    """A random model whose float64 masters are exactly float32 values (what an f32 file can hold)."""
    m = random_model(seed, **kw)
    m.params = {k: v.to(torch.float32).to(torch.float64) for k, v in m.params.items()}
    return m


@pytest.fixture(scope="module")
def tok():
    return byte_bpe()


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory, tok):
    """An HF folder (float32 safetensors + tokenizer.json) loaded back: the usual input of export-gguf."""
    m = random_model(3, vocab_size=tok.get_vocab_size() + 5)       # 5 rows beyond the tokenizer: padded tokens
    m.tokenizer = tok
    folder = save_hf(m, tmp_path_factory.mktemp("hf") / "model")
    return load_model(folder)


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory, hf_model):
    return export_gguf(hf_model, tmp_path_factory.mktemp("gguf") / "m-f32.gguf")


TOKENS = torch.tensor([[5, 17, 200, 3, 64, 64, 99, 250, 1, 0, 12, 77, 130]])


# -- round trips ----------------------------------------------------------------------------------
def test_f32_round_trip_is_exact(tmp_path):
    m = f32_model(vocab_size=61)
    path = export_gguf(m, tmp_path / "exact.gguf")
    g = load_gguf(path)
    assert g.config == m.config
    for k, v in m.params.items():
        assert torch.equal(g.params[k], v), k
    assert torch.equal(g.logits(TOKENS % 61), m.logits(TOKENS % 61))
    assert g.tokenizer is None and g.source == str(path) and "no tokenizer" in g.notes[0]
    # and GGUF -> GGUF is a fixed point
    g2 = load_gguf(export_gguf(g, tmp_path / "exact2.gguf"))
    assert all(torch.equal(g2.params[k], v) for k, v in g.params.items())


def test_f32_round_trip_of_hf_model(f32_file, hf_model):
    g = load_gguf(f32_file)
    assert g.config == hf_model.config
    for k, v in hf_model.params.items():
        if k.endswith(".A"):      # HF stores A_log; -exp(A_log) in float64 is rounded once more to f32 ssm_a
            assert torch.allclose(g.params[k], v, rtol=1e-7, atol=0), k
        else:
            assert torch.equal(g.params[k], v), k
    a, b = hf_model.logits(TOKENS), g.logits(TOKENS)
    assert ((a - b).abs().max() / a.abs().max()).item() < 1e-6


def test_tokenizer_round_trip(f32_file, hf_model, tok):
    g = load_gguf(f32_file)
    assert g.tokenizer is not None and g.source == str(f32_file) and g.notes == []
    assert g.encode(SAMPLE) == hf_model.encode(SAMPLE) == tok.encode(SAMPLE).ids
    ids = g.encode(SAMPLE)
    assert g.decode(ids) == hf_model.decode(ids)
    assert g.decode(g.encode(TEXT)) == TEXT
    eos = tok.token_to_id("<|endoftext|>")
    r = gguf.GGUFReader(str(f32_file))
    assert r.get_field("tokenizer.ggml.eos_token_id").contents() == eos
    assert r.get_field("tokenizer.ggml.pre").contents() == "gpt-2"
    tokens = r.get_field("tokenizer.ggml.tokens").contents()
    types = r.get_field("tokenizer.ggml.token_type").contents()
    assert len(tokens) == hf_model.config.vocab_size                     # padded to the embedding rows
    assert tokens[-1] == f"[PAD{len(tokens) - 1}]" and types[-1] == 5    # UNUSED
    assert types[eos] == 3                                               # CONTROL


def test_llamacpp_conventions(f32_file, hf_model):
    """Keys, names, ne order and types as llama.cpp's converter writes them."""
    r = gguf.GGUFReader(str(f32_file))
    f = lambda k: r.get_field(k).contents()  # noqa: E731
    c = hf_model.config
    assert f("general.architecture") == "mamba"
    assert (f("mamba.embedding_length"), f("mamba.block_count"), f("mamba.ssm.inner_size"), f("mamba.ssm.state_size"),
            f("mamba.ssm.conv_kernel"), f("mamba.ssm.time_step_rank")) == (c.d_model, c.n_layer, c.d_inner,
                                                                           c.d_state, c.d_conv, c.dt_rank)
    assert f("mamba.context_length") == 2 ** 20 and f("mamba.feed_forward_length") == 0
    assert f("mamba.attention.head_count") == 0 and f("mamba.ssm.dt_b_c_rms") is False
    t = {x.name: x for x in r.tensors}
    E, D, N, K, R, V = c.d_model, c.d_inner, c.d_state, c.d_conv, c.dt_rank, c.vocab_size
    ne = lambda n: [int(x) for x in t[n].shape]  # noqa: E731
    assert ne("token_embd.weight") == [E, V] and "output.weight" not in t          # tied -> omitted
    assert ne("blk.0.ssm_in.weight") == [E, 2 * D] and ne("blk.0.ssm_out.weight") == [D, E]
    assert ne("blk.0.ssm_conv1d.weight") == [K, D] and ne("blk.0.ssm_x.weight") == [D, R + 2 * N]
    assert ne("blk.0.ssm_dt.weight") == [R, D] and ne("blk.0.ssm_a") == [N, D] and ne("blk.0.ssm_d") == [D]
    a = np.asarray(t["blk.1.ssm_a"].data)
    assert (a < 0).all()                                                     # A, not A_log
    assert np.array_equal(a, hf_model.params["layers.1.A"].numpy().astype(np.float32))


def test_f16_bf16_q8_close(hf_model, tmp_path):
    ref = hf_model.logits(TOKENS)
    scale = ref.abs().max()
    for dtype, tol, big in (("f16", 1e-2, "F16"), ("bf16", 5e-2, "BF16"), ("q8_0", 2e-1, "Q8_0")):
        path = export_gguf(hf_model, tmp_path / f"m-{dtype}.gguf", dtype=dtype)
        r = gguf.GGUFReader(str(path))
        types = {x.name: x.tensor_type.name for x in r.tensors}
        assert types["blk.0.ssm_in.weight"] == big and types["token_embd.weight"] == big
        assert {types[n] for n in ("blk.0.ssm_x.weight", "blk.0.ssm_dt.weight", "blk.0.ssm_conv1d.weight",
                                   "blk.0.ssm_a", "blk.0.ssm_d", "blk.0.attn_norm.weight")} == {"F32"}
        g = load_gguf(path)
        err = ((g.logits(TOKENS) - ref).abs().max() / scale).item()
        assert 0 < err < tol, (dtype, err)


def test_untied_output_and_describe(tmp_path):
    m = f32_model(1, vocab_size=40, tie_embeddings=False)
    m.params["lm_head"] = m.params["lm_head"] * 0.5
    path = export_gguf(m, tmp_path / "untied.gguf", dtype="f16")
    g = load_gguf(path)
    assert g.config.tie_embeddings is False
    assert torch.allclose(g.params["lm_head"], m.params["lm_head"], atol=1e-3)
    text = describe_gguf(path)
    assert "arch      mamba" in text and "F16" in text and "no tokenizer" in text
    assert "note      " not in text and describe_gguf(path, g.notes + ["x"]).endswith("\nnote      x")


def test_export_refuses_what_llamacpp_cannot_load(tmp_path):
    with pytest.raises(MambaDebugError, match="expand 2"):
        export_gguf(random_model(expand=3), tmp_path / "x.gguf")
    with pytest.raises(MambaDebugError, match="biases"):
        export_gguf(random_model(proj_bias=True), tmp_path / "x.gguf")
    with pytest.raises(MambaDebugError, match="--dtype"):
        export_gguf(random_model(), tmp_path / "x.gguf", dtype="q4_0")
    assert not list(tmp_path.iterdir())                              # nothing half-written


def test_cli_export_gguf(hf_model, tmp_path, capsys):
    parser = build_parser()
    folder = str(hf_model.source)
    args = parser.parse_args(["export-gguf", "--model", folder, "--out", str(tmp_path / "o.gguf"), "--dtype", "q8_0"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "Q8_0" in out and "tokenizer gpt2" in out
    assert load_model(tmp_path / "o.gguf").config == hf_model.config
    from mamba_debug.io import describe_gguf
    assert describe_gguf(tmp_path / "o.gguf").startswith("file "), "describing a file is not writing it"


# -- damaged files --------------------------------------------------------------------------------
def test_truncated_file(f32_file, tmp_path):
    data = f32_file.read_bytes()
    for cut, what in ((len(data) // 2, "truncated"), (len(data) - 7, "truncated"), (60, "truncated")):
        p = tmp_path / f"cut{cut}.gguf"
        p.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=what) as exc:
            load_model(p)
        assert str(p) in str(exc.value)


def test_wrong_magic(f32_file, tmp_path):
    p = tmp_path / "magic.gguf"
    p.write_bytes(b"GGML" + f32_file.read_bytes()[4:])
    with pytest.raises(CheckpointError, match="not b'GGUF'"):
        load_gguf(p)
    with pytest.raises(CheckpointError, match="not b'GGUF'"):
        load_model(p)


def test_missing_tensor(monkeypatch, tmp_path):
    real = gguf.GGUFWriter.add_tensor

    def skip(self, name, *a, **kw):
        if name != "blk.2.ssm_a":
            real(self, name, *a, **kw)
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", skip)
    path = export_gguf(random_model(), tmp_path / "missing.gguf")
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match=r"blk\.2\.ssm_a missing"):
        load_gguf(path)


@pytest.mark.parametrize("arch, words", [("nemotron_h", "Nemotron-H"), ("llama", "'llama'")])
def test_wrong_architecture(monkeypatch, tmp_path, arch, words):
    monkeypatch.setattr(io_gguf, "ARCH", arch)
    path = export_gguf(random_model(), tmp_path / f"{arch}.gguf")
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="not supported yet") as exc:
        load_model(path)
    assert words in str(exc.value) and str(path) in str(exc.value)


def test_falcon_mamba_flag(monkeypatch, tmp_path):
    monkeypatch.setattr(gguf.GGUFWriter, "add_ssm_dt_b_c_rms",
                        lambda self, v: self.add_bool("mamba.ssm.dt_b_c_rms", True))
    path = export_gguf(random_model(), tmp_path / "falcon.gguf")
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="FalconMamba"):
        load_gguf(path)


def test_unsupported_tensor_type(monkeypatch, tmp_path):
    real = io_gguf._encode

    def as_int(t, qt, g):
        if t.ndim == 1 and t.shape[0] == 64 and (t > 0).all() and (t < 2).all():   # ssm_d (around 1)
            return t.astype(np.int32), g.GGMLQuantizationType.I32
        return real(t, qt, g)
    monkeypatch.setattr(io_gguf, "_encode", as_int)
    path = export_gguf(random_model(), tmp_path / "int.gguf")
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="I32.*cannot dequantize"):
        load_gguf(path)


def test_nan_and_positive_a(tmp_path):
    m = random_model()
    m.params["layers.1.dt_bias"] = m.params["layers.1.dt_bias"].clone()
    m.params["layers.1.dt_bias"][3] = float("nan")
    with pytest.raises(CheckpointError, match="NaN"):
        load_gguf(export_gguf(m, tmp_path / "nan.gguf"))
    m = random_model()
    m.params["layers.0.A"] = -m.params["layers.0.A"]
    with pytest.raises(CheckpointError, match="A_log"):
        load_gguf(export_gguf(m, tmp_path / "alog.gguf"))



def test_shipped_tiny_model_round_trip(tmp_path):
    """The shipped model: f32 GGUF reloads to the same weights (ssm_a up to f32 rounding) and tokenizer."""
    if not (DEFAULT_MODEL / "config.json").is_file():
        pytest.skip(f"the shipped tiny model is not in {DEFAULT_MODEL}")
    m = load_model()
    g = load_gguf(export_gguf(m, tmp_path / "tiny.gguf"))
    assert g.config == m.config
    for k, v in m.params.items():
        assert torch.equal(g.params[k], v) or (k.endswith(".A") and torch.allclose(g.params[k], v, rtol=1e-7)), k
    text = (DEFAULT_MODEL / "val.txt").read_text()[:20000] if (DEFAULT_MODEL / "val.txt").is_file() else TEXT
    assert g.encode(text) == m.encode(text)
    assert g.decode(g.encode(text)) == text
    r = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    eos = m.tokenizer.token_to_id("<|endoftext|>")
    if eos is not None:
        assert r.get_field("tokenizer.ggml.eos_token_id").contents() == eos


# -- the vocabulary through GGUF (tokenizers library on both ends) --------------------------------------------
ID_TEXTS = ["Elizabeth was not a little surprised.\n\nMr. Darcy bowed, and said nothing.\n",
            "1234567890 3.14159 -42 1e-5 on 2024-11-30, 007",
            "Ünïcode: café, naïve, Straße, Ελληνικά, 日本語, emoji 🙂👍",
            "tabs\tand  double  spaces \r\n   trailing   ",
            "<|endoftext|>It began again.<|endoftext|>and again<|endoftext|>", ""]


def _same_ids(a, b, texts):
    for text in texts:
        ids = a.encode(text).ids
        assert b.encode(text).ids == ids, text
        assert b.decode(ids) == a.decode(ids), text


def test_shipped_tokenizer_same_ids_after_gguf_round_trip(tmp_path):
    """The shipped model's tokenizer and the one rebuilt from its exported GGUF: same vocabulary, same special
    tokens, same ids and decoded text (non-ASCII, newlines, digits, the special token); GGUF -> GGUF is a fixed point."""
    if not (DEFAULT_MODEL / "tokenizer.json").is_file():
        pytest.skip(f"the shipped tiny model is not in {DEFAULT_MODEL}")
    shipped = load_model().tokenizer
    rebuilt = load_gguf(export_gguf(load_model(), tmp_path / "a.gguf")).tokenizer
    again = load_gguf(export_gguf(load_gguf(tmp_path / "a.gguf"), tmp_path / "b.gguf")).tokenizer
    assert rebuilt.get_vocab() == shipped.get_vocab() == again.get_vocab()
    added = lambda t: {i: (a.content, a.special) for i, a in t.get_added_tokens_decoder().items()}  # noqa: E731
    assert added(rebuilt) == added(shipped) == added(again)
    eos = shipped.token_to_id("<|endoftext|>")
    assert eos is not None and shipped.encode(ID_TEXTS[4]).ids.count(eos) == 3         # the special token splits
    _same_ids(shipped, rebuilt, ID_TEXTS)
    _same_ids(shipped, again, ID_TEXTS)


def test_added_tokens_keep_their_type_and_ids(tmp_path, tok):
    """A user-defined added token (type USER_DEFINED) and the special one (CONTROL) come back at their ids."""
    from tokenizers import Tokenizer
    t = Tokenizer.from_str(tok.to_str())
    t.add_tokens(["<user>"])
    m = random_model(vocab_size=t.get_vocab_size() + 3)
    m.tokenizer = t
    path = export_gguf(m, tmp_path / "added.gguf")
    types = gguf.GGUFReader(str(path)).get_field("tokenizer.ggml.token_type").contents()
    assert types[t.token_to_id("<user>")] == 4 and types[t.token_to_id("<|endoftext|>")] == 3
    _same_ids(t, load_gguf(path).tokenizer, ID_TEXTS + ["x<user>y <user>"])
