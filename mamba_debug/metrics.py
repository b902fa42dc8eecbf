"""Error metrics, accumulated in float64 (a peer-tools lesson: float32 metrics hide float32 errors).

Per (sequence, token) of one site: relative L2, max abs, NMSE (llama.cpp's test-backend-ops measure) and cosine.
Per token of the logits: KL(p_ref || p_dev), top-1 agreement, RMS of the probability difference.
A non-finite value on the device side where the reference is finite gives an infinite error, so a NaN
is always a divergence and is reported where it was born.

Metrics are computed where the reference tensor lives (the device tensor is moved there if needed) and
returned there: with the reference sides on a GPU only these [S, T] results ever cross to the host.
"""
from __future__ import annotations

import math

import torch

METRICS = ("rel_l2", "max_abs", "nmse", "cosine")


def site_errors(dev: torch.Tensor, ref: torch.Tensor) -> dict[str, torch.Tensor]:
    """dev, ref [S, T, ...] -> each metric as [S, T] (float64, on ref's device)."""
    a = dev.detach().to(ref.device, torch.float64).reshape(dev.shape[0], dev.shape[1], -1)
    b = ref.detach().to(torch.float64).reshape(ref.shape[0], ref.shape[1], -1)
    diff = a - b
    bad = ~torch.isfinite(a).all(-1) & torch.isfinite(b).all(-1)
    diff = torch.where(torch.isfinite(diff), diff, torch.zeros_like(diff))
    num = diff.pow(2).sum(-1)
    den = b.pow(2).sum(-1)
    rel = torch.where(den > 0, num.sqrt() / den.sqrt().clamp_min(1e-300), torch.where(num > 0, math.inf, 0.0))
    nmse = torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, math.inf, 0.0))
    an = a.pow(2).sum(-1).sqrt()
    cos = torch.where((an > 0) & (den > 0), (a * b).sum(-1) / (an * den.sqrt()).clamp_min(1e-300),
                      torch.ones_like(num))
    inf = torch.full_like(num, math.inf)
    return {"rel_l2": torch.where(bad, inf, rel), "max_abs": torch.where(bad, inf, diff.abs().amax(-1)),
            "nmse": torch.where(bad, inf, nmse), "cosine": torch.where(bad, torch.full_like(num, math.nan), cos)}


def logit_stats(dev: torch.Tensor, ref: torch.Tensor) -> dict[str, torch.Tensor]:
    """dev, ref logits [S, T, V] -> kld, top1 (1.0 when the argmax agrees), rms_dp, each [S, T] on ref's device."""
    a = dev.detach().to(ref.device, torch.float64)
    b = ref.detach().to(torch.float64)
    log_p, log_q = torch.log_softmax(b, -1), torch.log_softmax(a, -1)
    p = log_p.exp()
    kld = (p * (log_p - log_q)).sum(-1)
    kld = torch.where(torch.isfinite(kld), kld.clamp_min(0), torch.full_like(kld, math.inf))
    return {"kld": kld, "top1": (a.argmax(-1) == b.argmax(-1)).double(),
            "rms_dp": (log_q.exp() - p).pow(2).mean(-1).sqrt()}


def perplexity(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """exp(mean NLL) of tokens[:, 1:] under logits[:, :-1] (the prompt's own continuation)."""
    if tokens.shape[1] < 2:
        return math.nan
    logp = torch.log_softmax(logits[:, :-1].detach().to(torch.float64), -1)
    nll = -logp.gather(-1, tokens[:, 1:, None].to(logp.device)).squeeze(-1)
    return float(torch.exp(nll.mean()))
