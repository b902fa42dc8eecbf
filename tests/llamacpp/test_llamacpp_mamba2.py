"""`--engine llama.cpp` on the shipped Mamba-2 (`mamba2`) and Granite-4.0-H hybrid (`granitehybrid`) models.

Agreement with the reference at -ub 1 and 8 with 1-2 sequences and at -ub 1 with 3 sequences (llama.cpp's groups);
each layer reports its own site list (Mamba-2, Mamba-2 + feed-forward, attention), ffn_up is "not observed" (two
MUL_MATs in llama.cpp), never 0; faults written into a node's memory in the eval callback (a Mamba-2 layer's y_scan,
its gated norm and its state hand-off; an attention layer's attn, k and a feed-forward half) are found at their
token, sequence, layer and site. Kept small: a short prompt, two generated tokens.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed; run tests/llamacpp/build.sh")

import mamba_debug as md  # noqa: E402
from mamba_debug.io import export_gguf, load_model  # noqa: E402
from mamba_debug.views.summary import to_json  # noqa: E402
from test_llamacpp_side import compare as compare_side  # noqa: E402 (one lock-step run for both files)

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "It was a fine morning in the country, and Mr. Darcy"
MODELS = ("tiny-mamba2", "tiny-granite-hybrid")


@pytest.fixture(scope="module")
def subjects(tmp_path_factory):
    """name -> (name, model loaded from its f32 GGUF export, prompt ids, GGUF path); each exported once."""
    cache = {}

    def get(name):
        if name not in cache:
            try:
                hf = md.load_model(name)
            except md.CheckpointError:
                pytest.skip(f"data/{name} is not there")
            path = export_gguf(hf, tmp_path_factory.mktemp("gguf") / f"{name}-f32.gguf", dtype="f32")
            model = load_model(path)
            cache[name] = (name, model, model.encode(PROMPT), path)
        return cache[name]
    return get


def compare(subject, ubatch, n_seqs, fault=None, **kw):
    """test_llamacpp_side's lock-step run (its N_GEN and fault hook) on this file's subjects."""
    _, model, ids, path = subject
    return compare_side((model, ids, path), ubatch, n_seqs, fault, **kw)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("ubatch, n_seqs", [(1, 1), (8, 1), (1, 2), (8, 2), (1, 3)])
def test_agrees_with_the_reference(subjects, name, ubatch, n_seqs):
    subject = subjects(name)
    model = subject[1]
    res = compare(subject, ubatch, n_seqs)
    assert res.first_divergence is None, res.first_divergence
    j = to_json(res)
    c = j["config"]
    kinds = c["llama_cpp"]["layer_kinds"]
    assert kinds == [t + ("+ffn" if t == "mamba2" and model.config.d_ff else "") for t in model.config.layer_types]
    assert {(n["backend"], n["path"]) for n in c["llama_cpp"]["nodes"]} == {("CPU", "fp32")}
    assert c["llama_cpp"]["observer_effect"]["logits_bitwise_identical"]
    assert c["seqs_per_ubatch"] == min(n_seqs, ubatch + 1) and len(j["generations"]["device"]) == n_seqs
    for i, row in enumerate(j["per_layer"]):
        sites = row["sites"]
        assert tuple(sites) == tuple(s for s in res.layer_sites[i])     # this layer's own list, all compared
        want = {"mamba2": ("zxbcdt", "conv", "CONCAT", "y_scan", "ssm_state", "conv_state", "y_gated", "RMS_NORM#2",
                           "y_norm", "out", "resid"),
                "attention": ("norm", "q", "k", "v", "attn", "out", "SCALE", "ffn_act", "MUL_MAT#7", "resid")}
        for site in want[kinds[i].split("+")[0]]:
            assert isinstance(sites[site]["max_rel_l2"], float), (i, site)
        if kinds[i] != "mamba2":                # the feed-forward's [gate | up] is two nodes in llama.cpp
            assert sites["ffn_up"]["max_rel_l2"] is None and isinstance(sites["ffn_inp"]["max_rel_l2"], float)
    if "attention" in kinds:
        assert c["llama_cpp"]["kv_cache"] == "f32" and c["llama_cpp"]["flash_attn"] is False
        assert name == "tiny-granite-hybrid" and res.layer_sites[0] != res.layer_sites[2]


def _fault(layer, site, ubatch, n_seqs, seq, token=None, T=None, delta=0.05, group=0, x=None):
    """Adds delta to one element of node (layer, site) in ubatch `ubatch`: sequence `seq` (counted from the group's
    first sequence `group`), token `token` of the ubatch; a state (token None): element 3 of the sequence's row. The
    element is found in the node's own layout ([X, T, S], X fastest) through its byte strides. x: X where the node
    holds more than its [X, T, S] (SSM_SCAN: y, then the states)."""
    def hook(node, a, u, first_seq):
        if node.layer != layer or node.site != site or u != ubatch or first_seq != group:
            return
        if token is None:
            logical = seq * (a.size // n_seqs) + 3
        else:
            logical = (seq * T + token) * (x or a.size // (n_seqs * T))
        idx = np.unravel_index(logical, a.shape)
        a[idx] += delta * max(1.0, abs(float(a[idx])))
    return hook


CASES = {
    # name: (model, ubatch, n_seqs, layer, site, ubatch index, seq, token in ubatch)
    "m2-y_scan-second-seq": ("tiny-mamba2", 8, 2, 3, "y_scan", 1, 1, 2),
    "m2-gated-norm": ("tiny-mamba2", 4, 1, 6, "y_norm", 2, 0, 3),
    "m2-grouped-RMS_NORM": ("tiny-mamba2", 1, 1, 1, "RMS_NORM#2", 4, 0, 0),
    "m2-state-handoff": ("tiny-mamba2", 4, 1, 2, "ssm_state", 1, 0, None),
    "hy-m2-y_scan": ("tiny-granite-hybrid", 8, 2, 4, "y_scan", 0, 1, 1),
    "hy-attn-second-seq": ("tiny-granite-hybrid", 8, 2, 5, "attn", 1, 1, 3),
    "hy-attn-k-cache": ("tiny-granite-hybrid", 4, 1, 2, "k", 1, 0, 0),
    "hy-attn-ffn-gate": ("tiny-granite-hybrid", 1, 1, 2, "MUL_MAT#7", 6, 0, 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fault_is_localized(subjects, case):
    model_name, ub, S, layer, site, u, seq, tok = CASES[case]
    subject = subjects(model_name)
    T = max(1, ub // S)
    x = subject[1].config.d_inner if site == "y_scan" else None
    res = compare(subject, ub, S, fault=_fault(layer, site, u, S, seq, tok, T=T, x=x))
    fd = res.first_divergence
    assert fd is not None, f"fault at layer {layer} {site} not found"
    want_tok = u * T + (T - 1 if tok is None else tok)
    assert (fd["token"], fd["seq"], fd["layer"], fd["site"]) == (want_tok, seq, layer, site), fd


@pytest.mark.parametrize("name", MODELS)
def test_fault_in_the_second_group_of_sequences(subjects, name):
    """-ub 1 with 3 sequences: llama.cpp runs sequences 0-1, then 2 alone; a fault in the second group's graph (its
    sequence 0 there) is found at sequence 2. Hybrid: in an attention layer, whose KV cache is per sequence."""
    subject = subjects(name)
    layer, site = (5, "attn") if name == "tiny-granite-hybrid" else (4, "y_norm")
    res = compare(subject, 1, 3, fault=_fault(layer, site, 5, 1, 0, 0, T=1, group=2))
    fd = res.first_divergence
    assert (fd["seq"], fd["token"], fd["layer"], fd["site"]) == (2, 5, layer, site), fd


def test_local_error_per_node_on_the_hybrid(subjects):
    """--local on Granite's graph (grouped-query kq broadcasts its kv heads): clean within the fp32 floor; a fault
    written into an attention layer's attn is the first node past it."""
    subject = subjects("tiny-granite-hybrid")
    loc = compare(subject, 4, 2, local=True).sides["device"].extra["local"]
    assert loc["first_over"] is None and {"2.attn", "2.MUL_MAT#4", "3.y_norm", "3.ffn_act"} <= set(loc["max_per_node"])
    res = compare(subject, 4, 2, fault=_fault(5, "attn", 1, 2, 1, 0, T=2), local=True)
    first = res.sides["device"].extra["local"]["first_over"]
    assert (first["ubatch"], first["layer"], first["site"]) == (1, 5, "attn"), first


@pytest.mark.parametrize("name", MODELS)
def test_command_line_by_model_name(name, tmp_path):
    """`--model NAME`: the side exports the shipped HF model to an f32 GGUF in its cache first."""
    if not (ROOT / "data" / name / "config.json").is_file():
        pytest.skip(f"data/{name} is not there")
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MAMBA_DEBUG_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-m", "mamba_debug", "compare", "--engine", "llama.cpp", "--device", "cpu",
                           "--model", name, "--ubatch", "3", "--n-seqs", "2", "--n-gen", "2", "--json", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no divergence" in proc.stdout and "exported to" in proc.stderr
    j = json.loads(out.read_text())
    assert j["first_divergence"] is None and j["config"]["llama_cpp"]["gguf"].startswith(str(tmp_path / "cache"))


def test_local_error_of_mamba2_scans(subjects):
    """--local recomputes Mamba-2's SSM_SCAN (head_dim > 1, one A per head, grouped B and C): clean within the fp32
    floor on every layer's scan; a fault written into one layer's y_scan is the first node past it."""
    subject = subjects("tiny-mamba2")
    loc = compare(subject, 4, 2, local=True).sides["device"].extra["local"]
    n_layer = subject[1].config.n_layer
    assert loc["first_over"] is None
    assert {f"{i}.y_scan" for i in range(n_layer)} <= set(loc["max_per_node"]), sorted(loc["max_per_node"])
    T = 2
    fault = _fault(3, "y_scan", 1, 2, 1, 1, T=T, x=subject[1].config.d_inner)
    first = compare(subject, 4, 2, fault=fault, local=True).sides["device"].extra["local"]["first_over"]
    assert (first["ubatch"], first["layer"], first["site"], first["op"]) == (1, 3, "y_scan", "SSM_SCAN"), first


@pytest.mark.parametrize("name", MODELS)
def test_a_fault_in_the_embedding_lookup_is_named_by_its_local_error(subjects, name):
    """The embedding lookup is found by the weight it reads, not by its name: Granite's graph names it "node_0" (its
    "embd" is the SCALE by the embedding multiplier after it). A fault written into it first shows at layer 0's
    RMS_NORM, and the replay with local errors names the lookup, before layer 0."""
    def hook(node, a, u, first_seq):
        if node.op == "GET_ROWS" and node.extra.get("embedding") and u == 1:
            flat = a.reshape(-1)
            flat[3] += 0.5 + abs(flat[3])
    fd = compare(subjects(name), 4, 1, fault=hook).first_divergence
    assert (fd["token"], fd["seq"], fd["layer"], fd["site"]) == (4, 0, None, "GET_ROWS"), fd
    assert "GET_ROWS" in fd["by"], fd


def test_a_fault_in_granites_head_matmul_is_named_by_its_local_error(subjects):
    """Granite scales its logits: the head's MUL_MAT is followed by a SCALE named result_output (the `logits` site).
    A fault written into that MUL_MAT first shows at `logits`; the replay with local errors names the MUL_MAT, in no
    layer, the node where it is born."""
    def hook(node, a, u, first_seq):
        if node.op == "MUL_MAT" and node.layer is None and node.extra.get("head") and u == 1:
            flat = a.reshape(-1)
            flat[3] += 0.5 + abs(flat[3])
    fd = compare(subjects("tiny-granite-hybrid"), 4, 1, fault=hook).first_divergence
    assert (fd["token"], fd["seq"], fd["layer"], fd["site"]) == (4, 0, None, "MUL_MAT"), fd


def test_per_token_local_errors_read_mamba2_and_attention_layouts(subjects):
    """--local on Granite's hybrid: the per-token rows of a Mamba-2 layer's grouped RMS_NORM#2 ([D/G, G, T, S]) and of
    its SSM_SCAN (y of head_dim P before the states), and of an attention layer's q and attn ([X, n_tokens]) map to
    their (ubatch, seq, token): a fault at seq 1, token 1 of ubatch 1 in each is that node's worst token; no other
    node (kq and kqv are per head: no token axis) reads past the floor at any token."""
    subject = subjects("tiny-granite-hybrid")
    faults = [(3, "RMS_NORM#2", None), (4, "y_scan", subject[1].config.d_inner), (5, "attn", None), (2, "q", None)]
    hooks = [_fault(layer, site, 1, 2, 1, 1, T=2, x=x) for layer, site, x in faults]
    loc = compare(subject, 4, 2, fault=lambda *a: [h(*a) for h in hooks], local=True).sides["device"].extra["local"]
    for layer, site, _ in faults:
        err, u, seq, tok = loc["max_per_token"][f"{layer}.{site}"]
        assert err > loc["threshold"] and (u, seq, tok) == (1, 1, 1), (layer, site, err, u, seq, tok)
    faulty = {f"{layer}.{site}" for layer, site, _ in faults}
    others = {k: v for k, v in loc["max_per_token"].items() if v[0] > loc["threshold"] and k not in faulty}
    assert not others and "2.MUL_MAT#4" not in loc["max_per_token"], others


def test_a_context_holds_every_sequences_prompt(subjects):
    """llama.cpp splits n_ctx between the sequences (a KV cache each): a fixed 4104 gave each of 8 sequences 512
    cells, and a 600-token prompt of the hybrid failed in llama_decode (a 4.3k-token one with a single sequence)."""
    import torch
    from mamba_debug.sides.llamacpp import LlamaCppSide
    _, model, _, _ = subjects("tiny-granite-hybrid")
    s = md.RunSettings(engine="llama.cpp", device="cpu", ubatch=8 * 600, n_seqs=8, n_gen=1).validated(model.config)
    side = LlamaCppSide(model, s)
    try:
        side.reset(s, 8, n_tokens=601)
        tokens = torch.arange(8 * 600).reshape(8, 600) % (model.config.vocab_size - 1) + 1
        logits = side._decode(tokens, trace=False)[0]
        assert logits.shape[:2] == (8, 600) and bool(torch.isfinite(logits).all())
    finally:
        side.close()


def test_a_gguf_export_follows_the_config_not_only_the_weights(tmp_path):
    """The export was cached under a digest of the weights alone: an edited eps (or Granite's multipliers) ran the
    old file, and llama.cpp read as DIVERGED at layer 0's RMS_NORM."""
    import dataclasses
    from mamba_debug.sides.llamacpp import gguf_for
    hf = md.load_model("tiny-mamba2")
    first = gguf_for(hf, tmp_path)
    edited = md.Model(dataclasses.replace(hf.config, rms_eps=1e-2), hf.params, source=hf.source)
    assert gguf_for(edited, tmp_path) != first and gguf_for(hf, tmp_path) == first


def test_a_loaded_gguf_whose_weights_were_edited_is_exported_again(subjects, tmp_path):
    """llama.cpp ran the file on disk, not the edited weights: a false DIVERGED where the edit was."""
    from mamba_debug.sides.llamacpp import gguf_for
    _, model, _, path = subjects("tiny-mamba2")
    assert gguf_for(model, tmp_path) == path
    model.params["layers.1.D"] *= 3
    try:
        assert gguf_for(model, tmp_path) != path and not (tmp_path / "gguf").samefile(path.parent)
    finally:
        model.params["layers.1.D"] /= 3
