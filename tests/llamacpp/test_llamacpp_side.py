"""`--engine llama.cpp`: llama.cpp's CPU build traced as the device side, on the shipped model exported to a GGUF.

Agreement with the reference at -ub 1, 2, 3, 8, 512 and 1-3 sequences (no divergence); faults written into a node's
memory in the eval callback's observe call (so every later node consumes them, like a fault compiled into the build)
are found at the right token, sequence, layer and site; a fault that cannot trigger at the ubatch stays clean; a
library that is not llama.cpp is refused with exit 2. Kept small: a short prompt, two generated tokens.
"""
from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import llama_answers

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed; run tests/llamacpp/build.sh")

from mamba_debug.compare import run_compare  # noqa: E402
from mamba_debug.errors import MambaDebugError  # noqa: E402
from mamba_debug.io import export_gguf, load_model  # noqa: E402
from mamba_debug.settings import RunSettings  # noqa: E402
from mamba_debug.sides.llamacpp import lib as llib  # noqa: E402
from mamba_debug.sides.llamacpp import side as lside  # noqa: E402
from mamba_debug.views.summary import to_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "It was a fine morning in the country, and Mr. Darcy"
N_GEN = 2


@pytest.fixture(scope="module")
def subject(tmp_path_factory):
    path = export_gguf(load_model(None), tmp_path_factory.mktemp("gguf") / "tiny-f32.gguf", dtype="f32")
    model = load_model(path)
    return model, model.encode(PROMPT), path


def compare(subject, ubatch, n_seqs, fault=None, **kw):
    model, ids, _ = subject
    lside.FAULT = fault
    try:
        return run_compare(model, ids, RunSettings(engine="llama.cpp", device="cpu", ubatch=ubatch, n_seqs=n_seqs,
                                                   n_gen=N_GEN, **kw))
    finally:
        lside.FAULT = None


@pytest.mark.parametrize("ubatch, n_seqs", [(1, 1), (2, 1), (3, 1), (8, 1), (512, 1), (1, 2), (3, 2), (1, 3),
                                            (2, 3), (8, 3), (512, 3)])
def test_agrees_with_the_reference(subject, ubatch, n_seqs):
    res = compare(subject, ubatch, n_seqs)
    assert res.first_divergence is None, res.first_divergence
    j = to_json(res)
    c = j["config"]
    assert c["engine"] == "llama.cpp" and c["ubatch_per_seq"] == max(1, ubatch // n_seqs)
    assert c["llama_cpp"]["library"].endswith("libllama.so") and c["llama_cpp"]["version"]
    assert {(n["backend"], n["path"]) for n in c["llama_cpp"]["nodes"]} == {("CPU", "fp32")}
    assert c["llama_cpp"]["observer_effect"]["logits_bitwise_identical"]
    row = j["per_layer"][5]["sites"]
    assert row["gate"]["max_rel_l2"] in (None, "nan")          # SWIGLU fuses silu(z) into y_gated: not observed
    for site in ("norm", "RMS_NORM", "SSM_CONV", "MUL_MAT#2", "B", "y_scan", "ssm_state", "conv_state", "resid"):
        assert isinstance(row[site]["max_rel_l2"], float), site
    first_ub = res.token_info[0].ubatch_len
    assert first_ub == min(max(1, ubatch // n_seqs), res.n_prompt)
    assert c["seqs_per_ubatch"] == min(n_seqs, ubatch + 1) and len(j["generations"]["device"]) == n_seqs


def _fault(layer, site, ubatch, n_seqs, seq, token=None, T=None, delta=0.05, when=None, group=0):
    """Adds delta to one element of node (layer, site) in one ubatch: sequence `seq`, token `token` of the ubatch
    (a state: element 3 of the sequence's row); `seq` counts from the group's first sequence `group` (llama.cpp's
    groups of -ub + 1 sequences when -ub + 1 < n_seqs). The element is found in the node's own layout, [X, T, S] with X
    fastest (ggml's ne order), through its byte strides: a strided view is written where it really lies."""
    def hook(node, a, u, first_seq):
        if (node.layer != layer or node.site != site or u != ubatch or first_seq != group
                or (when and not when(node))):
            return
        if site in ("ssm_state", "conv_state", "GET_ROWS"):
            logical = seq * (a.size // n_seqs) + 3
        else:
            X = D_INNER if site == "y_scan" else a.size // (n_seqs * T)
            logical = (seq * T + token) * X
        idx = np.unravel_index(logical, a.shape)
        a[idx] += delta * max(1.0, abs(float(a[idx])))
    return hook


D_INNER = 256


def _run_fault(subject, ubatch, n_seqs, layer, site, u, seq, token):
    hook = _fault(layer, site, u, n_seqs, seq, token, T=max(1, ubatch // n_seqs))
    return compare(subject, ubatch, n_seqs, fault=hook)


@pytest.mark.parametrize("case", [
    # (ubatch, n_seqs, layer, site, ubatch index, seq, token in ubatch) -> found at the same place
    (4, 1, 1, "conv", 1, 0, 2),              # an early layer, a DESIGN site
    (4, 1, 10, "SSM_CONV", 2, 0, 1),         # a late layer, an op-named node
    (8, 2, 3, "y_scan", 1, 1, 3),            # the second sequence only
    (6, 2, 5, "B", 0, 0, 2),                 # a strided view (B is a view of the x_proj output)
    (3, 1, 7, "RMS_NORM", 2, 0, 2),          # a norm
    (4, 1, 4, "ssm_state", 1, 0, None),      # a state written at a ubatch end
    (6, 2, 6, "GET_ROWS", 1, 1, 0),          # the second sequence's conv state read from the cache at a ubatch start
], ids=["early-conv", "late-SSM_CONV", "second-seq-y_scan", "strided-B", "norm", "state-at-ubatch-end",
        "state-read-second-seq"])
def test_fault_is_localized(subject, case):
    ub, S, layer, site, u, seq, tok = case
    res = _run_fault(subject, ub, S, layer, site, u, seq, tok)
    fd = res.first_divergence
    assert fd is not None, f"fault at layer {layer} {site} not found"
    T = max(1, ub // S)
    want_tok = u * T + (T - 1 if tok is None else tok)
    assert (fd["token"], fd["seq"], fd["layer"], fd["site"]) == (want_tok, seq, layer, site), fd


def test_fault_that_cannot_trigger_at_this_ubatch_stays_clean(subject):
    """A fault only in ubatches of more than 4 tokens (like a kernel path taken for ne[1] > 4) at -ub 4."""
    hook = _fault(2, "conv", 0, 1, 0, 0, T=4, when=lambda node: node.ne[1] > 4)
    res = compare(subject, 4, 1, fault=hook)
    assert res.first_divergence is None
    res = compare(subject, 8, 1, fault=hook)
    assert res.first_divergence is not None and res.first_divergence["layer"] == 2


def test_fewer_ubatch_tokens_than_sequences_runs_llamacpps_groups(subject):
    """-ub 1 with 3 sequences: llama.cpp's equal split runs sequences 0-1 together, then sequence 2 alone; a fault
    in the second group's graph (its sequence 0 there) is found at sequence 2, with its own seq id kept."""
    res = compare(subject, 1, 3, fault=_fault(4, "y_scan", 5, 1, 0, 0, T=1, group=2))
    fd = res.first_divergence
    assert (fd["seq"], fd["token"], fd["layer"], fd["site"]) == (2, 5, 4, "y_scan"), fd
    assert res.errors[(4, "y_scan")]["rel_l2"].shape[0] == 3


def test_foreign_library_is_refused(tmp_path):
    other = ctypes.util.find_library("z") or ctypes.util.find_library("m")
    found = [p for p in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/lib64")
             if other and (Path(p) / other).is_file()]
    if not found:
        pytest.skip("no system library to stand in for a foreign one")
    shutil.copy(Path(found[0]) / other, tmp_path / "libllama.so")
    with pytest.raises(MambaDebugError, match="not a llama.cpp library"):
        llib._open(tmp_path / "libllama.so")
    with pytest.raises(MambaDebugError, match="struct ggml_tensor is 400 bytes"):
        llib.check_layout("libllama.so", 432, None)
    cpu = llib.Library(Path("libllama.so"), None, "x", "unknown", [("CPU", "cpu")])
    with pytest.raises(MambaDebugError, match="no GPU backend"):
        llib.check_device(cpu, "cuda")
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(tmp_path), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "mamba_debug", "compare", "--engine", "llama.cpp", "--device", "cpu",
                           "--n-gen", "1"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "libllama.so" in proc.stderr + proc.stdout and "not a llama.cpp library" in proc.stderr + proc.stdout


def test_command_line_end_to_end(subject, tmp_path):
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "mamba_debug", "compare", "--engine", "llama.cpp", "--device", "cpu",
                           "--model", str(subject[2]), "--ubatch", "3", "--n-seqs", "2", "--n-gen", "2",
                           "--json", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "no divergence" in proc.stdout
    j = json.loads(out.read_text())
    assert j["first_divergence"] is None and j["config"]["engine"] == "llama.cpp"
    assert j["config"]["ubatch"] == 3 and j["config"]["ubatch_per_seq"] == 1


def test_local_error_per_node_finds_where_an_error_is_born(subject, tmp_path):
    """--local: each node's op recomputed in float64 from the inputs it read. Clean: every node within the fp32
    floor; a fault written into SSM_CONV's output: that node is the first one past it, nothing before."""
    loc = compare(subject, 4, 2, local=True).sides["device"].extra["local"]
    assert loc["first_over"] is None and len(loc["max_per_node"]) > 100
    res = compare(subject, 4, 2, fault=_fault(3, "SSM_CONV", 1, 2, 1, 0, T=2), local=True)
    first = res.sides["device"].extra["local"]["first_over"]
    assert (first["ubatch"], first["layer"], first["site"]) == (1, 3, "SSM_CONV"), first
    # the summary and the report say it too: where the error is born, apart from what later nodes inherit
    from mamba_debug.views.report import write_report
    from mamba_debug.views.summary import summary
    line = next(x for x in summary(res).splitlines() if x.startswith("local"))
    assert "layer 3 'SSM_CONV'" in line and "born there" in line, line
    assert "Local error per node" in write_report(res, tmp_path / "r.html").read_text()


def test_fault_born_in_a_node_without_reference_is_named_by_its_local_error(subject):
    """The embedding lookup has no reference value of its own: a fault there first shows at layer 0's RMS_NORM, and
    the replay with local errors (up to that ubatch) names the node where it is born."""
    def hook(node, a, u, first_seq):
        if node.name == "embd" and u == 1:
            flat = a.reshape(-1)
            flat[3] += 0.5 + abs(flat[3])
    res = compare(subject, 4, 1, fault=hook)
    fd = res.first_divergence
    assert (fd["token"], fd["seq"], fd["layer"], fd["site"]) == (4, 0, None, "GET_ROWS"), fd
    assert "RMS_NORM" in fd["by"] and res.sides["device"].extra["local_replay"]["same_bits"]
    clean = _run_fault(subject, 4, 1, 10, "SSM_CONV", 2, 0, 1).first_divergence    # a compared node stays itself
    assert (clean["layer"], clean["site"]) == (10, "SSM_CONV") and "by" not in clean


def test_a_cuda_divergence_is_replayed_over_the_whole_schedule(subject, monkeypatch):
    """On CUDA local errors are measured only when the verdict needs them: a divergence replays every ubatch of every
    group of sequences with them (a fault in a later ubatch must not hide behind an excused TF32 drift), checked
    bit for bit; the CPU build stands in for CUDA here (same replay, every node FP32)."""
    monkeypatch.setattr(lside, "_replay_whole", lambda s, reduced: True)

    def hook(node, a, u, first_seq):
        if node.name == "embd" and u == 1 and first_seq == 0:
            flat = a.reshape(-1)
            flat[3] += 0.5 + abs(flat[3])
    res = compare(subject, 2, 4, fault=hook)       # -ub 2, 4 sequences: two groups (0-2, then 3), 14+2 ubatches
    rep = res.sides["device"].extra["local_replay"]
    n_ubatches = sum(len({i.ubatch for i in res.token_infos(g)}) for g in (0, 3))
    assert rep["until_ubatch"] is None and rep["same_bits"] and rep["ubatches"] == n_ubatches, rep
    assert rep["first_over"]["site"] == "GET_ROWS" and "local" in res.sides["device"].extra
    fd = res.first_divergence
    assert (fd["seq"], fd["layer"], fd["site"]) == (0, None, "GET_ROWS") and "RMS_NORM" in fd["by"], fd


def test_a_clean_run_needs_no_local_errors(subject, monkeypatch):
    """No divergence: nothing replayed, on CUDA as on the CPU (the run asked llama.cpp for its mapped nodes only)."""
    monkeypatch.setattr(lside, "_replay_whole", lambda s, reduced: True)
    extra = compare(subject, 2, 1).sides["device"].extra
    assert "local_replay" not in extra and "local" not in extra


def test_a_smaller_last_group_runs_its_own_ubatches(subject):
    """-ub 2 with 4 sequences: sequences 0-2 share ubatches of one token each, sequence 3 then runs alone with two
    tokens per ubatch (llama.cpp's equal split of what is left); each sequence's schedule is its own."""
    res = compare(subject, 2, 4)
    assert res.first_divergence is None and res.seq_token_info is not None
    assert res.token_infos(0)[0].ubatch_len == 1 and res.token_infos(3)[0].ubatch_len == 2
    fd = compare(subject, 2, 4, fault=_fault(2, "y_scan", 1, 1, 0, 1, T=2, group=3)).first_divergence
    assert (fd["seq"], fd["token"], fd["layer"], fd["site"], fd["ubatch"]) == (3, 3, 2, "y_scan", 1), fd


def test_a_repeated_graph_takes_the_trie_with_the_same_answers(subject, monkeypatch):
    """observe.py: a graph of a kind already seen takes the trie's path (one struct comparison per node, a yes only
    where a site needs a copy); the result is the one of mapping every graph node by node with every node
    observed (the path --local and the fault hook take)."""
    from mamba_debug.sides.llamacpp import contexts, fastpath, observe  # noqa: PLC0415
    contexts.release()              # a context an earlier test kept would know every graph already
    calls = {"ask": 0, "slow": 0}
    ev, slow, begin = observe.Tracer.eval, observe.Tracer._slow, observe.Tracer.begin
    made, init = [], fastpath.FastPath.__init__       # the C fast path answers the asks of a path it walks
    monkeypatch.setattr(fastpath.FastPath, "__init__", lambda self, *a: made.append(self) or init(self, *a))

    def counted_eval(self, t, ask, user_data):
        calls["ask"] += bool(ask and self.tracing)
        return ev(self, t, ask, user_data)

    def counted_slow(self, t, raw):
        calls["slow"] += 1
        return slow(self, t, raw)
    monkeypatch.setattr(observe.Tracer, "eval", counted_eval)
    monkeypatch.setattr(observe.Tracer, "_slow", counted_slow)
    fast = compare(subject, 3, 2)
    calls["c"] = sum(f.counts()["c_asks"] for f in made)
    assert 0 < calls["slow"] < (calls["ask"] + calls["c"]) / 3, calls      # most graphs are repeats of the first two
    assert calls["c"] > calls["ask"] or not fastpath.load()[0], calls     # ... answered in C where it compiled
    assert fast.first_divergence is None

    def node_by_node(self, *args, **kw):
        begin(self, *args, **kw)
        self.legacy = True
    monkeypatch.setattr(observe.Tracer, "begin", node_by_node)
    assert llama_answers(to_json(compare(subject, 3, 2))) == llama_answers(to_json(fast))


def test_a_finished_run_leaves_nothing_behind(subject, monkeypatch):
    """The eval callback lives as long as the process (llama.cpp may hold its pointer), and with it its Tracer: after
    a run, the Tracer holds no node data, graphs or LocalErrors (on a GPU, a 2.8B run's float64 weights), and the
    context and model are freed, also when the run fails half way. Kept for the next run (contexts.py): the
    context and its Tracer's trie, nothing of the run; freed when asked."""
    from mamba_debug.sides.llamacpp import contexts, observe
    contexts.release()
    monkeypatch.setenv("MAMBA_DEBUG_LLAMA_KEEP", "0")
    tracers, sides = [], []
    monkeypatch.setattr(lside, "Tracer", lambda *a, **kw: tracers.append(observe.Tracer(*a, **kw)) or tracers[-1])
    real_init = lside.LlamaCppSide.__init__
    monkeypatch.setattr(lside.LlamaCppSide, "__init__", lambda self, *a: sides.append(self) or real_init(self, *a))
    compare(subject, 3, 2, local=True)
    assert tracers and all(t.local is None and not t.data and not t.graphs and not t.weights for t in tracers)
    assert sides[-1].ctx is None and sides[-1].lmodel is None

    def broken(self):
        raise RuntimeError("half way")
    monkeypatch.setattr(lside.LlamaCppSide, "observer_effect", broken)
    with pytest.raises(RuntimeError, match="half way"):
        compare(subject, 3, 2, local=True)
    assert sides[-1].ctx is None and sides[-1].lmodel is None and tracers[-1].local is None
    monkeypatch.undo()
    compare(subject, 3, 2, local=True)
    kept = contexts._KEPT["context"][1].tracer
    assert kept.local is None and not kept.data and not kept.graphs and not kept.weights
    contexts.release()
    assert not contexts._KEPT


def test_per_token_local_errors_read_llamacpps_layouts(subject):
    """--local: each node's per-token local error maps its rows to (ubatch, seq, token) as llama.cpp lays them out
    ([X, n_tokens], [X, T, S], SSM_SCAN's y before its states, CONCAT's conv window): a fault at one token of one
    sequence in each kind of node is that node's worst token, and no other node's. CONCAT's column 0 (the oldest
    prior-state column) is read by token 0's window only."""
    T = 4
    at = {(1, "RMS_NORM"): lambda a: (0, 0, 1 * T + 2, 0), (2, "xz"): lambda a: (0, 1, 2, 0),
          (3, "SSM_CONV"): lambda a: (0, 1, 2, 0), (4, "y_scan"): lambda a: np.unravel_index((T + 2) * D_INNER, a.shape),
          (5, "CONCAT"): lambda a: (0, 1, 0, 0), (6, "resid"): lambda a: (0, 0, 1 * T + 2, 0)}

    def hook(node, a, u, first_seq):
        if u == 1 and (node.layer, node.site) in at:
            idx = at[(node.layer, node.site)](a)
            a[idx] += 0.05 * max(1.0, abs(float(a[idx])))
    loc = compare(subject, 8, 2, fault=hook, local=True).sides["device"].extra["local"]
    limit = loc["threshold"]
    for layer, site in at:                       # [error, ubatch, seq, token in ubatch]; seq 1, token 2 of ubatch 1
        err, u, seq, tok = loc["max_per_token"][f"{layer}.{site}"]
        want = (1, 1, 0 if site == "CONCAT" else 2)
        assert err > limit and (u, seq, tok) == want, (layer, site, loc["max_per_token"][f"{layer}.{site}"])
    faulty = {f"{layer}.{site}" for layer, site in at}
    others = {k: v for k, v in loc["max_per_token"].items() if v[0] > limit and k not in faulty}
    assert len(loc["max_per_token"]) > 100 and not others, others


def test_a_fault_at_one_token_is_named_by_its_per_token_local_error(subject):
    """A fault in the embedding lookup (no reference value) at one token of one sequence, 3e-5 of its row: over the
    whole node (16 tokens) its local error is diluted below k x the FP32 floor, so the whole-node replay would leave
    the divergence at layer 0's RMS_NORM; the per-token local error at the divergence's token names the lookup."""
    def hook(node, a, u, first_seq):
        if node.name == "embd" and u == 0:
            row = a.reshape(-1, a.shape[-1])[1 * 8 + 5]          # seq 1, token 5 of the ubatch (T = 8)
            row[3] += 3e-5 * float(np.linalg.norm(row))
    res = compare(subject, 16, 2, fault=hook)
    fd = res.first_divergence
    rep = res.sides["device"].extra["local_replay"]
    assert rep["max_per_node"]["head.GET_ROWS"] < rep["threshold"] and rep["first_over"] is None   # diluted
    assert rep["max_per_token"]["head.GET_ROWS"][1:] == [0, 1, 5]
    assert (fd["token"], fd["seq"], fd["layer"], fd["site"]) == (5, 1, None, "GET_ROWS"), fd
    assert "per-token local error of node embd" in fd["by"] and "'RMS_NORM' at layer 0 consumes it" in fd["by"]
    tok = fd["token_local"]
    assert tok["first_over"]["name"] == "embd" and tok["upto"] == {"layer": 0, "site": "RMS_NORM"}
    from mamba_debug.views.summary import summary
    line = next(x for x in summary(res).splitlines() if x.startswith("local"))
    assert "at the divergence's token (seq 1, token 5 of ubatch 0)" in line and "born there" in line, line
    assert to_json(res)["first_divergence"]["token_local"]["seq"] == 1


def test_a_rounding_divergence_is_measured_as_precision_or_named(subject):
    """No fault, thresholds at 2x the float32 floor (k_floor 2): the clean run's accumulated rounding passes one (at
    layer 6's y_scan, seq 1, token 0, by ~1%). The per-token local evidence at that token tells precision from a
    fault: nothing there past the floor (or past 4x an independent float32 recompute), so the whole schedule is
    replayed and, nothing past the floor anywhere and no site past 10x its threshold, the verdict is precision
    (exit 0), its `drift_from` the propagated divergence. The margin is thin, so a node past the floor at that token
    is allowed too: then that node is named and the run stays DIVERGED."""
    from mamba_debug.sides.llamacpp.precision import DRIFT_LIMIT
    from mamba_debug.views.summary import summary
    res = compare(subject, 8, 2, k_floor=2.0)
    fd, prec = res.first_divergence, res.precision
    if fd is None and prec is None:
        pytest.skip("this build's rounding passes no threshold at k_floor 2")
    line = next(x for x in summary(res).splitlines() if x.startswith("local"))
    if fd is None:
        tok = prec["drift_from"]["token_local"]
        rep = res.sides["device"].extra["local_replay"]
        assert prec["text"].startswith("float32 rounding: ") and prec["worst_excess"] <= DRIFT_LIMIT
        assert rep["until_ubatch"] is None and rep["same_bits"] and rep["first_over"] is None, rep
        assert tok["nodes"] > 100 and tok["limit"] == pytest.approx(2e-6) and tok["first_over"] is None
        assert to_json(res)["verdict"].startswith("no divergence beyond precision: float32 rounding")
        assert "no single op makes the excess, it is accumulated rounding" in line, line
    else:
        tok = fd["token_local"]
        assert "DIVERGED" in to_json(res)["verdict"] and tok["first_over"] is not None
        assert (fd["layer"], fd["site"]) == (tok["first_over"]["layer"], tok["first_over"]["site"]) and "born" in line