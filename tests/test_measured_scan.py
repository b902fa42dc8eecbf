"""The scan measuring its per-token states where they are born (kernels/triton.py's `states_ref`,
kernels/_triton_measure.py) and the engine's use of it (a device side measuring at birth, torch_side.Capture).

The oracle is the torch version of the metrics (`metrics._site_errors_torch`, float64) over the states the same
kernel writes out with `states_out` in the same call: equal up to the float64 rounding of sums taken in another order.
Runs under Triton's interpreter (CI) and, with MAMBA_DEBUG_TEST_DEVICE=cuda, compiled.
"""
import os
import sys
from pathlib import Path

import pytest
import torch

from mamba_debug import compare, metrics
from mamba_debug.compare import run_compare
from mamba_debug.plugins import load_plugin
from mamba_debug.settings import CompareSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_engine import PROMPT, random_model  # noqa: E402
from test_triton_kernels import SCAN_PLANS, make_inputs, scan_args  # noqa: E402

DEVICE = os.environ.get("MAMBA_DEBUG_TEST_DEVICE", "interpret")
TORCH_DEVICE = "cuda" if DEVICE == "cuda" else "cpu"
# the step plans (chunks with their offsets, slots, tiles) but chunked-19, which adds nothing here but 20 s
STEP_PLANS = {k: v for k, v in SCAN_PLANS.items() if v["schedule"] == "steps" and k != "chunked-19-slots-4"}


@pytest.fixture(scope="module")
def scan():
    return load_plugin("triton", device=DEVICE).ops["ssm_scan"]     # through the plug-in wrapper's output check


def assert_close(a, b, metric):
    """Float64 rounding apart (cosine near 0 has no relative precision to speak of; the rest are ratios of sums of
    squares, and maxima), the same non-finite values in the same places."""
    a, b = a.cpu(), b.cpu()
    assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.isinf(a), torch.isinf(b)), metric
    ok = torch.isfinite(b)
    torch.testing.assert_close(a[ok], b[ok], rtol=1e-12, atol=1e-13 if metric == "cosine" else 0, msg=metric)


def assert_close_metrics(got, want):
    for m in metrics.METRICS:
        assert_close(got[m], want[m], m)


@pytest.mark.parametrize("name,ref_dtype", [(name, (torch.float64, torch.float32)[i % 2])
                                            for i, name in enumerate([None, *STEP_PLANS])])
def test_scan_measures_its_states_as_the_metrics_of_states_out(scan, name, ref_dtype):
    """Every step plan (chunks, slots, tiles), a float64 and a float32 reference given as a strided view, with a NaN
    and an inf in the reference and an inf in the device's incoming state (its h non-finite from token 0 on, in one
    sequence): the metrics of the sums are those of the states written out, and y and the new state are unchanged."""
    S, T, D, N = 3, 9, 40, 12
    inp, _ = make_inputs(S, T, D, N, 4, seed=5)
    plan = STEP_PLANS.get(name)
    states = torch.empty((S, T, D, N), device=TORCH_DEVICE)
    y0, h0 = scan(*scan_args(inp), states_out=states, plan=plan)
    ref = (states.double() + 1e-4 * torch.randn(S, T, D, N, dtype=torch.float64, device=TORCH_DEVICE)).to(ref_dtype)
    ref = ref.transpose(2, 3).contiguous().transpose(2, 3)           # [S, T, D, N], N slowest
    ref[0, 4, 7, 3], ref[1, 8, 0, 11] = float("nan"), float("inf")
    y, h, sums = scan(*scan_args(inp), states_ref=ref, plan=plan)
    assert torch.equal(y, y0) and torch.equal(h, h0)
    assert_close_metrics(metrics.errors_of_sums(sums), metrics._site_errors_torch(states, ref))
    inp["ssm_state"][2, 5, 1] = float("inf")
    states.fill_(0.0)
    scan(*scan_args(inp), states_out=states, plan=plan)
    _, _, sums = scan(*scan_args(inp), states_ref=ref, plan=plan)
    e = metrics.errors_of_sums(sums)
    assert torch.isinf(e["max_abs"][2]).all()                       # a non-finite device state: inf error
    assert_close_metrics(e, metrics._site_errors_torch(states, ref))


def test_bad_states_ref_is_named(scan):
    inp, _ = make_inputs(2, 5, 24, 8, 4)
    with pytest.raises(Exception, match=r"states_ref must be \[S, T, D, N\]"):
        scan(*scan_args(inp), states_ref=torch.zeros(2, 4, 24, 8, device=TORCH_DEVICE))
    with pytest.raises(Exception, match="states_ref needs the step schedule"):
        scan(*scan_args(inp), states_ref=torch.zeros(2, 5, 24, 8, device=TORCH_DEVICE), plan=SCAN_PLANS["tiled-4"])


MEASURING_SNAPSHOT = '''
from mamba_debug.plugins import sibling
NAME = "measuring_snapshot"
MEASURES_STATES = True
_SCAN = sibling("triton").ops["ssm_scan"]
def ssm_scan(ssm_state, x, dt, A, B, C, *, states_out=None, states_ref=None):
    # the state handed on is not the last h_t: only the last token's measurement (from that state) can show it
    y, h, *sums = _SCAN(ssm_state, x, dt, A, B, C, states_out=states_out, states_ref=states_ref)
    return (y, h * 1.001, *sums)
OPS = {"ssm_scan": ssm_scan}
'''


@pytest.mark.parametrize("kernels", ["triton", "snapshot"])
def test_a_device_side_measuring_states_in_the_scan_gives_the_accumulators_result(kernels, tmp_path, monkeypatch):
    """capture='metrics' measured at birth (forced on the CPU; on a GPU with the reference there, as the engine
    does) with kernels whose scan measures its states: the scan gets the reference's states and never writes its
    own, and the result is the Accumulator's from the states written out: every other site bit for bit, the states
    to float64 rounding, a wrong handed-on state found at the same token (the last of the first device ubatch),
    several sequences and a last ubatch cut short."""
    from mamba_debug.sides import torch_side
    if kernels == "snapshot":
        kernels = str(tmp_path / "measuring_snapshot.py")
        Path(kernels).write_text(MEASURING_SNAPSHOT)
    m = random_model(n_layer=4)
    kw = dict(device="interpret", kernels=kernels, offload=2, capture="metrics", n_seqs=2, ubatch=6, n_gen=3)
    if DEVICE == "cuda":
        kw.update(device="cuda", ref_device="cuda")
    at_birth = compare._measures_at_birth
    monkeypatch.setattr(compare, "_measures_at_birth", lambda *a: False)
    base = run_compare(m, PROMPT, CompareSettings(**kw))
    monkeypatch.setattr(compare, "_measures_at_birth", at_birth)
    monkeypatch.setattr(compare, "AT_BIRTH_ON_CPU", True)
    measured = []
    monkeypatch.setattr(torch_side, "errors_of_sums", lambda s: measured.append(s.shape) or metrics.errors_of_sums(s))
    born = run_compare(m, PROMPT, CompareSettings(**kw))
    assert len(measured) == 2 * 10, "the two device layers' states, ten ubatches: measured in the scan"
    assert born.first_divergence == base.first_divergence
    assert (born.first_divergence is None) == (kernels == "triton")
    if kernels != "triton":
        assert (born.first_divergence["site"], born.first_divergence["token"]) == ("ssm_state", 2)
    assert born.errors.keys() == base.errors.keys()
    for key in base.errors:
        for m_ in metrics.METRICS:
            a, b = born.errors[key][m_], base.errors[key][m_]
            if key[1] == "ssm_state":
                assert_close(a, b, m_)
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
