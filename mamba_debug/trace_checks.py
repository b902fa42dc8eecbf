"""A trace file is believed only when it is consistent: known keys, known tensor kinds, and tensors whose shapes
agree with the metadata (sequences, tokens, layers). Anything else is refused naming the file, never loaded into
views that would draw a silently wrong picture."""
from __future__ import annotations

import math

import torch

from .errors import MambaDebugError

META_KEYS = {"settings", "model_info", "sides", "layer_sites", "observed", "placement", "n_prompt", "token_info",
             "thresholds", "trace_tokens", "nondeterminism", "generations", "perplexity", "timings"}
OPTIONAL_META = {"judged", "seq_token_info"}
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
