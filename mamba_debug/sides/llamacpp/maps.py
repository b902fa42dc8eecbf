"""Node maps of the layer types beyond Mamba-1 (llama.cpp `src/models/mamba-base.cpp::build_mamba2_layer`,
`granite-hybrid.cpp`): which node of a `mamba2` or `attention` layer means which site of docs/mamba2.md.

A layer's kind is its config layer type, with "+ffn" when Granite's shared feed-forward follows the mixer
(`layer_kinds`). Mamba-1 layers keep nodes.NODE_MAP and nodes.LAYER_SITES unchanged.

Nodes are recognised by data flow, as in nodes.py: the `blk.N.*` weight a node reads, the `cache_r_lN` /
`cache_s_lN` state it writes, the role of its sources; names only where llama.cpp's `cb` gives the one node of
that meaning a stable name (`l_out-N`, `ffn_inp-N`, `kqv_out-N` without flash attention). Every other computing
node keeps its op name with an ordinal from the second node of that op in the layer. Unlike Mamba-1, ordinals here
count empty nodes too (the SCALE that zeroes a fresh sequence's state rows is empty after a sequence's first
ubatch), so a name means the same node in every ubatch.
"""
from __future__ import annotations

from typing import Optional

# (op, weight read) -> site, per layer family; the FFN's rows apply to every kind with "+ffn" and to attention.
_MAMBA2 = {
    ("MUL", "attn_norm.weight"): "norm",
    ("MUL_MAT", "ssm_in.weight"): "zxbcdt",
    ("ADD", "ssm_conv1d.bias"): "conv",
    ("ADD", "ssm_dt.bias"): "dt",
    ("MUL", "ssm_norm.weight"): "y_norm",
    ("MUL_MAT", "ssm_out.weight"): "out",
}
_ATTENTION = {
    ("MUL", "attn_norm.weight"): "norm",
    ("MUL_MAT", "attn_q.weight"): "q",
    ("MUL_MAT", "attn_k.weight"): "k",
    ("MUL_MAT", "attn_v.weight"): "v",
    ("MUL_MAT", "attn_output.weight"): "out",
}
_FFN = {
    ("MUL", "ffn_norm.weight"): "ffn_norm",
    ("MUL_MAT", "ffn_down.weight"): "ffn_out",
}
NODE_MAPS = {"mamba2": _MAMBA2, "mamba2+ffn": {**_MAMBA2, **_FFN}, "attention": {**_ATTENTION, **_FFN}}

# Sites per kind in llama.cpp's graph order: DESIGN sites and the op-named nodes the reference can say something
# about (reference.py). A name in NOT_OBSERVED is a reference site llama.cpp has no node for, kept in its place.
# Mapped but not listed (no reference value, not compared): the state-zeroing SCALEs, the empty "extra" state
# GET_ROWS / CPY pairs, the last layer's `inp_out_ids` GET_ROWS; attention's two SET_ROWS into the KV cache and
# kq (MUL_MAT#4: over every cell of the sequence's KV stream, unused ones included), SOFT_MAX, kqv (MUL_MAT#5).
# The side runs attention without flash attention (which would cast the f32 KV cache to f16): `attn` is the CONT
# named kqv_out-N; with flash attention it would be FLASH_ATTN_EXT.
_M2 = ("GET_ROWS", "RMS_NORM", "norm", "zxbcdt", "CONCAT", "conv_state", "SSM_CONV", "conv", "conv_act", "CONT", "dt",
       "y_scan", "ssm_state", "CONT#2", "MUL#2", "y_skip", "y_gated", "RMS_NORM#2", "y_norm", "out")
_M2_FFN = ("SCALE#3", "ffn_inp", "RMS_NORM#3", "ffn_norm", "MUL_MAT#3", "MUL_MAT#4", "ffn_up", "ffn_act", "ffn_out",
           "SCALE#4", "resid")
_ATTN = ("RMS_NORM", "norm", "q", "v", "k", "attn", "out", "SCALE", "ffn_inp", "RMS_NORM#2", "ffn_norm", "MUL_MAT#7",
         "MUL_MAT#8", "ffn_up", "ffn_act", "ffn_out", "SCALE#2", "resid")
LAYER_SITES = {"mamba2": _M2 + ("resid",), "mamba2+ffn": _M2 + _M2_FFN, "attention": _ATTN}
# ffn_up ([gate | up], 2F) is two MUL_MATs in llama.cpp (ffn_gate, ffn_up: the op-named halves above)
NOT_OBSERVED = frozenset({"ffn_up"})

# What each op-named node of the lists above holds, for reference.py (the ordinals depend on the kind).
ROLES = {
    "mamba2": {"GET_ROWS": "prior_conv", "RMS_NORM": "rms_in", "CONCAT": "conv_window", "SSM_CONV": "conv_nobias",
               "CONT": "dt_raw", "CONT#2": "z", "MUL#2": "x_D", "y_gated": "gated", "RMS_NORM#2": "rms_grouped"},
    "ffn": {"SCALE#3": "scaled_out", "RMS_NORM#3": "rms_ffn", "MUL_MAT#3": "ffn_gate", "MUL_MAT#4": "ffn_up_half",
            "SCALE#4": "scaled_ffn_out"},
    "attention": {"RMS_NORM": "rms_in", "SCALE": "scaled_out", "RMS_NORM#2": "rms_ffn", "MUL_MAT#7": "ffn_gate",
                  "MUL_MAT#8": "ffn_up_half", "SCALE#2": "scaled_ffn_out"},
}


def layer_kinds(cfg) -> list:
    """Per layer: "mamba1", "mamba2", "mamba2+ffn" or "attention"."""
    return [t + ("+ffn" if t == "mamba2" and cfg.d_ff > 0 else "") for t in cfg.layer_types]


def roles(kind: str) -> dict:
    """Op-named site -> role for a kind (reference.py derives each role's value)."""
    if kind == "mamba2+ffn":
        return {**ROLES["mamba2"], **ROLES["ffn"]}
    return dict(ROLES.get(kind, {}))


def design_site(gm, node, weight: Optional[str], cache: Optional[str], kind: str) -> Optional[str]:
    """The docs/mamba2.md site of a computing node of a `kind` layer, or None (it keeps its op name).
    gm: the GraphMap (nodes and roles of this graph so far)."""
    op = node.op
    site = NODE_MAPS[kind].get((op, weight)) if weight else None
    if site:
        return site
    name = node.name.rsplit("-", 1)[0] if node.name.rsplit("-", 1)[-1].isdigit() else None
    if op == "ADD" and name == "l_out":
        return "resid"
    if op == "ADD" and name == "ffn_inp" and kind != "mamba2":
        return "ffn_inp"
    if op == "CPY" and cache in ("r", "s") and "copy of" in node.name and kind.startswith("mamba2"):
        return "conv_state" if cache == "r" else "ssm_state"
    src_roles = [gm.roles.get(s) for s in node.src]
    if kind.startswith("mamba2"):
        if op == "SSM_SCAN":
            return "y_scan"
        if op == "SILU" and "conv" in src_roles:
            return "conv_act"
        if op == "ADD" and any(gm.roles.get(n.view_src) == "y_scan" for s in node.src for n in gm.sources(s)):
            return "y_skip"
        if op == "SWIGLU" and "y_skip" in src_roles:
            return "y_gated"
    if kind == "attention" and (op == "FLASH_ATTN_EXT" or name == "kqv_out"):
        return "attn"       # kqv_out-N: the CONT of softmax(kq)·v without flash attention (a RESHAPE with it)
    if op == "SWIGLU" and any(gm.nodes.get(s) is not None and gm.nodes[s].extra.get("weight") == "ffn_gate.weight"
                              for s in node.src):
        return "ffn_act"
    return None
