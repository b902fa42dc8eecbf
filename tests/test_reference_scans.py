"""The reference scans (`ops.ssm_scan`, `ops.ssd_scan`) are bit for bit the plain per-token recurrence.

They take the per-token factors and y a block of tokens at a time and loop over the recurrence only; on a GPU the
recurrence is one Triton launch a block (`mamba_debug/_recurrence_kernel.py`, no fused multiply-adds). Elementwise
operations in the same order give the same bits, which these tests hold them to: against the literal loop below,
on strided inputs, odd sizes, several sequences, with and without states_out, and across block boundaries, with
torch's loop and with the kernel (interpreted on the CPU). On a GPU machine the same tests run on CUDA too.
"""
import pytest
import torch

import mamba_debug.ops as ops

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# the recurrence: torch's per-token loop, or the kernel (compiled on CUDA tensors, interpreted on the CPU's)
RECURRENCES = {"loop": "off", "kernel": "always"}


def loop_ssm_scan(h, x, dt, A, B, C, states_out=None):
    delta, ys = ops.softplus(dt), []
    for t in range(x.shape[1]):
        d_t = delta[:, t, :, None]
        h = torch.exp(d_t * A) * h + d_t * B[:, t, None, :] * x[:, t, :, None]
        ys.append((h * C[:, t, None, :]).sum(-1))
        if states_out is not None:
            states_out[:, t] = h
    return torch.stack(ys, dim=1), h.clone()


def loop_ssd_scan(h, x, dt, A, B, C, states_out=None):
    H = x.shape[2]
    delta, ys = ops.softplus(dt), []
    Bh, Ch = ops._per_head(B, H), ops._per_head(C, H)
    decay = torch.exp(delta * A)
    for t in range(x.shape[1]):
        dx = (delta[:, t, :, None] * x[:, t])[..., None]
        h = decay[:, t, :, None, None] * h + dx * Bh[:, t, :, None, :]
        ys.append((h * Ch[:, t, :, None, :]).sum(-1))
        if states_out is not None:
            states_out[:, t] = h
    return torch.stack(ys, dim=1), h.clone()


def _inputs(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return lambda *sh: torch.randn(*sh, generator=g, dtype=torch.float64).to(dtype).to(device)


def _same(a_pairs):
    return all(torch.equal(a, b) for a, b in a_pairs)


@pytest.mark.parametrize("recurrence", RECURRENCES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("S,T,D,N,block", [(1, 1, 8, 4, None), (2, 7, 33, 16, None), (3, 17, 64, 16, 5),
                                           (1, 40, 1536, 16, None), (2, 9, 96, 16, 1)])
def test_ssm_scan_is_the_per_token_loop(recurrence, device, dtype, S, T, D, N, block, monkeypatch):
    monkeypatch.setattr(ops, "RECURRENCE_KERNEL", RECURRENCES[recurrence])
    if block:
        monkeypatch.setattr(ops, "_scan_block", lambda T, per_token: block)
    mk = _inputs((S, T, D, N), dtype, device, S * T + D)
    x = mk(S, T, 2 * D)[..., :D]                                   # a strided view, as the layer hands it over
    dt, A, B, C, h0 = mk(S, T, D) - 2, -torch.exp(mk(D, N)), mk(S, T, N), mk(S, T, N), mk(S, D, N)
    so_loop, so_new = (torch.empty(S, T, D, N, dtype=dtype, device=device) for _ in range(2))
    y1, h1 = loop_ssm_scan(h0, x, dt, A, B, C, so_loop)
    y2, h2 = ops.ssm_scan(h0, x, dt, A, B, C, states_out=so_new)
    y3, h3 = ops.ssm_scan(h0, x, dt, A, B, C)
    assert _same([(y1, y2), (h1, h2), (so_loop, so_new), (y1, y3), (h1, h3)])


@pytest.mark.parametrize("recurrence", RECURRENCES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("S,T,H,P,G,N,block", [(1, 1, 2, 4, 1, 8, None), (2, 7, 4, 8, 2, 16, 3),
                                               (3, 17, 8, 16, 1, 64, None), (1, 33, 24, 64, 1, 128, 8)])
def test_ssd_scan_is_the_per_token_loop(recurrence, device, dtype, S, T, H, P, G, N, block, monkeypatch):
    monkeypatch.setattr(ops, "RECURRENCE_KERNEL", RECURRENCES[recurrence])
    if block:
        monkeypatch.setattr(ops, "_scan_block", lambda T, per_token: block)
    mk = _inputs((S, T, H, P), dtype, device, S * T + H)
    x = mk(S, T, 2 * H * P)[..., :H * P].unflatten(-1, (H, P))
    dt, A, B, C, h0 = mk(S, T, H) - 2, -torch.exp(mk(H)), mk(S, T, G, N), mk(S, T, G, N), mk(S, H, P, N)
    so_loop, so_new = (torch.empty(S, T, H, P, N, dtype=dtype, device=device) for _ in range(2))
    y1, h1 = loop_ssd_scan(h0, x, dt, A, B, C, so_loop)
    y2, h2 = ops.ssd_scan(h0, x, dt, A, B, C, states_out=so_new)
    y3, h3 = ops.ssd_scan(h0, x, dt, A, B, C)
    assert _same([(y1, y2), (h1, h2), (so_loop, so_new), (y1, y3), (h1, h3)])


def test_the_check_can_fail(monkeypatch):
    """A scan that fuses the recurrence's multiply-add differently is caught (the test is not vacuous)."""
    mk = _inputs(None, torch.float32, "cpu", 3)
    x, dt, A, B, C, h0 = mk(1, 40, 64), mk(1, 40, 64) - 2, -torch.exp(mk(64, 16)), mk(1, 40, 16), mk(1, 40, 16), \
        mk(1, 64, 16)
    y1, _ = loop_ssm_scan(h0, x, dt, A, B, C)
    delta = ops.softplus(dt)[..., None]
    h, ys = h0, []
    for t in range(40):            # the same maths, one rounding less (dt*B*x regrouped as dt*(B*x))
        h = torch.exp(delta[:, t] * A) * h + delta[:, t] * (B[:, t, None, :] * x[:, t, :, None])
        ys.append((h * C[:, t, None, :]).sum(-1))
    assert torch.allclose(y1, torch.stack(ys, 1), rtol=1e-4, atol=1e-5)
    assert not torch.equal(y1, torch.stack(ys, 1))


def test_the_kernel_takes_a_strided_state_and_leaves_other_layouts_to_the_loop(monkeypatch):
    """An incoming state that is a transposed view is copied for the kernel (the same bits as torch's loop); a
    block whose groups are not contiguous is left to the loop, not misread."""
    monkeypatch.setattr(ops, "RECURRENCE_KERNEL", "always")
    mk = _inputs(None, torch.float64, "cpu", 5)
    x, dt, A, B, C = mk(2, 9, 48)[..., :24], mk(2, 9, 24) - 2, -torch.exp(mk(24, 16)), mk(2, 9, 16), mk(2, 9, 16)
    h0 = mk(2, 16, 24).transpose(1, 2)
    got = ops.ssm_scan(h0, x, dt, A, B, C)
    monkeypatch.setattr(ops, "RECURRENCE_KERNEL", "off")
    assert _same(zip(got, ops.ssm_scan(h0, x, dt, A, B, C)))
    kernel = ops._kernel_copy(True)
    u = mk(2, 3, 16, 24).transpose(2, 3)                            # [S, L, D, N] whose D*N is not contiguous
    assert kernel.recurrence(mk(2, 3, 24, 16), u, mk(2, 24, 16), torch.empty(2, 3, 24, 16, dtype=torch.float64),
                             1) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel's PTX: on a GPU")
def test_the_compiled_kernel_has_no_fused_multiply_add():
    """Triton contracts a multiply and an add into one fma unless told not to; the loop rounds twice."""
    kernel = ops._kernel_copy(False)
    mk = _inputs(None, torch.float64, "cuda", 1)
    kernel.recurrence(mk(1, 4, 8, 16), mk(1, 4, 8, 16), mk(1, 8, 16), torch.empty(1, 4, 8, 16, device="cuda",
                                                                                  dtype=torch.float64), 1)
    ptx = [compiled.asm["ptx"] for compiled, _ in kernel._launch.kept.values()]
    assert ptx and not any("fma" in p for p in ptx)
