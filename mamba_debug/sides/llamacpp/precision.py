"""The precision-aware verdict of a llama.cpp run (issue #14 item 6).

On CUDA, f32 matmuls of 4 or more columns run in TF32 (the mmf tile kernel, cuBLAS on its TF32 handle): a clean run
then drifts past k x the float32 floor from the first such matmul on, and every later site inherits it. Propagated
error cannot tell that from a fault, so when a run used a reduced-precision path the verdict reads each node's
*local* error (its op recomputed in float64 from the inputs it really read, local.py):
- some node past its own path's limit (FP32 nodes: k x the FP32 floor, as on the CPU; TF32 nodes: TF32_LIMIT; the
  matmuls of a GGUF's f16, bf16 or quantized weights: 4x their family's floor, local.py, except on a CPU build for
  f16, bf16, q8_0, q4_0, q5_0, q4_1, q5_1 and the K-quants: k x the FP32 floor against their activations'
  rounding emulated, activations.py)
  -> the first divergence is that node;
- none -> `first_divergence` None (exit 0) and a `precision` list: the reduced-precision nodes whose error the FP32
  threshold would not excuse, with their path, error and floor, and the switch that removes each where one exists.
A run with no reduced-precision node keeps the propagated verdict (every CPU build), refined by `refine`: llama.cpp
has nodes with no reference value (the SCALE that zeroes a fresh sequence's state, the state copies, ...), so a
fault born there first shows at the compared node that consumes it; the node's local error names the node itself.
"""
from __future__ import annotations

from typing import Optional

from ...trace import error_fields, json_safe, worst_excess
from .local import ORACLE_MARGIN

# A run whose every node is within float32's reach may still pass a site's threshold (k x the torch float32
# reference's spread) by accumulated rounding: llama.cpp's CUDA kernels are built with fast math. That drift stays
# within a few times the threshold; an error no node makes (a state read from the wrong slot, which its node
# recomputes faithfully from what it read) is orders of magnitude past it. Past DRIFT_LIMIT x a threshold anywhere
# in the run, a divergence is never called rounding.
DRIFT_LIMIT = 10.0

SWITCHES = {"TF32 in cuBLAS": "NVIDIA_TF32_OVERRIDE=0 (or --fp32-everywhere) makes cuBLAS FP32",
            "TF32 in mmf": "no switch: the mmf tile kernel's TF32 MMA is inline PTX; -ub / sequences <= 3 tokens each "
                           "avoid it (the FP32 vector kernel runs instead)",
            "weights": "an f32 GGUF (mamba-debug export-gguf --dtype f32) keeps the matmuls' activations in float32"}


def _family(path: str) -> str:
    """A reduced-precision path's family as the verdict names it: TF32 in cuBLAS or mmf, or the weights' type."""
    if path.startswith("tf32"):
        return "TF32 in mmf" if "mmf" in path else "TF32 in cuBLAS"
    return path.split(" (", 1)[0]


def judge(res, local: dict) -> tuple[Optional[dict], Optional[dict]]:
    """(first_divergence, precision) for a finished llama.cpp run; local: its LocalErrors."""
    fd = res.first_divergence
    excused, fault = local.excused, local.fault
    if not local.reduced:
        return fd, None
    if fault is not None:
        return _at_node(res, fault), None
    if fd is None or not excused:
        return fd, None
    items = sorted(excused.values(), key=lambda r: r.get("first_seen", (r["first_seq"], r["ubatch"], r["index"])))
    paths = sorted({_family(r["path"]) for r in items})
    first = items[0]
    where = "the output head" if first["layer"] is None else f"layer {first['layer']}"
    emulated = [r["emulated_error"] for r in items if "emulated_error" in r and "fp32_split_sums" not in r]
    split = [(r["emulated_error"], r["fp32_split_sums"]) for r in items if "fp32_split_sums" in r]
    return None, {
        "text": f"precision: {' and '.join(paths)} from {where} ({first['site']}); {len(items)} reduced-"
                f"precision node(s), each within its path's floor; no node past its own limit"
                + (f"; {len(emulated)} of them within the FP32 floor of their activations' rounding, emulated "
                   f"(worst {max(emulated):.2g})" if emulated else "")
                + (f"; {len(split)} within {ORACLE_MARGIN:g}x float32's own error on ggml's split sums of their "
                   f"emulated product "
                   f"(worst {max(e for e, _ in split):.2g}, float32's {max(f for _, f in split):.2g})" if split else ""),
        "drift_from": fd, "switches": sorted({SWITCHES[p if p.startswith("TF32") else "weights"] for p in paths}),
        "items": [{"layer": r["layer"], "site": r["site"], "node": r["name"], "op": r["op"], "path": r["path"],
                   "error": r["error"], "floor": r["floor"], "limit": r["limit"], "ubatch": r["ubatch"],
                   **{k: r[k] for k in ("emulated_error", "fp32_split_sums") if k in r}}
                  for r in items]}


def _at_node(res, f: dict) -> dict:
    """The first divergence at a node found by its local error: the first token of its ubatch (in the node's group of
    sequences), the first sequence there whose propagated error passes its threshold (else the group's first)."""
    infos = res.token_infos(f["first_seq"])
    toks = [t for t, info in enumerate(infos) if info.ubatch == f["ubatch"]]
    t = toks[0] if toks else 0
    key = (f["layer"], f["site"])
    seq = f["first_seq"]
    if key in res.errors and key in res.thresholds:
        over = res.exceed(key)[:, toks]
        rows = [s for s in range(f["first_seq"], over.shape[0]) if bool(over[s].any())]
        seq = rows[0] if rows else seq
    info = infos[t]
    return {"token": t, "seq": seq, "layer": f["layer"], "site": f["site"], "ubatch": info.ubatch,
            "index_in_ubatch": info.index_in_ubatch, "position": info.position, "phase": info.phase,
            **error_fields(f["error"]), "threshold": f["threshold"],
            "on_device": True, "by": f"local error of node {f['name']} ({f['op']}, {f['path']})"}


def refine(res, fd: Optional[dict], local) -> Optional[dict]:
    """The propagated first divergence of a run with no reduced-precision node, with the per-token local evidence at
    its token (`token_local`: LocalErrors.at_token over the nodes of its ubatch and group up to its own node), moved
    to the node where the error is born when there is one:
    - the first node past k x the FP32 floor at that very token (a fault even when its whole-node error, diluted by
      the ubatch's other tokens, is not); fd's own node: fd stays;
    - none at the token: the first node of the same ubatch (and group) past it over the whole node, before fd's
      node in graph order, whose (layer, site) has no reference value (its error may sit at an earlier token).
    Neither: fd stays, a DIVERGED verdict with every node at its token within the FP32 floor (accumulated rounding,
    not one op), which `token_local` records as measured."""
    if fd is None:
        return fd
    tok = local.at_token(fd["ubatch"], fd["seq"], fd.get("index_in_ubatch", 0), fd["layer"], fd["site"])
    born = tok["first_over"] if tok else None
    if born is not None and (born["layer"], born["site"]) == (fd["layer"], fd["site"]):
        out = fd
    elif born is not None:
        out = {**fd, "layer": born["layer"], "site": born["site"], **error_fields(born["error"]),
               "threshold": tok["limit"],
               "by": f"per-token local error of node {born['name']} ({born['op']}, {born['path']}) at seq "
                     f"{fd['seq']}, token {fd['token']}: the first node past the float32 floor of one op at that "
                     f"token; '{fd['site']}' at layer {fd['layer']} consumes it"}
    else:
        out = _whole_node(res, fd, local)
    return out if tok is None else {**out, "token_local": json_safe(tok)}


def _whole_node(res, fd: dict, local) -> dict:
    """fd moved to the first node of its ubatch (and group) past k x the FP32 floor over the whole node, before fd's
    node in graph order, whose (layer, site) has no reference value; else fd unchanged."""
    first = local.first
    if first is None or (first["layer"], first["site"]) in res.errors:
        return fd
    group = first["first_seq"]
    at = local.index_of.get((fd["ubatch"], group, fd["layer"], fd["site"]))
    if first["ubatch"] != fd["ubatch"] or at is None or first["index"] >= at:
        return fd
    return {**fd, "layer": first["layer"], "site": first["site"], **error_fields(first["error"]),
            "threshold": first["threshold"], "by": f"local error of node {first['name']} ({first['op']}): the "
            f"first node past the float32 floor of one op; '{fd['site']}' at layer {fd['layer']} consumes it"}


def settle(res, fd: Optional[dict], local) -> tuple[Optional[dict], Optional[dict]]:
    """(first_divergence, precision) of an FP32 run whose local errors cover every ubatch (`--local`, or the whole
    replay on CUDA): `refine`, then, when nothing measured points at a node, a precision verdict instead of a
    divergence. Every node up to the site at the divergence's token is within the FP32 floor or within
    ORACLE_MARGIN x an independent float32 recompute (`explained`), every earlier token too, every node without a
    token axis and every node over the whole run within the floor, and no site anywhere past DRIFT_LIMIT x its
    threshold: accumulated float32 rounding, not a fault."""
    out = refine(res, fd, local)
    if not rounding_at_its_token(out) or local.first is not None:
        return out, None
    tok = out["token_local"]
    excess = worst_excess(res)
    if excess > DRIFT_LIMIT:
        return out, None
    where = "the output head" if out["layer"] is None else f"layer {out['layer']}"
    return None, {
        "text": f"float32 rounding: '{out['site']}' at {where} passes its threshold at token {out['token']} (seq "
                f"{out['seq']}), but no node up to it is past the float32 floor there"
                + (f" beyond {ORACLE_MARGIN:g}x what an independent float32 recompute of the op errs on the same "
                   f"inputs ({len(tok['explained'])} node(s))" if tok["explained"] else "")
                + "".join(f" ({r['op']} {r['name']}: recomputed with {r['formula']}: a precision defect of the op's "
                          f"formula, log1pf(expf(dt)) keeps them)" for r in tok["explained"] if r.get("formula"))
                + f", none over the whole run; the largest excess anywhere is {excess:.2g}x a threshold "
                  f"(rounding drift, not a fault)",
        "drift_from": out, "switches": [], "worst_excess": excess,
        "items": [{"layer": r["layer"], "site": r["site"], "node": r["name"], "op": r["op"], "path": r["path"],
                   "error": r["error"], "floor": r["fp32_recompute"], "limit": ORACLE_MARGIN * r["fp32_recompute"],
                   "ubatch": tok["ubatch"]} for r in tok["explained"]]}


def rounding_at_its_token(fd: Optional[dict]) -> bool:
    """Whether a refined divergence may be rounding as far as its own ubatch tells: a finite divergence not moved to
    a node, its site recomputed, and at its token every node up to it (and every earlier token of its sequence,
    every node without a token axis) within the FP32 floor or explained by the float32 recompute."""
    tok = (fd or {}).get("token_local")
    return bool(tok) and not (fd.get("by") or fd.get("nan") or tok["first_over"] or tok["earlier_over"]
                              or tok["not_recomputed"] or not tok["site_measured"]
                              or not tok["whole_node_only"]["within_floor"])
