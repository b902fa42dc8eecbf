"""The divergence engine: no false alarms on correct ops, exact localization of known bugs, data formats."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mamba_debug.cli import main as cli_main
from mamba_debug.compare import CompareSettings, run_compare
from mamba_debug.errors import MambaDebugError, PluginError
from mamba_debug.export import export_case
from mamba_debug.io import save_hf
from mamba_debug.trace import TRACE_VERSION, load_trace, save_trace
from mamba_debug.views import summary, to_json
from mamba_debug.sweep import bisect_layer, run_sweep

import mamba_debug as md
from conftest import random_model

DATA = Path(__file__).resolve().parent.parent / "data"

PROMPT = [(11 * i + 5) % 61 for i in range(20)]

STRIDED_SILU = '''
import torch
NAME = "strided_silu"
def silu(x):
    # the #6758 bug: read the view as if it were contiguous from its storage offset
    flat = torch.as_strided(x, x.shape, torch.empty(x.shape).stride(), x.storage_offset())
    return flat * torch.sigmoid(flat)
OPS = {"silu": silu}
'''

NAN_SCAN = '''
import torch
from mamba_debug.ops import ssm_scan as ref
def ssm_scan(state, x, dt, A, B, C, *, states_out=None):
    y, h = ref(state, x, dt, A, B, C, states_out=states_out)
    if x.shape[1] > 3:
        y = y.clone(); y[:, 3, 5] = float("nan")
    return y, h
OPS = {"ssm_scan": ssm_scan}
'''


@pytest.fixture(scope="module")
def model():
    return random_model(n_layer=4)


@pytest.fixture
def plugin(tmp_path):
    def write(src, name="p.py"):
        f = tmp_path / name
        f.write_text(src)
        return str(f)
    return write


def _run(model, **kw):
    base = dict(device="cpu", kernels="torch", n_gen=4, ubatch=4)
    base.update(kw)
    return run_compare(model, PROMPT, CompareSettings(**base))


@pytest.mark.parametrize("ubatch,n_seqs", [(1, 1), (4, 2), (20, 3)])
def test_correct_ops_never_diverge(model, ubatch, n_seqs):
    for offload in range(0, model.config.n_layer + 2):
        res = _run(model, offload=offload, ubatch=ubatch, n_seqs=n_seqs)
        assert res.first_divergence is None, (offload, res.first_divergence)
        assert res.logits["top1"].min() == 1.0


SEQ2_SCAN = '''
import torch
from mamba_debug.ops import ssm_scan as ref
def ssm_scan(state, x, dt, A, B, C, *, states_out=None):
    y, h = ref(state, x, dt, A, B, C, states_out=states_out)
    if x.shape[0] == 1:                # only in a ubatch holding a single sequence
        y = y.clone(); y[0, 0, 2] += 1.0
    return y, h
OPS = {"ssm_scan": ssm_scan}
'''


def test_fewer_ubatch_tokens_than_sequences_runs_llamacpps_groups(model, plugin):
    """-ub 1, 3 sequences: llama.cpp's equal split runs sequences 0-1 together (B + 1 of them), then sequence 2
    alone, each group's tokens before the next one's. The merged result equals separate runs of each group."""
    s = CompareSettings(ubatch=1, n_seqs=3)
    assert s.seq_groups() == [(0, 2), (2, 3)] and s.seqs_per_ubatch() == 2 and s.ubatch_per_seq() == 1
    assert CompareSettings(ubatch=2, n_seqs=3).seq_groups() == [(0, 3)]
    res = _run(model, offload=2, ubatch=1, n_seqs=3)
    assert res.first_divergence is None and res.tokens.shape[0] == 3
    assert len(res.generations["device"]) == 3 and res.errors[(1, "y_scan")]["rel_l2"].shape[0] == 3
    fd = _run(model, offload=2, ubatch=1, n_seqs=3, kernels=plugin(SEQ2_SCAN)).first_divergence
    assert (fd["seq"], fd["token"], fd["layer"], fd["site"]) == (2, 0, 2, "y_scan"), fd
    assert _run(model, offload=2, ubatch=2, n_seqs=3, kernels=plugin(SEQ2_SCAN)).first_divergence is None
    whole = to_json(_run(model, offload=2, ubatch=1, n_seqs=3))
    assert whole["config"]["seqs_per_ubatch"] == 2


WRONG_SCAN = '''
from mamba_debug.ops import ssm_scan as ref
def ssm_scan(state, x, dt, A, B, C, *, states_out=None):
    y, h = ref(state, x, dt, A, B, C, states_out=states_out)
    return 3 * y, h
OPS = {"ssm_scan": ssm_scan}
'''


def test_every_sequence_group_is_observed_after_the_device_generated_on_its_own(model, plugin):
    """A group's free-running device generation (free_run, when the device picks another token) once left the
    device runner unobserved: every later group then read as the reference itself (zero error, KLD 0)."""
    path = plugin(WRONG_SCAN)
    runs = {fr: _run(model, offload=2, ubatch=1, n_seqs=4, kernels=path, free_run=fr) for fr in (True, False)}
    assert runs[True].generations["first_difference"][:2] != [None, None], "group 1 must generate on its own"
    for key, e in runs[False].errors.items():
        assert torch.equal(runs[True].errors[key]["rel_l2"], e["rel_l2"]), key
    assert torch.equal(runs[True].logits["kld"], runs[False].logits["kld"])
    assert float(runs[True].logits["kld"][2:].mean(1).min()) > 0


def test_float64_reference_side_has_no_false_alarm(model):
    assert _run(model, offload=5, reference="float64").first_divergence is None


def test_strided_gate_reproduces_the_6758_symptoms(model, plugin):
    path = plugin(STRIDED_SILU)
    assert _run(model, offload=2, ubatch=1, kernels=path).first_divergence is None      # -ub 1 is exact
    fd = _run(model, offload=2, ubatch=4, kernels=path).first_divergence
    assert (fd["token"], fd["layer"], fd["site"], fd["position"]) == (1, 2, "gate", "inside its ubatch")
    # more offloaded layers, more drift
    klds = [float(_run(model, offload=o, ubatch=4, kernels=path).logits["kld"].mean()) for o in (1, 2, 4)]
    assert klds[0] < klds[1] < klds[2], klds
    # with several sequences only the very first token of the ubatch (seq 0) is right
    fd = _run(model, offload=2, ubatch=4, n_seqs=2, kernels=path).first_divergence
    assert (fd["token"], fd["seq"], fd["layer"]) == (0, 1, 2)


def test_nan_is_reported_where_it_is_born(model, plugin):
    res = _run(model, offload=3, ubatch=8, kernels=plugin(NAN_SCAN))
    fd = res.first_divergence
    assert fd["nan"] and (fd["token"], fd["layer"], fd["site"]) == (3, 1, "y_scan")
    json.dumps(to_json(res))                           # inf/nan are written as strings, the JSON stays valid


def test_json_has_the_design_fields(model, plugin):
    j = to_json(_run(model, offload=2, kernels=plugin(STRIDED_SILU)))
    assert {"n_layer", "offload", "ubatch", "n_seqs", "kernels", "device"} <= set(j["config"])
    assert {"token", "seq", "layer", "site", "ubatch", "error", "threshold"} <= set(j["first_divergence"])
    assert {"kld_mean", "kld_max", "top1_agreement"} <= set(j["logits"])
    assert len(j["per_layer"]) == 4 and j["per_layer"][2]["on_device"] and not j["per_layer"][1]["on_device"]
    assert j["per_layer"][0]["first_bad"] is None and j["per_layer"][2]["first_bad"]["site"] == "gate"


def test_local_mode_separates_own_from_inherited_error(model, plugin, tmp_path):
    res = _run(model, offload=3, ubatch=4, kernels=plugin(STRIDED_SILU), local=True)
    rows = to_json(res)["per_layer"]
    assert rows[1]["local_resid_rel_l2"] > 1e-3            # every device layer has its own error
    assert rows[2]["local_resid_rel_l2"] > 1e-3 and rows[2]["amplification"] is not None
    # in words and in the report too (they were in the JSON only)
    assert "the error is born at layer 1 (its own resid error" in summary(res)
    clean = _run(model, offload=3, ubatch=4, local=True)
    assert "every one's own error within its threshold" in summary(clean)
    from mamba_debug.views.report import write_report
    page = write_report(res, tmp_path / "r.html").read_text()
    assert "own error and what it inherited" in page and page.count("<tr><td>") >= 3


def test_repeat_flags_nondeterminism(model, plugin):
    racy = plugin('import torch\nfrom mamba_debug.ops import silu as ref\n'
                  'OPS = {"silu": lambda x: ref(x) * (1 + 1e-3 * torch.rand(()).item())}\n')
    res = _run(model, offload=2, kernels=racy, repeat=2)
    assert res.nondeterminism is not None and res.nondeterminism["rel_l2"] > 1e-5
    assert _run(model, offload=2, repeat=2).nondeterminism is None


def test_capture_policies_and_trace_round_trip(model, plugin, tmp_path):
    res = _run(model, offload=2, kernels=plugin(STRIDED_SILU))
    assert ("dev", 2, "ssm_state") in res.trace and res.trace[("dev", 2, "ssm_state")].shape[1] == 24
    assert _run(model, offload=2, capture="metrics").trace == {}
    part = _run(model, offload=2, capture="sites", capture_layers=[3], capture_sites=["gate"])
    assert set(part.trace) == {("ref", 3, "gate"), ("dev", 3, "gate")}
    path = save_trace(res, tmp_path / "run.safetensors")
    back = load_trace(path)
    assert back.first_divergence == res.first_divergence
    torch.testing.assert_close(back.trace[("dev", 2, "gate")], res.trace[("dev", 2, "gate")])


def test_trace_from_another_version_is_a_clear_error(model, tmp_path):
    from safetensors.torch import save_file
    save_file({"tokens": torch.zeros(1, 2)}, str(tmp_path / "old.safetensors"),
              metadata={"format": "mamba-debug-trace", "version": "0", "result": "{}"})
    with pytest.raises(MambaDebugError, match=f"version 0 but this mamba-debug reads version {TRACE_VERSION}"):
        load_trace(tmp_path / "old.safetensors")


def test_bad_settings_are_clear_errors(model):
    with pytest.raises(MambaDebugError, match="unknown site name 'gatee'"):
        _run(model, capture="sites", capture_sites=["gatee"])
    with pytest.raises(MambaDebugError, match="ubatch must be"):
        _run(model, ubatch=0)
    with pytest.raises(MambaDebugError, match="budget"):
        _run(model, memory_budget_mb=0.01)


@pytest.mark.parametrize("reference,nbytes", [("float32", 4 + 4), ("float64", 4 + 8)])
def test_memory_estimate_matches_the_kept_trace(model, reference, nbytes):
    """The budget check counts what capture='all' really keeps (both sides, every site, the head): the estimate
    is the kept trace but for the conv states (one row per ubatch, not per token), and it refuses just below."""
    from mamba_debug.arch import layer_sites, site_elements
    from mamba_debug.budget import check_budget
    res = _run(model, capture="all", n_seqs=2, reference=reference)
    kept = sum(t.numel() * t.element_size() for t in res.trace.values())
    c, n_tok = model.config, res.tokens.shape[1]
    el = site_elements(c)
    estimate = nbytes * 2 * n_tok * (c.n_layer * sum(el[s] for s in layer_sites(c)) + el["final_norm"] + el["logits"])
    n_ubatches = -(-len(PROMPT) // (4 // 2)) + 4                # -ub 4 over 2 sequences: 2 tokens of each, then 4 generated
    conv_state_rows = nbytes * 2 * c.n_layer * (c.d_conv - 1) * c.d_inner * n_ubatches
    assert kept == estimate + conv_state_rows
    settings = dict(capture="all", n_seqs=2, reference=reference)
    check_budget(c, CompareSettings(**settings, memory_budget_mb=1.01 * estimate / 2**20), n_tok)
    with pytest.raises(MambaDebugError, match="budget"):
        check_budget(c, CompareSettings(**settings, memory_budget_mb=0.99 * estimate / 2**20), n_tok)


def test_crashing_plugin_is_a_clear_error(model, plugin):
    crash = plugin('def ssm_conv(*a):\n    raise IndexError("oops")\nOPS = {"ssm_conv": ssm_conv}\n')
    with pytest.raises(PluginError, match=r"op ssm_conv\(.*raised IndexError: oops"):
        _run(model, offload=1, kernels=crash)


def test_sweep_matrix_and_bisect(model, plugin):
    path = plugin(STRIDED_SILU)
    base = CompareSettings(device="cpu", kernels=path, n_gen=2)
    sw = run_sweep(model, PROMPT, base, ubatches=(1, 4), progress=False)
    assert len(sw["cells"]) == 2 * 6
    by = {(c["offload"], c["ubatch"]): c for c in sw["cells"]}
    assert all(by[(o, 1)]["first_divergence"] is None for o in range(6))
    assert by[(0, 4)]["first_divergence"] is None
    assert [by[(o, 4)]["first_layer"] for o in range(1, 5)] == [3, 2, 1, 0]
    out = bisect_layer(model, PROMPT, CompareSettings(device="cpu", kernels=path, n_gen=2, ubatch=4))
    assert out["bad_layer"] == 3 and len(out["runs"]) <= 4


def test_bisect_of_llamacpp_checks_offload_0_and_refuses_a_cpu_build(model, monkeypatch):
    """Offload 0 is the reference only for the torch engine; llama.cpp runs it on its own CPU backend, and a CPU
    build runs every offload there. A bisection took offload 0 as clean and named layer 7 from runs that all
    diverged at layer 0."""
    import types
    import mamba_debug.sweep as sweep
    with pytest.raises(MambaDebugError, match="runs every layer on the CPU whatever the offload"):
        bisect_layer(model, PROMPT, CompareSettings(engine="llama.cpp", device="cpu"))
    seen = []
    fd = {"token": 0, "layer": 0, "site": "RMS_NORM"}
    monkeypatch.setattr(sweep, "run_compare", lambda m, p, s, **k: seen.append(s.offload) or
                        types.SimpleNamespace(first_divergence=fd))
    out = bisect_layer(model, PROMPT, CompareSettings(engine="llama.cpp", device="cuda"))
    assert seen == [0] and out["bad_layer"] is None and out["offload"] == 0 and "offload 0 already" in out["message"]


SLOW_LINEAR = '''
import torch
def linear(x, weight, bias=None):
    # a correct matmul of its own: the head's placement now decides which implementation runs it
    y = (x.unsqueeze(-2) * weight).sum(-1)
    return y if bias is None else y + bias
OPS = {"linear": linear}
'''


def test_sweep_runs_offloads_that_compute_the_same_bits_once(model, plugin):
    """On the CPU, with the head's ops left to plain torch, offload L (head on the host) and L+1 (head on the
    device) compute the same bits: the sweep runs L+1 once and says so in L's cell, which equals its own run."""
    from dataclasses import replace

    from mamba_debug.sweep import sweep_cell
    L = model.config.n_layer
    base = CompareSettings(device="cpu", kernels=plugin(STRIDED_SILU), n_gen=2)
    by = {c["offload"]: c for c in run_sweep(model, PROMPT, base, ubatches=(4,), progress=False)["cells"]}
    assert by[L]["same_run_as"] == L + 1 and "same_run_as" not in by[L + 1]
    alone = sweep_cell(run_compare(model, PROMPT, replace(base, offload=L, ubatch=4, capture="metrics",
                                                          free_run=False)))
    for key in ("first_token", "first_layer", "kld_mean", "kld_max", "top1_agreement"):
        assert by[L][key] == alone[key], key
    assert by[L]["first_divergence"]["site"] == alone["first_divergence"]["site"]
    # a plug-in with its own head op (linear): the head's placement matters, every offload is its own run
    cells = run_sweep(model, PROMPT, CompareSettings(device="cpu", kernels=plugin(SLOW_LINEAR, "lin.py"), n_gen=2),
                      ubatches=(4,), progress=False)["cells"]
    assert not any("same_run_as" in c for c in cells)


def test_export_case_replays_the_failing_op(model, plugin, tmp_path):
    case = export_case(model, PROMPT, CompareSettings(device="cpu", kernels=plugin(STRIDED_SILU), offload=2,
                                                       ubatch=4, n_gen=0), tmp_path / "case")
    assert case["layer"] == 2 and [c["op"] for c in case["calls"]] == ["silu", "silu"]
    z_view = case["calls"][1]["args"][0]
    assert z_view["stride"][-2] == 2 * model.config.d_inner        # the strided view of z was kept as a view
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "case")],
                       capture_output=True, text=True, timeout=300)
    assert "1 failed, 1 passed" in r.stdout, r.stdout[-2000:]


def test_cli_compare_exit_codes_and_outputs(tmp_path, plugin):
    folder = save_hf(random_model(n_layer=3), tmp_path / "m")
    base = [sys.executable, "-m", "mamba_debug", "compare", "--model", str(folder), "--device", "cpu",
            "--n-gen", "2", "--ubatch", "4"]
    ok = subprocess.run(base + ["--kernels", "torch", "--json", str(tmp_path / "a.json")],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "a.json").read_text())["first_divergence"] is None
    bad = subprocess.run(base + ["--kernels", plugin(STRIDED_SILU), "--offload", "1", "--report",
                                 str(tmp_path / "r.html")], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and "DIVERGED at token 1" in bad.stdout
    assert (tmp_path / "r.html").read_text().count("data:image/png;base64") >= 3
    err = subprocess.run(base + ["--kernels", "nope"], capture_output=True, text=True, timeout=300)
    assert err.returncode == 2 and "Traceback" not in err.stderr and "no such plug-in" in err.stderr


def test_parallel_sweep_equals_serial_sweep(tmp_path, plugin):
    import mamba_debug as md
    model = md.load_model(save_hf(random_model(n_layer=3), tmp_path / "m"))
    base = CompareSettings(device="cpu", kernels=plugin(STRIDED_SILU), n_gen=2)
    serial = run_sweep(model, PROMPT, base, ubatches=(1, 4), progress=False)
    parallel = run_sweep(model, PROMPT, base, ubatches=(1, 4), progress=False, workers=2)
    strip = lambda cells: [{k: v for k, v in c.items() if k != "seconds"} for c in cells]  # noqa: E731
    assert strip(parallel["cells"]) == strip(serial["cells"])
    assert any(c["first_divergence"] for c in serial["cells"])
    with pytest.raises(MambaDebugError, match="needs a model loaded from a path"):
        run_sweep(random_model(n_layer=3), PROMPT, base, ubatches=(1,), progress=False, workers=2)


def test_reference_device_defaults_to_cpu_and_bad_values_are_clear(model):
    res = _run(model, offload=2)
    assert CompareSettings().ref_device == "cpu" and to_json(res)["config"]["ref_device"] == "cpu"
    assert "reference float32 CPU" in summary(res)
    assert all(m.device.type == "cpu" for m in res.errors[(2, "y_scan")].values())
    with pytest.raises(MambaDebugError, match="unknown reference device 'gpu'"):
        _run(model, ref_device="gpu")
    if not torch.cuda.is_available():
        with pytest.raises(MambaDebugError, match="reference device 'cuda' was asked for but torch sees no GPU"):
            _run(model, ref_device="cuda")
        assert cli_main(["compare", "--ref-device", "cuda", "--device", "cpu", "--n-gen", "1"]) == 2


def test_reference_device_code_path_gives_the_cpu_result(model, plugin, monkeypatch):
    """ref_device='cuda' keeps the captured tensors where they were computed and takes the metrics there. CI has no
    GPU, so map 'cuda' to the CPU: that code path must then give exactly the default path's result."""
    from mamba_debug import compare, settings
    kw = dict(offload=2, kernels=plugin(STRIDED_SILU), capture="sites", capture_sites=["gate", "ssm_state"],
              local=True, repeat=2)
    base = _run(model, **kw)
    monkeypatch.setattr(compare, "resolve_ref_device", lambda name: torch.device("cpu"))
    monkeypatch.setattr(settings, "resolve_ref_device", lambda name: torch.device("cpu"))
    other = _run(model, ref_device="cuda", **kw)
    assert other.first_divergence == base.first_divergence and other.first_divergence is not None
    assert other.generations == base.generations and other.perplexity == base.perplexity
    for name in ("floor", "logits", "trace", "local"):
        a, b = getattr(other, name), getattr(base, name)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True)
    for k in base.errors:
        for m in base.errors[k]:
            torch.testing.assert_close(other.errors[k][m], base.errors[k][m], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("which", ["mamba1", "hybrid", "mamba1, results in blocks"])
def test_sites_measured_at_birth_give_the_accumulators_result(model, plugin, monkeypatch, which):
    """capture='metrics' with the reference on a GPU measures each device site where it is born, against the
    reference's value of the same ubatch (no copy). Forced on the CPU here: every error, floor and logit statistic
    bit for bit as the Accumulator's own measurement: a bug found at the same place, a plug-in whose SSM state comes
    at the ubatch end only, a hybrid, several sequences and a last ubatch cut short. "results in blocks": measured
    as the GPU's fused kernel hands them over, pieces of one block per call (metric_block.SiteErrors), at birth and
    in the Accumulator, through its whole path (states at the ubatch end, floors, the join on the host)."""
    from mamba_debug import accumulate, compare, metric_block, metrics
    from mamba_debug.metric_block import SiteErrors
    from mamba_debug.sides import torch_side
    m = model if which != "hybrid" else md.load_model(DATA / "tiny-granite-hybrid")
    no_states_out = STRIDED_SILU + "\nSUPPORTS_STATES_OUT = False\n"     # its SSM state at ubatch ends only
    kw = dict(offload=2, kernels=plugin(no_states_out) if which != "hybrid" else "torch", capture="metrics",
              n_seqs=2, ubatch=6, n_gen=3)
    base = _run(m, **kw)
    joined, in_blocks_too = [], "blocks" in which
    if in_blocks_too:
        measure = metrics.site_errors_many

        def in_blocks(pairs):
            out = measure(pairs)
            if not out:
                return out
            block = torch.cat([torch.stack([e[k] for k in metrics.METRICS]).flatten() for e in out])
            offsets = [0] + [4 * e["rel_l2"].numel() for e in out]
            return [SiteErrors(block, sum(offsets[:i + 1]), tuple(e["rel_l2"].shape)) for i, e in enumerate(out)]
        for module in (accumulate, torch_side):
            monkeypatch.setattr(module, "site_errors_many", in_blocks)
        monkeypatch.setattr(accumulate, "errors_cpu", lambda chunks, blocks: joined.append(
            all(isinstance(c, SiteErrors) for c in chunks)) or metric_block.errors_cpu(chunks, blocks))
    calls = []
    monkeypatch.setattr(compare, "AT_BIRTH_ON_CPU", True)
    monkeypatch.setattr(torch_side, "birth_pair", lambda *a: calls.append(a[1::2]) or metrics.birth_pair(*a))
    born = _run(m, **kw)
    assert (False, True) in calls or which == "hybrid", "no state measured against a per-token reference"
    assert (True, True) in calls and (False, False) in calls
    assert born.first_divergence == base.first_divergence
    assert (born.first_divergence is not None) == (which != "hybrid")
    for name in ("floor", "logits"):
        a, b = getattr(born, name), getattr(base, name)
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True)
    assert born.errors.keys() == base.errors.keys()
    for k in base.errors:
        for m_ in base.errors[k]:
            torch.testing.assert_close(born.errors[k][m_], base.errors[k][m_], rtol=0, atol=0, equal_nan=True)
    assert not in_blocks_too or any(joined), "no site's metrics joined from their blocks"


def test_sites_measured_at_birth_wait_in_whole_layers_up_to_the_held_cap(model, plugin, monkeypatch):
    """The device's sites measured at birth wait, whole layers at a time, until the layers waiting hold `held_cap`
    bytes (fewer launches on a host-bound GPU run): each measurement holds whole layers, starts a new one only past
    the cap, and the results are those of a layer at a time (held_cap 0) bit for bit."""
    from mamba_debug import compare, metrics
    from mamba_debug.sides import torch_side
    monkeypatch.setattr(compare, "AT_BIRTH_ON_CPU", True)
    calls = []

    def recorded(pairs):
        calls.append([d.numel() * d.element_size() for d, _ in pairs])
        return metrics.site_errors_many(pairs)
    monkeypatch.setattr(torch_side, "site_errors_many", recorded)
    kw = dict(offload=model.config.n_layer, kernels=plugin(STRIDED_SILU), capture="metrics", n_seqs=2, ubatch=6,
              n_gen=2)
    results, per_call = {}, {}
    layer_bytes = None
    for cap in (0, "two layers", 1 << 30):
        if cap == "two layers":     # the bytes of a layer's device sites, found in the run a layer at a time
            cap = 2 * layer_bytes - 1
        monkeypatch.setattr(torch_side.Capture, "held_cap", cap)
        calls.clear()
        results[cap] = _run(model, **kw)
        per_call[cap] = [sum(c) for c in calls]
        if layer_bytes is None:
            layer_bytes = max(per_call[cap])
    caps = list(results)
    assert len(per_call[caps[0]]) > len(per_call[caps[1]]) > len(per_call[caps[2]]), per_call
    assert max(per_call[caps[1]]) >= 2 * layer_bytes - 1 and max(per_call[caps[1]]) < 3 * layer_bytes, per_call
    base = results[0]
    for res in results.values():
        assert res.first_divergence == base.first_divergence and base.first_divergence is not None
        assert res.errors.keys() == base.errors.keys()
        for k in base.errors:
            for m_ in base.errors[k]:
                torch.testing.assert_close(res.errors[k][m_], base.errors[k][m_], rtol=0, atol=0, equal_nan=True)


def test_capture_copies_values_and_keeps_them_where_asked():
    from mamba_debug.sides import Capture
    x = torch.arange(6.0).reshape(1, 2, 3)
    for to_host in (True, False):
        cap = Capture(to_host=to_host)
        cap.site(0, "norm", x[..., :2], True)
        x_before = x.clone()
        x.add_(1)                                   # an op writing into the tensor later must not change the capture
        (value, per_token), = cap.take().values()
        assert per_token and torch.equal(value, x_before[..., :2]) and cap.take() == {}


def test_gpu_reference_refuses_a_ubatch_that_cannot_fit():
    """2.8B shape with the reference sides on the GPU: the estimate within 2% of the peaks measured on an H100
    (weights float32 values but A, as a transformers checkpoint loads), within 4% for a Mamba-2 and a hybrid;
    ubatch 512 fits 141 GB (an H200), not 80 GB, and the error names the largest ubatch that does. The weights are
    counted only when the bound that takes every one as float64-valued does not fit. Checked before any weight is
    touched, so it runs without a GPU."""
    from mamba_debug.budget import check_gpu_memory, comparison_gpu_bytes
    from mamba_debug.config import MambaConfig
    cfg = MambaConfig(d_model=2560, n_layer=64, d_inner=5120, d_state=16, d_conv=4, dt_rank=160, vocab_size=50280)
    a_elements = 64 * 5120 * 16
    for ub, measured in ((64, 35.87e9), (128, 47.23e9), (256, 69.71e9)):    # benchmarks/README.md, 2026-12-05
        assert abs(comparison_gpu_bytes(cfg, ub, 1, 2052, a_elements) / measured - 1) < 0.02
    mamba2 = MambaConfig(d_model=2048, n_layer=48, vocab_size=50280, d_state=128, layer_types=("mamba2",) * 48,
                         head_dim=64)
    hybrid = MambaConfig(d_model=1536, n_layer=40, vocab_size=49160, d_state=128, head_dim=64, n_heads=48,
                         layer_types=tuple("attention" if i % 10 == 5 else "mamba2" for i in range(40)),
                         n_attn_heads=12, n_kv_heads=4, d_ff=512)
    for other, wide, peaks in ((mamba2, 48 * 64, (20.96e9, 29.70e9, 46.89e9)),       # 256+2 tokens, an H100
                               (hybrid, 36 * 48, (11.86e9, 16.82e9, 26.80e9))):
        for ub, measured in zip((16, 32, 64), peaks):
            assert abs(comparison_gpu_bytes(other, ub, 1, 258, wide) / measured - 1) < 0.04
    counted = []
    count = lambda: counted.append(1) or a_elements       # noqa: E731
    check_gpu_memory(cfg, CompareSettings(ubatch=64, ref_device="cuda"), 2052, total_bytes=141e9, count_wide=count)
    assert not counted                                    # the bound fits: the weights are not looked at
    s = CompareSettings(ubatch=512, ref_device="cuda")
    check_gpu_memory(cfg, s, 2052, total_bytes=141e9, count_wide=count)
    assert counted
    with pytest.raises(MambaDebugError, match=r"ubatch 512 needs about 11\d GB .* use --ubatch 256 \(about 70 GB\)"):
        check_gpu_memory(cfg, s, 2052, total_bytes=80e9, count_wide=count)
    with pytest.raises(MambaDebugError, match=r"ubatch 256 needs about 9\d GB .* use --ubatch 128"):   # uncounted
        check_gpu_memory(cfg, CompareSettings(ubatch=256, ref_device="cuda"), 2052, total_bytes=80e9)
    check_gpu_memory(cfg, CompareSettings(ubatch=512), 2052, total_bytes=1e9)   # reference on the CPU: no check


def test_gpu_check_counts_the_sequences_one_ubatch_holds():
    """-ub 8 puts at most 9 sequences, a token each, in one ubatch (llama.cpp's equal split): 512 sequences of a 2.8B
    need the working memory of 9 and the kept logits of 512, which fit an 80 GB card (the sites of 512 sequences at
    once would not: 130 GB)."""
    from mamba_debug.budget import check_gpu_memory, comparison_gpu_bytes
    from mamba_debug.config import MambaConfig
    cfg = MambaConfig(d_model=2560, n_layer=64, d_inner=5120, d_state=16, d_conv=4, dt_rank=160, vocab_size=50280)
    wide = 64 * 5120 * 16
    nine, all_at_once = comparison_gpu_bytes(cfg, 1, 9, 40, wide), comparison_gpu_bytes(cfg, 1, 512, 40, wide)
    split = comparison_gpu_bytes(cfg, 1, 512, 40, wide, ubatch_seqs=9)
    assert split - nine == (512 - 9) * 40 * 2 * cfg.vocab_size * 4 and all_at_once > 100e9 > 80e9 * 0.9 > split
    check_gpu_memory(cfg, CompareSettings(ubatch=8, n_seqs=512, ref_device="cuda"), 40, total_bytes=80e9,
                     count_wide=lambda: wide)
    with pytest.raises(MambaDebugError, match=r"ubatch 8 needs about 34 GB .* over 90% of the 35 GB"):
        check_gpu_memory(cfg, CompareSettings(ubatch=8, n_seqs=512, ref_device="cuda"), 40, total_bytes=35e9,
                         count_wide=lambda: wide)


def test_memory_estimates_count_attention_caches_in_three_runners():
    """A hybrid's KV caches grow with the prompt (k and v, Hk x Dh a token, float32 twice and float64 once); a
    Mamba-only model's estimates grow only by the logits kept."""
    from mamba_debug.arch import layer_site_elements
    from mamba_debug.budget import comparison_gpu_bytes, host_bytes
    from mamba_debug.config import MambaConfig
    hybrid = MambaConfig(d_model=64, n_layer=6, vocab_size=100, d_state=8, head_dim=16,
                         layer_types=("mamba2", "attention") * 3, n_attn_heads=4, n_kv_heads=2)
    pure = MambaConfig(d_model=64, n_layer=6, vocab_size=100, d_state=8)
    s = CompareSettings(ubatch=8)
    for cfg, per_token in ((hybrid, 3 * 2 * 2 * 16 * (4 + 4 + 8)), (pure, 0)):
        logits_gpu, logits_host = 2 * 100 * 4, 2 * 100 * 8
        metrics = (sum(len(x) for x in layer_site_elements(cfg)) + 2) * 8 * 6
        assert comparison_gpu_bytes(cfg, 8, 1, 1001) - comparison_gpu_bytes(cfg, 8, 1, 1) == 1000 * (
            per_token + logits_gpu)
        assert host_bytes(cfg, s.validated(cfg), 1009) - host_bytes(cfg, s.validated(cfg), 9) == 1000 * (
            per_token + logits_host + metrics)


def test_wide_elements_counts_the_weights_that_are_not_float32_values():
    """What the float64 reference keeps in float64 on a GPU: a tied tensor once, one odd value makes its tensor wide."""
    m = random_model(n_layer=2)
    for k in m.params:
        m.params[k] = m.params[k].to(torch.float32).to(torch.float64)
    m.params["lm_head"] = m.params["embed"]
    assert m.wide_elements() == 0
    name = random.choice([k for k in m.params if k != "lm_head"])
    m.params[name].view(-1)[random.randrange(m.params[name].numel())] = 1 + 2.0 ** -40   # not a float32 value
    assert m.wide_elements() == m.params[name].numel()


def test_a_weight_edited_between_two_runs_is_read_by_every_side(model):
    """The back-ends' cast copies were cached per model: after `params[k] *= 3` the float32 sides kept the old
    weight and the float64 reference's on-the-fly copy read the new one."""
    s = CompareSettings(device="cpu", kernels="torch", n_gen=1, offload=2)
    run_compare(model, PROMPT, s)
    model.params["layers.1.D"] *= 3
    edited = run_compare(model, PROMPT, s)
    fresh = run_compare(md.Model(model.config, {k: v.clone() for k, v in model.params.items()}), PROMPT, s)
    assert edited.first_divergence is None and edited.perplexity == fresh.perplexity
    assert torch.equal(edited.logits["kld"], fresh.logits["kld"])
