"""Error metrics, accumulated in float64 (a peer-tools lesson: float32 metrics hide float32 errors).

Per (sequence, token) of one site: relative L2, max abs, NMSE (llama.cpp's test-backend-ops measure) and cosine.
Per token of the logits: KL(p_ref || p_dev), top-1 agreement, RMS of the probability difference.
A non-finite value on the device side where the reference is finite gives an infinite error, so a NaN
is always a divergence and is reported where it was born.

Metrics are computed where the reference tensor lives (the device tensor is moved there if needed) and
returned there: with the reference sides on a GPU only these [S, T] results ever cross to the host.

What runs where:
* reference on the CPU (the default, `ref_device="cpu"`): `site_errors` is `_site_errors_torch`, plain torch
  ops in float64 on the CPU, as always. The accumulator asks for one ubatch's sites at once (`site_errors_many`):
  with one torch thread the sites of one shape are stacked and measured together, the same bits in ~10 passes.
* reference on a GPU (`ref_device="cuda"`): `site_errors` is `fused_site_errors`, one Triton kernel
  (`_site_metrics.py`, compiled for CUDA) that reads dev and ref once in their own dtypes and strides and sums in
  float64 inside the kernel; the torch version made ~10 float64 passes over every site, 14x an untraced 2.8B
  prefill. Same values up to the rounding of the float64 sums (their order differs); if the kernel fails that is
  an error, never a quiet switch to the torch version (Triton is a requirement of the package).
* `fused_site_errors` on CPU tensors runs the same kernel under Triton's interpreter: how the tests check it
  against `_site_errors_torch` on a machine without a GPU (slow; never used by the engine on the CPU).
* `logit_stats` and `perplexity` are torch ops wherever the reference is (one [S, T, V] tensor per ubatch).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import MambaDebugError
from .metric_block import METRICS
from .triton_env import exec_file, mode


def site_errors(dev: torch.Tensor, ref: torch.Tensor) -> dict[str, torch.Tensor]:
    """dev, ref [S, T, ...] -> each metric as [S, T] (float64, on ref's device).

    A CUDA ref: the fused Triton kernel (`fused_site_errors`); otherwise the torch version. See the module
    docstring."""
    dev, ref = _pair(dev, ref, "site_errors", "[S, T, ...]", 2)
    if ref.is_cuda:
        return fused_site_errors(dev, ref)
    return _site_errors_torch(dev, ref)


def fused_site_errors(dev: torch.Tensor, ref: torch.Tensor, config: dict | None = None) -> dict[str, torch.Tensor]:
    """`site_errors` by the fused Triton kernel: compiled for a CUDA ref, under Triton's interpreter for a CPU one
    (tests). config: the kernel's cut (`_site_metrics.plan`), for tests and benchmarks."""
    return _fused_module(interpret=not ref.is_cuda).site_errors_fused(dev, ref, config)


def _fused_module(interpret: bool):
    """_site_metrics.py executed for one mode, once per process: one copy per mode however it is asked for (the
    cache below would keep f(False) and f(interpret=False) apart: two copies, each with its own plans and compiles)."""
    return _fused_copy(bool(interpret))


@functools.lru_cache(maxsize=None)
def _fused_copy(interpret: bool):
    """_site_metrics.py executed for one mode, once per process (like a kernel plug-in, mamba_debug.plugins):
    triton.jit reads TRITON_INTERPRET when the file runs, so it is set for that moment and then restored.
    Triton fixes its own library's mode at its first import. The interpreted copy works with either, so it imports
    triton under the process's own setting; the compiled copy needs a compiled library, so if triton is not
    imported yet it is imported with TRITON_INTERPRET=0 (already imported interpreted: the file raises ImportError)."""
    if interpret:
        import triton  # noqa: F401, PLC0415
    path = Path(__file__).with_name("_site_metrics.py")
    name = f"mamba_debug._site_metrics_{'interpret' if interpret else 'cuda'}"
    with mode(interpret):
        return exec_file(path, name)


def _site_errors_torch(dev: torch.Tensor, ref: torch.Tensor, masks: bool = False) -> dict[str, torch.Tensor]:
    """The reference implementation of `site_errors` in plain torch float64 ops (what runs on the CPU).

    The NaN/inf rules (a non-finite device value against a finite reference: inf, cosine NaN) need three masks over
    every element, half of the passes. They change nothing when every value is finite, which the squared sums tell
    for free: a sum of squares is finite only if each of its values is (a finite value whose square overflows sends
    the pair down the masked path too). Finite values of finite squares cannot overflow their difference, so
    without the masks each metric is the same op on the same numbers: the same bits (masks=True: always masked, for
    the test that holds both paths to one answer)."""
    a = dev.detach().to(ref.device, torch.float64).reshape(dev.shape[0], dev.shape[1], -1)
    b = ref.detach().to(torch.float64).reshape(ref.shape[0], ref.shape[1], -1)
    diff = a - b
    an2, den = a.pow(2).sum(-1), b.pow(2).sum(-1)
    finite = bool(torch.isfinite(an2).all() and torch.isfinite(den).all())
    bad = None
    if masks or not finite:
        bad = ~torch.isfinite(a).all(-1) & torch.isfinite(b).all(-1)
        diff = torch.where(torch.isfinite(diff), diff, torch.zeros_like(diff))
    num = diff.pow(2).sum(-1)
    rel = torch.where(den > 0, num.sqrt() / den.sqrt().clamp_min(1e-300), torch.where(num > 0, math.inf, 0.0))
    nmse = torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, math.inf, 0.0))
    an = an2.sqrt()
    cos = torch.where((an > 0) & (den > 0), (a * b).sum(-1) / (an * den.sqrt()).clamp_min(1e-300),
                      torch.ones_like(num))
    out = {"rel_l2": rel, "max_abs": diff.abs().amax(-1), "nmse": nmse, "cosine": cos}
    if bad is None:
        return out
    inf = torch.full_like(num, math.inf)
    return {m: torch.where(bad, torch.full_like(num, math.nan) if m == "cosine" else inf, v) for m, v in out.items()}


STACK_MAX_ELEMENTS = 1 << 22     # a stacked group of sites is cut beyond this many elements (memory)


@dataclass(frozen=True)
class Measured:
    """A device site measured where it was born (`birth_pair`, then `site_errors_many`), in place of its value: its
    `site_errors` against the reference's value of the same ubatch, and whether the device had it at the ubatch
    end only."""
    errors: dict
    at_end: bool = False


def birth_pair(dev: torch.Tensor, dev_per_token: bool, ref: torch.Tensor, ref_per_token: bool):
    """The (dev, ref) pair measured for a device site and the reference's (value, per_token) of the same ubatch (by
    the Accumulator, and by a side measuring at birth), and whether it is the device's state at the ubatch end
    (measured against the reference's last token); None for a per-token device value against a reference taken at
    the ubatch end (no side reports one; at birth it is handed over as a value)."""
    if ref_per_token and dev_per_token:
        return (dev, ref), False
    if ref_per_token:
        return (dev[:, None], ref[:, -1:]), True
    if not dev_per_token:
        return (dev[:, None], ref[:, None]), False
    return None


def site_errors_many(pairs: list) -> list:
    """`site_errors` of many (dev, ref) pairs: [mapping, ...] in the pairs' order, the same values bit for bit (a
    pair on a GPU: a `metric_block.SiteErrors`, its views made when read).

    * on the CPU with one torch thread (what a small model runs with, `backends.cpu_threads_for`) the pairs of one
      shape and dtypes are stacked: ~10 stacked torch passes per shape instead of ~25 tiny torch calls per site,
      which dominated a small model's comparison. Every metric is elementwise or a reduction over each row's own
      contiguous elements, so each row is the same sum in the same order (with more threads a reduction could be
      split differently: each pair on its own);
    * on a GPU, `_site_metrics.site_errors_sites`: one launch of the fused kernel per group of like pairs, each read
      where it lies. One launch per pair (~100 us of host work each) made the metrics of a 2.8B comparison 10 s of
      its 48; stacking them instead copied every value (issue #18: never copy what is only to be reduced)."""
    out: list = [None] * len(pairs)
    groups: dict = {}
    on_gpu = [i for i, (_, ref) in enumerate(pairs) if ref.is_cuda]
    if on_gpu:
        for i, e in zip(on_gpu, _fused_module(interpret=False).site_errors_sites([pairs[i] for i in on_gpu])):
            out[i] = e
    for i, (dev, ref) in enumerate(pairs):
        if ref.is_cuda:
            continue
        if torch.get_num_threads() != 1 or not (_row_major(dev) and _row_major(ref)):
            out[i] = site_errors(dev, ref)
            continue
        groups.setdefault((tuple(dev.shape), dev.dtype, tuple(ref.shape), ref.dtype), []).append(i)
    for (shape, *_), idx in groups.items():
        step = max(1, STACK_MAX_ELEMENTS // max(1, math.prod(shape)))
        for k in range(0, len(idx), step):
            part = idx[k:k + step]
            if len(part) == 1:
                out[part[0]] = site_errors(*pairs[part[0]])
                continue
            for i, e in zip(part, _stacked([pairs[i] for i in part])):
                out[i] = e
    return out


def _row_major(t: torch.Tensor) -> bool:
    """Whether `t` is contiguous or a view whose strides run in row-major order, its last one 1 (a slice of a wider
    projection: dt, B and C of x_proj's output): the torch version's elementwise results are then contiguous, so
    its sums run over each row's contiguous elements as for a stacked copy. A transposed view is measured alone."""
    if t.is_contiguous():
        return True
    strides = [st for st, n in zip(t.stride(), t.shape) if n != 1]
    return bool(strides) and strides[-1] == 1 and all(a >= b for a, b in zip(strides, strides[1:]))


def _stacked(pairs: list) -> list:
    """CPU pairs of one shape measured as one [n*S, T, X] pair by the torch version; a dict per pair."""
    S, T = pairs[0][1].shape[:2]
    n = len(pairs)
    dev = torch.stack([d.to(r.device) for d, r in pairs]).reshape(n * S, T, -1)
    ref = torch.stack([r for _, r in pairs]).reshape(n * S, T, -1)
    e = {m: v.reshape(n, S, T).unbind(0) for m, v in _site_errors_torch(dev, ref).items()}
    return [{m: v[j] for m, v in e.items()} for j in range(n)]


def nmse(a: torch.Tensor, b: torch.Tensor) -> float:
    """Normalised mean squared error of a against b, in float64 (llama.cpp's test-backend-ops measure); inf if a
    holds a NaN or Inf."""
    a, b = _pair(a, b, "nmse", "", 0)
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not torch.isfinite(a).all():
        return math.inf
    return float(((a - b) ** 2).sum() / (b ** 2).sum().clamp_min(1e-300))


def logit_stats(dev: torch.Tensor, ref: torch.Tensor) -> dict[str, torch.Tensor]:
    """dev, ref logits [S, T, V] -> kld, top1 (1.0 when the argmax agrees), rms_dp, each [S, T] on ref's device."""
    dev, ref = _pair(dev, ref, "logit_stats", "[..., V]", 1)
    a = dev.detach().to(ref.device, torch.float64)
    b = ref.detach().to(torch.float64)
    log_p, log_q = torch.log_softmax(b, -1), torch.log_softmax(a, -1)
    p = log_p.exp()
    kld = (p * (log_p - log_q)).sum(-1)
    kld = torch.where(torch.isfinite(kld), kld.clamp_min(0), torch.full_like(kld, math.inf))
    return {"kld": kld, "top1": (a.argmax(-1) == b.argmax(-1)).double(),
            "rms_dp": (log_q.exp() - p).pow(2).mean(-1).sqrt()}


def _pair(a, b, fn: str, shape: str, min_dim: int) -> tuple:
    """The public metrics' two inputs as tensors (numpy arrays taken) of one shape with at least min_dim dimensions,
    none of them 0: refused naming the function instead of a broadcasting error deep inside it."""
    a, b = (x if isinstance(x, torch.Tensor) else torch.as_tensor(x) for x in (a, b))
    if a.shape != b.shape or a.dim() < min_dim or (min_dim and 0 in a.shape):
        need = f" {shape}, no size 0" if min_dim else ""
        raise MambaDebugError(f"{fn} needs two tensors of one shape{need}; got {list(a.shape)} and {list(b.shape)}")
    return a, b


def perplexity(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """exp(mean NLL) of tokens[:, 1:] under logits[:, :-1] (the prompt's own continuation)."""
    if tokens.shape[1] < 2:
        return math.nan
    logp = torch.log_softmax(logits[:, :-1].detach().to(torch.float64), -1)
    nll = -logp.gather(-1, tokens[:, 1:, None].to(logp.device)).squeeze(-1)
    return float(torch.exp(nll.mean()))
