"""On a CUDA run the llama.cpp side recomputes MUL_MAT's local error with torch on the GPU (the numpy recompute of a
2.8B model's matmuls took minutes at -ub 1). The torch path is the same float64 sums: here it runs on the CPU and
must give numpy's local errors, with ggml's head broadcast, and a weight is moved once. Also the SSM_SCAN recompute
of both forms (Mamba-1 and Mamba-2) against ggml's element loop."""
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


def _naive_ssm_scan(s, x, dt, A, B, C, ids):
    """ggml's SSM_SCAN element by element (ops.cpp's loops), float64: the oracle of local._scan."""
    S, T, H, P = x.shape
    G, N = B.shape[2], s.shape[3]
    y, out = np.zeros((S, T, H, P)), np.zeros((S, H, P, N))
    for q in range(S):
        st = s[int(ids.reshape(-1)[q])].copy()
        for t in range(T):
            for h in range(H):
                d = float(dt[0, q, t, h])
                d = d if d > 20 else np.log1p(np.exp(d))
                g = h // (H // G)
                for p in range(P):
                    for n in range(N):
                        a = A[0, 0, h, n if A.shape[3] > 1 else 0]
                        st[h, p, n] = st[h, p, n] * np.exp(d * a) + B[q, t, g, n] * (x[q, t, h, p] * d)
                        y[q, t, h, p] += st[h, p, n] * C[q, t, g, n]
        out[q] = st
    return np.concatenate([y.reshape(-1), out.reshape(-1)])


@pytest.mark.parametrize("H,P,G,N,per_state_A", [(6, 1, 1, 4, True), (4, 3, 2, 5, False), (2, 4, 1, 3, False)])
def test_ssm_scan_recompute_in_both_forms(H, P, G, N, per_state_A):
    """Mamba-1 (head_dim 1, A per state) and Mamba-2 (head_dim P, scalar A per head, grouped B and C): the local
    recompute is ggml's loop, with slots read through ids (the second sequence from slot 2) and dt past the softplus
    threshold."""
    from mamba_debug.sides.llamacpp.local import recompute
    rng = np.random.default_rng(7)
    S, T = 2, 3
    s = rng.standard_normal((3, H, P, N))
    x, dt = rng.standard_normal((S, T, H, P)), rng.standard_normal((1, S, T, H))
    dt[0, 1, 2, 0] = 25.0
    A = -rng.random((1, 1, H, N if per_state_A else 1))
    B, C = rng.standard_normal((S, T, G, N)), rng.standard_normal((S, T, G, N))
    ids = np.array([[[[0, 2]]]], dtype=np.float64)
    n_out = S * T * H * P + S * H * P * N
    got = recompute("SSM_SCAN", [s, x, dt, A, B, C, ids], (n_out,), ())
    np.testing.assert_allclose(got, _naive_ssm_scan(s, x, dt, A, B, C, ids), rtol=1e-12, atol=1e-12)
