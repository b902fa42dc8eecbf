"""The llama.cpp side's precision-aware verdict (sides/llamacpp/precision.py), on synthetic local errors: no library
needed. On the H200 every clean cell of the grid read clean or precision (benchmarks/llamacpp_h200.md); here the
rules themselves: TF32 error within its floor is precision, an FP32 node past k x its floor is a fault wherever
the propagated drift began, and a run with no reduced-precision node keeps the propagated verdict."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mamba_debug.sides.llamacpp.local import TF32_LIMIT, LocalErrors, path_of
from mamba_debug.sides.llamacpp.precision import judge
from mamba_debug.trace import TokenInfo

DRIFT = {"token": 0, "seq": 0, "layer": 0, "site": "xz", "ubatch": 0, "error": 3e-4, "threshold": 1e-5}


@pytest.fixture(autouse=True)
def _cublas_path_unknown(monkeypatch):
    """Whether cuBLAS ran FP32 is process state (the first CUDA run records it): each test starts without it."""
    from mamba_debug.sides.llamacpp import local
    monkeypatch.setitem(local.CUBLAS_FP32, "at_init", None)


def node(op, backend, cols, layer, site, index):
    return SimpleNamespace(op=op, backend=backend, ne=(64, cols, 1, 1), layer=layer, site=site, name=f"node_{index}",
                           index=index, extra={})


def result(fd):
    info = [TokenInfo(t, t // 4, t % 4, 4, "prompt") for t in range(8)]
    err = torch.zeros(2, 8, dtype=torch.float64)
    err[1, 5] = 0.5
    return SimpleNamespace(first_divergence=fd, token_info=info, token_infos=lambda seq: info,
                           errors={(3, "CONT"): {"rel_l2": err}}, thresholds={(3, "CONT"): 1e-5},
                           exceed=lambda key: err > 1e-5)


def matmul_with_error(local, n, rel, u=0):
    """Feed a MUL_MAT node whose output is off from x @ w.T by about `rel` (relative L2)."""
    rng = np.random.default_rng(n.index)
    w, x = rng.standard_normal((32, 64)), rng.standard_normal((1, 1, n.ne[1], 64))
    want = x @ w.T
    got = want * (1 + rel * rng.choice([-1.0, 1.0], size=want.shape))
    local.add(n, [w[None, None], x], got.astype(np.float32), u)


def test_paths():
    assert path_of(node("MUL_MAT", "CPU", 512, 0, "xz", 1)) == "fp32"
    assert path_of(node("MUL_MAT", "CUDA0", 2, 0, "xz", 1)).startswith("fp32 (mmvf)")
    assert path_of(node("MUL_MAT", "CUDA0", 8, 0, "xz", 1)).startswith("tf32 (mmf")
    assert path_of(node("MUL_MAT", "CUDA0", 512, 0, "xz", 1)).startswith("tf32 (cuBLAS")
    # weights narrower than float32 pick the path on either backend: their activations are rounded to that family
    from mamba_debug.sides.llamacpp.local import path_limit
    assert path_of(node("MUL_MAT", "CPU", 512, 0, "xz", 1), 1).startswith("f16 weights (f16;")
    assert path_of(node("MUL_MAT", "CUDA0", 512, 0, "xz", 1), 30).startswith("bf16 weights")
    assert path_of(node("MUL_MAT", "CPU", 512, 0, "xz", 1), 8).startswith("8-bit weights (q8_0;")
    assert path_of(node("MUL_MAT", "CPU", 512, 0, "xz", 1), 12).startswith("8-bit weights (q4_K;")
    assert path_of(node("SILU", "CPU", 512, 0, "conv_act", 1), 1) == "fp32"
    assert path_limit("f16 weights (f16; ...)", 10) == 4 * 2.0 ** -11 and path_limit("fp32", 10) == pytest.approx(1e-5)


def test_cublas_is_fp32_when_the_override_was_set_as_cuda_started(monkeypatch):
    """--fp32-everywhere (NVIDIA_TF32_OVERRIDE=0 before llama.cpp starts its backends): cuBLAS nodes are FP32 and
    judged against the FP32 floor (on the H200 their local errors are; they read TF32 before); mmf has no switch."""
    from mamba_debug.sides.llamacpp import local
    monkeypatch.setitem(local.CUBLAS_FP32, "at_init", True)
    assert path_of(node("MUL_MAT", "CUDA0", 512, 0, "xz", 1)) == "fp32 (cuBLAS, NVIDIA_TF32_OVERRIDE=0)"
    assert path_of(node("MUL_MAT", "CUDA0", 8, 0, "xz", 1)).startswith("tf32 (mmf")
    le = LocalErrors(10.0)
    matmul_with_error(le, node("MUL_MAT", "CUDA0", 512, 0, "xz", 14), 3e-4)     # a TF32-sized error: now a fault
    assert not le.reduced and le.fault is not None and le.fault["site"] == "xz"


def test_tf32_error_within_its_floor_is_precision_not_a_bug():
    local = LocalErrors(10.0)
    matmul_with_error(local, node("MUL_MAT", "CUDA0", 512, 0, "xz", 14), 3e-4)
    fd, prec = judge(result(DRIFT), local)
    assert fd is None and prec["items"][0]["path"].startswith("tf32 (cuBLAS")
    assert "TF32 in cuBLAS from layer 0" in prec["text"] and "NVIDIA_TF32_OVERRIDE=0" in prec["switches"][0]
    assert prec["drift_from"] == DRIFT


def test_tf32_error_beyond_its_limit_is_a_fault():
    local = LocalErrors(10.0)
    matmul_with_error(local, node("MUL_MAT", "CUDA0", 512, 2, "out", 30), 5 * TF32_LIMIT, u=1)
    fd, prec = judge(result(DRIFT), local)
    assert prec is None and (fd["layer"], fd["site"], fd["token"]) == (2, "out", 4) and "local error" in fd["by"]


def test_fp32_node_past_k_floor_is_found_under_tf32_drift():
    """A CONT that scrambles a strided view (the #6758 class) in a run drifting from TF32: found at its node and at
    the sequence whose propagated error passes there."""
    local = LocalErrors(10.0)
    matmul_with_error(local, node("MUL_MAT", "CUDA0", 512, 0, "xz", 14), 3e-4)
    src = np.arange(24, dtype=np.float64).reshape(1, 1, 4, 6)
    local.add(node("CONT", "CUDA0", 4, 3, "CONT", 40), [src], src[..., ::-1].astype(np.float32), 1)
    fd, prec = judge(result(DRIFT), local)
    assert prec is None and (fd["layer"], fd["site"], fd["token"], fd["seq"]) == (3, "CONT", 4, 1)


def test_without_reduced_precision_the_propagated_verdict_stands():
    local = LocalErrors(10.0)
    matmul_with_error(local, node("MUL_MAT", "CPU", 512, 0, "xz", 14), 1e-3)
    assert judge(result(DRIFT), local) == (DRIFT, None)
    assert judge(result(None), local) == (None, None)


def test_an_emulated_nodes_worst_is_its_judged_error(monkeypatch):
    """A narrow-weight node is judged by its error against the emulated rounding, so the record the precision list
    keeps of it is the ubatch with the largest such error, not the largest plain one (a node excused near its limit
    at one ubatch once stayed out of the report behind another ubatch's larger plain error)."""
    local = LocalErrors(10.0, emulate=True)
    judged = iter([(2e-6, None), (8e-6, None)])
    monkeypatch.setattr(LocalErrors, "_emulated", lambda self, *a, **k: next(judged))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 64))
    for u, rel in ((0, 1e-3), (1, 5e-4)):
        x = rng.standard_normal((1, 1, 4, 64))
        got = (x @ w.T) * (1 + rel * rng.choice([-1.0, 1.0], size=(1, 1, 4, 32)))
        local.add(node("MUL_MAT", "CPU", 4, 2, "MUL_MAT#2", 20), [w[None, None], x], got.astype(np.float32), u, 0, 1)
    (kept,) = local.excused.values()
    assert kept["ubatch"] == 1 and kept["emulated_error"] == 8e-6 and local.fault is None
