"""The trace: one comparison's result as pure data (`CompareResult`), its first divergence, and its file on disk.

Nothing here runs a model: views, the JSON summary and `show` read a `CompareResult` without the engine. A trace
file is one safetensors file: metrics, floors and captured tensors as tensors, everything else as versioned JSON
in its metadata, so a run can be attached to a bug report and reopened with `load_trace`.

Not observed: a side that does not report a site leaves it out of `observed[side]`; its errors are NaN, it has no
threshold crossing, and it is never the first divergence (NaN > threshold is False).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .arch import MODEL_SITES
from .errors import MambaDebugError
from .placement import Placement
from .settings import RunSettings

TRACE_FORMAT = "mamba-debug-trace"
TRACE_VERSION = 2          # 2: sides, observed and per-layer site lists in the file (1: a device label only)
RESULT_VERSION = 1         # the JSON result's own version (DESIGN.md's keys; unchanged by the trace file's)
# A site's threshold is k * max(floor, MIN_FLOOR): MIN_FLOOR (~8 float32 ulps) keeps a site whose float32 and float64
# results happen to agree exactly from getting a zero threshold.
MIN_FLOOR = 1e-6
# A token whose floor is more than OUTLIER x its site's median floor (a value near zero: its relative error is large
# for any implementation) is judged by its own floor and left out of the site's level, which it would otherwise
# raise for every other token (one such y_scan token made a 1e-4 bug land a layer late: research/threshold_conditioning)
OUTLIER = 100.0


@dataclass(frozen=True)
class SideInfo:
    """One side of a comparison: its role, what really ran (in words), its kernels and its device (a field, never
    parsed out of the label)."""
    name: str                 # "ref32" | "ref64" | "device"
    label: str
    kernels: Optional[str]
    device: str               # "cpu" | "interpret" | "cuda"
    engine: str = "torch"
    extra: Optional[dict] = None   # engine details: llama.cpp's library, version, devices, nodes (node -> backend)


@dataclass
class TokenInfo:
    token: int           # position in the sequence (prompt then generated)
    ubatch: int
    index_in_ubatch: int
    ubatch_len: int
    phase: str           # prompt | gen

    @property
    def position(self) -> str:
        if self.token == 0:
            return "first token of the prompt"
        if self.index_in_ubatch == 0:
            return "first of its ubatch (just after a boundary)"
        return "inside its ubatch"


@dataclass
class CompareResult:
    settings: RunSettings                          # validated: offload and device resolved
    model_info: dict
    placement: Placement
    sides: dict                                    # role -> SideInfo ("device", "ref32", "ref64")
    layer_sites: list                              # per layer: its site names in graph order
    tokens: torch.Tensor                           # [S, P + G] fed to every side
    n_prompt: int
    token_info: list
    errors: dict = field(default_factory=dict)     # (layer, site) -> {metric: [S, n_tok]}; NaN = not observed
    floor: dict = field(default_factory=dict)      # (layer, site) -> [S, n_tok] rel_l2(ref32, ref64)
    thresholds: dict = field(default_factory=dict)
    observed: dict = field(default_factory=dict)   # side role -> frozenset of (layer, site) it reported
    logits: dict = field(default_factory=dict)     # kld, top1, rms_dp: [S, n_tok]
    trace: dict = field(default_factory=dict)      # (side, layer, site) -> [S, n_tok(or n_ub), ...]
    trace_tokens: dict = field(default_factory=dict)  # (layer, site) -> token index of each captured row
    local: dict = field(default_factory=dict)      # layer -> [S, n_tok] rel_l2 of resid with reference inputs
    nondeterminism: Optional[dict] = None
    generations: dict = field(default_factory=dict)
    perplexity: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    first_divergence: Optional[dict] = None
    precision: Optional[dict] = None               # llama.cpp on reduced-precision paths: the excess they explain
    judged: bool = False                           # first_divergence set by the side's own verdict, not recomputable
    seq_token_info: Optional[list] = None          # per sequence, when groups of sequences ran other ubatches
    second_opinion: Optional[dict] = None          # a borderline first divergence re-judged (second_opinion.py)

    @property
    def n_layer(self) -> int:
        return self.placement.n_layer

    @property
    def device(self) -> SideInfo:
        return self.sides["device"]

    @property
    def device_label(self) -> str:
        return self.sides["device"].label

    def site_order(self) -> list:
        """(layer, site) keys in graph order: layers ascending, then the model-level sites; only those compared."""
        keys = [(i, s) for i, sites in enumerate(self.layer_sites) for s in sites] + [(None, s) for s in MODEL_SITES]
        return [k for k in keys if k in self.errors]

    def token_infos(self, seq: int) -> list:
        """The ubatch schedule sequence `seq` ran: `token_info`, unless groups of sequences ran different ones
        (-ub + 1 < n_seqs with a smaller last group: llama.cpp gives it more tokens per ubatch)."""
        return self.seq_token_info[seq] if self.seq_token_info else self.token_info

    def is_observed(self, key, side: str = "device") -> bool:
        return key in self.observed.get(side, ())

    def token_thresholds(self, key) -> torch.Tensor:
        """[S, n_tok]: each token's threshold, the site's (`thresholds`) or k x the token's own floor where that is
        larger (an outlier token, see OUTLIER); the site's where a floor is not known (NaN)."""
        own = self.settings.k_floor * torch.nan_to_num(self.floor[key].double(), nan=0.0)
        return own.clamp(min=self.thresholds[key])

    def ratio(self, key) -> torch.Tensor:
        """[S, n_tok]: error / threshold per token (NaN where not observed or not captured)."""
        return self.errors[key]["rel_l2"] / self.token_thresholds(key)

    def exceed(self, key) -> torch.Tensor:
        """[S, n_tok] bool: where the site's error is beyond its token's threshold (NaN = not captured = False)."""
        return self.errors[key]["rel_l2"] > self.token_thresholds(key)


def require_result(res, fn: str) -> None:
    """A public function's result argument, refused naming the function (an AttributeError on None before)."""
    if not isinstance(res, CompareResult):
        raise MambaDebugError(f"{fn} takes a CompareResult (md.run_compare's or md.load_trace's), got a "
                              f"{type(res).__name__}")


def thresholds_from_floor(floor: dict, k: float) -> dict:
    """Each site's threshold: k x its level, the largest floor over every sequence and token but the outliers (a
    floor past OUTLIER x the site's median), at least MIN_FLOOR. An outlier token is judged by its own floor
    (`CompareResult.token_thresholds`)."""
    out = {}
    for key, f in floor.items():
        finite = f[torch.isfinite(f)]
        kept = finite[finite <= OUTLIER * max(float(finite.median()), MIN_FLOOR)] if finite.numel() else finite
        level = float(kept.max()) if kept.numel() else 0.0
        out[key] = k * max(level, MIN_FLOOR)
    return out


def find_first_divergence(res: CompareResult) -> Optional[dict]:
    """Earliest token; at that token the lowest layer (model-level sites last); then graph order.
    A site the device side did not observe has NaN errors and can never be it."""
    order = res.site_order()
    if not order:
        return None
    hit = torch.stack([res.exceed(key).any(0) for key in order])      # [sites, n_tok]: one pass, not a loop
    tokens = torch.nonzero(hit.any(0))
    if not tokens.numel():
        return None
    t = int(tokens[0])                                                 # the earliest token, then graph order
    key = order[int(torch.nonzero(hit[:, t])[0])]
    seq = int(torch.nonzero(res.exceed(key)[:, t])[0])
    info = res.token_infos(seq)[t]
    layer, site = key
    return {"token": t, "seq": seq, "layer": layer, "site": site, "ubatch": info.ubatch,
            "index_in_ubatch": info.index_in_ubatch, "position": info.position, "phase": info.phase,
            **error_fields(float(res.errors[key]["rel_l2"][seq, t])),
            "threshold": float(res.token_thresholds(key)[seq, t]),
            "on_device": layer is not None and res.placement.on_device(layer)
            or layer is None and res.placement.head_on_device}


def error_fields(err: float) -> dict:
    """A first divergence's error as the JSON result writes it: the float, or "inf" with nan true when it is not
    finite (a NaN or Inf was born there)."""
    return {"error": err if math.isfinite(err) else "inf", "nan": not math.isfinite(err)}


def json_num(x: float):
    """JSON has no inf/nan: write them as strings, keep finite floats."""
    x = float(x)
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf" if x < 0 else "nan")


def json_safe(obj):
    """obj with every non-finite float written as json_num writes it (dicts, lists and tuples walked): for records
    whose floats may be inf or NaN (llama.cpp's local errors)."""
    if isinstance(obj, float):
        return json_num(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def nanmax(t: torch.Tensor) -> float:
    """Largest value that is not NaN (NaN: not observed / not captured); NaN if there is none."""
    t = t[~torch.isnan(t)]
    return float(t.max()) if t.numel() else math.nan


def worst_excess(res) -> float:
    """The largest error / threshold over every site and token of a result (inf where a value is not finite; a site
    not observed or not captured, NaN throughout, counts nothing); 0.0 with none."""
    ratios = (nanmax(res.ratio(k)) for k, t in res.thresholds.items() if k in res.errors and t)
    return max((r for r in ratios if r == r), default=0.0)


# -- trace files -------------------------------------------------------------------------------------
def _key(k) -> str:
    return ".".join("head" if p is None else str(p) for p in k)


def _unkey(text: str):
    return tuple(None if p == "head" else int(p) if p.isdigit() else p for p in text.split("."))


def save_trace(res: CompareResult, path) -> Path:
    from safetensors.torch import save_file  # noqa: PLC0415
    require_result(res, "save_trace")

    tensors = {"tokens": res.tokens.contiguous()}
    for k, m in res.errors.items():
        for name, v in m.items():
            tensors[f"err/{name}/{_key(k)}"] = v.contiguous()
    tensors.update({f"floor/{_key(k)}": v.contiguous() for k, v in res.floor.items()})
    tensors.update({f"logits/{k}": v.contiguous() for k, v in res.logits.items()})
    tensors.update({f"trace/{_key(k)}": v.contiguous() for k, v in res.trace.items()})
    tensors.update({f"local/{k}": v.contiguous() for k, v in res.local.items()})
    meta = {"settings": res.settings.to_dict(), "model_info": res.model_info,
            "sides": {k: dataclasses.asdict(v) for k, v in res.sides.items()},
            "layer_sites": [list(s) for s in res.layer_sites],
            "observed": {side: sorted(_key(k) for k in keys) for side, keys in res.observed.items()},
            "placement": [res.placement.n_layer, res.placement.offload, res.placement.rule]
            + ([list(res.placement.devices), list(res.placement.tensor_split)] if res.placement.devices else []),
            "n_prompt": res.n_prompt, "token_info": [t.__dict__ for t in res.token_info],
            "thresholds": {_key(k): v for k, v in res.thresholds.items()},
            "trace_tokens": {_key(k): v for k, v in res.trace_tokens.items()},
            "nondeterminism": res.nondeterminism, "generations": res.generations,
            "perplexity": res.perplexity, "timings": res.timings,
            **({"judged": {"first_divergence": res.first_divergence, "precision": res.precision}} if res.judged
               else {}),
            **({"seq_token_info": [[t.__dict__ for t in row] for row in res.seq_token_info]}
               if res.seq_token_info else {}),
            **({"second_opinion": res.second_opinion} if res.second_opinion else {})}
    from .safeio import atomic_path  # noqa: PLC0415
    path = Path(path)
    header = {"format": TRACE_FORMAT, "version": str(TRACE_VERSION), "result": json.dumps(meta, default=str)}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=header)
    return path


def load_trace(path) -> CompareResult:
    from safetensors import safe_open  # noqa: PLC0415

    path = Path(path)
    if path.is_dir():
        raise MambaDebugError(f"{path} is a folder; give the trace file (--trace wrote it)")
    if not path.exists():
        raise MambaDebugError(f"{path}: no such trace file")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:
        raise MambaDebugError(f"{path}: not a readable trace file ({exc})") from exc
    if header.get("format") != TRACE_FORMAT:
        raise MambaDebugError(f"{path}: not a mamba-debug trace (format {header.get('format')!r})")
    if header.get("version") != str(TRACE_VERSION):
        raise MambaDebugError(f"{path}: trace format version {header.get('version')} but this mamba-debug reads "
                              f"version {TRACE_VERSION}; re-run the comparison with this version to get a new trace")
    try:
        return _from_file(json.loads(header["result"]), tensors, path)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        detail = str(exc).replace("\n", "\\n")      # one line, whatever the file's keys hold
        raise MambaDebugError(f"{path}: damaged trace file ({type(exc).__name__}: {detail}); re-run the comparison "
                              f"to get a new trace") from exc


def _settings(fields, path) -> RunSettings:
    """A trace's settings, typed and in range, or the trace is refused as inconsistent (naming the setting)."""
    from .settings_checks import check_numbers  # noqa: PLC0415
    try:
        settings = RunSettings(**fields)
        check_numbers(settings)
    except MambaDebugError as exc:
        raise MambaDebugError(f"{path}: inconsistent trace file (settings: {exc}); re-run the comparison to get a "
                              f"new trace") from None
    return settings


def _from_file(meta, tensors: dict, path) -> CompareResult:
    from .trace_checks import check_judged, check_meta, check_result, check_second_opinion  # noqa: PLC0415
    check_meta(meta, tensors, path)
    res = CompareResult(settings=_settings(meta["settings"], path), model_info=meta["model_info"],
                        placement=Placement(*meta["placement"]),
                        sides={k: SideInfo(**v) for k, v in meta["sides"].items()},
                        layer_sites=[tuple(s) for s in meta["layer_sites"]],
                        tokens=tensors["tokens"], n_prompt=meta["n_prompt"],
                        token_info=[TokenInfo(**t) for t in meta["token_info"]])
    for name, t in tensors.items():
        kind, _, rest = name.partition("/")
        if kind == "err":
            metric, _, k = rest.partition("/")
            res.errors.setdefault(_unkey(k), {})[metric] = t
        elif kind == "floor":
            res.floor[_unkey(rest)] = t
        elif kind == "logits":
            res.logits[rest] = t
        elif kind == "trace":
            res.trace[_unkey(rest)] = t
        elif kind == "local":
            res.local[int(rest)] = t
    res.observed = {side: frozenset(_unkey(k) for k in keys) for side, keys in meta["observed"].items()}
    res.thresholds = {_unkey(k): v for k, v in meta["thresholds"].items()}
    res.trace_tokens = {_unkey(k): v for k, v in meta["trace_tokens"].items()}
    res.nondeterminism, res.generations = meta["nondeterminism"], meta["generations"]
    res.perplexity, res.timings = meta["perplexity"], meta["timings"]
    if "seq_token_info" in meta:        # before the first divergence, which reads its sequence's schedule
        res.seq_token_info = [[TokenInfo(**t) for t in row] for row in meta["seq_token_info"]]
    res.second_opinion = meta.get("second_opinion")
    check_second_opinion(res.second_opinion, path)
    check_result(res, path)
    res.first_divergence = find_first_divergence(res)
    if "judged" in meta:                # a side's own verdict (llama.cpp's precision-aware one) is kept as given
        check_judged(meta["judged"], path)
        res.first_divergence, res.precision = meta["judged"]["first_divergence"], meta["judged"]["precision"]
        res.judged = True
    return res
