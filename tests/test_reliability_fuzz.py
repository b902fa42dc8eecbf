"""Issue 17, kept so by property-based tests: loaders on random and mutated bytes (a clear error or a correct load,
within a time bound), settings on random values, and the numerics against an independent float64 implementation.

Bounded for a 2-core CI machine: few examples with a deadline each (FUZZ), every strategy of bounded size (files of
at most a few hundred bytes changed, JSON values of at most 6 leaves, text of at most 5 characters from a fixed
alphabet, so hypothesis never builds its ~200 MB Unicode table), and each test's peak memory growth asserted
(`bounded_rss`, conftest.py)."""
from __future__ import annotations

import json
import math
import shutil
import string

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import random_model
from mamba_debug.errors import MambaDebugError
from mamba_debug.io import load_model
from mamba_debug.io.gguf import export_gguf
from mamba_debug.io.hf import save_hf
from mamba_debug.settings import RunSettings
from mamba_debug.settings_checks import N_GEN_MAX
from mamba_debug.trace import load_trace
from mamba_debug.views import summary, to_json

FUZZ = settings(max_examples=25, deadline=5000, suppress_health_check=list(HealthCheck), derandomize=True)
pytestmark = pytest.mark.usefixtures("bounded_rss")
# ASCII letters and digits, JSON's specials, a control character, a non-ASCII letter and an astral-plane character
ALPHABET = string.ascii_letters + string.digits + " _-.,:/\\\"'\n\x00\u00e9\u2603\U0001f600"


def texts(max_size: int):
    return st.text(alphabet=ALPHABET, max_size=max_size)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    m = random_model(n_layer=2, d_model=16, vocab_size=40)
    save_hf(m, root / "hf")
    export_gguf(m, root / "m.gguf")
    from mamba_debug.compare import run_compare
    from mamba_debug.trace import save_trace
    save_trace(run_compare(m, [1, 2, 3], RunSettings(n_gen=1, device="cpu", kernels="torch")), root / "t.safetensors")
    return root


def _mutate(data: bytes, edits, cut) -> bytes:
    b = bytearray(data)
    for pos, val in edits:
        b[pos % len(b)] = val
    return bytes(b[:max(1, int(len(b) * cut))]) if cut < 1 else bytes(b)


edits = st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(0, 255)), max_size=8)
cuts = st.one_of(st.just(1.0), st.floats(0.0, 1.0))


def _clear_or_correct(load):
    try:
        out = load()
    except MambaDebugError as exc:
        assert str(exc) and "\n" not in str(exc).strip()
        return None
    return out


@FUZZ
@given(edits, cuts)
def test_mutated_safetensors_model_is_a_clear_error_or_a_finite_model(files, tmp_path_factory, e, cut):
    d = tmp_path_factory.mktemp("st")
    shutil.copy(files / "hf" / "config.json", d / "config.json")
    (d / "model.safetensors").write_bytes(_mutate((files / "hf" / "model.safetensors").read_bytes(), e, cut))
    m = _clear_or_correct(lambda: load_model(d))
    assert m is None or all(torch.isfinite(t.float()).all() for t in m.params.values())


@FUZZ
@given(edits, cuts)
def test_mutated_gguf_is_a_clear_error_or_a_finite_model(files, tmp_path_factory, e, cut):
    p = tmp_path_factory.mktemp("gg") / "m.gguf"
    p.write_bytes(_mutate((files / "m.gguf").read_bytes(), e, cut))
    m = _clear_or_correct(lambda: load_model(p))
    assert m is None or all(torch.isfinite(t.float()).all() for t in m.params.values())


@FUZZ
@given(st.binary(min_size=0, max_size=300), st.sampled_from(["x.gguf", "model.safetensors", "t.safetensors"]))
def test_random_bytes_are_a_clear_error(files, tmp_path_factory, data, name):
    d = tmp_path_factory.mktemp("rb")
    p = d / name
    p.write_bytes((b"GGUF" if name.endswith("gguf") else b"") + data)
    if name == "model.safetensors":
        shutil.copy(files / "hf" / "config.json", d / "config.json")
        _clear_or_correct(lambda: load_model(d))
    elif name == "t.safetensors":
        _clear_or_correct(lambda: load_trace(p))
    else:
        _clear_or_correct(lambda: load_model(p))


@FUZZ
@given(edits, cuts)
def test_mutated_trace_is_a_clear_error_or_a_consistent_trace(files, tmp_path_factory, e, cut):
    p = tmp_path_factory.mktemp("tr") / "t.safetensors"
    p.write_bytes(_mutate((files / "t.safetensors").read_bytes(), e, cut))
    res = _clear_or_correct(lambda: load_trace(p))
    assert res is None or res.tokens.shape[1] == len(res.token_info)


json_values = st.recursive(st.none() | st.booleans() | st.integers(-10 ** 12, 10 ** 12) | st.floats() | texts(5),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(texts(4), c, max_size=3),
                           max_leaves=6)


@FUZZ
@given(st.data())
def test_trace_metadata_changed_is_a_clear_error_or_loads(files, tmp_path_factory, data):
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(files / "t.safetensors"), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    meta = json.loads(header["result"])
    key = data.draw(st.sampled_from(sorted(meta)))
    meta[key] = data.draw(json_values)
    p = tmp_path_factory.mktemp("tm") / "t.safetensors"
    save_file(tensors, str(p), metadata={**header, "result": json.dumps(meta)})
    res = _clear_or_correct(lambda: load_trace(p))
    if res is not None:                     # what loads, `show` prints
        summary(res), to_json(res)


def _with_meta(files, tmp_path, path: str, value, judged: bool = False):
    """The fixture's trace with the metadata value at `path` ("a.b": key b of object a) replaced (DELETE: removed);
    judged: first kept as a side's own verdict, as llama.cpp's traces are."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    with safe_open(str(files / "t.safetensors"), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    meta = json.loads(header["result"])
    if judged:
        meta["judged"] = {"first_divergence": None, "precision": {"items": [], "text": "float32 rounding"}}
    *parents, last = path.split(".")
    obj = meta
    for k in parents:
        obj = obj[k]
    if value is DELETE:
        del obj[last]
    else:
        obj[last] = value
    p = tmp_path / "t.safetensors"
    save_file(tensors, str(p), metadata={**header, "result": json.dumps(meta)})
    return p


DELETE = object()


@pytest.mark.parametrize("path, value", [
    ("generations", True), ("generations.first_difference", True), ("generations.device", DELETE),
    ("model_info", 1e308), ("perplexity", "x"), ("settings.ubatch", {}), ("nondeterminism", {"rel_l2": "x"}),
    ("judged.precision", 1e308), ("judged.first_divergence", {"token": 1}),
])
def test_trace_metadata_the_views_read_is_checked_at_load(files, tmp_path, path, value):
    """Each of these loaded and then crashed `show` (a TypeError, KeyError or AttributeError in the summary)."""
    p = _with_meta(files, tmp_path, path, value, judged=path.startswith("judged"))
    with pytest.raises(MambaDebugError, match="inconsistent trace file"):
        load_trace(p)


def test_a_trace_with_a_kept_verdict_loads_and_prints(files, tmp_path):
    res = load_trace(_with_meta(files, tmp_path, "judged.first_divergence", None, judged=True))
    assert res.judged and "float32 rounding" in summary(res)


# -- settings ------------------------------------------------------------------------------------------------
anything = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 6, 10 ** 6), st.floats(), texts(4))


@FUZZ
@given(st.fixed_dictionaries({}, optional={"ubatch": anything, "n_seqs": anything, "n_gen": anything,
                                           "k_floor": anything, "repeat": anything, "offload": anything,
                                           "memory_budget_mb": anything, "reference": anything}))
def test_settings_are_refused_clearly_or_valid(kw):
    cfg = random_model().config
    try:
        s = RunSettings(**kw).validated(cfg)
    except MambaDebugError:
        return
    assert isinstance(s.ubatch, int) and s.ubatch >= 1 and isinstance(s.n_seqs, int) and s.n_seqs >= 1
    assert math.isfinite(s.k_floor) and s.k_floor > 1 and isinstance(s.offload, int) and s.offload >= 0
    assert math.isfinite(s.memory_budget_mb) and s.memory_budget_mb > 0
    assert isinstance(s.n_gen, int) and 0 <= s.n_gen <= N_GEN_MAX


# -- numerics: an independent float64 Mamba-1 in numpy -----------------------------------------------------------
def _np_mamba(params: dict, cfg, tokens: np.ndarray) -> np.ndarray:
    """Mamba-1 written from the paper's equations, token by token, numpy float64 (no code shared with ops.py)."""
    p = {k: v.numpy() for k, v in params.items()}
    D, N, R, K = cfg.d_inner, cfg.d_state, cfg.dt_rank, cfg.d_conv
    h = p["embed"][tokens]                                         # [T, E]
    for i in range(cfg.n_layer):
        w = {k.split(".", 2)[2]: v for k, v in p.items() if k.startswith(f"layers.{i}.")}
        x = h / np.sqrt((h ** 2).mean(-1, keepdims=True) + cfg.rms_eps) * w["norm"]
        xz = x @ w["in_proj"].T
        xs, z = xz[:, :D], xz[:, D:]
        pad = np.concatenate([np.zeros((K - 1, D)), xs])
        conv = np.stack([(pad[t:t + K].T * w["conv_w"]).sum(-1) for t in range(len(xs))]) + w["conv_b"]
        u = conv / (1 + np.exp(-conv))
        dbc = u @ w["x_proj"].T
        dt = dbc[:, :R] @ w["dt_proj"].T + w["dt_bias"]
        delta = np.where(dt > 20, dt, np.log1p(np.exp(np.minimum(dt, 20))))
        B, C = dbc[:, R:R + N], dbc[:, R + N:]
        s = np.zeros((D, N))
        ys = []
        for t in range(len(u)):
            s = np.exp(delta[t][:, None] * w["A"]) * s + delta[t][:, None] * B[t][None] * u[t][:, None]
            ys.append(s @ C[t] + w["D"] * u[t])
        y = np.stack(ys) * (z / (1 + np.exp(-z)))
        h = h + y @ w["out_proj"].T
    f = h / np.sqrt((h ** 2).mean(-1, keepdims=True) + cfg.rms_eps) * p["norm_f"]
    return f @ p["lm_head"].T


@settings(max_examples=8, deadline=10000, derandomize=True)
@given(st.integers(0, 10 ** 6), st.integers(1, 3), st.integers(1, 9), st.integers(1, 5))
def test_reference_logits_match_an_independent_float64_mamba(seed, n_layer, n_tok, ubatch):
    m = random_model(seed=seed, n_layer=n_layer, d_model=16, vocab_size=37, d_state=4)
    tokens = np.random.default_rng(seed).integers(0, 37, n_tok)
    got = m.logits(torch.tensor(tokens)[None], ubatch=ubatch)[0].double().numpy()
    want = _np_mamba(m.params, m.config, tokens)
    assert np.allclose(got, want, rtol=1e-9, atol=1e-9), np.abs(got - want).max()


@FUZZ
@given(st.data())
def test_config_values_changed_are_a_clear_error_or_a_finite_model(files, tmp_path_factory, data):
    d = tmp_path_factory.mktemp("cf")
    shutil.copy(files / "hf" / "model.safetensors", d / "model.safetensors")
    raw = json.loads((files / "hf" / "config.json").read_text())
    key = data.draw(st.sampled_from(sorted(raw)))
    raw[key] = data.draw(json_values)
    (d / "config.json").write_text(json.dumps(raw))
    m = _clear_or_correct(lambda: load_model(d))
    assert m is None or (math.isfinite(m.config.rms_eps) and m.config.rms_eps > 0)
