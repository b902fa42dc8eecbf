"""Each ubatch's site values of every side turned into metrics (and kept tensors, per the capture policy).

Metrics stay where the reference's tensors are until `finish` (one transfer per site on a GPU, not one per ubatch
and site); kept tensors go to the CPU as they come, since the trace is a host-side artefact. A site the device side
did not report has NaN metrics: "not observed", never 0 and never a divergence.
"""
from __future__ import annotations

import math

import torch

from .metric_block import cat_cpu, errors_cpu
from .metrics import METRICS, Measured, birth_pair, logit_stats, perplexity, site_errors, site_errors_many
from .settings import RunSettings
from .trace import CompareResult


class Accumulator:
    def __init__(self, res: CompareResult, s: RunSettings):
        self.res, self.s = res, s
        self.err, self.floor, self.logit, self.local = {}, {}, [], {}
        self.logit_ref, self.logit_dev, self.kept = [], [], {}
        self.repeat_max = None
        self.tok0 = 0

    def _keep(self, layer, site) -> bool:
        if self.s.capture == "metrics":
            return False
        if self.s.capture == "sites":
            if self.s.capture_layers and (layer is None or layer not in [int(x) for x in self.s.capture_layers]):
                return site in ("logits",) and not self.s.capture_sites
            if self.s.capture_sites and site not in self.s.capture_sites:
                return False
        return True

    def add(self, vdev: dict, vref: dict, v32: dict, v64: dict, extra: dict, floors: dict):
        """v*: (layer, site) -> (value, per_token) of one ubatch per side. floors: this ubatch's floor per site,
        shared by every run over the same reference (filled here if empty)."""
        T = vref[(None, "logits")][0].shape[1]
        rows, pairs = [], []            # every site's metrics of this ubatch are measured together (metrics.py)
        for key, (ref, per_token) in vref.items():
            observed = key in vdev
            dev, dev_per_token = vdev[key] if observed else (None, None)
            b, a32, a64 = (v if per_token else v[:, None] for v in (ref, v32[key][0], v64[key][0]))
            at_end = False              # the device has this state at the ubatch end only (measured at the last token)
            if not observed:
                e = _not_observed(b)
            elif isinstance(dev, Measured):             # measured where it was born (capture='metrics')
                e, at_end = dev.errors, dev.at_end
            elif dev is ref:
                e = _identical(b)                       # shared host blocks: exactly 0
            else:                                       # the pair a side measuring at birth forms too
                pair, at_end = birth_pair(dev, dev_per_token, ref, per_token) or ((dev[:, None], b), False)
                e = len(pairs)
                pairs.append(pair)
            f = None
            if key not in floors:
                f = len(pairs)
                pairs.append((a32, a64))
            rows.append((key, ref, dev, per_token, at_end, e, f))
        measured = site_errors_many(pairs)
        for key, ref, dev, per_token, at_end, e, f in rows:
            if isinstance(e, int):
                e = measured[e]
            if at_end:
                e = {m: _at_last(v, T) for m, v in e.items()}
            if f is not None:
                floors[key] = measured[f]["rel_l2"]
            f = floors[key]
            if not per_token:       # a state taken at the ubatch's end belongs to its last token
                e = {m: _at_last(v, T) for m, v in e.items()}
                f = _at_last(f, T)
            self.err.setdefault(key, []).append(e)
            self.floor.setdefault(key, []).append(f)
            if self._keep(*key):
                for side, val in (("ref", ref), ("dev", dev)):
                    if val is not None and side == "dev" and at_end:
                        val = _kept_at_last(val, T)     # kept per token like the reference's: NaN but the last
                    if val is not None:
                        self.kept.setdefault((side,) + key, []).append((val if per_token else val[:, None]).cpu())
                toks = list(range(self.tok0, self.tok0 + T)) if per_token else [self.tok0 + T - 1]
                self.res.trace_tokens.setdefault(key, []).extend(toks)
        ldev, lref = vdev[(None, "logits")][0], vref[(None, "logits")][0]
        self.logit.append(logit_stats(ldev, lref))
        self.logit_ref.append(lref)
        self.logit_dev.append(ldev)
        if "repeat" in extra:
            self._repeat(vdev, extra["repeat"])
        if "local" in extra:
            for (layer, site), (val, _) in extra["local"].items():
                if site == "resid":
                    self.local.setdefault(layer, []).append(site_errors(val, vref[(layer, site)][0])["rel_l2"])
        self.tok0 += T

    def _repeat(self, vdev, vrep):
        for key, (val, _) in vrep.items():
            if key not in vdev:
                continue
            d = float(site_errors(val, vdev[key][0])["rel_l2"].max())
            if d > 0 and (self.repeat_max is None or d > self.repeat_max["rel_l2"]):
                self.repeat_max = {"rel_l2": d, "layer": key[0], "site": key[1], "ubatch_first_token": self.tok0}

    def finish(self):
        r = self.res
        blocks: dict = {}                   # each metric block crosses to the host once (metric_block)
        r.errors = {k: errors_cpu(chunks, blocks) for k, chunks in self.err.items()}
        r.floor = {k: cat_cpu(v) for k, v in self.floor.items()}
        r.logits = {m: cat_cpu([c[m] for c in self.logit]) for m in self.logit[0]}
        r.trace = {k: torch.cat(v, 1) for k, v in self.kept.items()}
        r.local = {k: cat_cpu(v) for k, v in self.local.items()}
        r.nondeterminism = self.repeat_max
        P = r.n_prompt
        lr, ld = torch.cat(self.logit_ref, 1), torch.cat(self.logit_dev, 1)
        r.perplexity = {"reference": perplexity(lr[:, :P], r.tokens[:, :P]),
                        "device": perplexity(ld[:, :P], r.tokens[:, :P])}


def merge_groups(res: CompareResult, parts: list):
    """The results of groups of sequences run one after another (llama.cpp's split when -ub + 1 < n_seqs) as one
    result: every [S, ...] array joined along the sequence axis, in sequence order."""
    cat = lambda get: torch.cat([get(p) for p in parts], 0)  # noqa: E731
    first = parts[0]
    res.tokens = cat(lambda p: p.tokens)
    res.token_info, res.trace_tokens = first.token_info, dict(first.trace_tokens)
    if any(p.token_info != first.token_info for p in parts):     # a smaller last group runs longer ubatches
        res.seq_token_info = [p.token_info for p in parts for _ in range(p.tokens.shape[0])]
    res.errors = {k: {m: cat(lambda p: p.errors[k][m]) for m in v} for k, v in first.errors.items()}
    res.floor = {k: cat(lambda p: p.floor[k]) for k in first.floor}
    res.logits = {m: cat(lambda p: p.logits[m]) for m in first.logits}
    res.trace = {k: cat(lambda p: p.trace[k]) if len({p.trace[k].shape[1:] for p in parts}) == 1
                 else _per_token(res, parts, k) for k in first.trace}
    res.trace = {k: v for k, v in res.trace.items() if v is not None}
    res.local = {k: cat(lambda p: p.local[k]) for k in first.local}
    rep = [p.nondeterminism for p in parts if p.nondeterminism]
    res.nondeterminism = max(rep, key=lambda r: r["rel_l2"]) if rep else None
    n = [p.tokens.shape[0] for p in parts]      # perplexity: a mean of NLL over equal-length sequences
    res.perplexity = {k: math.exp(sum(m * math.log(p.perplexity[k]) for m, p in zip(n, parts)) / sum(n))
                      for k in first.perplexity}
    res.generations = {k: [x for p in parts for x in p.generations[k]] for k in first.generations}


def _per_token(res: CompareResult, parts: list, key):
    """A value kept at ubatch ends whose groups ended their ubatches at other tokens: one row per token, NaN where
    the group kept nothing (`trace_tokens` becomes every token for it)."""
    n_tok = res.tokens.shape[1]
    rows = []
    for p in parts:
        v = p.trace[key]
        if v.shape[1] != len(p.trace_tokens[key[1:]]):
            return None                 # not one row per kept token: not kept (shown as not captured)
        full = torch.full((v.shape[0], n_tok) + tuple(v.shape[2:]), math.nan, dtype=v.dtype)
        full[:, p.trace_tokens[key[1:]]] = v
        rows.append(full)
    res.trace_tokens[key[1:]] = list(range(n_tok))
    return torch.cat(rows, 0)


def _identical(ref: torch.Tensor) -> dict:
    zeros = torch.zeros(ref.shape[0], ref.shape[1], dtype=torch.float64, device=ref.device)
    return {"rel_l2": zeros, "max_abs": zeros, "nmse": zeros, "cosine": torch.ones_like(zeros)}


def _not_observed(ref: torch.Tensor) -> dict:
    nan = torch.full((ref.shape[0], ref.shape[1]), math.nan, dtype=torch.float64, device=ref.device)
    return {m: nan for m in METRICS}


def _kept_at_last(v: torch.Tensor, T: int) -> torch.Tensor:
    """A state the device has at the ubatch's end only, [S, ...] -> [S, T, ...] with NaN but at the last token (so
    it lines up with the reference's per-token states in the trace)."""
    out = torch.full((v.shape[0], T) + tuple(v.shape[1:]), math.nan, dtype=v.dtype, device=v.device)
    out[:, -1] = v
    return out


def _at_last(v: torch.Tensor, T: int) -> torch.Tensor:
    """[S, 1] -> [S, T] with NaN everywhere but the last token."""
    out = torch.full((v.shape[0], T), math.nan, dtype=torch.float64, device=v.device)
    out[:, -1] = v[:, 0]
    return out
