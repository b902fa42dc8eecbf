"""The fused single-token decode step (fused_decode.py) against the float64 reference and the engine's layer.

Runs on the CPU under Triton's interpreter (CI, laptops), one launch per phase. On a GPU machine run it again with
MAMBA_DEBUG_TEST_DEVICE=cuda: the kernel is compiled, and the GPU-only tests check that the one-launch step (grid
barriers) equals the per-phase launches bit for bit and that it can be captured and replayed in a CUDA graph.

Inputs are built as the engine hands them over: xz is a strided view (a row of a bigger tensor), the conv state is
time-fastest like llama.cpp's, the ssm state is a slot range of a state cache, some weights are transposed views;
states are non-zero, A and dt_bias have Mamba's scales, and a few channels have dt above the softplus threshold 20.
Shapes are awkward on purpose: D never a multiple of a block, N = 12 padded to 16, K = 3 and 4, R not a power of
two. Errors are NMSE = sum((a - b)^2) / sum(b^2) against float64, at tests/test_triton_kernels.py's bar.
"""
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from mamba_debug.triton_env import exec_file

DEVICE = os.environ.get("MAMBA_DEBUG_TEST_DEVICE", "interpret")    # "interpret" or "cuda"
TORCH_DEVICE = "cuda" if DEVICE == "cuda" else "cpu"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("MAMBA_DEBUG_TEST_DEVICE=cuda but no GPU", allow_module_level=True)

NMSE_VS_FP64 = 1e-11    # as tests/test_triton_kernels.py: fp32 rounding is ~1e-14, a wrong index ~1
HERE = Path(__file__).resolve().parent
KERNEL = HERE / "fused_decode.py"
# random_model from tests/conftest.py, executed by path (this folder is not under tests/, and a second module
# named "conftest" would clash with pytest's own)
random_model = exec_file(HERE.parent.parent / "tests" / "conftest.py", "mamba_debug_research_test_helpers").random_model


def _load():
    """The kernel file by path, interpreted or compiled (Triton reads TRITON_INTERPRET when the kernel is defined
    and at launch; conftest.py sets it for the interpreter)."""
    os.environ["TRITON_INTERPRET"] = "0" if DEVICE == "cuda" else "1"
    name = f"mamba_debug_fused_decode_{DEVICE}"
    return sys.modules.get(name) or exec_file(KERNEL, name)


fd = _load()

# (S, D, N, K, R)
CASES = [
    (1, 40, 16, 4, 5),
    (3, 100, 12, 3, 7),
    (3, 72, 8, 4, 12),
]
CASE_IDS = [f"S{s}-D{d}-N{n}-K{k}-R{r}" for s, d, n, k, r in CASES]
# Under the interpreter the default plan has 3 programs and one block of sequences per phase; this one cuts every
# phase finer (more channel blocks, x_proj rows and column slices than programs would need, 2 sequences at a time,
# so the loops over sequence blocks and phase 2's per-block state loads run too).
FINE = dict(channels=16, rows=4, ks=3, bs0=2, bs1=2, bs2=2)


# %% helpers

def nmse(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


def make_case(S, D, N, K, R, seed=0):
    """(xz, conv_state, ssm_state, weights, bases): views into bigger float32 tensors, made on the CPU and moved."""
    g = torch.Generator().manual_seed(seed)
    RP = R + 2 * N
    dt0 = torch.exp(torch.rand(D, generator=g) * 4.6 - 6.9)                          # softplus(dt_bias) 1e-3..0.1
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))
    dt_bias[torch.randperm(D, generator=g)[:3]] = 25.0                                # dt > 20: softplus = identity
    bases = dict(
        xz=torch.randn(S, 2, 2 * D + 5, generator=g),                                  # xz = bases[:, 1, 2:2+2D]
        conv_state_td=torch.randn(S, D, K - 1, generator=g),                           # llama.cpp: time-fastest
        ssm_cache=torch.randn(S + 2, D, N, generator=g) * 0.5,                         # slots 1..S
        conv_w_kd=torch.randn(K, D, generator=g) / K ** 0.5,
        conv_b2=0.1 * torch.randn(2 * D, generator=g),                                 # every other element
        x_proj=torch.randn(RP, D, generator=g) / D ** 0.5,
        dt_proj_rd=torch.randn(R, D, generator=g) / R ** 0.5,                         # dt_proj [D, R] transposed
        dt_bias=dt_bias,
        A=-torch.exp(torch.log(torch.arange(1, N + 1, dtype=torch.float32)) + 0.1 * torch.randn(D, N, generator=g)),
        D=1 + 0.1 * torch.randn(D, generator=g),
    )
    b = {k: v.to(TORCH_DEVICE) for k, v in bases.items()}
    w = dict(conv_w=b["conv_w_kd"].t(), conv_b=b["conv_b2"][::2], x_proj=b["x_proj"], dt_proj=b["dt_proj_rd"].t(),
             dt_bias=b["dt_bias"], A=b["A"], D=b["D"])
    return b["xz"][:, 1, 2:2 + 2 * D], b["conv_state_td"].transpose(1, 2), b["ssm_cache"][1:S + 1], w, b


def reference(xz, conv_state, ssm_state, w):
    cpu = lambda t: t.detach().cpu()  # noqa: E731
    return fd.decode_step_reference(cpu(xz), cpu(conv_state), cpu(ssm_state), {k: cpu(v) for k, v in w.items()})


def check(got, ref):
    """y_gated, new conv state, new ssm state against float64: NMSE, and element by element."""
    for name, g_, r in zip(("y_gated", "conv_state", "ssm_state"), got, ref):
        g_ = g_.detach().cpu()
        assert g_.shape == r.shape, name
        assert not torch.isnan(g_).any(), f"{name}: some element was never written"
        assert nmse(g_, r) <= NMSE_VS_FP64, name
        assert torch.allclose(g_.double(), r, rtol=1e-4, atol=1e-5), name
    # the new conv state is a copy of inputs: exact
    assert torch.equal(got[1].detach().cpu(), ref[1].float())


def step(xz, conv_state, ssm_state, w, **kw):
    return fd.fused_decode_step(xz, conv_state, ssm_state, w, **kw)


# %% against the float64 reference

@pytest.mark.parametrize("conv", ["phase", "recompute"])
@pytest.mark.parametrize("S,D,N,K,R", CASES, ids=CASE_IDS)
def test_matches_fp64_reference(S, D, N, K, R, conv):
    xz, cs, ss, w, _ = make_case(S, D, N, K, R, seed=S * 100 + D)
    assert (S == 1 or not xz.is_contiguous()) and not cs.is_contiguous() and not w["dt_proj"].is_contiguous()
    got = step(xz, cs, ss, w, config=dict(conv=conv))
    assert got[0].is_contiguous() and got[1].is_contiguous() and got[2].is_contiguous()
    check(got, reference(xz, cs, ss, w))


@pytest.mark.parametrize("conv", ["phase", "recompute"])
@pytest.mark.parametrize("S,D,N,K,R", CASES[1:], ids=CASE_IDS[1:])
def test_fine_plan_matches_fp64_reference(S, D, N, K, R, conv):
    xz, cs, ss, w, _ = make_case(S, D, N, K, R, seed=7)
    check(step(xz, cs, ss, w, config=dict(FINE, conv=conv)), reference(xz, cs, ss, w))


def assert_same_or_rounding(a, b):
    """Interpreted (numpy), the same arithmetic gives the same bits. Compiled, the code of one launch and of one
    phase differs where the compiler fuses a multiply and an add into an FMA (seen on an H200: NMSE ~1e-14 between
    them, each as close to float64); more than rounding there is a race or an indexing bug."""
    if DEVICE != "cuda":
        assert torch.equal(a, b)
    else:
        assert nmse(a, b) <= 1e-12


def test_conv_phase_and_recompute_give_the_same_result():
    """conv_act is elementwise arithmetic in a fixed order, wherever it is computed: the two ways agree."""
    xz, cs, ss, w, _ = make_case(3, 100, 12, 3, 7, seed=3)
    for a, b in zip(step(xz, cs, ss, w, config=dict(conv="phase")), step(xz, cs, ss, w, config=dict(conv="recompute"))):
        assert_same_or_rounding(a, b)


# %% states: in place, every element written, inputs untouched

@pytest.mark.parametrize("conv", ["phase", "recompute"])
def test_in_place_states_equal_separate_outputs(conv):
    S, D, N, K, R = 3, 72, 12, 4, 7
    xz, cs, ss, w, bases = make_case(S, D, N, K, R, seed=5)
    y0, cs0, ss0 = step(xz, cs, ss, w, config=dict(FINE, conv=conv))
    # in place on the strided state views themselves (time-fastest conv state, a slot range of the cache)
    y1, cs1, ss1 = step(xz, cs, ss, w, conv_state_out=cs, ssm_state_out=ss, config=dict(FINE, conv=conv))
    assert cs1 is cs and ss1 is ss
    assert torch.equal(y0, y1) and torch.equal(cs0, cs) and torch.equal(ss0, ss)
    assert torch.equal(bases["ssm_cache"][0], make_case(S, D, N, K, R, seed=5)[4]["ssm_cache"][0])  # other slots


def test_every_output_element_is_written(monkeypatch):
    """Outputs the launcher allocates start as NaN, and so do the state outputs passed in."""
    def nan_empty(shape, like, dtype=None):
        return torch.full(shape, float("nan"), dtype=dtype or like.dtype, device=like.device)

    monkeypatch.setattr(fd, "_empty", nan_empty)
    S, D, N, K, R = 3, 100, 12, 3, 7
    xz, cs, ss, w, _ = make_case(S, D, N, K, R, seed=9)
    ref = reference(xz, cs, ss, w)
    for conv in ("phase", "recompute"):
        check(step(xz, cs, ss, w, config=dict(conv=conv)), ref)
        cso = torch.full((S, D, K - 1), float("nan"), device=TORCH_DEVICE).transpose(1, 2)   # strided outputs
        sso = torch.full((S, D, N), float("nan"), device=TORCH_DEVICE)
        got = step(xz, cs, ss, w, conv_state_out=cso, ssm_state_out=sso, config=dict(FINE, conv=conv))
        assert got[1] is cso and got[2] is sso
        check(got, ref)


def test_inputs_are_not_modified():
    xz, cs, ss, w, bases = make_case(3, 72, 8, 4, 12, seed=11)
    before = {k: v.clone() for k, v in bases.items()}
    step(xz, cs, ss, w)
    step(xz, cs, ss, w, config=dict(FINE, conv="recompute"))
    for k, v in bases.items():
        assert torch.equal(v, before[k]), f"{k} was modified"


def test_sequences_are_independent():
    xz, cs, ss, w, bases = make_case(3, 72, 12, 4, 7, seed=13)
    out0 = step(xz, cs, ss, w, config=FINE)
    for name in ("xz", "conv_state_td"):
        bases[name][1] += 1.0
    bases["ssm_cache"][2] += 1.0                       # slot 2 of the cache = sequence 1
    out1 = step(xz, cs, ss, w, config=FINE)
    for a, b in zip(out0, out1):
        assert torch.equal(a[[0, 2]], b[[0, 2]])
        assert not torch.equal(a[1], b[1])


# %% the engine's layer, five tokens with the states carried

def test_five_tokens_carried_equal_the_engine_layer():
    """mamba_debug.model.Runner on the float64 reference back-end runs a 2-layer random model token by token; the
    observer records each layer's `xz`, `y_gated` and states. The fused step, given the same `xz` each token and carrying
    its own float32 states in place from zero, matches y_gated at every token and the states at the end."""
    from mamba_debug.backends import reference_backend
    from mamba_debug.model import Runner

    model = random_model(seed=3, d_model=32, n_layer=2, d_state=12, d_conv=4)
    c = model.config
    S, T = 2, 5
    sites = {}

    class Record:
        def site(self, layer, site, value, per_token):
            if layer is not None and site in ("xz", "y_gated", "conv_state", "ssm_state"):
                sites.setdefault((layer, site), []).append(value.detach().clone())

    runner = Runner(model, reference_backend(), observer=Record())
    tokens = torch.randint(0, c.vocab_size, (S, T), generator=torch.Generator().manual_seed(0))
    runner.reset(S)
    for t in range(T):
        runner.forward(tokens[:, t:t + 1])
    for i in range(c.n_layer):
        w = {k: v.to(device=TORCH_DEVICE, dtype=torch.float32)
             for k, v in Runner._layer_weights(model.params, i).items()}
        cs = torch.zeros(S, c.d_conv - 1, c.d_inner, device=TORCH_DEVICE)
        ss = torch.zeros(S, c.d_inner, c.d_state, device=TORCH_DEVICE)
        for t in range(T):
            xz = sites[(i, "xz")][t].to(device=TORCH_DEVICE, dtype=torch.float32)        # [S, 1, 2D]
            y, _, _ = step(xz, cs, ss, w, conv_state_out=cs, ssm_state_out=ss)
            assert y.shape == (S, 1, c.d_inner)
            want = sites[(i, "y_gated")][t]
            assert nmse(y, want) <= NMSE_VS_FP64, (i, t)
            assert torch.allclose(y.cpu().double(), want, rtol=1e-4, atol=1e-6), (i, t)
        ssm_last = sites[(i, "ssm_state")][-1]
        ssm_last = ssm_last[:, -1] if ssm_last.dim() == 4 else ssm_last             # per-token states [S, T, D, N]
        assert nmse(ss, ssm_last) <= NMSE_VS_FP64
        assert torch.equal(cs.cpu(), sites[(i, "conv_state")][-1].float())


# %% errors

def test_one_launch_under_the_interpreter_is_refused():
    if DEVICE == "cuda":
        pytest.skip("compiled: one launch is the default")
    xz, cs, ss, w, _ = make_case(1, 40, 16, 4, 5)
    with pytest.raises(ValueError, match="interpreter.*one after another.*barrier"):
        step(xz, cs, ss, w, one_launch=True)


def test_bad_inputs_name_the_tensor():
    S, D, N, K, R = 2, 40, 16, 4, 5
    xz, cs, ss, w, bases = make_case(S, D, N, K, R)
    with pytest.raises(ValueError, match=r"x_proj must be \[R \+ 2N, D\]"):
        step(xz, cs, ss, dict(w, x_proj=w["x_proj"][:-1]))
    with pytest.raises(ValueError, match=r"conv_state must be \[S, K-1, D\]"):
        step(xz, cs[:, :2], ss, w)
    with pytest.raises(ValueError, match=r"ssm_state must be \[S, D, N\]"):
        step(xz, cs, ss[:1], w)
    with pytest.raises(ValueError, match=r"dt_bias must be \[D\]"):
        step(xz, cs, ss, dict(w, dt_bias=w["dt_bias"][:-1]))
    with pytest.raises(ValueError, match=r"xz must be \[S, 2D\]"):
        step(xz[:, :-1], cs, ss, w)
    with pytest.raises(ValueError, match=r"weights \['A'\] missing"):
        step(xz, cs, ss, {k: v for k, v in w.items() if k != "A"})
    with pytest.raises(ValueError, match="ssm_state_out overlaps ssm_state"):
        step(xz, cs, ss, w, ssm_state_out=bases["ssm_cache"][:S])      # slots 0..S-1: overlaps, not the same view
    with pytest.raises(ValueError, match="conv_state_out overlaps xz"):
        step(xz, cs, ss, w, conv_state_out=xz.as_strided((S, K - 1, D), (xz.stride(0), 1, 1)))
    with pytest.raises(ValueError, match="config conv must be"):
        step(xz, cs, ss, w, config=dict(conv="nope"))


# %% GPU only: one launch, CUDA graphs

cuda_only = pytest.mark.skipif(DEVICE != "cuda", reason="grid barriers and CUDA graphs need the GPU")


def _finish_or_exit(timeout_s: float = 30.0):
    """Wait for the GPU, but not forever: a grid barrier that deadlocks never returns, and nothing can run on the
    GPU after it in this process, so say so and end the process (pytest could not even tear down)."""
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.monotonic()
    while not ev.query():
        if time.monotonic() - t0 > timeout_s:
            sys.stderr.write(f"\ntest_fused_decode: a one-launch step did not finish within {timeout_s:.0f} s: "
                             f"the grid barrier deadlocked; the GPU is wedged, exiting\n")
            sys.stderr.flush()
            os._exit(3)
        time.sleep(0.001)


@cuda_only
@pytest.mark.parametrize("conv", ["phase", "recompute"])
@pytest.mark.parametrize("S,D,N,K,R", CASES + [(1, 5120, 16, 4, 160), (8, 5120, 16, 4, 160), (64, 256, 16, 4, 16)])
def test_one_launch_equals_per_phase_launches(S, D, N, K, R, conv):
    xz, cs, ss, w, _ = make_case(S, D, N, K, R, seed=S + D)
    one = step(xz, cs, ss, w, one_launch=True, config=dict(conv=conv))
    _finish_or_exit()
    per_phase = step(xz, cs, ss, w, one_launch=False, config=dict(conv=conv))
    for a, b in zip(one, per_phase):
        assert_same_or_rounding(a, b)
    check(one, reference(xz, cs, ss, w))
    for _ in range(20):                         # the barrier holds every time (a race would show as a mismatch)
        again = step(xz, cs, ss, w, one_launch=True, config=dict(conv=conv))
        assert all(torch.equal(a, b) for a, b in zip(one, again))


@cuda_only
@pytest.mark.parametrize("conv", ["phase", "recompute"])
def test_one_launch_in_a_cuda_graph(conv):
    """Capture three in-place steps in a CUDA graph, replay it twice: the same as six eager steps, and the barrier
    counter grows by (barriers x grid) per step and is never reset."""
    S, D, N, K, R = 3, 1536, 16, 4, 48
    xz, cs, ss, w, _ = make_case(S, D, N, K, R, seed=21)
    cfg = dict(conv=conv)
    cs_e, ss_e = cs.clone(), ss.clone()
    ys = [step(xz, cs_e, ss_e, w, conv_state_out=cs_e, ssm_state_out=ss_e, config=cfg)[0].clone() for _ in range(6)]
    cs_g, ss_g = cs.clone(), ss.clone()
    step(xz, cs_g.clone(), ss_g.clone(), w, config=cfg)               # compile and allocate outside the capture
    _finish_or_exit()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [step(xz, cs_g, ss_g, w, conv_state_out=cs_g, ssm_state_out=ss_g, config=cfg)[0] for _ in range(3)]
    grid = fd._prepare(xz, cs, ss, w, None, None, cfg, False)[0]
    counter = fd._COUNTERS[(xz.device.index, grid)]
    barriers = 2 if conv == "phase" else 1
    before = int(counter.item())
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(o, y) for o, y in zip(outs, ys[:3]))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(o, y) for o, y in zip(outs, ys[3:]))
    assert torch.equal(cs_g, cs_e) and torch.equal(ss_g, ss_e)
    assert int(counter.item()) == before + 2 * 3 * barriers * grid

