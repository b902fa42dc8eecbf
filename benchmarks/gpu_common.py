"""Shared by the GPU benchmark scripts (gpu_e2e.py, gpu_tracing.py, llamacpp_h200.py): the 2.8B and small
shapes, random weights at mamba_ssm's initial scale, timing (CUDA events), peak memory, and the prefill loop.
Importing it fixes Triton's mode for the process (compiled on a GPU, the interpreter without one)."""
from __future__ import annotations

import datetime
import gc
import math
import os
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
# Triton fixes compiled-or-interpreted for its own library at its first import, before any plug-in loads
os.environ["TRITON_INTERPRET"] = "0" if CUDA else "1"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mamba_debug.arch import param_shapes as expected_shapes  # noqa: E402
from mamba_debug.config import MambaConfig  # noqa: E402
from mamba_debug.model import Runner  # noqa: E402

TODAY = datetime.date.today().isoformat()
GB = 1e9
T0 = time.perf_counter()

BIG = dict(d_model=2560, n_layer=64, d_inner=5120, d_state=16, d_conv=4, dt_rank=160, vocab_size=50280)
SMALL = dict(d_model=256, n_layer=4, d_inner=512, d_state=16, d_conv=4, dt_rank=16, vocab_size=50280)


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


# -- the model -----------------------------------------------------------------------------------------------
def mamba_ssm_params(cfg: MambaConfig, seed: int, device: str) -> dict[str, torch.Tensor]:
    """Random weights at mamba_ssm's initial scale (Mamba.__init__, MambaLMHeadModel._init_weights), rounded to
    float32 values (a real checkpoint's, so the float64 reference keeps them as float32 on the GPU) and held as float64;
    A as the transformers loader makes it from a float32 A_log (-exp in float64: not a float32 value).

    Not tests/conftest.random_params: that one draws every matrix on the CPU with one generator (~15 s for
    2.8B parameters) and does not scale out_proj by 1/sqrt(n_layer), which 64 residual additions need.
    Drawn on `device` (fast on a GPU), kept on the host as float64 masters like the checkpoint loaders do.
    """
    g = torch.Generator(device).manual_seed(seed)
    N, K, R, L = cfg.d_state, cfg.d_conv, cfg.dt_rank, cfg.n_layer

    def uniform(shape, bound):
        return (torch.rand(shape, generator=g, device=device, dtype=torch.float64) * 2 - 1) * bound

    def linear(shape):       # nn.Linear's default init: kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in))
        return uniform(shape, 1 / math.sqrt(shape[1]))

    def dt_bias(shape):      # softplus(dt_bias) log-uniform in [1e-3, 1e-1]
        dt = torch.exp(uniform(shape, 1.0) * 0.5 * math.log(100) + math.log(1e-2)).clamp(min=1e-4)
        return dt + torch.log(-torch.expm1(-dt))

    make = {"norm": lambda s: torch.ones(s, dtype=torch.float64, device=device),
            "in_proj": linear, "x_proj": linear,
            "out_proj": lambda s: linear(s) / math.sqrt(L),          # rescale_prenorm_residual
            "conv_w": lambda s: uniform(s, 1 / math.sqrt(K)),       # nn.Conv1d default, fan_in = K
            "conv_b": lambda s: uniform(s, 1 / math.sqrt(K)),
            "dt_proj": lambda s: uniform(s, R ** -0.5), "dt_bias": dt_bias,
            "A": lambda s: -torch.arange(1, N + 1, dtype=torch.float64, device=device).expand(s).clone(),  # -exp(A_log)
            "D": lambda s: torch.ones(s, dtype=torch.float64, device=device)}
    params = {}
    for name, shape in expected_shapes(cfg).items():
        leaf = name.split(".")[-1]
        if name == "embed":
            t = torch.randn(shape, generator=g, device=device, dtype=torch.float64) * 0.02
        elif name == "norm_f":
            t = make["norm"](shape)
        elif name == "lm_head":
            continue
        else:
            t = make[leaf](shape)
        params[name] = t.to(torch.float32).to(torch.float64).cpu()   # float32 values, as a real checkpoint holds
        if leaf == "A":      # a checkpoint holds A_log (float32); the loader's A = -exp(A_log) is not a float32 value
            params[name] = -torch.exp(torch.log(-params[name]).to(torch.float32).to(torch.float64))
    params["lm_head"] = params["embed"]                          # tied embeddings
    return params


def param_count(cfg: MambaConfig) -> int:
    """Elements of every cast weight set (lm_head counted: the cast keeps it apart from the embedding)."""
    return sum(math.prod(s) for s in expected_shapes(cfg).values())


def master_bytes(cfg: MambaConfig) -> int:
    """The float64 masters on the host: the tied lm_head is the embedding tensor itself there."""
    return (param_count(cfg) - cfg.vocab_size * cfg.d_model) * 8


# -- measuring -----------------------------------------------------------------------------------------------
class RssPeak:
    """Peak resident memory of this process while the block runs (sampled from /proc every 20 ms)."""

    def __enter__(self):
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def sync():
    if CUDA:
        torch.cuda.synchronize()


def reset_peak():
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for name in ("reset_peak_host_memory_stats", "reset_accumulated_host_memory_stats"):   # not in every torch
            getattr(torch.cuda, name, lambda: None)()


def peak_gpu():
    return torch.cuda.max_memory_allocated() if CUDA else None


def once(fn) -> float:
    """Seconds of one call: CUDA events around it on a GPU (the call itself may sync), else the wall clock."""
    if not CUDA:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def median_time(fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(once(fn) for _ in range(reps))


def paired_times(fn, base, reps: int, warmup: int) -> tuple[float, float, list[float]]:
    """fn and base (the untraced run) alternating, after warmup calls of each: medians of fn's and of base's
    seconds, and the ratio of each pair (fn / the base run right after it), sorted. The machine's speed drifts by
    tens of percent over a run; a pair sees the same speed, the ratio's median drops the outliers."""
    for _ in range(warmup):
        fn()
        base()
    pairs = [(once(fn), once(base)) for _ in range(reps)]
    return (statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs),
            sorted(a / b for a, b in pairs))


def free_memory(host_cache=True):
    """Drop what a part left behind. host_cache=False keeps torch's pool of pinned blocks: pinning is slow (GB/s),
    and the levels that copy to the host reuse each other's block sizes."""
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
        empty_host = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
        if host_cache and empty_host is not None:
            empty_host()


def prefill(runner: Runner, tokens: torch.Tensor, ubatch: int, after_ubatch=None) -> torch.Tensor:
    """The prompt in ubatches from fresh states, like the engine; after_ubatch() takes that ubatch's capture."""
    runner.reset(tokens.shape[0])
    for i in range(0, tokens.shape[1], ubatch):
        logits = runner.forward(tokens[:, i:i + ubatch])
        if after_ubatch is not None:
            after_ubatch()
    return logits


def error_row(part, what, exc) -> dict:
    log(f"  ERROR in {part} / {what}: {type(exc).__name__}: {exc}")
    return {"part": part, "what": what, "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-20000:]}
