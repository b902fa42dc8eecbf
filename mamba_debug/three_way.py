"""Three-way (issue #14 item 5): the float64 reference, llama.cpp on its CPU backend and llama.cpp on CUDA, in one run
and one report, so a user sees at once whether the two builds' backends agree with each other and with the exact
answer.

One process holds one llama.cpp library (their ggml libraries collide by name), and a CUDA build also runs its CPU
backend (`--device cpu`: no layer offloaded, op offload off), so both runs use the same library. They share the
reference sides (`run_compare`'s ref_cache: computed once). CPU vs CUDA is compared site by site from the device
values both runs keep (capture `all` or `sites`), against the float32 threshold of each site.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .compare import run_compare
from .errors import MambaDebugError
from .model import prompt_list
from .settings import RunSettings
from .views.summary import to_json, verdict

DEVICES = ("cuda", "cpu")          # CUDA first: a CPU-only build is refused before any run


@dataclass
class ThreeWay:
    runs: dict                               # label ("llama.cpp cuda", "llama.cpp cpu") -> CompareResult
    cross: dict = field(default_factory=dict)

    @property
    def primary(self):
        return next(iter(self.runs.values()))

    @property
    def diverged(self) -> bool:
        return any(r.first_divergence for r in self.runs.values())


def run_three_way(model, prompt_ids, settings: RunSettings, devices=DEVICES, progress=None,
                  on_run: Optional[Callable[[str], None]] = None) -> ThreeWay:
    """Run the llama.cpp side once per device against one shared reference, then compare the two runs' sites."""
    if settings.engine != "llama.cpp":
        raise MambaDebugError("--three-way compares llama.cpp's CPU and CUDA backends: add --engine llama.cpp")
    if settings.capture == "metrics":
        raise MambaDebugError("--three-way compares the two runs' site values: use --capture all or sites")
    cache, runs, prompt_ids = {}, {}, prompt_list(prompt_ids)       # an iterator is read once, here
    for i, device in enumerate(devices):
        label = f"llama.cpp {device}" + (f" #{i + 1}" if list(devices).count(device) > 1 else "")
        if on_run:
            on_run(label)
        runs[label] = run_compare(model, prompt_ids, settings.replace(device=device), progress=progress,
                                  ref_cache=cache)
    out = ThreeWay(runs)
    a, b = list(runs)[:2]
    out.cross = cross_compare(runs[a], runs[b], a, b)
    return out


def cross_compare(ra, rb, a: str, b: str) -> dict:
    """Run a against run b, site by site: rel. L2 per (seq, token) from the device values both kept; the first
    (token, then graph order) past the site's float32 threshold, and the largest per layer."""
    per_layer, first, compared = {}, None, 0
    rows = []
    for key in ra.site_order():
        va, vb = ra.trace.get(("dev",) + key), rb.trace.get(("dev",) + key)
        toks = ra.trace_tokens.get(key, [])
        if va is None or vb is None or va.shape != vb.shape or va.dim() < 2 or va.shape[1] != len(toks):
            continue                    # not kept by both, or not one row per token (a state kept per ubatch end)
        compared += 1
        e = _rel_l2(va, vb)                           # [S, n]
        layer = "head" if key[0] is None else key[0]
        per_layer[layer] = max(per_layer.get(layer, 0.0), _finite_max(e))
        thr = ra.token_thresholds(key)[:, toks] if key in ra.thresholds else torch.full_like(e, math.inf)
        over = e > thr
        if over.any():
            s, j = (int(i) for i in torch.nonzero(over)[0])
            rows.append((toks[j], ra.site_order().index(key), {"token": toks[j], "seq": s, "layer": key[0],
                                                               "site": key[1], "rel_l2": float(e[s, j]),
                                                               "threshold": float(thr[s, j])}))
    if rows:
        first = min(rows, key=lambda r: (r[0], r[1]))[2]
    logits = per_layer.get("head")
    return {"runs": [a, b], "sites_compared": compared, "first_difference": first,
            "logits_rel_l2_max": logits, "per_layer_max_rel_l2": per_layer,
            "note": None if compared else "no site values kept by both runs (capture policy): nothing compared"}


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a, b = a.to(torch.float64).flatten(2), b.to(torch.float64).flatten(2)
    num, den = (a - b).norm(dim=-1), b.norm(dim=-1)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, math.inf, 0.0))


def _finite_max(e: torch.Tensor) -> float:
    e = e[~torch.isnan(e)]
    return float(e.max()) if e.numel() else math.nan


def to_json_three_way(tw: ThreeWay) -> dict:
    """The primary run's JSON (CUDA's), plus `three_way`: each run's verdict and the CPU-vs-CUDA comparison."""
    out = to_json(tw.primary)
    out["three_way"] = {"runs": {label: _run_row(r) for label, r in tw.runs.items()}, "cross": tw.cross}
    return out


def _run_row(res) -> dict:
    j = to_json(res)
    e = res.errors.get((None, "logits"))
    return {"verdict": j["verdict"], "first_divergence": j["first_divergence"], "precision": j.get("precision"),
            "logits_rel_l2_max_vs_reference": None if e is None else _finite_max(e["rel_l2"]),
            "kld_max": j["logits"]["kld_max"], "top1_agreement": j["logits"]["top1_agreement"],
            "device": j["config"]["device"], "library": j["config"].get("llama_cpp", {}).get("library")}


def summary_three_way(tw: ThreeWay) -> str:
    lines = ["three-way  float64 reference vs " + " vs ".join(tw.runs)]
    for label, res in tw.runs.items():
        lines.append(f"  {label:16} {verdict(res)}")
    c = tw.cross
    a, b = c["runs"]
    fd = c["first_difference"]
    diff = (f"first difference past the float32 threshold at token {fd['token']} (seq {fd['seq']}), "
            f"{'head' if fd['layer'] is None else 'layer %d' % fd['layer']} '{fd['site']}': {fd['rel_l2']:.3g}"
            if fd else "no site differs past its float32 threshold")
    lines.append(f"  {a} vs {b}: {c['note'] or diff}; {c['sites_compared']} sites compared, logits differ by "
                 f"{_g(c['logits_rel_l2_max'])} (rel. L2)")
    return "\n".join(lines)


def html_three_way(tw: ThreeWay) -> str:
    """The report's three-way section: one row per run, then the cross comparison per layer."""
    rows = "".join(f"<tr><td>{html.escape(label)}</td><td>{html.escape(verdict(r))}</td></tr>"
                   for label, r in tw.runs.items())
    c = tw.cross
    layers = "".join(f"<tr><td>{k}</td><td>{_g(v)}</td></tr>" for k, v in c["per_layer_max_rel_l2"].items())
    return (f"<table>{rows}</table><pre>{html.escape(summary_three_way(tw).splitlines()[-1].strip())}</pre>"
            f"<table><tr><td>layer</td><td>largest rel. L2, {html.escape(' vs '.join(c['runs']))}</td></tr>"
            f"{layers}</table>")


def _g(x) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3g}"
