"""The comparison as data (DESIGN.md's JSON), its verdict and a short readable summary.

A site the device side did not observe has NaN errors in the trace; here its error numbers are `null`, never "nan"
and never 0, and it is neither the worst site nor a first bad token. Its floor and threshold stay: they come from
the two reference sides alone.
"""
from __future__ import annotations

import math

import torch

from .. import second_opinion
from ..arch import MODEL_SITES
from ..trace import (RESULT_VERSION, TRACE_FORMAT, CompareResult, json_num, json_safe, nanmax, require_result,
                     worst_excess)
from .local_mode import layer_local_line


def _err(res: CompareResult, key):
    """A site's worst error as a JSON number; null where the device side did not observe it."""
    return json_num(nanmax(res.errors[key]["rel_l2"])) if res.is_observed(key) else None


def per_layer(res: CompareResult) -> list[dict]:
    require_result(res, "per_layer")
    rows = []
    for i in range(res.n_layer):
        sites, first_bad, worst = {}, None, (0.0, None)
        for site in res.layer_sites[i]:
            key = (i, site)
            if key not in res.errors:
                continue
            thr, tok = res.thresholds[key], res.token_thresholds(key)
            own = int((tok > thr).sum())      # tokens judged by their own floor (trace.OUTLIER)
            sites[site] = {"max_rel_l2": _err(res, key), "floor": json_num(nanmax(res.floor[key])),
                           "threshold": json_num(thr), **({"outlier_tokens": own} if own else {})}
            if not res.is_observed(key):
                continue
            err = res.errors[key]["rel_l2"]
            ratio = nanmax(err / tok) if thr > 0 else math.inf
            if ratio > worst[0] or math.isnan(ratio):
                worst = (ratio, site)
            ex = torch.nonzero((err > tok).any(0))
            if ex.numel() and (first_bad is None or int(ex[0]) < first_bad["token"]):
                first_bad = {"token": int(ex[0]), "site": site}
        row = {"layer": i, "on_device": res.placement.on_device(i),
               **({"device": res.placement.slot_name(res.placement.layer_slot(i))} if res.placement.devices else {}),
               "resid_max_rel_l2": sites.get("resid", {}).get("max_rel_l2"),
               "worst_site": worst[1], "worst_ratio_to_threshold": json_num(worst[0]),
               "first_bad": first_bad, "sites": sites}
        if i in res.local:
            resid = (i, "resid")
            incoming = nanmax(res.errors[(i - 1, "resid")]["rel_l2"]) if i > 0 else 0.0
            row["local_resid_rel_l2"] = json_num(nanmax(res.local[i]))
            row["amplification"] = (json_num(nanmax(res.errors[resid]["rel_l2"]) / incoming)
                                    if incoming > 0 and res.is_observed(resid) else None)
        rows.append(row)
    return rows


def _groups(s) -> dict:
    """With groups of sequences (-ub + 1 < n_seqs), each group's sequences and its tokens per sequence in a ubatch:
    `ubatch_per_seq` and `tokens` are the first group's, and a smaller last group runs longer ubatches."""
    groups = s.seq_groups()
    if len(groups) < 2:
        return {}
    return {"seq_groups": [{"seqs": [a, b], "ubatch_per_seq": s.ubatch_per_seq(b - a)} for a, b in groups]}


def split_config(p) -> dict:
    """A split placement's keys of the JSON config (none with one device): the devices, the shares, which device
    each block and the head ran on, and the blocks (n_layer: the head) where the hidden state changed device."""
    if not p.devices:
        return {}
    return {"devices": list(p.devices), "tensor_split": list(p.shares), "split_mode": "layer",
            "layer_devices": [p.slot_name(k) for k in p.layer_slots], "head_device": p.slot_name(p.head_slot),
            "device_boundaries": p.device_boundaries}


def to_json(res: CompareResult) -> dict:
    require_result(res, "to_json")
    s = res.settings
    lg = res.logits
    fd = res.first_divergence
    return {
        "format": TRACE_FORMAT, "version": RESULT_VERSION,
        "config": {"n_layer": res.n_layer, "offload": res.placement.offload, "ubatch": s.ubatch, "n_seqs": s.n_seqs,
                   "kernels": s.kernels if s.engine == "torch" else "llama.cpp", "device": res.sides["device"].device,
                   "device_label": res.sides["device"].label, "rule": s.rule,
                   "first_device_layer": res.placement.first_device_layer,
                   "head_on_device": res.placement.head_on_device, "n_prompt": res.n_prompt, "n_gen": s.n_gen,
                   "reference": s.reference, "ref_device": s.ref_device, "k_floor": s.k_floor, "capture": s.capture,
                   "local": s.local, "repeat": s.repeat, "model": res.model_info,
                   "engine": s.engine, "ubatch_per_seq": s.ubatch_per_seq(),
                   "seqs_per_ubatch": s.seqs_per_ubatch(), **_groups(s),
                   **({"llama_cpp": json_safe(res.sides["device"].extra)} if res.sides["device"].extra else {}),
                   **split_config(res.placement)},
        "first_divergence": _with_node(fd, res.sides["device"].extra),
        **({"precision": res.precision["items"] if res.precision else [],
            "precision_summary": {k: v for k, v in res.precision.items() if k != "items"} if res.precision else None}
           if res.judged else {}),
        **({"second_opinion": json_safe(res.second_opinion)} if res.second_opinion else {}),
        "verdict": verdict(res),
        "logits": {"kld_mean": json_num(lg["kld"].mean()), "kld_max": json_num(lg["kld"].max()),
                   "top1_agreement": json_num(lg["top1"].mean()), "rms_dp_mean": json_num(lg["rms_dp"].mean()),
                   "kld_per_token": [[json_num(v) for v in row] for row in lg["kld"].tolist()],
                   "ppl_reference": json_num(res.perplexity.get("reference", math.nan)),
                   "ppl_device": json_num(res.perplexity.get("device", math.nan))},
        "per_layer": per_layer(res),
        "model_level": {site: {"max_rel_l2": _err(res, (None, site)),
                               "threshold": json_num(res.thresholds[(None, site)])} for site in MODEL_SITES},
        "tokens": [{"token": t.token, "ubatch": t.ubatch, "index_in_ubatch": t.index_in_ubatch, "phase": t.phase}
                   for t in res.token_info],
        "nondeterminism": res.nondeterminism,
        "generations": res.generations,
        "timings": {k: round(v, 4) for k, v in res.timings.items()},
    }


def not_observed(res: CompareResult) -> list:
    """The compared (layer, site) keys the device side did not observe, in graph order."""
    return [k for k in res.site_order() if not res.is_observed(k)]


def verdict(res: CompareResult) -> str:
    require_result(res, "verdict")
    fd = res.first_divergence
    if fd is None and res.precision:
        return f"no divergence beyond precision: {res.precision['text']}"
    if fd is None:
        worst = worst_excess(res)
        floors = (f", the largest of {res.second_opinion['samples'] + 1} float32 samples after a second opinion"
                  if (res.second_opinion or {}).get("taken") else "")
        return (f"no divergence: every site stays within {res.settings.k_floor:g}x its float32 rounding floor"
                f"{floors} (worst site at {worst:.2g}x its threshold)")
    where = (f"layer {fd['layer']}" if fd["layer"] is not None else "the output head" if fd["site"] in MODEL_SITES
             else "the model input (before layer 0)")          # llama.cpp's embedding lookup ('GET_ROWS')
    p = res.placement
    slot = p.layer_slot(fd["layer"]) if fd["layer"] is not None else p.head_slot if fd["site"] in MODEL_SITES else None
    if p.devices and slot is not None:                          # a split placement: which device ran it
        crossed = (fd["layer"] if fd["layer"] is not None else p.n_layer) in p.device_boundaries
        where += f" on {p.slot_name(slot)}" + (" (just after a device boundary)" if crossed else "")
    what = "NaN/Inf born" if fd["nan"] else f"error {fd['error']:.3g} > threshold {fd['threshold']:.3g}"
    so = res.second_opinion or {}
    second = (f" (past {so['samples'] + 1} float32 samples of the floor: a second opinion)" if so.get("taken")
              else " (a second opinion was not taken)" if so else "")
    return (f"DIVERGED at token {fd['token']} (seq {fd['seq']}, ubatch {fd['ubatch']}, {fd['position']}), {where}, "
            f"site '{fd['site']}': {what}{second}")


def summary(res: CompareResult) -> str:
    require_result(res, "summary")
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
    second = second_opinion.words(res)
    if second:
        lines.append(f"second    {second}")
    missing = not_observed(res)
    if missing:
        names = ", ".join(f"{'head' if layer is None else 'L%d' % layer}:{site}" for layer, site in missing[:6])
        lines.append(f"observed  the device side did not observe {len(missing)} site(s): {names}"
                     f"{' ...' if len(missing) > 6 else ''} (null in the JSON, hatched in the views)")
    bad = [r for r in j["per_layer"] if r["first_bad"]]
    if bad:
        lines.append("layers    first bad token per layer: " +
                     ", ".join(f"L{r['layer']}@t{r['first_bad']['token']}:{r['first_bad']['site']}" for r in bad[:8]) +
                     (" ..." if len(bad) > 8 else ""))
    for local in (local_line(res), layer_local_line(res)):
        if local:
            lines.append(local)
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


def engine_local(res: CompareResult):
    """The local errors an engine traced from outside recorded (llama.cpp's `--local`, or the replay
    that refines a divergence), or None: what the node made itself, apart from what it inherited."""
    extra = res.sides["device"].extra or {}
    return extra.get("local") or extra.get("local_replay")


def local_line(res: CompareResult):
    """One summary line: the first node whose own op (recomputed in float64 from the inputs it read) is past the
    FP32 floor, i.e. where an error is born; or the worst node when none is."""
    loc = engine_local(res)
    if not loc or not loc.get("max_per_node"):
        return None
    head = f"local     each node's op recomputed in float64 from its own inputs ({len(loc['max_per_node'])} nodes)"
    at = res.first_divergence or (res.precision or {}).get("drift_from")     # a divergence precision explained
    return head + _whole_node_clause(loc) + _token_clause(at, loc)


def _whole_node_clause(loc: dict) -> str:
    first = loc.get("first_fault") or loc.get("first_over")      # past its own path's limit, else the FP32 floor
    if first is None:
        key, err = max(loc["max_per_node"].items(), key=lambda kv: kv[1])
        text = f": every one within the FP32 floor {loc['threshold']:.2g} (worst {key} at {err:.2g})"
        if loc.get("explained"):            # past the floor, within a few x what float32 itself errs there
            text = f": every one within the FP32 floor {loc['threshold']:.2g} or " + _explained(
                loc["explained"], loc["oracle_margin"], "conditioning")
        return text
    where = f"layer {first['layer']}" if first["layer"] is not None else "outside the layers"
    fault = loc.get("first_fault") is not None
    emulated = first.get("emulated_error")
    why = ("the error is born there; the nodes after it inherit" if fault else
           f"within its reduced-precision path's limit {first.get('limit', loc['tf32_limit']):.2g} ({first['path']})"
           + (f" and within the FP32 floor of its activations' rounding, emulated ({emulated:.2g})"
              if emulated is not None else "") + ": precision")
    past = f"its path's limit {first['threshold']:.2g}" if fault else f"the FP32 floor {loc['threshold']:.2g}"
    return (f": first past {past}: {where} '{first['site']}' "
            f"({first['op']} {first['name']}, ubatch {first['ubatch']}) at {first['error']:.3g}, {why}")


def _token_clause(fd, loc: dict) -> str:
    """The per-token local evidence at the divergence's token (llama.cpp, `first_divergence.token_local`): the node
    where the error is born at that token; else the measured facts, and "accumulated rounding" only when nothing
    measured points elsewhere (every node up to the site recomputed and within the floor at this token and the
    sequence's earlier ones, none past it over the whole node in the run, a finite divergence at a recomputed site)."""
    tok = (fd or {}).get("token_local")
    if not tok:
        return ""
    at = f"; at the divergence's token (seq {tok['seq']}, token {tok['token_in_ubatch']} of ubatch {tok['ubatch']})"
    born = tok["first_over"]
    if born is not None:
        return (at + f": first node past the FP32 floor {tok['limit']:.2g} there: {_node_at(born)} at "
                     f"{_fmt(born['error'], '.3g')}, the error is born there")
    w = tok["worst"]
    text = at + f": every one of its {tok['nodes']} recomputed nodes up to '{tok['upto']['site']}' within the FP32 " \
                f"floor {tok['limit']:.2g}" + (f" (worst {_node_at(w)} at {_fmt(w['error'], '.2g')})" if w else "")
    if tok.get("explained"):
        text += " or " + _explained(tok["explained"], tok["oracle_margin"], "the row's own conditioning")
    buts = _caveats(fd, tok, loc)
    if buts:
        return text + ", but " + "; ".join(buts)
    return text + ": no single op makes the excess, it is accumulated rounding"


def _explained(items: list, margin: float, why: str) -> str:
    """The nodes past the FP32 floor that an independent float32 recompute of their op explains, worst first."""
    e = max(items, key=lambda r: r["error"])
    why = f"its recompute with {e['formula']}" if e.get("formula") else why   # llama.cpp's own formula (local.py)
    return (f"within {margin:g}x an independent float32 recompute of its op ({len(items)} node(s); "
            f"{_node_at(e)} {_fmt(e['error'], '.3g')} against {_fmt(e['fp32_recompute'], '.3g')}: {why})")


def _caveats(fd: dict, tok: dict, loc: dict) -> list:
    """What keeps a divergence whose nodes at its token are all within the floor from being called rounding."""
    out, whole, early = [], tok["whole_node_only"], tok.get("earlier_over")
    if not whole["within_floor"]:
        out.append(f"{_node_at(whole['first_over'])} (no token axis) is past it over the whole node")
    if early:
        out.append(f"{_node_at(early)} is past it at token {early['token_in_ubatch']} of the same sequence")
    if tok["not_recomputed"]:
        out.append(f"{tok['not_recomputed']} node(s) before it are not recomputed")
    if not tok["site_measured"]:
        out.append(f"'{tok['upto']['site']}' itself is not recomputed")
    if fd.get("nan"):
        out.append("the divergence is not finite")
    if fd.get("by"):                    # named by a whole-node local error (precision.refine)
        out.append(f"the divergence is named by a whole-node local error: {fd['by']}")
    elif loc.get("first_fault") or loc.get("first_over"):
        out.append("a node is past the floor over the whole node elsewhere in the run (above)")
    return out


def _node_at(r: dict) -> str:
    where = f"layer {r['layer']}" if r["layer"] is not None else "outside the layers"
    return f"{where} '{r['site']}' ({r['op']} {r['name']})"


def _ref_where(ref_device: str) -> str:
    return "CPU" if ref_device == "cpu" else f"torch ops on {ref_device}"


def _fmt(v, spec: str = ".4g"):
    """A JSON-safe number: a float formatted, or "inf"/"nan" as trace.json_num writes them."""
    return format(v, spec) if isinstance(v, float) else str(v)


def _with_node(fd, extra):
    """An engine traced from outside (llama.cpp) names the graph node behind the divergent site: its name, op,
    backend and arithmetic path."""
    if fd is None or not extra or not extra.get("nodes"):
        return fd
    node = next((n for n in extra["nodes"] if n["layer"] == fd["layer"] and n["site"] == fd["site"]), None)
    return fd if node is None else {**fd, "node": {k: node[k] for k in ("name", "op", "backend", "path")}}
