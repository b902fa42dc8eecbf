"""On a CUDA run the llama.cpp side recomputes MUL_MAT's local error with torch on the GPU (the numpy recompute of a
2.8B model's matmuls took minutes at -ub 1). The torch path is the same float64 sums: here it runs on the CPU and
must give numpy's local errors, with ggml's head broadcast, and a weight is moved once."""
import numpy as np
import pytest

from mamba_debug.sides.llamacpp.local import LocalErrors
from mamba_debug.sides.llamacpp.nodes import Node


def _node(ne, backend="CUDA0"):
    return Node(0, 1, "node_0", "MUL_MAT", ne, (4, 4 * ne[0], 4 * ne[0] * ne[1], 4 * ne[0] * ne[1] * ne[2]), 0,
                [2, 3], 0, 0, backend, layer=0, site="xz")


@pytest.mark.parametrize("w_heads,x_heads", [(1, 1), (2, 4)])
def test_mul_mat_local_error_on_torch_is_numpys(w_heads, x_heads):
    rng = np.random.default_rng(5)
    M, K, N = 512, 256, 7                        # w: 1 MB per head, what counts as a weight
    w = rng.standard_normal((1, w_heads, M, K))
    x = rng.standard_normal((1, x_heads, N, K)).astype(np.float32)
    exact = np.matmul(x.astype(np.float64), np.swapaxes(np.repeat(w, x_heads // w_heads, axis=1), -1, -2))
    got = (exact * (1 + 3e-4 * rng.standard_normal(exact.shape))).astype(np.float32)    # a TF32-sized error
    node = _node((M, N, x_heads, 1))
    errs = []
    for device in (None, "cpu"):
        le = LocalErrors(10.0, device=device)
        for _ in range(2):                       # a second ubatch reads the same weight array
            le.add(node, [w, x], got, 0)
        errs.append(le.worst["0.xz"])
        if device is not None:
            assert len(le._on_device) == 1       # moved once
    assert errs[0] > 1e-4 and errs[1] == pytest.approx(errs[0], rel=1e-9)


def test_an_impossible_broadcast_is_not_recomputed():
    w, x = np.ones((1, 3, 8, 4)), np.ones((1, 4, 2, 4), dtype=np.float32)
    le = LocalErrors(10.0, device="cpu")
    le.add(_node((8, 2, 4, 1)), [w, x], np.ones((1, 4, 2, 8), dtype=np.float32), 0)
    assert le.worst == {}


def test_a_weight_that_does_not_fit_is_recomputed_on_the_host(monkeypatch):
    """No room on the GPU for a float64 weight: numpy recomputes that node (the same sums), and the result says
    where each MUL_MAT was recomputed."""
    import mamba_debug.sides.llamacpp.local as local
    monkeypatch.setattr(local, "_fits", lambda device, nbytes: False)
    rng = np.random.default_rng(1)
    w, x = rng.standard_normal((1, 1, 512, 256)), rng.standard_normal((1, 1, 3, 256)).astype(np.float32)
    got = np.matmul(x.astype(np.float64), np.swapaxes(w, -1, -2)).astype(np.float32)
    le = LocalErrors(10.0, device="cpu")
    le.add(_node((512, 3, 1, 1)), [w, x], got, 0)
    assert le.worst["0.xz"] < 1e-6 and le._on_device == {}
    assert le.to_dict()["mul_mat_recomputed_on"] == {"cpu": 0, "host": 1}
