"""Per-token local errors of the llama.cpp side (sides/llamacpp/token_rows.py, LocalErrors.at_token, precision.refine)
on synthetic arrays in ggml's layouts: no library needed. A whole-node local error is one rel. L2 over every token of
the ubatch; a fault confined to one token is diluted below the FP32 floor there, and only its row shows it."""
from __future__ import annotations

import struct
from types import SimpleNamespace

import numpy as np
import pytest

import torch

from mamba_debug.sides.llamacpp.local import FP32_FLOOR, ORACLE_MARGIN, LocalErrors
from mamba_debug.sides.llamacpp.precision import DRIFT_LIMIT, refine, settle
from mamba_debug.sides.llamacpp.token_rows import layout, rows_and_whole
from mamba_debug.views.summary import _token_clause

S, T, K = 3, 8, 10.0            # sequences, tokens per sequence in the ubatch, k_floor
LIMIT = K * FP32_FLOOR
DEVICES = [None, "cpu"] + (["cuda"] if torch.cuda.is_available() else [])   # numpy; torch (a CUDA run's MUL_MAT)
EPS = struct.unpack("i", struct.pack("f", 1e-5))[0]


def node(op, layer, site, index, ne=(16, S * T, 1, 1), name=None):
    return SimpleNamespace(op=op, backend="CPU", ne=ne, layer=layer, site=site, name=name or f"node_{index}",
                           index=index, extra={"op_params": (EPS, 0, 0, 0)})


def with_fault(want, at, rel):
    """want with one element of the row `at` (an index tuple of the row) moved by rel x that row's norm."""
    got = want.copy()
    row = got[at]
    row.reshape(-1)[3] += rel * np.linalg.norm(want[at])
    return got


@pytest.mark.parametrize("op, shape, row_of", [
    ("ADD", (1, 1, S * T, 16), lambda q, t: (0, 0, q * T + t)),         # [X, n_tokens]
    ("SSM_CONV", (1, S, T, 16), lambda q, t: (0, q, t)),                # [X, T, S]
    ("MUL", (S, T, 4, 5), lambda q, t: (q, t)),                         # [A, B, T, S] (Mamba-2 heads)
])
def test_rows_of_the_flat_layouts_are_the_tokens(op, shape, row_of):
    rng = np.random.default_rng(0)
    want = rng.standard_normal(shape)
    got = with_fault(want, row_of(1, 5), 1e-3)
    lay = layout(op, shape, [want, want], S, T)
    rows, whole = rows_and_whole(got, want, lay, S, T)
    assert lay[0] == "flat" and rows.shape == (S, T) and np.argmax(rows) == 1 * T + 5
    assert rows[1, 5] == pytest.approx(1e-3, rel=1e-9) and np.count_nonzero(rows) == 1
    assert whole == pytest.approx(np.linalg.norm(got - want) / np.linalg.norm(want), rel=1e-12)


def test_ssm_scan_rows_are_its_y_part():
    """SSM_SCAN's output is flat: y (S, T, H, P) first, then the states (S, H, P, N); only y has tokens."""
    rng = np.random.default_rng(1)
    H, P, N = 6, 2, 4
    x = rng.standard_normal((S, T, H, P))
    y, states = rng.standard_normal((S, T, H, P)), rng.standard_normal((S, H, P, N))
    want = np.concatenate([y.reshape(-1), states.reshape(-1)]).reshape(1, 1, 1, -1)
    got_y = with_fault(y, (2, 0), 1e-3)
    got_states = states.copy()
    got_states[0, 0, 0, 0] += 1.0                           # a state error is no token's
    got = np.concatenate([got_y.reshape(-1), got_states.reshape(-1)]).reshape(want.shape)
    lay = layout("SSM_SCAN", want.shape, [None, x], S, T)
    rows, whole = rows_and_whole(got, want, lay, S, T)
    assert lay == ("flat", H * P) and whole is None
    assert np.argmax(rows) == 2 * T + 0 and np.count_nonzero(rows) == 1


def test_concat_rows_are_the_conv_windows():
    """CONCAT (1, S, D, K-1+T): token t's row is the K columns the conv reads for t (the CONCAT site's window), so
    x of token t shows in the windows of tokens t .. t+K-1."""
    d_conv, D = 4, 5
    rng = np.random.default_rng(2)
    want = rng.standard_normal((1, S, D, d_conv - 1 + T))
    got = want.copy()
    got[0, 2, 1, d_conv - 1 + 3] += 1e-3                  # x of seq 2, token 3
    lay = layout("CONCAT", want.shape, [], S, T)
    rows, _ = rows_and_whole(got, want, lay, S, T)
    assert lay == ("window", d_conv)
    assert sorted(zip(*np.nonzero(rows))) == [(2, t) for t in range(3, 3 + d_conv)]


def test_nodes_without_a_token_axis():
    state = np.zeros((1, 1, S, 24))                        # a state read, one row per sequence (T > 1)
    assert layout("GET_ROWS", state.shape, [state], S, T) is None
    assert layout("CPY", (1, 1, 1, S * T * 4), [None], S, T) is None           # a state copy
    heads = np.zeros((1, 4, 32, 8))                        # attention's kq: a per-head MUL_MAT
    assert layout("MUL_MAT", (1, 4, S * T, 32), [heads, None], S, T) is None


def embedding_then_norm(rel, at=(2, 5), T_=T):
    """A ubatch: the embedding lookup (GET_ROWS, no reference value) with a fault of `rel` at one token, then layer
    0's RMS_NORM reading it. Returns the LocalErrors."""
    rng = np.random.default_rng(3)
    N, X, V = S * T_, 32, 50
    emb = rng.standard_normal((1, 1, V, X))
    ids = rng.integers(0, V, size=(1, 1, 1, N)).astype(np.int32)
    want = emb[0, 0][ids.reshape(-1)].reshape(1, 1, N, X)
    got = with_fault(want, (0, 0, at[0] * T_ + at[1]), rel).astype(np.float32)
    le = LocalErrors(K)
    le.ubatch_shape = (S, T_)
    le.add(node("GET_ROWS", None, "GET_ROWS", 1, ne=(X, N, 1, 1), name="embd"), [emb, ids], got, 0)
    x = got.astype(np.float64)
    norm = (x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)).astype(np.float32)
    le.add(node("RMS_NORM", 0, "RMS_NORM", 2, ne=(X, N, 1, 1), name="norm-0"), [got], norm, 0)
    le.place(node("VIEW", 0, "B", 3), 0)
    return le


def fd_at(seq, t, site="RMS_NORM", layer=0):
    return {"token": t, "seq": seq, "layer": layer, "site": site, "ubatch": 0, "index_in_ubatch": t,
            "position": "", "phase": "prompt", "error": 2e-5, "threshold": 1e-5, "nan": False}


def result():
    return SimpleNamespace(errors={(0, "RMS_NORM"): None, (0, "B"): None})


def test_a_fault_at_one_token_diluted_in_the_whole_node_is_named_by_its_token_error():
    le = embedding_then_norm(3e-5)
    whole = le.worst["head.GET_ROWS"]
    assert whole < LIMIT < 3e-5 and le.first is None                    # diluted: invisible over the whole node
    assert le.worst_token["head.GET_ROWS"][1:] == [0, 2, 5]             # [error, ubatch, seq, token in ubatch]
    assert le.worst_token["head.GET_ROWS"][0] == pytest.approx(3e-5, rel=1e-3)
    assert le.to_dict()["max_per_token"]["head.GET_ROWS"] == le.worst_token["head.GET_ROWS"]
    fd = refine(result(), fd_at(2, 5), le)
    tok = fd["token_local"]
    assert (fd["layer"], fd["site"]) == (None, "GET_ROWS") and "per-token local error of node embd" in fd["by"]
    assert "'RMS_NORM' at layer 0 consumes it" in fd["by"] and fd["threshold"] == LIMIT
    assert tok["first_over"]["name"] == "embd" and not tok["within_floor"] and tok["nodes"] == 2
    assert "the error is born there" in _token_clause(fd, {}) and "'GET_ROWS' (GET_ROWS embd)" in _token_clause(fd, {})


def test_every_node_within_the_floor_at_the_token_keeps_the_divergence_and_says_so():
    """The same ubatch, a divergence at another token: every node there within the FP32 floor; the verdict stays
    where it was (not relabelled precision), and the evidence is recorded as measured."""
    le = embedding_then_norm(3e-5)
    fd = refine(result(), fd_at(0, 5), le)
    tok = fd["token_local"]
    assert (fd["layer"], fd["site"]) == (0, "RMS_NORM") and "by" not in fd
    assert tok["within_floor"] and tok["first_over"] is None and tok["site_measured"]
    assert tok["worst"]["error"] < LIMIT and tok["whole_node_only"]["nodes"] == 0
    assert (tok["seq"], tok["token_in_ubatch"], tok["upto"]) == (0, 5, {"layer": 0, "site": "RMS_NORM"})
    assert "no single op makes the excess, it is accumulated rounding" in _token_clause(fd, {})
    assert "accumulated rounding" not in _token_clause(fd, {"first_over": {"layer": 3}})      # a fault elsewhere
    at_view = refine(result(), fd_at(0, 5, site="B"), le)["token_local"]     # a view: placed, not recomputed
    assert at_view["nodes"] == 2 and not at_view["site_measured"]
    assert "not recomputed" in _token_clause({"token_local": at_view}, {})
    assert "accumulated rounding" not in _token_clause({"token_local": at_view}, {})


def test_the_evidence_stops_at_the_divergent_node():
    """Nodes after the divergence's node in graph order are not counted: at layer 0's RMS_NORM the evidence sees the
    lookup and the norm, at the lookup only the lookup."""
    le = embedding_then_norm(3e-5)
    assert le.at_token(0, 2, 5, None, "GET_ROWS")["nodes"] == 1
    assert le.at_token(0, 2, 5, 0, "RMS_NORM")["nodes"] == 2
    assert le.at_token(1, 2, 5, 0, "RMS_NORM") is None                  # no such ubatch recorded


def test_mul_mat_rows_on_torch_are_numpys():
    """The MUL_MAT recompute by torch (on the GPU for CUDA runs; here the CPU) gives numpy's per-token errors."""
    rng = np.random.default_rng(4)
    w = rng.standard_normal((1, 1, 512, 256))                # 1 MB: a weight
    x = rng.standard_normal((1, S, T, 256)).astype(np.float32)
    want = np.matmul(x.astype(np.float64), np.swapaxes(w, -1, -2))
    got = with_fault(want, (0, 1, 6), 1e-4).astype(np.float32)
    rows = []
    for device in (None, "cpu"):
        le = LocalErrors(K, device=device)
        le.ubatch_shape = (S, T)
        le.add(node("MUL_MAT", 0, "xz", 4, ne=(512, T, S, 1)), [w, x], got, 0)
        rows.append(le.tokens[(0, 0)]["nodes"][0][7])
        assert le.worst_token["0.xz"][1:] == [0, 1, 6]
    np.testing.assert_allclose(rows[1], rows[0], rtol=1e-9, atol=1e-12)


def test_without_a_ubatch_shape_only_the_whole_node_error_is_kept():
    le = LocalErrors(K)
    x = np.ones((1, 1, 4, 8), dtype=np.float32)
    le.add(node("ADD", 0, "resid", 1, ne=(8, 4, 1, 1)), [x, x], x + x, 0)
    assert "0.resid" in le.worst and le.worst_token == {} and le.tokens == {}


def test_a_whole_node_fault_at_another_token_still_names_an_unreferenced_node():
    """Nothing past the floor at the divergence's token, but the lookup (no reference value) is past it over the
    whole node from a fault at another token: the whole-node rule still names it, and the summary does not call
    the divergence rounding."""
    le = embedding_then_norm(1e-2, at=(0, 1))
    fd = refine(result(), fd_at(2, 5), le)
    assert fd["token_local"]["within_floor"] and (fd["layer"], fd["site"]) == (None, "GET_ROWS")
    assert fd["by"].startswith("local error of node embd")
    text = _token_clause(fd, {})
    assert "named by a whole-node local error" in text and "accumulated rounding" not in text


def test_an_earlier_token_of_the_sequence_past_the_floor_keeps_it_from_being_called_rounding():
    """The fault at token 3 of sequence 2 (past the floor there) and a divergence at token 5 of the same sequence,
    where every node is within the floor: the divergence stays, `earlier_over` names the lookup at token 3, and
    the summary does not call it rounding. Another sequence's token 3 is not this sequence's history."""
    le = embedding_then_norm(3e-5, at=(2, 3))
    tok = refine(result(), fd_at(2, 5), le)["token_local"]
    assert tok["within_floor"] and tok["earlier_over"]["name"] == "embd" and tok["earlier_over"]["token_in_ubatch"] == 3
    text = _token_clause({"token_local": tok}, {})
    assert "at token 3 of the same sequence" in text and "accumulated rounding" not in text
    assert refine(result(), fd_at(1, 5), le)["token_local"]["earlier_over"] is None


def test_a_nan_made_from_finite_inputs_is_born_there_not_inherited():
    """rel_l2: a node whose output is NaN or inf where its float64 recompute is finite has local error inf (past
    every limit: born there); a NaN recompute (non-finite inputs) stays NaN (inherited)."""
    from mamba_debug.sides.llamacpp.local import rel_l2
    want = np.ones((1, 1, 4, 8))
    got = want.copy()
    got[0, 0, 2, 3] = np.nan
    assert rel_l2(got, want) == np.inf
    assert np.isnan(rel_l2(want, np.where(got != got, np.nan, want)))
    assert rel_l2(want, want) == 0.0


def ill_conditioned_mul_mat(fault=0.0, device=None):
    """A MUL_MAT whose row at (seq 2, token 5) nearly cancels: x there lies in the null space of w but for a 1e-4
    part, so every output is ~1e-4 of its terms and float32 rounding is ~1e4 ulps of it in any implementation. `got`
    is a float32 implementation of its own (products rounded, summed one term after another), plus `fault` x the
    row's norm on one value of that row. Returns (LocalErrors, the row's error)."""
    rng = np.random.default_rng(5)
    Kd, M = 64, 32
    w = rng.standard_normal((1, 1, M, Kd)).astype(np.float32).astype(np.float64)
    x = rng.standard_normal((1, S, T, Kd))
    q, _ = np.linalg.qr(w[0, 0].T, mode="complete")            # columns M.. span w's null space
    x[0, 2, 5] = q[:, M:] @ rng.standard_normal(Kd - M) + 1e-4 * rng.standard_normal(Kd)
    x = x.astype(np.float32)
    got = np.zeros((1, S, T, M), dtype=np.float32)
    for k in range(Kd):                                        # float32, sequential: not numpy's order
        got += x[..., k, None] * w[0, 0, None, :, k].astype(np.float32)
    want = np.matmul(x.astype(np.float64), np.swapaxes(w, -1, -2))
    if fault:
        got = with_fault(got.astype(np.float64), (0, 2, 5), fault).astype(np.float32)
    le = LocalErrors(K, device=device)
    le.ubatch_shape = (S, T)
    le.add(node("MUL_MAT", 0, "x_proj", 4, ne=(M, T, S, 1)), [w, x], got, 0)
    row = np.linalg.norm(got[0, 2, 5] - want[0, 2, 5]) / np.linalg.norm(want[0, 2, 5])
    return le, float(row)


def clean_result(excess=2.0):
    """A run whose only site ('x_proj' at layer 0) passes its threshold 1e-5 by `excess` at (seq 2, token 5)."""
    err = torch.zeros(S, T, dtype=torch.float64)
    err[2, 5] = excess * 1e-5
    errors = {(0, "x_proj"): {"rel_l2": err}}
    return SimpleNamespace(errors=errors, thresholds={(0, "x_proj"): 1e-5},
                           ratio=lambda key: errors[key]["rel_l2"] / 1e-5)


@pytest.mark.parametrize("device", DEVICES)                # numpy, and torch (the GPU path of a CUDA run)
def test_an_ill_conditioned_row_is_explained_by_the_float32_recompute(device):
    """The row errs far past the flat FP32 floor in a float32 implementation with no fault: the independent float32
    recompute errs as much there, so the node is not where an error is born, and the summary says why."""
    le, row = ill_conditioned_mul_mat(device=device)
    tok = le.at_token(0, 2, 5, 0, "x_proj")
    assert row > 30 * LIMIT                                   # the flat floor alone would call it a fault
    assert tok["first_over"] is None and tok["within_floor"] and len(tok["explained"]) == 1
    e = tok["explained"][0]
    assert e["error"] == pytest.approx(row, rel=1e-6) and e["error"] <= ORACLE_MARGIN * e["fp32_recompute"]
    assert e["fp32_recompute"] > LIMIT                        # numpy's / torch's float32 errs as much: conditioning
    assert le.at_token(0, 2, 4, 0, "x_proj")["explained"] == []      # a well-conditioned token: within the floor
    text = _token_clause(refine(clean_result(), fd_at(2, 5, site="x_proj"), le), {})
    assert "independent float32 recompute" in text and "the row's own conditioning" in text


def test_a_fault_on_an_ill_conditioned_row_is_still_born_there():
    """A fault of 1e-2 of the row's norm on the same row: far past ORACLE_MARGIN x the float32 recompute's error."""
    le, _ = ill_conditioned_mul_mat(fault=1e-2)
    tok = le.at_token(0, 2, 5, 0, "x_proj")
    assert tok["first_over"]["name"] == "node_4" and tok["explained"] == []


def test_rounding_drift_with_every_node_explained_is_a_precision_verdict():
    """settle (every ubatch's local errors at hand): a divergence whose token has every node within the floor or
    explained, nothing past it over the run and no site past DRIFT_LIMIT x its threshold is float32 rounding, not a
    divergence; a site anywhere past DRIFT_LIMIT x its threshold (an error no node makes: a state read from the
    wrong slot) keeps the divergence, as does a fault at the token."""
    le, _ = ill_conditioned_mul_mat()
    fd, prec = settle(clean_result(), fd_at(2, 5, site="x_proj"), le)
    assert fd is None and prec["text"].startswith("float32 rounding: 'x_proj' at layer 0")
    assert prec["drift_from"]["site"] == "x_proj" and prec["items"][0]["node"] == "node_4"
    assert prec["worst_excess"] == pytest.approx(2.0)
    gross = clean_result()
    gross.errors[(0, "x_proj")]["rel_l2"][0, 7] = 2 * DRIFT_LIMIT * 1e-5
    fd, prec = settle(gross, fd_at(2, 5, site="x_proj"), le)
    assert prec is None and fd["site"] == "x_proj"
    faulty, _ = ill_conditioned_mul_mat(fault=1e-2)
    fd, prec = settle(clean_result(), fd_at(2, 5, site="x_proj"), faulty)
    assert prec is None and fd["token_local"]["first_over"]["name"] == "node_4"


@pytest.mark.parametrize("device", DEVICES)
def test_an_ill_conditioned_whole_node_is_explained_not_a_fault(device):
    """A decode step's node is one token: its whole-node error is that token's. An ill-conditioned one (the same
    nearly cancelling row, alone) passes the flat floor in any float32 implementation: explained by the float32
    recompute, it is neither `first_over` nor `first_fault`; with a real fault it is both."""
    rng = np.random.default_rng(6)
    Kd, M = 64, 32
    w = rng.standard_normal((1, 1, M, Kd)).astype(np.float32).astype(np.float64)
    q, _ = np.linalg.qr(w[0, 0].T, mode="complete")
    x = (q[:, M:] @ rng.standard_normal(Kd - M) + 1e-4 * rng.standard_normal(Kd)).reshape(1, 1, 1, Kd)
    x = x.astype(np.float32)
    got = np.zeros((1, 1, 1, M), dtype=np.float32)
    for k in range(Kd):
        got += x[..., k, None] * w[0, 0, None, :, k].astype(np.float32)
    for fault, explained in ((0.0, True), (1e-2, False)):
        g = with_fault(got.astype(np.float64), (0, 0, 0), fault).astype(np.float32) if fault else got
        le = LocalErrors(K, device=device)
        le.add(node("MUL_MAT", 0, "x_proj", 4, ne=(M, 1, 1, 1)), [w, x], g, 0)
        assert le.worst["0.x_proj"] > 30 * LIMIT
        assert (le.first is None and le.fault is None) == explained
        assert bool(le.to_dict()["explained"]) == explained
    from mamba_debug.views.summary import _whole_node_clause
    le = LocalErrors(K)
    le.add(node("MUL_MAT", 0, "x_proj", 4, ne=(M, 1, 1, 1)), [w, x], got, 0)
    text = _whole_node_clause(le.to_dict())
    assert "or within 4x an independent float32 recompute of its op (1 node(s); layer 0 'x_proj'" in text, text


def test_the_float32_recompute_of_a_matmul_never_runs_in_tf32(monkeypatch):
    """A process that let torch use TF32 (set_float32_matmul_precision "high") would make torch's recompute lenient:
    the recompute then sums in numpy's FP32, and explains the row as much as before."""
    le, row = ill_conditioned_mul_mat(device="cpu")
    want = le.at_token(0, 2, 5, 0, "x_proj")["explained"][0]["fp32_recompute"]
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    le, _ = ill_conditioned_mul_mat(device="cpu")
    got = le.at_token(0, 2, 5, 0, "x_proj")["explained"][0]["fp32_recompute"]
    numpy_le, _ = ill_conditioned_mul_mat(device=None)
    assert got == pytest.approx(numpy_le.at_token(0, 2, 5, 0, "x_proj")["explained"][0]["fp32_recompute"], rel=1e-9)
    assert got > LIMIT and want > LIMIT


def ggml_softplus_scan(fault=0.0):
    """A Mamba-2 SSM_SCAN (fresh states, softplus(dt) ~ 1e-3) computed in float32 as llama.cpp's CPU writes it:
    softplus as logf(1 + expf(dt)), which rounds expf(dt)'s low bits away (~1e-5 of delta here); `fault` x the
    row's norm added to one value of (seq 1, token 0). Returns the LocalErrors it was added to."""
    rng = np.random.default_rng(7)
    H, P, N = 4, 8, 16
    x = rng.standard_normal((S, T, H, P)).astype(np.float32)
    dt = (rng.uniform(-7.5, -6.5, (1, S, T, H))).astype(np.float32)
    A = -rng.uniform(1, 4, (1, 1, H, 1)).astype(np.float32)
    B, C = (rng.standard_normal((S, T, 1, N)).astype(np.float32) for _ in range(2))
    s0, ids = np.zeros((S, H, P, N), np.float32), np.arange(S, dtype=np.int32).reshape(1, 1, 1, S)
    y, states = np.empty((S, T, H, P), np.float32), np.empty((S, H, P, N), np.float32)
    for q in range(S):
        h = s0[q].copy()
        for t in range(T):
            d = np.log(np.float32(1) + np.exp(dt[0, q, t]))                    # logf(1 + expf(dt)), float32
            h = h * np.exp(d[:, None] * A[0, 0])[:, :, None] + (d[:, None] * x[q, t])[:, :, None] * B[q, t, 0]
            y[q, t] = (h * C[q, t, 0][None, None]).sum(-1)
        states[q] = h
    if fault:
        y = with_fault(y.astype(np.float64), (1, 0), fault).astype(np.float32)
    got = np.concatenate([y.reshape(-1), states.reshape(-1)]).reshape(1, 1, 1, -1)
    le = LocalErrors(K)
    le.ubatch_shape = (S, T)
    srcs = [a.astype(np.float64) for a in (s0, x, dt, A, B, C)] + [ids]
    le.add(node("SSM_SCAN", 0, "y_scan", 7, ne=(got.size, 1, 1, 1)), srcs, got, 0)
    return le


def test_llama_cpps_softplus_explains_an_ssm_scan_row_and_says_so():
    """Where delta is small, llama.cpp's float32 softplus errs ~100x log1p's: the row passes the flat floor and
    numpy's own float32 recompute (log1p) would not explain it; its recompute with llama.cpp's formula does, and
    the evidence names the formula (a precision defect of the op, found on the CPU build: one of 120 random runs read
    DIVERGED at 1.05x so). A fault of 1e-3 of the row on top is still born there."""
    tok = ggml_softplus_scan().at_token(0, 1, 0, 0, "y_scan")
    assert tok["first_over"] is None and len(tok["explained"]) == 1, tok
    e = tok["explained"][0]
    assert e["error"] > LIMIT and "logf(1 + expf(dt))" in e["formula"]
    fd, prec = settle(SimpleNamespace(errors={(0, "y_scan"): {"rel_l2": torch.full((S, T), 1.5e-5)}},
                                      thresholds={(0, "y_scan"): 1e-5},
                                      ratio=lambda key: torch.full((S, T), 1.5)), fd_at(1, 0, site="y_scan"),
                       ggml_softplus_scan())
    assert fd is None and "a precision defect of the op's formula" in prec["text"], prec
    faulty = ggml_softplus_scan(fault=1e-3).at_token(0, 1, 0, 0, "y_scan")
    assert faulty["first_over"]["name"] == "node_7" and faulty["explained"] == []
