"""The plug-in isolation check's kernel path (`_isolation_kernel.py`, interpreted here; compiled on a GPU): every
input kind, a write anywhere in it found and named, and nothing found where nothing was written.

On the CPU the deferred path is forced (`DEFER_ON_CPU`): the same code a GPU forward pass runs, with the kernel
under Triton's interpreter. On a GPU run (MAMBA_DEBUG_TEST_DEVICE=cuda) the same cases run compiled.
"""
from __future__ import annotations

import os

import pytest
import torch

from mamba_debug import isolation

DEVICE = os.environ.get("MAMBA_DEBUG_TEST_DEVICE", "cpu")
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("MAMBA_DEBUG_TEST_DEVICE=cuda without a GPU", allow_module_level=True)


@pytest.fixture(autouse=True)
def _deferred_on_cpu(monkeypatch):
    monkeypatch.setattr(isolation, "DEFER_ON_CPU", DEVICE == "cpu")


def _inputs(seed: int) -> dict:
    """One of each kind an op is handed: slices of a wider projection (x, z, B), contiguous tensors of several
    dtypes, a scalar, an aligned row layout (16-byte moves), an expanded view, one the kernel does not read
    (transposed), an empty one, rows longer than a tile."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE)      # noqa: E731  (views taken there)
    xz, proj = r(2, 7, 10), r(3, 5, 13)
    return dict(x=xz[..., :5], z=xz[..., 5:], B=proj[..., 4:7], A=r(5, 3), rows=r(6, 16)[:, :8],
                scalar=torch.tensor(1.5, device=DEVICE), mask=r(11) > 0.5, half=r(3, 5).half(), bf16=r(9).bfloat16(),
                f64=r(2, 3).double(), ids=torch.randint(0, 100, (4, 3), generator=g).to(DEVICE), wide=r(4, 1, 5),
                expanded=r(5).expand(3, 5), transposed=r(4, 6).t(), empty=torch.empty(0, 4, device=DEVICE),
                long=r(3, 4700)[:, 5:4610])               # two tiles a row under the interpreter (TILE 4096)


def _check(inputs: dict, write) -> list:
    """The names the deferred check reports after `write()` runs between the snapshot and the check."""
    found = []
    try:
        with isolation.deferred():
            snap = isolation.snapshot_inputs((), inputs)
            assert isinstance(snap, isolation.Fused)
            write()
            isolation.defer(snap, lambda names: found.extend(names) or "wrote")
    except isolation.PluginError:
        pass
    return found


def test_which_inputs_the_kernel_reads():
    t = _inputs(0)
    with isolation.deferred():
        snap = isolation.snapshot_inputs((), t)
        isolation.defer(snap, str)
    kernel, plan = isolation._PLANS[tuple((v.shape, v.stride(), v.dtype, v.device, v.data_ptr() % 16)
                                          for v in t.values())]
    names = list(t)
    assert sorted(names[i] for i in kernel) == sorted(set(names) - {"transposed", "empty"})   # rows of stride 0 too
    vec = {g["vec"] for g in plan.launches}
    assert 1 in vec and 4 in vec, "both layouts: 16-byte moves (rows) and single elements (z, B)"
    assert sum(len(set(g["idx"])) for g in plan.launches) == len(kernel)


def test_nothing_written_nothing_found():
    t = _inputs(1)
    assert _check(t, lambda: None) == []
    assert _check(t, lambda: [v.clone() for v in t.values()]) == []      # reads only


def _positions(v: torch.Tensor) -> list:
    n = v.numel()
    return sorted({0, n // 2, n - 1}) if n else []


CASES = [(name, k) for name, v in _inputs(0).items() for k in range(len(_positions(v)))]


@pytest.mark.parametrize("name,k", CASES)
def test_a_write_anywhere_is_found_and_named(name, k):
    """First, middle and last element of every input (the kernel's and the torch way's), each alone."""
    t = _inputs(2)
    v = t[name]
    target = v._base if name == "expanded" else v         # an expanded view is written through what it expands
    i = _positions(target)[min(k, len(_positions(target)) - 1)]
    idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(i), target.shape))

    def write():
        old = target[idx].item()
        target[idx] = (not old) if target.dtype == torch.bool else old + 1
    assert _check(t, write) == [name]


@pytest.mark.parametrize("old,new", [(0.0, -0.0), (float("nan"), -float("nan")), (1.0, 1.0 + 2 ** -23)])
def test_bits_not_values(old, new):
    """-0.0 == 0.0 and NaN != NaN as values; as bits it is the other way round."""
    t = _inputs(3)
    t["rows"][5, 7] = old
    t["z"][1, 6, 4] = old
    assert _check(t, lambda: None) == []                  # a NaN is its own bits

    def write():
        t["rows"][5, 7] = new
        t["z"][1, 6, 4] = new
    assert _check(t, write) == ["z", "rows"]


def test_a_resized_input_is_found_on_the_host():
    t = _inputs(4)
    assert _check(t, lambda: t["ids"].resize_(2)) == ["ids"]


@pytest.mark.parametrize("seed", range(6))
def test_random_views(seed):
    """Fresh random slices of random tensors (offsets, steps of rows, dropped and kept dimensions), one element of
    one of them written."""
    g = torch.Generator().manual_seed(100 + seed)
    r = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))      # noqa: E731
    t = {}
    for j in range(r(3, 12)):
        base = torch.randn(r(1, 5), r(1, 9), r(1, 40), generator=g).to(DEVICE)
        a, b = r(0, base.shape[2]), r(0, base.shape[2])
        lo, hi = min(a, b), max(a, b) + 1
        v = base[:, r(0, base.shape[1]):, lo:hi]
        t[f"v{j}"] = v
    assert _check(t, lambda: None) == []
    names = [k for k, v in t.items() if v.numel()]
    name = names[r(0, len(names))]
    flat = r(0, t[name].numel())
    idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(flat), t[name].shape))

    def write():
        t[name][idx] += 1
    assert _check(t, write) == [name]


def test_outside_a_forward_pass_the_check_is_at_once():
    """changed_inputs on a kernel snapshot (no deferred block to settle it) reads the flags itself."""
    t = _inputs(5)
    with isolation.deferred():
        snap = isolation.snapshot_inputs((), t)
    t["A"][0, 0] += 1
    assert isolation.changed_inputs(snap) == ["A"]


def test_a_call_outside_a_forward_pass():
    """A kernel called alone (a notebook): GPU inputs still go through the kernel, checked with one wait; CPU
    inputs the torch way."""
    t = _inputs(6)
    snap = isolation.snapshot_inputs((), t)
    assert isinstance(snap, isolation.Fused) == (DEVICE == "cuda")
    t["z"][1, 2, 3] += 1
    assert isolation.changed_inputs(snap) == ["z"]


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU run checks this")
def test_a_hybrid_models_forward_passes_go_through_the_kernel(monkeypatch):
    """Mamba-2's and attention's plug-in ops (4-D views of one projection, gated norms) in a whole comparison: every
    call through the kernel, and the comparison's answer the same as without the deferred check."""
    from mamba_debug.compare import run_compare
    from mamba_debug.io.load import load_model
    from mamba_debug.settings import RunSettings
    from mamba_debug.shipped import shipped_dir
    m = load_model(shipped_dir("data") / "tiny-granite-hybrid")
    ids, s = list(range(3, 30)), RunSettings(kernels="triton", device="cpu", ubatch=8, n_gen=1)
    monkeypatch.setattr(isolation, "DEFER_ON_CPU", False)
    plain = run_compare(m, ids, s)
    took = []
    real = isolation.Fused.take.__func__
    monkeypatch.setattr(isolation.Fused, "take", classmethod(lambda cls, named: took.append(real(cls, named)) or
                                                             took[-1]))
    monkeypatch.setattr(isolation, "DEFER_ON_CPU", True)
    checked = run_compare(m, ids, s)
    assert took and all(f is not None and f.queued is not None for f in took)
    for key, e in plain.errors.items():
        for metric, v in e.items():
            assert torch.equal(v.nan_to_num(-1), checked.errors[key][metric].nan_to_num(-1)), (key, metric)
