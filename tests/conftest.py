"""Shared test helpers: small random Mamba models built in memory or saved as HF folders."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

# Triton kernels run under the interpreter on this CPU-only machine (DESIGN.md "Devices").
os.environ.setdefault("TRITON_INTERPRET", "1")

from mamba_debug.config import MambaConfig  # noqa: E402
from mamba_debug.model import MambaModel  # noqa: E402
from mamba_debug.arch import param_shapes  # noqa: E402


def random_params(cfg: MambaConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Weights of realistic scale: A = -exp(A_log) with A_log ~ log(1..N), dt bias around softplus^-1(0.01..0.1)."""
    g = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        leaf = name.split(".")[-1]
        if leaf in ("norm", "norm_f", "ssm_norm", "ffn_norm"):
            t = 1 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        elif leaf == "A" and len(shape) == 1:                         # Mamba-2: one A per head
            a_log = torch.log(torch.arange(1, shape[0] + 1, dtype=torch.float64))
            t = -torch.exp(a_log + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64))
        elif leaf == "A":
            a_log = torch.log(torch.arange(1, cfg.d_state + 1, dtype=torch.float64)).expand(shape)
            t = -torch.exp(a_log + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64))
        elif leaf == "D":
            t = 1 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64)
        elif leaf == "dt_bias":
            dt = torch.exp(torch.rand(shape, generator=g, dtype=torch.float64) * (2.3 * 2) - 4.6)  # 0.01..0.1
            t = dt + torch.log(-torch.expm1(-dt))
        elif leaf == "conv_w":
            t = torch.randn(shape, generator=g, dtype=torch.float64) / cfg.d_conv ** 0.5
        else:
            fan_in = shape[-1] if len(shape) == 2 else 1
            t = torch.randn(shape, generator=g, dtype=torch.float64) / fan_in ** 0.5
        params[name] = t
    if cfg.tie_embeddings:
        params["lm_head"] = params["embed"]
    return params


def small_delta_compare(cfg: MambaConfig, device: str, seed: int = 4):
    """A clean random model whose dt_bias gives δ = softplus(dt_bias) log-uniform in [1e-3, 1e-2] (where trained
    heads sit) compared with the default kernels on `device`: (the result, the worst ratio of a site's error to the
    float32 reference's own error against float64, the floor), over every site and token."""
    from mamba_debug.compare import run_compare  # noqa: PLC0415
    from mamba_debug.settings import RunSettings  # noqa: PLC0415
    params = random_params(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed)
    for name in [n for n in params if n.endswith("dt_bias")]:
        delta = torch.exp(torch.rand(params[name].shape, generator=g, dtype=torch.float64) * math.log(10)
                          + math.log(1e-3))
        params[name] = torch.log(torch.expm1(delta))
    res = run_compare(MambaModel(cfg, params), list(range(1, 14)), RunSettings(ubatch=5, n_gen=2, device=device))
    worst = max(float((res.errors[k]["rel_l2"] / res.floor[k].clamp_min(1e-8)).nan_to_num(0).max())
                for k in res.site_order() if k in res.floor)
    return res, worst


def random_model(seed: int = 0, **kw) -> MambaModel:
    base = dict(d_model=32, n_layer=4, vocab_size=61, d_state=8, d_conv=4)
    base.update(kw)
    cfg = MambaConfig(**base)
    return MambaModel(cfg, random_params(cfg, seed), source=f"random(seed={seed})")


@pytest.fixture
def small_model():
    return random_model()


RSS_BUDGET_MB = 100


def _peak_rss_kib(reset: bool = False) -> int:
    """The process's peak resident set (VmHWM), reset to the current one first when asked (Linux clear_refs 5);
    elsewhere the never-reset ru_maxrss."""
    try:
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        import resource  # noqa: PLC0415
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


@pytest.fixture
def bounded_rss():
    """Property tests stay small: the peak resident memory may grow by at most RSS_BUDGET_MB during the test, so a
    strategy that builds a huge config, array or file fails here instead of swapping a 2-core CI machine."""
    before = _peak_rss_kib(reset=True)
    yield
    grown = (_peak_rss_kib() - before) / 1024
    assert grown <= RSS_BUDGET_MB, f"peak memory grew by {grown:.0f} MB during the test (budget {RSS_BUDGET_MB} MB)"


@pytest.fixture
def read_node_calls(monkeypatch):
    """The llama.cpp side's observe.read_node calls counted: the node-by-node mapping's cost (a recalled or known
    node reads none)."""
    from mamba_debug.sides.llamacpp import observe  # noqa: PLC0415
    calls = {"read_node": 0}
    real = observe.read_node

    def counted(*a, **kw):
        calls["read_node"] += 1
        return real(*a, **kw)
    monkeypatch.setattr(observe, "read_node", counted)
    return calls


def llama_answers(j: dict) -> str:
    """A llama.cpp run's JSON without what says how fast, or through which context and callback, it came: two runs
    that gave the same answers give the same string."""
    j = json.loads(json.dumps(j))
    j.pop("timings", None)
    lc = j["config"]["llama_cpp"]
    lc["observer_effect"]["traced_s"] = lc["observer_effect"]["untraced_s"] = None
    lc["context"] = lc["callback"] = None
    lc.pop("copies", None)              # how the values were copied (stops, deferred copies), not what they were
    return json.dumps(j, sort_keys=True)
