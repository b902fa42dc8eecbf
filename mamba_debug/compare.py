"""Side-by-side traced runs: the reference side and the placed device side see the same tokens.

The prompt, then the reference's greedy continuation for n_gen tokens (teacher forcing, so the states
stay comparable after a token flips), in llama.cpp's ubatches. Three runners go in lock-step, one
ubatch at a time: `ref32` (float32 CPU), `ref64` (float64 CPU) and `dev` (host blocks below the
boundary, device blocks from it on). The reference side is ref32 (default) or ref64. The float32-vs-
float64 spread of the reference on the same input is the *noise floor* of every site: a site diverges
when its error exceeds K_FLOOR times its floor (see `thresholds`).

Blocks below the boundary run the same float32 CPU back-end on both sides, so the device side does not
recompute them: it starts at the boundary from ref32's hidden state (they would be bit-identical).

`ref_device="cuda"` runs ref32, ref64 and the host blocks with the same plain torch ops on the GPU (for big
models, where the CPU would take minutes per comparison). Their tensors then stay on the GPU, the metrics are
computed there, and only the metrics (and the kept trace, per the capture policy) come to the host.
Memory: every site of every layer of one ubatch is held for the three runners until its metrics are taken
(`ubatch_capture_bytes`), so the ubatch size bounds it.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from .backends import (Backend, cpu_backend, cpu_threads_for, device_backend, reference_backend, resolve_device,
                       resolve_ref_device)
from .errors import MambaDebugError
from .metrics import logit_stats, perplexity, site_errors
from .model import LAYER_SITES, MODEL_SITES, MambaModel, Runner, check_tokens
from .placement import Placement

# A site diverges when rel_l2(dev, ref) > K_FLOOR * max(floor, MIN_FLOOR), floor = rel_l2(ref32, ref64) at that
# site (max over tokens and sequences). Two float32 implementations that differ only in the order of operations
# differ by about the floor each (both round to float32), so honest kernels sit near 1-2x the floor; K_FLOOR = 10
# leaves room for that without letting real bugs through (they show 1e-3..1e2 relative, 100x-1e8x the floor).
# MIN_FLOOR (~8 float32 ulps) keeps a site whose float32 and float64 results happen to agree exactly from getting
# a zero threshold.
K_FLOOR = 10.0
MIN_FLOOR = 1e-6
CAPTURE_POLICIES = ("all", "sites", "metrics")


@dataclass
class CompareSettings:
    offload: Optional[int] = None        # None: every block and the head (like -ngl 99)
    ubatch: int = 512
    n_seqs: int = 1
    n_gen: int = 16
    kernels: str = "triton"
    device: Optional[str] = None         # None/auto: cuda if a GPU exists, else the Triton interpreter
    reference: str = "float32"           # the reference side: float32 or float64
    ref_device: str = "cpu"              # where ref32/ref64 (and the host blocks) run their torch ops: cpu | cuda
    rule: str = "llama2024"
    capture: str = "all"                 # all | sites (capture_layers/capture_sites) | metrics (no tensors kept)
    capture_layers: Optional[list] = None
    capture_sites: Optional[list] = None
    memory_budget_mb: float = 2048.0
    k_floor: float = K_FLOOR
    local: bool = False                  # also run each device block on the reference's inputs and states
    repeat: int = 1                      # >= 2: run the device side again and report run-to-run differences
    free_run: bool = True                # also let the device side generate on its own (text view)

    def validate(self, n_layer: int):
        if not isinstance(self.ubatch, int) or self.ubatch < 1:
            raise MambaDebugError(f"ubatch must be an integer >= 1 (like -ub), got {self.ubatch!r}")
        if not isinstance(self.n_seqs, int) or self.n_seqs < 1:
            raise MambaDebugError(f"n_seqs must be an integer >= 1, got {self.n_seqs!r}")
        if not isinstance(self.n_gen, int) or self.n_gen < 0:
            raise MambaDebugError(f"n_gen must be an integer >= 0, got {self.n_gen!r}")
        resolve_ref_device(self.ref_device)
        if self.capture not in CAPTURE_POLICIES:
            raise MambaDebugError(f"capture policy {self.capture!r} unknown: choose one of {CAPTURE_POLICIES}")
        from .model import SITES  # noqa: PLC0415
        for s in self.capture_sites or []:
            if s not in SITES:
                raise MambaDebugError(f"unknown site name {s!r}; the sites are {', '.join(SITES)}")
        for layer in self.capture_layers or []:
            if not 0 <= int(layer) < n_layer:
                raise MambaDebugError(f"capture layer {layer} out of range 0..{n_layer - 1}")
        if self.repeat < 1:
            raise MambaDebugError(f"repeat must be >= 1, got {self.repeat}")
        if self.k_floor <= 1:
            raise MambaDebugError(f"k_floor must be > 1 (a multiple of the rounding floor), got {self.k_floor}")


def sequence_prompts(ids: list[int], n_seqs: int, vocab_size: int) -> torch.Tensor:
    """S different prompts of equal length from one: identical sequences would hide state-slot bugs."""
    base = torch.tensor(ids, dtype=torch.long)
    rows = [base]
    for s in range(1, n_seqs):
        rolled = torch.roll(base, -s)
        rows.append(rolled if not torch.equal(rolled, base) else (base + 7 * s) % vocab_size)
    return torch.stack(rows)


class _Capture:
    """The hook of one runner: keeps this ubatch's site values, keyed (layer, site).

    to_host=True (reference on the CPU): every value is copied to the CPU. A CUDA value goes into pinned host
    memory with a non-blocking copy, so the GPU is not stalled at each of the ~15 sites per layer, and `take()`
    waits once per ubatch for all of them (a pageable `.to("cpu")` syncs and stages every tensor). The pinned
    blocks come from torch's caching host allocator: from the second ubatch on the same sizes are reused.
    to_host=False (reference on the GPU): values stay on their device; only metrics go to the host later.
    Either way the value is a copy, as an op may later write into a tensor it was handed (a state) in place.
    """

    def __init__(self, to_host: bool = True):
        self.to_host = to_host
        self.values: dict[tuple, tuple[torch.Tensor, bool]] = {}
        self.pending = False       # non-blocking copies issued since the last take()

    def __call__(self, layer, site, value, per_token):
        value = value.detach()
        if self.to_host and value.is_cuda:
            copy = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            copy.copy_(value, non_blocking=True)
            self.pending = True
        elif self.to_host:
            copy = value.to("cpu", copy=True)
        else:
            copy = value.clone()
        self.values[(layer, site)] = (copy, per_token)

    def take(self):
        if self.pending:           # the one wait of this ubatch: every copy above has landed after it
            torch.cuda.synchronize()
            self.pending = False
        values, self.values = self.values, {}
        return values


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
    settings: CompareSettings
    model_info: dict
    placement: Placement
    device_label: str
    tokens: torch.Tensor                          # [S, P + G] fed to both sides
    n_prompt: int
    token_info: list
    errors: dict = field(default_factory=dict)    # (layer, site) -> {metric: [S, n_tok]}
    floor: dict = field(default_factory=dict)     # (layer, site) -> [S, n_tok] rel_l2(ref32, ref64)
    thresholds: dict = field(default_factory=dict)
    logits: dict = field(default_factory=dict)    # kld, top1, rms_dp: [S, n_tok]
    trace: dict = field(default_factory=dict)     # (side, layer, site) -> [S, n_tok(or n_ub), ...]
    trace_tokens: dict = field(default_factory=dict)  # (layer, site) -> token index of each captured row
    local: dict = field(default_factory=dict)     # layer -> [S, n_tok] rel_l2 of resid with reference inputs
    nondeterminism: Optional[dict] = None
    generations: dict = field(default_factory=dict)
    perplexity: dict = field(default_factory=dict)
    timings: dict = field(default_factory=dict)
    first_divergence: Optional[dict] = None

    @property
    def n_layer(self) -> int:
        return self.placement.n_layer

    def site_order(self):
        """(layer, site) keys in DESIGN.md graph order: layers ascending, then the model-level sites."""
        keys = [(i, s) for i in range(self.n_layer) for s in LAYER_SITES]
        return [k for k in keys + [(None, s) for s in MODEL_SITES] if k in self.errors]

    def exceed(self, key) -> torch.Tensor:
        """[S, n_tok] bool: where the site's error is beyond its threshold (NaN = not captured = False)."""
        return self.errors[key]["rel_l2"] > self.thresholds[key]


def thresholds_from_floor(floor: dict, k: float) -> dict:
    out = {}
    for key, f in floor.items():
        finite = f[torch.isfinite(f)]
        level = float(finite.max()) if finite.numel() else 0.0
        out[key] = k * max(level, MIN_FLOOR)
    return out


def find_first_divergence(res: CompareResult) -> Optional[dict]:
    """Earliest token; at that token the lowest layer (model-level sites last); then graph order."""
    order = res.site_order()
    exceed = {key: res.exceed(key) for key in order}
    n_tok = res.tokens.shape[1]
    for t in range(n_tok):
        for key in order:
            col = exceed[key][:, t]
            if col.any():
                errs = res.errors[key]["rel_l2"][:, t]
                seq = int(torch.nonzero(col)[0])
                info = res.token_info[t]
                err = float(errs[seq])
                layer, site = key
                return {"token": t, "seq": seq, "layer": layer, "site": site, "ubatch": info.ubatch,
                        "index_in_ubatch": info.index_in_ubatch, "position": info.position, "phase": info.phase,
                        "error": err if math.isfinite(err) else "inf",
                        "threshold": res.thresholds[key], "nan": not math.isfinite(err),
                        "on_device": layer is not None and res.placement.on_device(layer)
                        or layer is None and res.placement.head_on_device}
    return None


def run_compare(model: MambaModel, prompt_ids, settings: Optional[CompareSettings] = None,
                progress=None, ref_cache: Optional[dict] = None) -> CompareResult:
    """Run both sides over the prompt plus n_gen teacher-forced tokens; see the module docstring.

    ref_cache: a dict shared by runs that differ only in offload/kernels/device (a sweep): the reference
    side does not depend on them, so it is computed once and read back from the cache.
    """
    s = dataclasses.replace(settings) if settings is not None else CompareSettings()   # never edit the caller's
    cfg = model.config
    s.validate(cfg.n_layer)
    offload = cfg.n_layer + 1 if s.offload is None else s.offload
    placement = Placement(cfg.n_layer, offload, s.rule)
    tokens = check_tokens(sequence_prompts(list(prompt_ids), s.n_seqs, cfg.vocab_size), cfg.vocab_size)
    _check_budget(model, s, tokens.shape[1] + s.n_gen)
    ref_device = resolve_ref_device(s.ref_device)
    if ref_device.type == "cuda":
        check_gpu_memory(cfg, s, tokens.shape[1] + s.n_gen)
    device = resolve_device(s.device)
    dev_backend = device_backend(s.kernels, device)
    t0 = time.perf_counter()
    sides = _Sides(model, placement, dev_backend, s, ref_device, _cache_for(ref_cache, model, tokens, s))
    res = CompareResult(settings=s, model_info={"source": model.source, **cfg.to_dict()}, placement=placement,
                        device_label=dev_backend.label, tokens=tokens, n_prompt=tokens.shape[1], token_info=[])
    with cpu_threads_for(cfg):
        sides.run(tokens, res, progress)
    res.timings["compare_s"] = time.perf_counter() - t0
    res.thresholds = thresholds_from_floor(res.floor, s.k_floor)
    res.first_divergence = find_first_divergence(res)
    res.settings.offload = offload
    return res


def _cache_for(ref_cache, model, tokens, s: CompareSettings):
    """The part of a shared reference cache for this prompt, ubatch, n_gen and local mode."""
    if ref_cache is None:
        return None
    key = (id(model), tuple(map(tuple, tokens.tolist())), s.ubatch, s.n_gen, s.local, s.reference, s.ref_device)
    return ref_cache.setdefault(key, {})


def site_elements(cfg) -> dict[str, int]:
    """Elements per token and sequence of each layer site (model.py's list; conv_state is per ubatch, so 0 here)
    and of the head's sites: what every memory estimate below counts."""
    E, D, N = cfg.d_model, cfg.d_inner, cfg.d_state
    layer = {"norm": E, "xz": 2 * D, "conv": D, "conv_state": 0, "conv_act": D, "dt": D, "B": N, "C": N, "y_scan": D,
             "ssm_state": D * N, "y_skip": D, "gate": D, "y_gated": D, "out": E, "resid": E}
    return {**layer, "final_norm": E, "logits": cfg.vocab_size}


def ubatch_capture_bytes(cfg, ubatch: int, n_seqs: int = 1) -> int:
    """Bytes of one ubatch of captured sites for the three runners (device and ref32 float32, ref64 float64): every
    layer site, the per-token SSM states included, and the head. They are held until the ubatch's metrics are taken,
    so with capture='metrics' this, not the prompt length, is what a comparison's working memory grows with."""
    el = site_elements(cfg)
    per_token = cfg.n_layer * sum(el[k] for k in LAYER_SITES) + el["final_norm"] + el["logits"]
    return n_seqs * (ubatch * per_token + cfg.n_layer * (cfg.d_conv - 1) * cfg.d_inner) * (4 + 4 + 8)


def comparison_gpu_bytes(cfg, ubatch: int, n_seqs: int, n_tok: int) -> int:
    """GPU bytes of a comparison whose reference sides run on the GPU: float32 and float64 weights, one ubatch of
    captured sites for the three runners, the float64 metric scratch of the largest site (the per-token states)
    and the logits kept for perplexity. (2.8B shape, ubatch 256, 2052 tokens: 72.7 GB estimated, 72.7 GB
    measured on an H200, benchmarks/results/gpu_e2e.md.)"""
    from .weights import expected_shapes  # noqa: PLC0415
    params = sum(math.prod(shape) for shape in expected_shapes(cfg).values())
    scratch = 8 * n_seqs * ubatch * cfg.d_inner * cfg.d_state * 8
    logits = 2 * n_seqs * n_tok * cfg.vocab_size * 4
    return params * (4 + 8) + ubatch_capture_bytes(cfg, ubatch, n_seqs) + scratch + logits


def check_gpu_memory(cfg, s: CompareSettings, n_tok: int, total_bytes: Optional[int] = None):
    """With the reference sides on the GPU, refuse before loading anything a ubatch whose working set would not fit
    (90% of the GPU's memory), and name the largest ubatch that would."""
    if s.ref_device != "cuda":
        return
    if total_bytes is None:
        total_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    need = comparison_gpu_bytes(cfg, s.ubatch, s.n_seqs, n_tok)
    if need <= 0.9 * total_bytes:
        return
    fits = next((u for u in (512, 256, 128, 64, 32, 16, 8, 4, 2, 1)
                 if u < s.ubatch and comparison_gpu_bytes(cfg, u, s.n_seqs, n_tok) <= 0.9 * total_bytes), None)
    fix = (f"use --ubatch {fits} (about {comparison_gpu_bytes(cfg, fits, s.n_seqs, n_tok) / 1e9:.0f} GB)" if fits
           else "the weights alone do not fit: use --ref-device cpu")
    raise MambaDebugError(f"with the reference sides on the GPU, ubatch {s.ubatch} needs about {need / 1e9:.0f} GB "
                          f"of GPU memory (weights in float32 and float64, every site of one ubatch for the three "
                          f"runners), over 90% of the {total_bytes / 1e9:.0f} GB there: {fix}")


def _check_budget(model: MambaModel, s: CompareSettings, n_tok: int):
    """The kept trace (host memory): both sides of every kept site, the device's float32 and the reference side's
    float32 (ref32, the default) or float64 (reference='float64'), counted with the per-site sizes of
    ubatch_capture_bytes (tests/test_engine.py checks the estimate against a kept trace)."""
    if s.capture == "metrics":
        return
    c, el = model.config, site_elements(model.config)
    layers = len(s.capture_layers) if s.capture_layers else c.n_layer
    sites = [x for x in LAYER_SITES if not s.capture_sites or x in s.capture_sites]
    per_tok = layers * sum(el[x] for x in sites) + el["final_norm"] * (not s.capture_sites) + el["logits"]
    mb = (4 + (8 if s.reference == "float64" else 4)) * s.n_seqs * n_tok * per_tok / 2**20
    if mb > s.memory_budget_mb:
        raise MambaDebugError(
            f"capturing every site would keep about {mb:.0f} MB of tensors, over the {s.memory_budget_mb:.0f} MB "
            f"budget: use capture='metrics' (metrics only), or capture='sites' with fewer layers/sites, or raise "
            f"the budget (--memory-budget-mb)")


class _Sides:
    """The runners of one comparison and the lock-step loop over ubatches."""

    def __init__(self, model, placement: Placement, dev_backend: Backend, s: CompareSettings,
                 ref_device: torch.device, cache=None):
        self.model, self.placement, self.s = model, placement, s
        # A shared reference cache is read only once a run completed it and written only when this run
        # completes: an interrupted run must not leave half a reference behind for the next one.
        self.shared = cache
        self.cache = cache if cache is not None and cache.get("complete") else {"steps": []}
        capture = lambda: _Capture(to_host=s.ref_device == "cpu")  # noqa: E731
        self.cap32, self.cap64, self.capdev = capture(), capture(), capture()
        host = cpu_backend(ref_device)       # ref32, and the host blocks of the device side (shared with ref32)
        self.ref32 = Runner(model, host, hook=self.cap32)
        self.ref64 = Runner(model, reference_backend(ref_device), hook=self.cap64)
        self.has_device = placement.n_device_layers > 0 or placement.head_on_device
        self.dev = Runner(model, host, dev_backend, placement, hook=self.capdev)
        self.start = min(placement.first_device_layer, model.config.n_layer)
        self.dev2 = Runner(model, host, dev_backend, placement, hook=capture()) if s.repeat > 1 else None
        self.local = Runner(model, host, dev_backend, placement, hook=capture()) if s.local else None

    def _refside(self) -> Runner:
        return self.ref64 if self.s.reference in ("float64", "fp64") else self.ref32

    def run(self, tokens, res: CompareResult, progress):
        S, P = tokens.shape
        for r in self._runners():
            r.reset(S)
        schedule = [tokens[:, i:i + self.s.ubatch] for i in range(0, P, self.s.ubatch)]
        acc = _Accumulator(res, self.s)
        fed, pos = [], 0
        total = len(schedule) + self.s.n_gen
        self.fork, self.n_sched = None, len(schedule)
        for u in range(total):
            chunk = schedule[u] if u < len(schedule) else nxt[:, None]
            T = chunk.shape[1]
            res.token_info += [TokenInfo(pos + j, u, j, T, "prompt" if u < len(schedule) else "gen") for j in range(T)]
            ref_logits, dev_logits = self._step(u, chunk, acc)
            fed.append(chunk)
            pos += T
            nxt = ref_logits[:, -1].argmax(-1).cpu()      # the schedule's tokens stay on the CPU
            g = u - (len(schedule) - 1)          # index of the generated token chosen after this ubatch
            if 0 <= g < self.s.n_gen and self.fork is None and self.s.free_run:
                self._maybe_fork(u, g, nxt, dev_logits[:, -1].argmax(-1).cpu())
            if progress:
                progress(u + 1, total)
        res.tokens = torch.cat(fed, dim=1)
        if self.shared is not None and not self.shared.get("complete"):
            self.shared.update(self.cache, complete=True)
        acc.finish()
        self._generations(res)

    def _maybe_fork(self, u, g, ref_next, dev_next):
        """The device would pick another token than the reference here: keep its states, so its own (free-running)
        generation can continue from this point later. Until then both generations are the same tokens."""
        if torch.equal(ref_next, dev_next):
            return
        host = self.cache["host_states"][u]
        states = [host[i] if i < self.start else (c.clone(), s.clone())
                  for i, (c, s) in enumerate(zip(self.dev.conv_states, self.dev.ssm_states))]
        self.fork = {"g": g, "next": dev_next, "states": states}

    def _runners(self):
        return [r for r in (self.ref32, self.ref64, self.dev, self.dev2, self.local) if r is not None]

    def _ref_step(self, u, chunk):
        """Both reference runs of ubatch u, from the cache when a sweep already computed them."""
        if u < len(self.cache["steps"]):
            return self.cache["steps"][u]
        states_before = self._ref_states() if self.local is not None else None
        l32 = self.ref32.forward(chunk)
        v32 = self.cap32.take()
        l64 = self.ref64.forward(chunk)
        v64 = self.cap64.take()
        step = (l32, v32, l64, v64, states_before)
        if self.shared is not None:      # kept for the sweep's next runs only: it holds every captured value
            self.cache["steps"].append(step)
        # ref32's states after this ubatch: the host blocks' states, should the device side fork off here
        # (kept only from the last prompt ubatch on, where generated tokens are chosen)
        self.cache.setdefault("host_states", []).append(
            [(c.clone(), s.clone()) for c, s in zip(self.ref32.conv_states, self.ref32.ssm_states)]
            if u >= self.n_sched - 1 else None)
        return step

    def _step(self, u, chunk, acc: "_Accumulator"):
        ref_runner = self._refside()
        l32, v32, l64, v64, states_before = self._ref_step(u, chunk)
        vref = v64 if ref_runner is self.ref64 else v32
        lref = l64 if ref_runner is self.ref64 else l32
        if self.has_device:
            h0 = v32[(self.start - 1, "resid")][0] if self.start > 0 else None
            ldev = self.dev.forward(chunk, self.start, h0)
            vdev = self.capdev.take()
        else:
            ldev, vdev = l32, {}
        for key, val in v32.items():      # host blocks (and head) are shared with ref32: identical by construction
            vdev.setdefault(key, val)
        extra = {}
        if self.dev2 is not None and self.has_device:
            self.dev2.forward(chunk, self.start, h0)
            extra["repeat"] = self.dev2.hook.take()
        if self.local is not None:
            extra["local"] = self._local_step(chunk, vref, states_before)
        acc.add(vdev, vref, v32, v64, extra, self.cache.setdefault("floors", {}).setdefault(u, {}))
        return lref, ldev

    def _ref_states(self):
        r = self._refside()
        return [(c.clone(), s.clone()) for c, s in zip(r.conv_states, r.ssm_states)]

    def _local_step(self, chunk, vref, states_before):
        """Every device block gets the reference's input and states: its own (local) error, nothing inherited."""
        embed = self.model.weights(self.local.host)["embed"]
        emb = embed[chunk.to(embed.device)]

        def feed(i, h, conv, ssm):
            if not self.placement.on_device(i):
                return h, conv, ssm
            b = self.local.layer_backends[i]
            h_in = vref[(i - 1, "resid")][0] if i > 0 else emb
            c, s = states_before[i]
            cast = lambda t: t.to(device=b.device, dtype=b.dtype)  # noqa: E731
            return cast(h_in), cast(c), cast(s)

        self.local.forward(chunk, feed=feed)
        return self.local.hook.take()

    def _generations(self, res: CompareResult):
        """Reference text = the teacher-forced tokens; device text = the device side generating on its own, which
        costs nothing extra while it picks the reference's tokens (its states are the teacher-forced ones)."""
        model, S, G, P = self.model, res.tokens.shape[0], self.s.n_gen, res.n_prompt
        ref_gen = res.tokens[:, P:]
        dev_gen = ref_gen.clone()
        if self.fork is not None:
            self.dev.hook = None
            for i, (c, s) in enumerate(self.fork["states"]):
                self.dev.conv_states[i], self.dev.ssm_states[i] = c.clone(), s.clone()
            g, t = self.fork["g"], self.fork["next"]
            for j in range(g, G):
                dev_gen[:, j] = t
                if j + 1 < G:
                    t = self.dev.forward(t[:, None])[:, -1].argmax(-1).cpu()
        res.generations = {
            "prompt": [model.decode(res.tokens[s, :P].tolist()) for s in range(S)],
            "reference": [model.decode(ref_gen[s].tolist()) for s in range(S)],
            "device": [model.decode(dev_gen[s].tolist()) for s in range(S)],
            "reference_ids": ref_gen.tolist(), "device_ids": dev_gen.tolist(),
            "first_difference": [_first_diff(ref_gen[s], dev_gen[s]) for s in range(S)],
        }


def _first_diff(a, b):
    idx = torch.nonzero(a != b)
    return int(idx[0]) if idx.numel() else None


class _Accumulator:
    """Turns each ubatch's captured values into metrics (and kept tensors, per the capture policy).

    Metrics stay where the reference's tensors are until `finish` (one transfer per site on a GPU, not one per
    ubatch and site); kept tensors go to the CPU as they come, since the trace is a host-side artefact."""

    def __init__(self, res: CompareResult, s: CompareSettings):
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

    def add(self, vdev, vref, v32, v64, extra, floors: dict):
        """floors: this ubatch's floor per site, shared by every run over the same reference (filled if empty)."""
        T = vref[(None, "logits")][0].shape[1]
        for key, (ref, per_token) in vref.items():
            dev = vdev[key][0]
            a, b, a32, a64 = (v if per_token else v[:, None] for v in (dev, ref, v32[key][0], v64[key][0]))
            e = _identical(b) if a is b or dev is ref else site_errors(a, b)   # shared host blocks: exactly 0
            if key not in floors:
                floors[key] = site_errors(a32, a64)["rel_l2"]
            f = floors[key]
            if not per_token:       # a state taken at the ubatch's end belongs to its last token
                e = {m: _at_last(v, T) for m, v in e.items()}
                f = _at_last(f, T)
            self.err.setdefault(key, []).append(e)
            self.floor.setdefault(key, []).append(f)
            if self._keep(*key):
                for side, val in (("ref", ref), ("dev", dev)):
                    self.kept.setdefault((side,) + key, []).append((val if per_token else val[:, None]).cpu())
                toks = list(range(self.tok0, self.tok0 + T)) if per_token else [self.tok0 + T - 1]
                self.res.trace_tokens.setdefault(key, []).extend(toks)
        self.logit.append(logit_stats(vdev[(None, "logits")][0], vref[(None, "logits")][0]))
        self.logit_ref.append(vref[(None, "logits")][0])
        self.logit_dev.append(vdev[(None, "logits")][0])
        if "repeat" in extra:
            self._repeat(vdev, extra["repeat"])
        if "local" in extra:
            for (layer, site), (val, _) in extra["local"].items():
                if site == "resid":
                    self.local.setdefault(layer, []).append(site_errors(val, vref[(layer, site)][0])["rel_l2"])
        self.tok0 += T

    def _repeat(self, vdev, vrep):
        for key, (val, _) in vrep.items():
            d = float(site_errors(val, vdev[key][0])["rel_l2"].max())
            if d > 0 and (self.repeat_max is None or d > self.repeat_max["rel_l2"]):
                self.repeat_max = {"rel_l2": d, "layer": key[0], "site": key[1], "ubatch_first_token": self.tok0}

    def finish(self):
        r = self.res
        r.errors = {k: {m: _cat_cpu([c[m] for c in chunks]) for m in chunks[0]} for k, chunks in self.err.items()}
        r.floor = {k: _cat_cpu(v) for k, v in self.floor.items()}
        r.logits = {m: _cat_cpu([c[m] for c in self.logit]) for m in self.logit[0]}
        r.trace = {k: torch.cat(v, 1) for k, v in self.kept.items()}
        r.local = {k: _cat_cpu(v) for k, v in self.local.items()}
        r.nondeterminism = self.repeat_max
        P = r.n_prompt
        lr, ld = torch.cat(self.logit_ref, 1), torch.cat(self.logit_dev, 1)
        r.perplexity = {"reference": perplexity(lr[:, :P], r.tokens[:, :P]),
                        "device": perplexity(ld[:, :P], r.tokens[:, :P])}


def _cat_cpu(chunks: list) -> torch.Tensor:
    """[S, t] metric chunks of the ubatches, on the reference's device -> one [S, n_tok] CPU tensor."""
    return torch.cat(chunks, 1).cpu()


def _identical(ref: torch.Tensor) -> dict:
    zeros = torch.zeros(ref.shape[0], ref.shape[1], dtype=torch.float64, device=ref.device)
    return {"rel_l2": zeros, "max_abs": zeros, "nmse": zeros, "cosine": torch.ones_like(zeros)}


def _at_last(v: torch.Tensor, T: int) -> torch.Tensor:
    """[S, 1] -> [S, T] with NaN everywhere but the last token."""
    out = torch.full((v.shape[0], T), math.nan, dtype=torch.float64, device=v.device)
    out[:, -1] = v[:, 0]
    return out
