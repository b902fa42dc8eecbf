"""The fused site-metrics kernel (mamba_debug/_site_metrics.py) against the torch version it replaces on a GPU.

On the CPU the kernel runs under Triton's interpreter: every index, stride, mask and split of it is checked here
against `metrics._site_errors_torch` (float64 metrics to 1e-12 relative, NaN/inf patterns exactly). On a GPU
machine run it again compiled: `MAMBA_DEBUG_TEST_DEVICE=cuda python3 -m pytest tests/test_site_metrics.py`
(one device per run, as tests/test_triton_kernels.py).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mamba_debug import metrics
from mamba_debug.metric_block import SiteErrors, errors_cpu
from mamba_debug.metrics import METRICS, _site_errors_torch, fused_site_errors, site_errors

DEVICE = os.environ.get("MAMBA_DEBUG_TEST_DEVICE", "interpret")    # "interpret" or "cuda"
TORCH_DEVICE = "cuda" if DEVICE == "cuda" else "cpu"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("MAMBA_DEBUG_TEST_DEVICE=cuda but no GPU", allow_module_level=True)

RTOL = 1e-12
NAN, INF = float("nan"), float("inf")
# Cuts of the kernel besides its own plan: several rows per program (with a masked last program), short steps
# (a row crosses step boundaries, the last step masked) and rows split into pieces (the combine kernel).
CUTS = [None, dict(BLOCK_X=64, ROWS=4, SPLIT=3, num_warps=1)]
CUT_IDS = ["plan", "rows4-step64-split3"]


def assert_same(got: dict, want: dict):
    assert set(got) == set(want) == set(METRICS)
    for m in METRICS:
        g, w = got[m], want[m]
        assert g.dtype == torch.float64 and g.shape == w.shape and g.device == w.device, (m, g.shape, w.shape)
        g, w = g.cpu(), w.cpu()
        for pattern in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(pattern(g), pattern(w)), (m, pattern.__name__, g, w)
        fin = torch.isfinite(w)
        if m == "max_abs":            # a max does not depend on the order: exact
            assert torch.equal(g[fin], w[fin]), (m, g, w)
        else:
            err = (g[fin] - w[fin]).abs() / w[fin].abs()
            assert torch.all((g[fin] == w[fin]) | (err <= RTOL)), (m, float(err.max()), g, w)


def check(dev, ref, cut=None):
    got = fused_site_errors(dev, ref, config=cut)
    assert_same(got, _site_errors_torch(dev, ref))
    return got


def rand(*shape, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def near(ref, seed=1, scale=1e-3, dtype=torch.float32):
    """A device result: the reference with a small relative error, in the device's dtype."""
    r = ref.double()
    return (r * (1 + scale * rand(*ref.shape, seed=seed).to(r.device))).to(dtype)


def on(*ts):
    return [t.to(TORCH_DEVICE) for t in ts]


# %% values

@pytest.mark.parametrize("cut", CUTS, ids=CUT_IDS)
@pytest.mark.parametrize("X", [1, 7, 1000])
def test_float32_device_against_float64_reference(X, cut):
    ref = rand(3, 5, X)
    ref[0, 0] *= 1e-30                 # tiny and huge rows: the float64 sums must not underflow or overflow
    ref[1, 1] *= 1e30
    dev, ref = on(near(ref), ref)
    out = check(dev, ref, cut)
    assert float(out["rel_l2"].min()) > 1e-6 and (X == 1 or float(out["cosine"].max()) < 1)


@pytest.mark.parametrize("cut", CUTS, ids=CUT_IDS)
def test_identical_values_give_zero_errors_and_cosine_one(cut):
    ref = rand(2, 3, 300)
    dev, ref = on(ref.clone(), ref)
    out = check(dev, ref, cut)
    assert out["rel_l2"].eq(0).all() and out["max_abs"].eq(0).all() and out["nmse"].eq(0).all()
    assert torch.allclose(out["cosine"], torch.ones_like(out["cosine"]), rtol=0, atol=1e-15)
    f32 = ref.float()                  # float32 vs itself, as a site against a shared host block
    out = check(f32, f32, cut)
    assert out["rel_l2"].eq(0).all()


@pytest.mark.parametrize("cut", CUTS, ids=CUT_IDS)
def test_non_finite_values(cut):
    ref = rand(2, 6, 100)
    dev = near(ref, dtype=torch.float64)
    dev[0, 0, 5] = NAN                                   # NaN in dev, finite ref: inf errors, NaN cosine
    dev[0, 1, 99] = INF                                  # the last element of a row
    dev[0, 2, 0] = -INF
    dev[0, 3, 7], ref[0, 3, 7] = NAN, NAN                # NaN in both: as torch does (not a divergence)
    ref[0, 4, 50] = NAN                                  # NaN in ref only
    dev[0, 5, 3], ref[0, 5, 3] = INF, INF                # the same inf on both sides: NaN cosine, no divergence
    dev[1, 0, 1], ref[1, 0, 2] = INF, -INF               # inf on both sides, elsewhere
    dev[1, 1, 4] = 1e300                                 # finite, but its square overflows (float64 dev)
    dev, ref = on(dev, ref)
    check(dev, ref, cut)
    out = check(dev.float(), ref, cut)                   # float32 dev (1e300 becomes inf there)
    assert out["rel_l2"][0, :3].isposinf().all() and out["cosine"][0, :3].isnan().all()
    assert out["max_abs"][0, :3].isposinf().all() and out["nmse"][0, :3].isposinf().all()
    assert torch.isfinite(out["rel_l2"][1, 2:]).all()


@pytest.mark.parametrize("cut", CUTS, ids=CUT_IDS)
def test_zero_rows(cut):
    ref = rand(1, 4, 50)
    dev = near(ref)
    ref[0, 0] = 0                                        # ref zero, dev zero: 0 errors, cosine 1
    dev[0, 0] = 0
    ref[0, 1] = 0                                        # ref zero, dev not: inf rel/nmse, max |dev|, cosine 1
    dev[0, 2] = 0                                        # dev zero, ref not: rel 1, cosine 1
    ref[0, 3, :10] = 0                                   # partly zero
    dev, ref = on(dev, ref)
    out = check(dev, ref, cut)
    assert out["rel_l2"][0, 0] == 0 and out["cosine"][0, 0] == 1 and out["max_abs"][0, 0] == 0
    assert out["rel_l2"][0, 1] == INF and out["nmse"][0, 1] == INF and out["cosine"][0, 1] == 1
    assert out["max_abs"][0, 1] == dev[0, 1].abs().max().double()
    assert out["rel_l2"][0, 2] == 1 and out["cosine"][0, 2] == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_device_dtypes(dtype):
    ref = rand(2, 3, 257)
    dev, ref = on(near(ref, scale=1e-2, dtype=dtype), ref)
    check(dev, ref)
    check(ref.float(), dev)                              # and as the reference side (the floor: f32 vs f64)


# %% layouts

@pytest.mark.parametrize("cut", CUTS, ids=CUT_IDS)
def test_views_are_read_through_their_strides(cut):
    big = on(rand(3, 10, 40))[0]
    base = on(rand(3, 5, 16))[0]
    ref = big[:, ::2, 3:19]                              # [3, 5, 16] slice: strides (400, 80, 1), offset 3
    dev = near(base).to(TORCH_DEVICE)
    check(dev, ref, cut)
    check(ref, dev, cut)
    ref2 = base.expand(2, 3, 5, 16)[:, 1]                # an expanded (stride 0) dim
    check(near(ref2.contiguous()).to(TORCH_DEVICE), ref2, cut)


@pytest.mark.parametrize("cut", CUTS, ids=CUT_IDS)
def test_transposed_trailing_dims(cut):
    states = on(rand(2, 3, 16, 6))[0]                     # [S, T, D, N] per-token states
    ref = states.transpose(-1, -2)                       # [S, T, N, D]: two strided runs per row, no copy
    dev = near(ref.contiguous()).to(TORCH_DEVICE)
    check(dev, ref, cut)
    check(ref, dev, cut)
    weird = on(rand(2, 3, 4, 5, 6))[0].permute(0, 1, 4, 2, 3)   # three runs: copied once, same values
    check(near(weird.contiguous()).to(TORCH_DEVICE), weird, cut)
    flat = on(rand(2, 3, 96))[0]                        # same elements, other trailing shape (reshape semantics)
    check(near(flat).view(2, 3, 16, 6), flat, cut)


@pytest.mark.parametrize("cut", CUTS, ids=CUT_IDS)
def test_state_at_the_end_of_a_ubatch_and_scalar_sites(cut):
    """The engine's per_token=False values: v[:, None], one row per sequence; and a [S, T] tensor: X = 1."""
    cache = on(rand(4, 12, 8))[0]                         # a state cache; slots 1..3 are the sequences
    ref = cache[1:][:, None]                              # [3, 1, 12, 8]
    dev = near(ref.contiguous()).to(TORCH_DEVICE)
    check(dev, ref, cut)
    st = on(rand(3, 11))[0]                               # [S, T]
    check(near(st).to(TORCH_DEVICE), st, cut)
    check(near(st).to(TORCH_DEVICE).t().contiguous().t(), st, cut)


def test_long_rows_cross_the_interpreters_block():
    ref = rand(1, 2, 20000)                               # the interpreter's steps are 16384 elements
    dev, ref = on(near(ref), ref)
    check(dev, ref)


@pytest.mark.parametrize("shape", [(2, 1, 5120 * 16), (3, 8, 5120), (2, 40, 16)])
def test_the_gpu_plans(shape):
    """The cuts an H200 (132 SMs) gets, run here too: a state at the end of a ubatch in one-step pieces, a few
    long rows in pieces, short rows packed per program."""
    plan = metrics._fused_module(interpret=DEVICE != "cuda").plan
    S, T, X = shape
    cut = plan(S * T, X, 132)
    assert cut["ROWS"] * cut["BLOCK_X"] <= 512 and cut["BLOCK_X"] & (cut["BLOCK_X"] - 1) == 0
    assert (cut["SPLIT"] > 1) == (S * T < 132 and X > 1024)     # pieces of 1024 elements at least
    ref = rand(S, T, X)
    dev, ref = on(near(ref), ref)
    check(dev, ref, cut)


def test_deterministic_and_empty():
    ref = rand(2, 3, 500)
    dev, ref = on(near(ref), ref)
    cut = CUTS[1]
    a, b = fused_site_errors(dev, ref, config=cut), fused_site_errors(dev, ref, config=cut)
    for m in METRICS:
        assert torch.equal(a[m], b[m])
    empty = on(torch.zeros(0, 3, 5))[0]
    out = fused_site_errors(empty, empty)
    assert all(v.shape == (0, 3) and v.dtype == torch.float64 for v in out.values())


def test_bad_shapes_are_errors():
    ref = on(rand(2, 3, 4))[0]
    with pytest.raises(ValueError, match="same S, T"):
        fused_site_errors(ref[:, :2], ref)
    with pytest.raises(ValueError, match="same S, T"):
        fused_site_errors(ref[..., :3], ref)
    with pytest.raises(ValueError, match="no elements"):
        fused_site_errors(ref[..., :0], ref[..., :0])


# %% which implementation runs where

def test_site_errors_on_the_cpu_is_the_torch_version():
    if DEVICE == "cuda":
        pytest.skip("CPU dispatch: checked by the CPU run")
    ref = rand(2, 3, 10)
    dev = near(ref)
    got, want = site_errors(dev, ref), _site_errors_torch(dev, ref)
    for m in METRICS:
        assert torch.equal(got[m], want[m])


def test_the_torch_versions_finite_path_gives_the_masked_paths_bits():
    """All-finite values skip the NaN/inf masks (half the torch version's passes): the same bits as with the masks,
    for float32/16 and float64 device values, strided and transposed views, zero rows and values near the largest
    whose square stays finite. A finite value whose square overflows takes the masked path."""
    if DEVICE == "cuda":
        pytest.skip("the torch version on the CPU: checked by the CPU run")
    g = torch.Generator().manual_seed(11)
    cases = []
    for dtype in (torch.float32, torch.float16, torch.float64):
        for shape in [(1, 1, 7), (2, 3, 100), (1, 8, 4096), (3, 2, 16, 5)]:
            ref = torch.randn(shape, generator=g, dtype=torch.float64)
            cases.append(((ref + 1e-3 * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype), ref))
    wide = torch.randn(2, 5, 48, generator=g, dtype=torch.float64)
    cases.append((wide[..., :16].float(), wide[..., 16:32]))                         # strided slices
    cases.append((wide.transpose(1, 2).float(), wide.transpose(1, 2)))                # transposed
    zero = torch.randn(2, 4, 9, generator=g, dtype=torch.float64)
    zero[0, 1] = 0
    dev = zero.clone()
    dev[1, 2] = 0
    cases.append((dev, zero))
    big = torch.full((1, 2, 3), 1e150, dtype=torch.float64)
    cases.append((big * 1.5, big))                                                   # squares near 1e300: finite
    for dev, ref in cases:
        fast, masked = _site_errors_torch(dev, ref), _site_errors_torch(dev, ref, masks=True)
        for m in METRICS:
            assert torch.equal(fast[m].view(torch.int64), masked[m].view(torch.int64)), (m, dev.shape, dev.dtype)
    ref = torch.ones(1, 2, 3, dtype=torch.float64)
    dev = ref.clone()
    dev[0, 0, 1] = 1e200                  # finite, its square inf: the masked path, still a finite error
    out = _site_errors_torch(dev, ref)
    assert out["max_abs"][0, 0] == 1e200 - 1 and out["rel_l2"][0, 1] == 0 and torch.isnan(out["nmse"]).sum() == 0


def test_many_sites_at_once_are_each_site_bit_for_bit():
    """site_errors_many stacks the pairs of one shape (one torch thread): every value as site_errors gives it alone,
    including NaN/inf patterns, float32-vs-float64 pairs, single-token rows and a non-contiguous pair."""
    if DEVICE == "cuda":
        pytest.skip("CPU stacking: checked by the CPU run")
    from mamba_debug.metrics import site_errors_many
    g = torch.Generator().manual_seed(7)
    pairs = []
    for shape in [(1, 1, 256), (1, 1, 4096), (1, 64, 256), (3, 8, 16), (2, 1, 768), (1, 27, 4096)]:
        for k in range(4):
            ref = torch.randn(shape, generator=g, dtype=torch.float64)
            dev = (ref + 1e-7 * torch.randn(shape, generator=g, dtype=torch.float64)).float()
            if k == 1:
                dev.view(-1)[3] = NAN
            if k == 2:
                ref = ref.float()
                ref.view(-1)[0] = INF
            if k == 3:
                dev = ref.clone()
            pairs.append((dev, ref))
    wide = torch.randn(2, 5, 32, generator=g)
    pairs.append((wide[..., :16], wide[..., 16:]))             # strided views: measured on their own
    for k in range(3):     # slices of wider projections (x_proj's dt, B, C), float32 against float64: stacked
        proj = torch.randn(2, 5, 48, generator=g, dtype=torch.float64)
        noisy = (proj + 1e-6 * torch.randn(proj.shape, generator=g, dtype=torch.float64)).float()
        pairs.append((noisy[..., 8:24], proj[..., 8:24]))
        pairs.append((noisy[..., 24:40].contiguous(), proj[..., 24:40]))
        pairs.append((noisy[:, :, None, :16], proj[:, :, None, 32:]))
    for k in range(2):     # transposed views (strides out of row-major order): each on its own
        sq = torch.randn(2, 16, 5, generator=g, dtype=torch.float64)
        pairs.append((sq.transpose(1, 2).float(), sq.transpose(1, 2)))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = site_errors_many(pairs)
    finally:
        torch.set_num_threads(before)
    for (dev, ref), e in zip(pairs, got):
        want = site_errors(dev, ref)
        for m in METRICS:
            assert torch.equal(e[m].isnan(), want[m].isnan()), m
            assert torch.equal(e[m].nan_to_num(0.0), want[m].nan_to_num(0.0)), (m, dev.shape)


@pytest.mark.skipif(DEVICE != "cuda", reason="the GPU run checks this (MAMBA_DEBUG_TEST_DEVICE=cuda)")
def test_site_errors_on_a_gpu_is_the_kernel():
    ref = rand(2, 3, 500).cuda()
    dev = near(ref)
    got, fused = site_errors(dev, ref), fused_site_errors(dev, ref)
    assert all(torch.equal(got[m], fused[m]) for m in METRICS)
    assert_same(got, _site_errors_torch(dev, ref))
    host = dev.cpu()                                      # dev on the host, ref on the GPU: moved there, as before
    assert_same(site_errors(host, ref), _site_errors_torch(host, ref))


@pytest.mark.skipif(DEVICE != "cuda", reason="the GPU run checks this (MAMBA_DEBUG_TEST_DEVICE=cuda)")
def test_a_gpu_comparison_measured_at_birth_or_alone_gives_the_same_result(monkeypatch):
    """capture='metrics' with the reference on the GPU: the device's sites measured where they are born (a layer's
    together) or handed to the Accumulator give the same errors, floors and logits bit for bit; every pair measured
    alone by the single-pair kernel, the same within float64 rounding."""
    from conftest import random_model
    from mamba_debug import compare
    from mamba_debug.compare import CompareSettings, run_compare
    model, prompt = random_model(n_layer=4), [(11 * i + 5) % 61 for i in range(20)]
    s = CompareSettings(device="cuda", kernels="triton", ref_device="cuda", capture="metrics", offload=2,
                        n_seqs=2, ubatch=6, n_gen=3)
    born = run_compare(model, prompt, s)
    monkeypatch.setattr(compare, "_measures_at_birth", lambda *a: False)
    handed = run_compare(model, prompt, s)
    one_by_one = lambda pairs: [site_errors(*p) for p in pairs]  # noqa: E731
    monkeypatch.setattr("mamba_debug.accumulate.site_errors_many", one_by_one)
    alone = run_compare(model, prompt, s)
    for res, exact in ((born, True), (alone, False)):      # alone: the single-pair kernel, float64 rounding
        for name in ("floor", "logits"):
            a, b = getattr(res, name), getattr(handed, name)
            assert a.keys() == b.keys()
            for k in a:
                if exact or name == "logits":
                    assert torch.equal(a[k].nan_to_num(7.0), b[k].nan_to_num(7.0)), (name, k)
                else:
                    torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=0, equal_nan=True)
        assert res.errors.keys() == handed.errors.keys()
        for k, e in handed.errors.items():
            if exact:
                assert all(torch.equal(res.errors[k][m].nan_to_num(7.0), e[m].nan_to_num(7.0)) for m in e), k
            else:
                assert_same(res.errors[k], e)


@pytest.mark.skipif(DEVICE != "cuda", reason="the GPU run checks this (MAMBA_DEBUG_TEST_DEVICE=cuda)")
def test_measuring_beside_the_run_gives_the_run_streams_bits_however_late_the_side_stream(monkeypatch):
    """The sites measured on a side stream (torch_side._beside) give the bits measured on the run's own stream, also
    when the side stream starts each layer's measurement ~20 ms late: the run's stream meanwhile frees and reuses
    memory (the next layers' per-token states, 4 layers x 5 ubatches), which must not be a site still to be read."""
    from conftest import random_model
    from mamba_debug.compare import CompareSettings, run_compare
    from mamba_debug.sides import torch_side
    model, prompt = random_model(n_layer=4), [(7 * i + 3) % 61 for i in range(20)]
    s = CompareSettings(device="cuda", kernels="triton", ref_device="cuda", capture="metrics", offload=4,
                        n_seqs=2, ubatch=4, n_gen=2)
    monkeypatch.setattr(torch_side.Capture, "held_cap", 0)   # each layer measured as the next starts (not batched)
    monkeypatch.setattr(torch_side.Capture, "beside", False)
    same = run_compare(model, prompt, s)
    monkeypatch.setattr(torch_side.Capture, "beside", True)
    real, launched = torch_side.site_errors_many, []

    def late(pairs):
        launched.append((len(pairs), torch.cuda.current_stream() != torch.cuda.default_stream()))
        torch.cuda._sleep(40_000_000)          # clock cycles of the side stream: the run's stream runs ahead
        return real(pairs)
    monkeypatch.setattr(torch_side, "site_errors_many", late)
    beside = run_compare(model, prompt, s)
    assert len(launched) > 4 * 5 and all(n and on_side for n, on_side in launched), launched[:8]
    for name in ("floor", "logits"):
        a, b = getattr(beside, name), getattr(same, name)
        assert a.keys() == b.keys() and all(torch.equal(a[k].nan_to_num(7.0), b[k].nan_to_num(7.0)) for k in a)
    assert beside.errors.keys() == same.errors.keys()
    for k, e in same.errors.items():
        assert all(torch.equal(beside.errors[k][m].nan_to_num(7.0), e[m].nan_to_num(7.0)) for m in e), k


def test_a_layers_plan_is_kept_and_follows_its_tensors():
    """A layer's pairs have the same signature layer after layer: their plan is built once and kept, each call reads
    its own tensors (another layer's, at other addresses: the launch's arguments), the tables go to the device once,
    and pairs that need a copy first (an integer dtype) are copied on each call, then measured by their kept plan."""
    mod = metrics._fused_module(interpret=DEVICE != "cuda")

    def layer(seed):          # fresh tensors, the same shapes, strides and dtypes: a strided slice, a state at the end
        ref = rand(2, 3, 40, seed=seed).to(TORCH_DEVICE)
        wide = rand(2, 3, 64, seed=seed + 1, dtype=torch.float32).to(TORCH_DEVICE)
        state = rand(2, 1, 40, 4, seed=seed + 2).to(TORCH_DEVICE)
        return [(near(ref, seed=seed), ref), (wide[..., 8:24] + 1e-3, wide[..., 8:24]), (near(state), state)]
    mod._PLANS.clear()
    first, second = layer(1), layer(5)
    got = [mod.site_errors_sites(first), mod.site_errors_sites(second)]
    assert len(mod._PLANS) == 1
    kept, as_is = next(iter(mod._PLANS.values()))
    assert as_is
    for pairs, errs in zip((first, second), got):
        for (dev, ref), e in zip(pairs, errs):
            alone = mod.site_errors_fused(dev, ref)
            assert all(torch.equal(e[m], alone[m]) for m in METRICS)
    tables = [g["table"] for g in kept.launches]
    assert all(t.device.type == TORCH_DEVICE for t in tables)
    mod.site_errors_sites(first)                       # another layer's tensors: the same tables, nothing uploaded
    assert all(g["table"] is t for g, t in zip(kept.launches, tables))
    ints = [(torch.arange(240, device=TORCH_DEVICE).reshape(2, 3, 40), rand(2, 3, 40).to(TORCH_DEVICE))]
    n_plans = len(mod._PLANS)                          # the layer's, and each pair's alone (site_errors_fused)
    for k in range(2):                                 # copied to float64 each call, measured by a kept plan
        assert_same(mod.site_errors_sites(ints)[0], _site_errors_torch(*ints[0]))
        assert len(mod._PLANS) == n_plans + 1 and not mod._PLANS[next(reversed(mod._PLANS))][1]
        ints = [(ints[0][0] + 1, ints[0][1])]


def test_many_sites_in_one_launch_read_in_place_give_each_pairs_values():
    """site_errors_sites: pairs of several dtypes, layouts (contiguous, a transposed view, a slice of the tokens),
    sizes (short rows packed, a long row), NaN/Inf and an empty ubatch, in few launches and without stacking copies:
    each pair's values as the kernel gives it alone (bit for bit: the same cuts), and as the torch version gives
    them."""
    mod = metrics._fused_module(interpret=DEVICE != "cuda")
    ref1 = rand(2, 3, 40).to(TORCH_DEVICE)
    dev1 = near(ref1)
    dev1[0, 1, 3], dev1[1, 2, 0] = NAN, INF
    ref2 = rand(1, 5, 7, 3, seed=2).to(TORCH_DEVICE)
    ref3 = rand(3, 4, 16, 8, seed=3, dtype=torch.float32).to(TORCH_DEVICE).transpose(2, 3)
    long_ref = rand(1, 2, 5000, seed=4).to(TORCH_DEVICE)
    pairs = [(dev1, ref1), (near(ref2, dtype=torch.float64), ref2), (ref3 + 1e-2, ref3),
             (dev1[:, :2], ref1[:, :2]), (near(long_ref), long_ref),
             (torch.zeros(1, 0, 4, device=TORCH_DEVICE), torch.zeros(1, 0, 4, device=TORCH_DEVICE))]
    pairs += [(near(r, seed=k), r) for k, r in ((5, ref1), (6, rand(2, 3, 40, seed=6).to(TORCH_DEVICE)))]
    pairs += [(near(r, seed=k), r) for k in range(7, 30) for r in [rand(2, 3, 40, seed=k).to(TORCH_DEVICE)]]
    launches = []
    real = mod._launch_table

    def counted(grid, *args):
        launches.append(grid)
        real(grid, *args)
    mod._launch_table = counted
    try:
        got = mod.site_errors_sites(pairs)
    finally:
        mod._launch_table = real
    # the last two share the first pair's launch; none for the empty
    assert 0 < len(launches) <= len(pairs) - 3
    for (dev, ref), e in zip(pairs, got):
        alone = mod.site_errors_fused(dev, ref)
        assert_same(e, alone)
        if not alone["rel_l2"].numel():
            continue
        assert_same(e, _site_errors_torch(dev, ref))
        assert all(torch.equal(e[m].nan_to_num(7.0), alone[m].nan_to_num(7.0)) for m in METRICS)


class _FakeCuda(torch.Tensor):
    @property
    def is_cuda(self):
        return True


def test_a_cuda_reference_takes_the_kernel_and_its_failure_is_an_error(monkeypatch):
    """No quiet fallback to the torch version: a failing kernel on a CUDA reference raises."""
    calls = []

    class Broken:
        @staticmethod
        def site_errors_fused(dev, ref, config=None):
            calls.append(config)
            raise RuntimeError("kernel exploded")

    monkeypatch.setattr(metrics, "_fused_module", lambda interpret: Broken)
    ref = torch.Tensor._make_subclass(_FakeCuda, rand(1, 2, 3))
    with pytest.raises(RuntimeError, match="kernel exploded"):
        site_errors(rand(1, 2, 3), ref)
    assert calls == [None]


def test_copies_and_triton_modes():
    """The interpreted copy works in a process whose triton was imported compiled (a GPU machine checking it on
    CPU tensors); loading a copy leaves TRITON_INTERPRET as it was; the compiled copy loads (no GPU needed)."""
    if DEVICE == "cuda":
        pytest.skip("checked by the CPU run")
    code = """
import os, torch, triton
from mamba_debug.metrics import _fused_module, fused_site_errors, _site_errors_torch
assert triton.language.standard._sum_combine.__class__.__name__ == "JITFunction"
ref = torch.linspace(-1, 1, 24, dtype=torch.float64).reshape(1, 2, 12)
dev = (ref + 1e-3).float()
got, want = fused_site_errors(dev, ref), _site_errors_torch(dev, ref)
assert all(torch.allclose(got[m], want[m], rtol=1e-12, atol=0) for m in want), (got, want)
assert "TRITON_INTERPRET" not in os.environ
cuda = _fused_module(False)
assert not cuda.INTERPRET and _fused_module(True).INTERPRET and "TRITON_INTERPRET" not in os.environ
assert _fused_module(interpret=False) is cuda             # one copy per mode, however it is asked for
try:
    cuda.site_errors_fused(dev, ref)
except ValueError as exc:
    assert "built for CUDA" in str(exc)
else:
    raise AssertionError("the compiled copy took CPU tensors")
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_like_pairs_through_the_kernel_are_each_pair_bit_for_bit():
    """On a GPU site_errors_many measures like pairs in one launch of the fused kernel: each value is the bits the
    pair gets alone, including NaN/inf patterns, rows the plan splits into pieces and a float32-vs-float64 pair."""
    from mamba_debug.metrics import site_errors_many
    mod = metrics._fused_module(interpret=DEVICE != "cuda")
    g = torch.Generator().manual_seed(11)
    dev_of = "cuda" if DEVICE == "cuda" else "cpu"
    for shape, ref_dtype in [((1, 3, 40), torch.float64), ((2, 1, 5000), torch.float32), ((1, 4, 2, 33), torch.float64)]:
        pairs = []
        for k in range(3):
            ref = torch.randn(shape, generator=g, dtype=torch.float64).to(ref_dtype)
            dev = (ref.double() + 1e-7 * torch.randn(shape, generator=g, dtype=torch.float64)).float()
            if k == 1:
                dev.view(-1)[5] = NAN
            if k == 2:
                ref.view(-1)[0] = INF
            pairs.append((dev.to(dev_of), ref.to(dev_of)))
        got = site_errors_many(pairs) if DEVICE == "cuda" else mod.site_errors_sites(pairs)
        for (dev, ref), e in zip(pairs, got):
            want = fused_site_errors(dev, ref)
            for m in METRICS:
                assert torch.equal(e[m].isnan(), want[m].isnan()), (m, shape)
                assert torch.equal(e[m].nan_to_num(0.0), want[m].nan_to_num(0.0)), (m, shape)


def test_metric_blocks_are_views_made_when_read_and_join_on_the_host_as_cat_does():
    """site_errors_sites hands each site its piece of the launch group's block (metric_block.SiteErrors): the same
    values as its four views, made at the first read; errors_cpu joins a site's ubatches from the blocks' host
    copies, each block moved once, bit for bit torch.cat(...).cpu() of each metric; chunks of plain tensors (a state
    spread over the ubatch by _at_last) take the torch path."""
    mod = metrics._fused_module(interpret=DEVICE != "cuda")
    ubatches = []
    for u, T in enumerate((3, 1, 4)):               # awkward ubatch lengths, two sequences
        ref = rand(2, T, 40, seed=10 + u).to(TORCH_DEVICE)
        state = rand(2, T, 40, 4, seed=20 + u).to(TORCH_DEVICE)
        ubatches.append(mod.site_errors_sites([(near(ref, seed=u), ref), (near(state, seed=u), state)]))
    for site in range(2):
        chunks = [errs[site] for errs in ubatches]
        assert all(isinstance(c, SiteErrors) and c._views is None for c in chunks)
        blocks: dict = {}
        joined = errors_cpu(chunks, blocks)
        assert len(blocks) == len(ubatches)         # one host copy a block, shared by its sites
        for m in METRICS:
            want = torch.cat([c[m] for c in chunks], 1).cpu()
            assert joined[m].dtype == torch.float64 and joined[m].shape == want.shape
            torch.testing.assert_close(joined[m], want, rtol=0, atol=0, equal_nan=True)
        plain = [{m: v.clone() for m, v in c.items()} for c in chunks]
        for a, b in zip(errors_cpu(plain, {}).values(), joined.values()):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
