"""A trace file is believed only when it is consistent: known keys, known tensor kinds, and tensors whose shapes
agree with the metadata (sequences, tokens, layers). Anything else is refused naming the file, never loaded into
views that would draw a silently wrong picture."""
from __future__ import annotations

import math

import torch

from .errors import MambaDebugError

META_KEYS = {"settings", "model_info", "sides", "layer_sites", "observed", "placement", "n_prompt", "token_info",
             "thresholds", "trace_tokens", "nondeterminism", "generations", "perplexity", "timings"}
OPTIONAL_META = {"judged", "seq_token_info", "second_opinion"}
TENSOR_KINDS = {"tokens", "err", "floor", "logits", "trace", "local"}


def check_meta(meta, tensors: dict, path) -> None:
    def bad(what):
        raise MambaDebugError(f"{path}: inconsistent trace file ({what}); it was not written by this mamba-debug "
                              f"or has been edited: re-run the comparison to get a new trace")
    if not isinstance(meta, dict):
        bad("its metadata is not an object")
    unknown, missing = set(meta) - META_KEYS - OPTIONAL_META, META_KEYS - set(meta)
    if unknown or missing:
        bad(f"unknown keys {sorted(unknown)}" if unknown else f"missing keys {sorted(missing)}")
    kinds = {k.partition("/")[0] for k in tensors}
    if kinds - TENSOR_KINDS:
        bad(f"unknown tensor kinds {sorted(kinds - TENSOR_KINDS)}")
    if "tokens" not in tensors:
        bad("no tokens tensor")


def check_result(res, path) -> None:
    def bad(what):
        raise MambaDebugError(f"{path}: inconsistent trace file ({what}); re-run the comparison to get a new trace")
    tokens = res.tokens
    if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        bad(f"tokens is {list(tokens.shape)} {tokens.dtype}, expected [sequences, tokens] integers")
    S, n_tok = tokens.shape
    if len(res.token_info) != n_tok:
        bad(f"{len(res.token_info)} token entries for {n_tok} tokens")
    if not isinstance(res.n_prompt, int) or not 0 < res.n_prompt <= n_tok:
        bad(f"n_prompt {res.n_prompt!r} with {n_tok} tokens")
    if res.settings.n_seqs != S:
        bad(f"settings say {res.settings.n_seqs} sequence(s), tokens hold {S}")
    if res.placement.n_layer != len(res.layer_sites):
        bad(f"placement of {res.placement.n_layer} layers, site lists of {len(res.layer_sites)}")
    for group, table in (("errors", {k: t for k, m in res.errors.items() for t in m.values()}),
                         ("floor", res.floor), ("logits", res.logits), ("local", res.local)):
        for key, t in table.items():
            if tuple(t.shape) != (S, n_tok):
                bad(f"{group} {key} is {list(t.shape)}, expected {[S, n_tok]}")
    for key in list(res.errors) + list(res.floor):
        layer = key[0]
        if layer is not None and not 0 <= layer < res.placement.n_layer:
            bad(f"a site of layer {layer} in a {res.placement.n_layer}-layer model")
    for key, v in res.thresholds.items():
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            bad(f"threshold of {key} is {v!r}")
    _check_free_form(res, S, bad)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_free_form(res, S: int, bad) -> None:
    """The metadata the views read as given: the model's description, the texts, the timings (the settings' counts
    are checked where the trace's settings are made, `trace._settings`)."""
    if not isinstance(res.model_info, dict):
        bad("model_info is not an object")
    if not {"ref32", "ref64", "device"} <= set(res.sides):
        bad(f"sides are {sorted(res.sides)}, not ref32, ref64 and device")
    for name in ("perplexity", "timings"):
        table = getattr(res, name)
        if not isinstance(table, dict) or not all(_is_num(v) for v in table.values()):
            bad(f"{name} is not an object of numbers")
    g = res.generations
    texts = ("prompt", "reference", "device")
    if g and not (isinstance(g, dict) and all(isinstance(g.get(k), list) and len(g[k]) == S and
                                              all(isinstance(x, str) for x in g[k]) for k in texts)
                  and isinstance(g.get("first_difference"), list) and len(g["first_difference"]) == S
                  and all(x is None or isinstance(x, int) for x in g["first_difference"])):
        bad(f"generations must hold {', '.join(texts)} and first_difference for each of {S} sequence(s)")
    nd = res.nondeterminism
    if nd and not (isinstance(nd, dict) and _is_num(nd.get("rel_l2")) and {"layer", "site"} <= set(nd)):
        bad("nondeterminism must be an object of rel_l2, layer and site")


# what the views read of a first divergence (`trace.find_first_divergence` writes these and more)
DIVERGENCE_KEYS = {"token", "seq", "layer", "site", "ubatch", "position", "error", "nan", "threshold"}


def check_judged(judged, path) -> None:
    """A side's own verdict kept in the trace (llama.cpp's): first_divergence null or an object of the keys the views
    read, precision null or an object with its items and text."""
    fd, prec = (judged.get("first_divergence"), judged.get("precision")) if isinstance(judged, dict) else (0, 0)
    if not (isinstance(judged, dict) and {"first_divergence", "precision"} <= set(judged)
            and (fd is None or isinstance(fd, dict) and DIVERGENCE_KEYS <= set(fd))
            and (prec is None or isinstance(prec, dict) and isinstance(prec.get("items"), list)
                 and isinstance(prec.get("text"), str))):
        raise MambaDebugError(f"{path}: inconsistent trace file (its judged verdict is not "
                              f"{{first_divergence, precision}} as written); re-run the comparison to get a new trace")


def check_second_opinion(so, path) -> None:
    """A second opinion kept in the trace: null, or an object with the first answer (a divergence's keys), whether
    it was taken, and the samples it took or why not (what the summary reads)."""
    fd = so.get("first_divergence_before") if isinstance(so, dict) else None
    if so is None or (isinstance(fd, dict) and DIVERGENCE_KEYS <= set(fd) and isinstance(so.get("taken"), bool)
                      and (isinstance(so.get("samples"), int) if so["taken"] else isinstance(so.get("why"), str))):
        return
    raise MambaDebugError(f"{path}: inconsistent trace file (its second opinion is not as written); re-run the "
                          f"comparison to get a new trace")
