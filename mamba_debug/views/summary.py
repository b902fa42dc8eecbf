"""TEMPORARY until the views branch merges."""
from __future__ import annotations

import math

import torch

from ..trace import CompareResult, RESULT_VERSION, TRACE_FORMAT

LAYER_SITES = ("norm", "xz", "conv", "conv_state", "conv_act", "dt", "B", "C", "y_scan", "ssm_state",
               "y_skip", "gate", "y_gated", "out", "resid")


def _num(x: float):
    """JSON has no inf/nan: write them as strings, keep finite floats."""
    x = float(x)
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf" if x < 0 else "nan")


def _nanmax(t: torch.Tensor) -> float:
    t = t[~torch.isnan(t)]
    return float(t.max()) if t.numel() else math.nan


def per_layer(res: CompareResult) -> list[dict]:
    rows = []
    for i in range(res.n_layer):
        sites, first_bad, worst = {}, None, (0.0, None)
        for site in (res.layer_sites[i] if i < len(res.layer_sites) else LAYER_SITES):
            key = (i, site)
            if key not in res.errors:
                continue
            err = _nanmax(res.errors[key]["rel_l2"])
            thr = res.thresholds[key]
            sites[site] = {"max_rel_l2": _num(err), "floor": _num(_nanmax(res.floor[key])), "threshold": _num(thr)}
            ratio = err / thr if thr > 0 else math.inf
            if ratio > worst[0] or math.isnan(ratio):
                worst = (ratio, site)
            ex = torch.nonzero(res.exceed(key).any(0))
            if ex.numel() and (first_bad is None or int(ex[0]) < first_bad["token"]):
                first_bad = {"token": int(ex[0]), "site": site}
        row = {"layer": i, "on_device": res.placement.on_device(i),
               "resid_max_rel_l2": sites.get("resid", {}).get("max_rel_l2"),
               "worst_site": worst[1], "worst_ratio_to_threshold": _num(worst[0]),
               "first_bad": first_bad, "sites": sites}
        if i in res.local:
            local = _nanmax(res.local[i])
            incoming = _nanmax(res.errors[(i - 1, "resid")]["rel_l2"]) if i > 0 else 0.0
            row["local_resid_rel_l2"] = _num(local)
            row["amplification"] = _num(_nanmax(res.errors[(i, "resid")]["rel_l2"]) / incoming) if incoming > 0 else None
        rows.append(row)
    return rows


def to_json(res: CompareResult) -> dict:
    s = res.settings
    lg = res.logits
    fd = res.first_divergence
    return {
        "format": TRACE_FORMAT, "version": RESULT_VERSION,
        "config": {"n_layer": res.n_layer, "offload": res.placement.offload, "ubatch": s.ubatch, "n_seqs": s.n_seqs,
                   "kernels": s.kernels, "device": res.sides["device"].device,
                   "device_label": res.device_label, "rule": s.rule, "first_device_layer": res.placement.first_device_layer,
                   "head_on_device": res.placement.head_on_device, "n_prompt": res.n_prompt, "n_gen": s.n_gen,
                   "reference": s.reference, "ref_device": s.ref_device, "k_floor": s.k_floor, "capture": s.capture,
                   "local": s.local, "repeat": s.repeat, "model": res.model_info,
                   "engine": s.engine, "ubatch_per_seq": s.ubatch_per_seq(),
                   **({"llama_cpp": res.sides["device"].extra} if res.sides["device"].extra else {})},
        "first_divergence": fd,
        "verdict": verdict(res),
        "logits": {"kld_mean": _num(lg["kld"].mean()), "kld_max": _num(lg["kld"].max()),
                   "top1_agreement": _num(lg["top1"].mean()), "rms_dp_mean": _num(lg["rms_dp"].mean()),
                   "kld_per_token": [[_num(v) for v in row] for row in lg["kld"].tolist()],
                   "ppl_reference": _num(res.perplexity.get("reference", math.nan)),
                   "ppl_device": _num(res.perplexity.get("device", math.nan))},
        "per_layer": per_layer(res),
        "model_level": {site: {"max_rel_l2": _num(_nanmax(res.errors[(None, site)]["rel_l2"])),
                               "threshold": _num(res.thresholds[(None, site)])} for site in ("final_norm", "logits")},
        "tokens": [{"token": t.token, "ubatch": t.ubatch, "index_in_ubatch": t.index_in_ubatch, "phase": t.phase}
                   for t in res.token_info],
        "nondeterminism": res.nondeterminism,
        "generations": res.generations,
        "timings": {k: round(v, 4) for k, v in res.timings.items()},
    }


def verdict(res: CompareResult) -> str:
    fd = res.first_divergence
    if fd is None:
        worst = max((_nanmax(res.errors[k]["rel_l2"]) / res.thresholds[k] for k in res.errors), default=0.0)
        return (f"no divergence: every site stays within {res.settings.k_floor:g}x its float32 rounding floor "
                f"(worst site at {worst:.2g}x its threshold)")
    where = "the output head" if fd["layer"] is None else f"layer {fd['layer']}"
    what = "NaN/Inf born" if fd["nan"] else f"error {fd['error']:.3g} > threshold {fd['threshold']:.3g}"
    return (f"DIVERGED at token {fd['token']} (seq {fd['seq']}, ubatch {fd['ubatch']}, {fd['position']}), {where}, "
            f"site '{fd['site']}': {what}")


def summary(res: CompareResult) -> str:
    j = to_json(res)
    c, lg = j["config"], j["logits"]
    lines = [f"model     {res.model_info.get('source') or 'in memory'}: {c['n_layer']} layers",
             f"placement {res.placement.describe()}",
             f"device    {res.device_label}",
             f"run       {c['n_prompt']} prompt tokens + {c['n_gen']} generated, ubatch {c['ubatch']}, "
             f"{c['n_seqs']} sequence(s), reference {c['reference']} {_ref_where(c['ref_device'])}, "
             f"{j['timings'].get('compare_s', 0):.1f} s",
             f"verdict   {j['verdict']}",
             f"logits    KLD mean {_fmt(lg['kld_mean'])} max {_fmt(lg['kld_max'])}, top-1 agreement "
             f"{_fmt(lg['top1_agreement'])}, perplexity ref {_fmt(lg['ppl_reference'])} / device {_fmt(lg['ppl_device'])}"]
    bad = [r for r in j["per_layer"] if r["first_bad"]]
    if bad:
        lines.append("layers    first bad token per layer: " +
                     ", ".join(f"L{r['layer']}@t{r['first_bad']['token']}:{r['first_bad']['site']}" for r in bad[:8]) +
                     (" ..." if len(bad) > 8 else ""))
    if res.nondeterminism:
        nd = res.nondeterminism
        lines.append(f"WARNING   device side is not deterministic: runs differ by {nd['rel_l2']:.2g} (rel L2) at "
                     f"layer {nd['layer']} site {nd['site']}")
    g = res.generations
    if g:
        lines.append(f"text ref  {g['prompt'][0]!r} -> {g['reference'][0]!r}")
        diff = g["first_difference"][0]
        lines.append(f"text dev  {'identical' if diff is None else 'differs from generated token %d' % diff}: "
                     f"{g['device'][0]!r}")
    return "\n".join(lines)


def _ref_where(ref_device: str) -> str:
    return "CPU" if ref_device == "cpu" else f"torch ops on {ref_device}"


def _fmt(v):
    return f"{v:.4g}" if isinstance(v, float) else str(v)


