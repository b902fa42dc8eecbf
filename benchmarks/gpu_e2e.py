"""Issue "GPU performance", tracing and end to end: what tracing costs on the GPU, and one comparison of a
2.8B-shaped Mamba-1 (random weights at mamba_ssm's initial scale) over a 2048-token prompt on one GPU.

Part 1  build the model in memory (float64 masters on the host, as the loaders keep them) and upload it.
Part 2  tracing overhead: a 2048-token prefill (batch 1) of the device side only (every layer and the head on
        the GPU, Triton kernels), untraced and with each capture level the engine uses; CUDA events, warmed up,
        median of a few runs; ratio vs untraced, bytes captured, peak GPU memory, host copy bandwidth.
Part 3  end to end: `run_compare` with the reference sides' torch ops on the GPU (`ref_device="cuda"`) and
        capture="metrics"; wall time, peak GPU memory, peak host RSS, first divergence (None expected), KLD.
Part 4  the same with the reference sides on the CPU (the default), over a short prompt, extrapolated to 2048.

Run on the GPU machine:  TRITON_INTERPRET=0 python3 benchmarks/gpu_e2e.py          (about 3-4 minutes)
Check it on a CPU:       python3 benchmarks/gpu_e2e.py --small    (4 layers, d_model 256, 256 tokens, Triton's
                         interpreter; the CUDA-only measurements are skipped and say so)
Writes $OUT/gpu_e2e.json and $OUT/gpu_e2e.md ($OUT defaults to benchmarks/results; with --small, out/benchmarks-small). Each part records its error
in the JSON and the script goes on, so one failure does not lose the other measurements.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import pstats
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
# Triton fixes compiled-or-interpreted for its own library at its first import, before any plug-in loads
os.environ["TRITON_INTERPRET"] = "0" if CUDA else "1"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mamba_debug.backends import cpu_threads_for, device_backend  # noqa: E402
from mamba_debug.sides import Capture as _Capture  # noqa: E402
from mamba_debug.compare import (CompareSettings, comparison_gpu_bytes, run_compare,  # noqa: E402
                                 ubatch_capture_bytes)
from mamba_debug.config import MambaConfig  # noqa: E402
from mamba_debug.metrics import METRICS, site_errors_many  # noqa: E402
from mamba_debug.model import MambaModel, Runner  # noqa: E402
from mamba_debug.ops import OpTable  # noqa: E402
from mamba_debug.arch import param_shapes as expected_shapes  # noqa: E402

OUT = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
# --small (a check on a CPU) never overwrites the recorded GPU figures unless $OUT says where to write
SMALL_OUT = Path(os.environ.get("OUT", ROOT / "out" / "benchmarks-small"))
TODAY = datetime.date.today().isoformat()
GB = 1e9
T0 = time.perf_counter()

BIG = dict(d_model=2560, n_layer=64, d_inner=5120, d_state=16, d_conv=4, dt_rank=160, vocab_size=50280)
SMALL = dict(d_model=256, n_layer=4, d_inner=512, d_state=16, d_conv=4, dt_rank=16, vocab_size=50280)


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


# -- the model -----------------------------------------------------------------------------------------------
def mamba_ssm_params(cfg: MambaConfig, seed: int, device: str) -> dict[str, torch.Tensor]:
    """Random weights at mamba_ssm's initial scale (Mamba.__init__, MambaLMHeadModel._init_weights), rounded to
    float32 values (a real checkpoint's, so the float64 reference keeps them as float32 on the GPU) and held as float64.

    Not tests/conftest.random_params: that one draws every matrix on the CPU with one generator (~15 s for
    2.8B parameters) and does not scale out_proj by 1/sqrt(n_layer), which 64 residual additions need.
    Drawn on `device` (fast on a GPU), kept on the host as float64 masters like the checkpoint loaders do.
    """
    g = torch.Generator(device).manual_seed(seed)
    N, K, R, L = cfg.d_state, cfg.d_conv, cfg.dt_rank, cfg.n_layer

    def uniform(shape, bound):
        return (torch.rand(shape, generator=g, device=device, dtype=torch.float64) * 2 - 1) * bound

    def linear(shape):       # nn.Linear's default init: kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in))
        return uniform(shape, 1 / math.sqrt(shape[1]))

    def dt_bias(shape):      # softplus(dt_bias) log-uniform in [1e-3, 1e-1]
        dt = torch.exp(uniform(shape, 1.0) * 0.5 * math.log(100) + math.log(1e-2)).clamp(min=1e-4)
        return dt + torch.log(-torch.expm1(-dt))

    make = {"norm": lambda s: torch.ones(s, dtype=torch.float64, device=device),
            "in_proj": linear, "x_proj": linear,
            "out_proj": lambda s: linear(s) / math.sqrt(L),          # rescale_prenorm_residual
            "conv_w": lambda s: uniform(s, 1 / math.sqrt(K)),       # nn.Conv1d default, fan_in = K
            "conv_b": lambda s: uniform(s, 1 / math.sqrt(K)),
            "dt_proj": lambda s: uniform(s, R ** -0.5), "dt_bias": dt_bias,
            "A": lambda s: -torch.arange(1, N + 1, dtype=torch.float64, device=device).expand(s).clone(),  # -exp(A_log)
            "D": lambda s: torch.ones(s, dtype=torch.float64, device=device)}
    params = {}
    for name, shape in expected_shapes(cfg).items():
        leaf = name.split(".")[-1]
        if name == "embed":
            t = torch.randn(shape, generator=g, device=device, dtype=torch.float64) * 0.02
        elif name == "norm_f":
            t = make["norm"](shape)
        elif name == "lm_head":
            continue
        else:
            t = make[leaf](shape)
        params[name] = t.to(torch.float32).to(torch.float64).cpu()   # float32 values, as a real checkpoint holds
    params["lm_head"] = params["embed"]                          # tied embeddings
    return params


def param_count(cfg: MambaConfig) -> int:
    """Elements of every cast weight set (lm_head counted: the cast keeps it apart from the embedding)."""
    return sum(math.prod(s) for s in expected_shapes(cfg).values())


def master_bytes(cfg: MambaConfig) -> int:
    """The float64 masters on the host: the tied lm_head is the embedding tensor itself there."""
    return (param_count(cfg) - cfg.vocab_size * cfg.d_model) * 8


# -- measuring -----------------------------------------------------------------------------------------------
class RssPeak:
    """Peak resident memory of this process while the block runs (sampled from /proc every 20 ms)."""

    def __enter__(self):
        self.peak, self._stop = _rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def sync():
    if CUDA:
        torch.cuda.synchronize()


def reset_peak():
    if CUDA:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for name in ("reset_peak_host_memory_stats", "reset_accumulated_host_memory_stats"):   # not in every torch
            getattr(torch.cuda, name, lambda: None)()


def peak_gpu():
    return torch.cuda.max_memory_allocated() if CUDA else None


def once(fn) -> float:
    """Seconds of one call: CUDA events around it on a GPU (the call itself may sync), else the wall clock."""
    if not CUDA:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def median_time(fn, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    return statistics.median(once(fn) for _ in range(reps))


def free_memory(host_cache=True):
    """Drop what a part left behind. host_cache=False keeps torch's pool of pinned blocks: pinning is slow (GB/s),
    and the levels that copy to the host reuse each other's block sizes."""
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()
        empty_host = getattr(torch.accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
        if host_cache and empty_host is not None:
            empty_host()


# -- part 2: tracing levels ------------------------------------------------------------------------------------
class Tap:
    """A benchmark observer: hands the chosen sites (all when `sites` is None) to `inner` and counts their bytes."""

    def __init__(self, inner=None, sites=None):
        self.inner, self.sites, self.bytes = inner, sites, 0

    def site(self, layer, site, value, per_token):
        if self.inner is None or self.sites is not None and site not in self.sites:
            return
        self.bytes += value.numel() * value.element_size()
        self.inner.site(layer, site, value, per_token)


class KeepOnDevice:
    """Keeps copies of the chosen sites where they were computed for the whole prefill (capture='sites')."""

    def __init__(self):
        self.kept = []

    def site(self, layer, site, value, per_token):
        self.kept.append(value.detach().clone())


class PageableCapture(_Capture):
    """The engine's hook before pinned copies: one pageable, synchronous `.to("cpu")` per site."""

    def site(self, layer, site, value, per_token):
        self.values[(layer, site)] = (value.detach().to("cpu", copy=True), per_token)


def metrics_on_device(values: dict):
    """capture='metrics' as the Accumulator measures what a side hands over by value (the device side before it
    measured at birth, and the reference floors): `site_errors_many` over the ubatch's copies (on CUDA the fused
    Triton kernel of mamba_debug/_site_metrics.py, a launch per group of like sites reading each in place), the
    metrics kept on the device, one transfer per ubatch. This run has no reference side, so each site is compared
    with itself: the kernel reads it twice (the second read partly from cache), where the engine reads a distinct
    float32 or float64 reference; benchmarks/site_metrics_bench.py times those pairs."""
    pairs = [(a, a) for a in (v if per_token else v[:, None] for v, per_token in values.values())]
    out = [e[m].flatten() for e in site_errors_many(pairs) for m in METRICS]
    return torch.cat(out).cpu()          # one transfer per ubatch: only metrics reach the host


class AtBirth(_Capture):
    """What capture='metrics' does on the device side now (compare._measures_at_birth), through the engine's own
    Capture: each site measured where it is born, a layer's sites together (`site_errors_many`: on a GPU one or two
    launches of the fused kernel reading each site in place), nothing copied, the metrics kept on the device. No
    reference side here, so each site is measured against itself."""

    def __init__(self):
        super().__init__(to_host=False)
        self.kept = []             # each ubatch's Measured sites (the keep protocol)
        self.host_s = 0.0          # host time in the layer measurements (grouping, tables, launches, result views)

    def site(self, layer, site, value, per_token):
        self.against = {(layer, site): (value, per_token)}
        super().site(layer, site, value, per_token)

    def _measure_born(self):
        t0 = time.perf_counter()
        super()._measure_born()
        self.host_s += time.perf_counter() - t0

    def take(self):
        self.kept.append(super().take())


def prefill(runner: Runner, tokens: torch.Tensor, ubatch: int, after_ubatch=None) -> torch.Tensor:
    """The prompt in ubatches from fresh states, like the engine; after_ubatch() takes that ubatch's capture."""
    runner.reset(tokens.shape[0])
    for i in range(0, tokens.shape[1], ubatch):
        logits = runner.forward(tokens[:, i:i + ubatch])
        if after_ubatch is not None:
            after_ubatch()
    return logits


def tracing_levels(dev) -> list[dict]:
    """The capture levels, cheapest first. what; backend; tap (the hook); after (run after each ubatch, as the
    engine takes its capture there); to_host (bytes cross to the host); keep (kept for the whole prefill);
    once (one run, no warm-up: too slow to repeat at 2.8B); check (compare host copies with the device values)."""
    no_states_out = dataclasses.replace(dev, ops=OpTable(dev.ops.name, dev.ops.ops, supports_states_out=False))
    gpu, keep, states, pinned, pageable = (_Capture(to_host=False), KeepOnDevice(), _Capture(), _Capture(),
                                          PageableCapture())
    born = AtBirth()
    host = "pinned host memory, non-blocking, one sync per ubatch" if CUDA else "the CPU (no GPU: plain copies)"
    level = dict(backend=dev, after=None, to_host=False, keep=None, once=False, check=False)
    return [
        {**level, "what": "hook that keeps nothing; SSM states at ubatch ends only", "backend": no_states_out,
         "tap": Tap()},
        {**level, "what": "hook that keeps nothing; per-token SSM states (states_out)", "tap": Tap()},
        {**level, "what": "capture='metrics' device half: every site copied on the device, site_errors_many "
                          f"({'fused Triton kernel, like sites in one launch' if CUDA else 'torch version on the CPU'}), "
                          "then dropped",
         "tap": Tap(gpu), "after": lambda: metrics_on_device(gpu.take())},
        {**level, "what": "capture='metrics' device half, measured at birth: a layer's sites by "
                          f"{'the fused kernel, read in place' if CUDA else 'the torch version'} as the next layer "
                          "starts (against themselves: no reference here), nothing copied, metrics kept on the device",
         "tap": Tap(born), "after": born.take, "keep": born},
        {**level, "what": "keep resid, y_scan (every layer) and logits on the device for the whole prefill",
         "tap": Tap(keep, {"resid", "y_scan", "logits"}), "keep": keep},
        {**level, "what": f"per-token SSM states (states_out) to {host}", "tap": Tap(states, {"ssm_state"}),
         "after": states.take, "to_host": True},
        {**level, "what": f"every site to {host} (engine _Capture)", "tap": Tap(pinned), "after": pinned.take,
         "to_host": True, "check": True},
        {**level, "what": "every site to the host, pageable .to('cpu') per site (the engine's hook before)",
         "tap": Tap(pageable), "after": pageable.take, "to_host": True, "once": True, "cuda_only": True},
    ]


TRACE_DIR = os.environ.get("OUT")   # where --profile writes a chrome trace of its GPU run (a device call's $OUT)
ONLY = None           # --only TEXT: run only the tracing levels whose description contains TEXT ('a|b': either)
PROFILE = None        # --profile TEXT: profiles of one run of the tracing level whose description contains TEXT


def profile(run):
    """Where one run's time goes: host (cProfile, by own time), then on a GPU the kernels (torch.profiler)."""
    sync()
    pr = cProfile.Profile()
    pr.enable()
    run()
    sync()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(28)
    pstats.Stats(pr).sort_stats("cumulative").print_stats(28)
    if CUDA:
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            run()
            sync()
        table = prof.key_averages()
        print(table.table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        print(table.table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=60))
        if TRACE_DIR:                      # the timeline, for gaps on the GPU and what the host did meanwhile
            prof.export_chrome_trace(str(Path(TRACE_DIR) / f"trace_{len(list(Path(TRACE_DIR).glob('trace_*')))}.json"))


def part_tracing(model, dev, tokens, ubatch, small) -> list[dict]:
    reps, warm = (1, 1) if small else (3, 1)
    rows = []

    def row(what, seconds, base, captured=0, to_host=False, peak=None):
        r = {"part": "tracing", "what": what, "seconds": seconds, "ratio": seconds / base, "bytes": captured,
             "peak_gpu_bytes": peak, "host_gb_s": captured / seconds / GB if to_host and CUDA else None, "note": ""}
        log(f"  {seconds:8.3f} s  x{r['ratio']:6.2f}  {captured / GB:7.2f} GB  {what}")
        rows.append(r)
        return r

    plain = Runner(model, dev)
    reset_peak()
    base = median_time(lambda: prefill(plain, tokens, ubatch), reps + 2, warm)
    row(f"untraced, ubatch {ubatch}", base, base, peak=peak_gpu())
    reset_peak()
    t = median_time(lambda: prefill(plain, tokens, tokens.shape[1]), reps, warm)
    row(f"untraced, ubatch {tokens.shape[1]} (one ubatch)", t, base, peak=peak_gpu())
    ceilings = copy_ceilings()
    rows += ceilings
    pageable_gb_s = next((r["host_gb_s"] for r in ceilings if "pageable" in r["what"]), None)
    dev_bytes = ubatch_capture_bytes(model.config, tokens.shape[1]) // 4      # every site, the device's float32
    for lv in tracing_levels(dev):
        if ONLY and not any(p in lv["what"] for p in ONLY.split("|")):
            continue
        if lv.get("cuda_only") and not CUDA:
            log(f"  skipped (no GPU, nothing to page): {lv['what']}")
            continue
        if lv["once"] and pageable_gb_s and dev_bytes / GB / pageable_gb_s > 60:   # keep the run near 5 minutes
            reason = f"predicted {dev_bytes / GB / pageable_gb_s:.0f} s at the pageable ceiling: not run"
            rows.append({"part": "tracing", "what": lv["what"], "skipped": reason})
            log(f"  skipped ({reason}): {lv['what']}")
            continue
        tap, keep = lv["tap"], lv["keep"]
        runner = Runner(model, lv["backend"], observer=tap)

        def run():
            tap.bytes = 0
            if hasattr(tap.inner, "host_s"):
                tap.inner.host_s = 0.0     # the last (timed) run's, not the first run's compiles
            if keep is not None:
                keep.kept.clear()          # one prefill's worth kept at a time
            return prefill(runner, tokens, ubatch, lv["after"])
        try:
            free_memory(host_cache=False)
            reset_peak()
            t = median_time(run, 1 if lv["once"] else reps, 0 if lv["once"] else warm)
            peak = peak_gpu()
            # the ratio is to an untraced run timed right after this level: one machine's speed drifts by tens of
            # percent over a run (0.61 s untraced at the start of a run whose hook-only levels took 0.51 s)
            beside = median_time(lambda: prefill(plain, tokens, ubatch), reps, 0)
            r = row(lv["what"], t, beside, tap.bytes, lv["to_host"], peak)
            host = getattr(tap.inner, "host_s", None)
            notes = [f"untraced beside it {beside:.3f} s",
                     f"host time measuring the layers {host:.3f} s in the last run" if host else "",
                     check_capture(runner, tokens, ubatch, tap.inner) if lv["check"] else "",
                     pinned_note() if lv["to_host"] else ""]
            r["note"] = "; ".join(n for n in notes if n)
            if PROFILE and any(p in lv["what"] for p in PROFILE.split("|")):
                profile(run)
        except Exception as exc:           # noqa: BLE001 - record it and go on to the next level
            rows.append(error_row("tracing", lv["what"], exc))
        if keep is not None:
            keep.kept.clear()
        runner = None
        free_memory(host_cache=False)
    return rows


def check_capture(runner, tokens, ubatch, cap) -> str:
    """The host copies are the device values: the last ubatch's logits as captured vs as returned."""
    runner.reset(tokens.shape[0])
    for i in range(0, tokens.shape[1], ubatch):
        logits = runner.forward(tokens[:, i:i + ubatch])
        values = cap.take()
    same = torch.equal(values[(None, "logits")][0], logits.cpu())
    return "host copies equal the device values" if same else "HOST COPIES DIFFER FROM THE DEVICE VALUES"


def pinned_note() -> str:
    stats = getattr(torch.cuda, "host_memory_stats", None)      # not in every torch version
    if not CUDA or stats is None:
        return ""
    s = stats()
    if "allocated_bytes.peak" not in s:
        return ""
    return f"pinned pool peak {s['allocated_bytes.peak'] / GB:.1f} GB, {s.get('num_host_alloc', '?')} host allocations"


def copy_ceilings() -> list[dict]:
    """Device-to-host bandwidth of one plain 1 GiB copy, pinned and pageable: what the levels can reach at best."""
    if not CUDA:
        log("  skipped (no GPU): device-to-host copy ceilings")
        return []
    src = torch.empty(2**28, dtype=torch.float32, device="cuda")
    rows = []
    for kind, dst in (("pinned", torch.empty(src.shape, pin_memory=True)), ("pageable", torch.empty(src.shape))):
        t = median_time(lambda: dst.copy_(src, non_blocking=kind == "pinned"), 3, 1)
        rows.append({"part": "tracing", "what": f"ceiling: one 1 GiB device-to-host copy, {kind}", "seconds": t,
                     "ratio": None, "bytes": src.numel() * 4, "peak_gpu_bytes": None,
                     "host_gb_s": src.numel() * 4 / t / GB, "note": ""})
        log(f"  {t:8.3f} s  {rows[-1]['host_gb_s']:.1f} GB/s  {rows[-1]['what']}")
    return rows


# -- parts 3 and 4: end to end -----------------------------------------------------------------------------------
def e2e_memory(cfg: MambaConfig, ubatch: int, n_tok: int, ref_device: str) -> dict:
    """Bytes the comparison holds: weights per side, and one ubatch of every site for the three runners."""
    p = param_count(cfg)
    per_ubatch = ubatch_capture_bytes(cfg, ubatch)                         # dev f32, ref32 f32, ref64 f64
    logits = 2 * n_tok * cfg.vocab_size * 4                                # kept for perplexity: ref and dev
    on_gpu = ref_device == "cuda"
    gpu = comparison_gpu_bytes(cfg, ubatch, 1, n_tok) if on_gpu else p * 4
    host = master_bytes(cfg) + (0 if on_gpu else p * 4 + per_ubatch + logits)
    return {"gpu_bytes": gpu, "host_bytes": host, "capture_per_ubatch_bytes": per_ubatch}


def pick_ubatch(cfg, n_tok, small) -> int:
    """The largest llama.cpp-like ubatch whose estimate stays within the issue's 48 GB of GPU memory."""
    if small or not CUDA:
        return 64
    return next((u for u in (512, 256, 128, 64, 32) if e2e_memory(cfg, u, n_tok, "cuda")["gpu_bytes"] < 48e9), 16)


def progress_printer(label):
    t0 = time.perf_counter()
    stamps = []

    def update(done, total):
        stamps.append(time.perf_counter() - t0)
        log(f"  {label}: ubatch {done}/{total} at {stamps[-1]:.1f} s")
    update.stamps = stamps
    return update


class Breakdown:
    """Where an end-to-end comparison's time goes: each side's `step` and the Accumulator's `add` (the metrics),
    timed with a device sync on both ends (benchmark-only wrappers; the sync costs a few ms per ubatch)."""

    def __init__(self):
        self.seconds = {}

    def _wrap(self, cls, attr, key):
        fn = getattr(cls, attr)

        def timed(obj, *a, **kw):
            sync()
            t = time.perf_counter()
            try:
                return fn(obj, *a, **kw)
            finally:
                sync()
                k = key(obj)
                self.seconds[k] = self.seconds.get(k, 0.0) + time.perf_counter() - t
        setattr(cls, attr, timed)
        self._undo.append((cls, attr, fn))

    def __enter__(self):
        from mamba_debug.accumulate import Accumulator
        from mamba_debug.sides.torch_side import TorchSide
        self._undo = []
        self._wrap(TorchSide, "step", lambda side: f"side {side.info.name}")
        self._wrap(Accumulator, "add", lambda acc: "metrics (Accumulator.add)")
        return self

    def __exit__(self, *exc):
        for cls, attr, fn in self._undo:
            setattr(cls, attr, fn)


def part_e2e(model, prompt, n_gen, ubatch, ref_device, device, breakdown=False) -> dict:
    cfg = model.config
    est = e2e_memory(cfg, ubatch, len(prompt) + n_gen, ref_device)
    steps = 2 * cfg.n_layer * (len(prompt) + n_gen)
    log(f"end to end: {len(prompt)} + {n_gen} tokens, ubatch {ubatch}, reference sides on {ref_device}; estimate: "
        f"GPU {est['gpu_bytes'] / GB:.1f} GB, host {est['host_bytes'] / GB:.1f} GB (one ubatch of every site for "
        f"the three runners: {est['capture_per_ubatch_bytes'] / GB:.1f} GB); the reference scans are plain torch "
        f"loops: {steps} steps of ~10 small ops, ~{steps * 10 * 8e-6:.0f} s at ~8 us per op launch")
    s = CompareSettings(kernels="triton", device=device, ubatch=ubatch, n_gen=n_gen, capture="metrics",
                        ref_device=ref_device)
    reset_peak()
    with RssPeak() as rss, (Breakdown() if breakdown else contextlib.nullcontext()) as parts:
        t = time.perf_counter()
        res = run_compare(model, prompt, s, progress=progress_printer("compare"))
        sync()
        wall = time.perf_counter() - t
    split = {k: round(v, 3) for k, v in parts.seconds.items()} if breakdown else None
    if split:
        log("  where the time went (synced): " + ", ".join(f"{k} {v:.2f} s" for k, v in split.items()))
    kld, fd = res.logits["kld"], res.first_divergence
    verdict = ("first divergence None" if fd is None else
               f"DIVERGED at token {fd['token']} layer {fd['layer']} site {fd['site']}")
    return {"part": "e2e", "what": f"run_compare {cfg.n_layer} layers, {len(prompt)}+{n_gen} tokens, ubatch {ubatch}, "
                                   f"capture metrics, reference on {ref_device}, device {device}",
            "seconds": wall, "ratio": None, "bytes": None, "peak_gpu_bytes": peak_gpu(),
            "peak_host_rss_bytes": rss.peak, "host_gb_s": None, "first_divergence": fd,
            "kld_max": float(kld.max()), "kld_mean": float(kld.mean()),
            "top1_agreement": float(res.logits["top1"].mean()), "estimate": est, "device_label": res.device_label,
            "breakdown_s": split, "ubatch": ubatch,
            "note": f"{verdict}; KLD max {float(kld.max()):.3g}, top-1 {float(res.logits['top1'].mean()):.3f}"}


def part_cpu_reference(model, prompt, ubatch, device, n_full) -> dict:
    """The reference sides on the CPU over a short prompt; the time per token after the first ubatch (which also
    casts the weights) extrapolated to the full prompt."""
    s = CompareSettings(kernels="triton", device=device, ubatch=ubatch, n_gen=0, capture="metrics", ref_device="cpu")
    prog = progress_printer("cpu reference")
    with RssPeak() as rss:
        t = time.perf_counter()
        res = run_compare(model, prompt, s, progress=prog)
        wall = time.perf_counter() - t
    per_token = (prog.stamps[-1] - prog.stamps[0]) / (len(prompt) - ubatch)
    return {"part": "e2e", "what": f"reference sides on the CPU: {len(prompt)} tokens measured (ubatch {ubatch}), "
                                   f"extrapolated to {n_full}", "seconds": per_token * n_full, "ratio": None,
            "bytes": None, "peak_gpu_bytes": peak_gpu(), "peak_host_rss_bytes": rss.peak, "host_gb_s": None,
            "first_divergence": res.first_divergence,
            "note": f"estimate: {per_token * 1e3:.0f} ms/token after the first ubatch; measured run {wall:.1f} s"}


# -- report --------------------------------------------------------------------------------------------------
def error_row(part, what, exc) -> dict:
    log(f"  ERROR in {part} / {what}: {type(exc).__name__}: {exc}")
    return {"part": part, "what": what, "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-20000:]}


def _gb(v):
    return "" if v is None else f"{v / GB:.2f} GB"


def markdown(rows) -> str:
    lines = ["| part | what | s | x untraced | captured | peak GPU | peak host RSS | host GB/s | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r or "skipped" in r:
            why = f"ERROR {r['error'][:200]}" if "error" in r else f"skipped: {r['skipped']}"
            lines.append(f"| {r['part']} | {r['what']} | | | | | | | {why} |")
            continue
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}"
        bw = "" if r.get("host_gb_s") is None else f"{r['host_gb_s']:.1f}"
        lines.append(f"| {r['part']} | {r['what']} | {r['seconds']:.3f} | {ratio} | {_gb(r.get('bytes'))} | "
                     f"{_gb(r.get('peak_gpu_bytes'))} | {_gb(r.get('peak_host_rss_bytes'))} | {bw} | "
                     f"{r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def carried_rows(path: Path, parts: set, small: bool) -> list:
    """The recorded rows of the parts this run skipped (each keeps its own date): the file stays whole when one
    part is re-measured."""
    if small or not path.is_file():
        return []
    skipped = {"tracing", "e2e", "cpu_ref"} - parts
    kind = lambda r: "cpu_ref" if "CPU" in r.get("what", "") and r["part"] == "e2e" else r["part"]  # noqa: E731
    return [r for r in json.loads(path.read_text())["rows"] if kind(r) in skipped]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="4 layers, d_model 256, 256 tokens: a check on a CPU")
    ap.add_argument("--tokens", type=int, default=None, help="prompt tokens (default 2048; 256 with --small)")
    ap.add_argument("--n-gen", type=int, default=None, help="generated tokens in the comparison (default 4; 2)")
    ap.add_argument("--trace-ubatch", type=int, default=None, help="ubatch of the tracing runs (default 512; 64)")
    ap.add_argument("--e2e-ubatch", default=None,
                    help="ubatch(es) of the comparison, comma-separated (default: the largest within 48 GB)")
    ap.add_argument("--breakdown", action="store_true",
                    help="after the timed comparisons, one more at the first ubatch with each side synced and timed")
    ap.add_argument("--profile", default=None, help="print a cProfile (and on a GPU a kernel profile) of the tracing "
                                                    "level whose description contains this text (e.g. 'at birth'; several: 'a|b')")
    ap.add_argument("--only", default=None, help="run only the tracing levels whose description contains this "
                                                 "text ('a|b': either); nothing is recorded then (a partial run)")
    ap.add_argument("--parts", default="tracing,e2e,cpu_ref", help="comma-separated subset of tracing,e2e,cpu_ref")
    ap.add_argument("--time-budget-s", type=float, default=240, help="skip the CPU-reference estimate past this")
    args = ap.parse_args(argv)
    global PROFILE, ONLY
    PROFILE, ONLY = args.profile, args.only
    if not CUDA and not args.small:
        sys.exit("gpu_e2e.py: torch sees no GPU; the 2.8B run needs one (use --small to check the script on a CPU)")
    cfg = MambaConfig(**(SMALL if args.small else BIG))
    n_tok = args.tokens or (256 if args.small else 2048)
    n_gen = args.n_gen if args.n_gen is not None else (2 if args.small else 4)
    trace_ub = args.trace_ubatch or (64 if args.small else 512)
    device = "cuda" if CUDA else "interpret"
    parts = set(args.parts.split(","))
    out_dir = SMALL_OUT if args.small or args.only else OUT     # a partial run never replaces the record
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    log(f"{'small' if args.small else '2.8B-shaped'} Mamba-1: {param_count(cfg) / 1e9:.2f}B weights "
        f"(lm_head counted), device {device}, torch {torch.__version__}, TF32 matmul "
        f"{torch.backends.cuda.matmul.allow_tf32}")
    if not CUDA:
        log("no GPU: CUDA events, peak GPU memory, pinned copies and copy ceilings are skipped; the Triton kernels "
            "run under the interpreter")

    t = time.perf_counter()
    with RssPeak() as rss:
        model = MambaModel(cfg, mamba_ssm_params(cfg, 0, "cuda" if CUDA else "cpu"), source="random mamba_ssm init")
    rows.append({"part": "build", "what": f"random weights, {param_count(cfg) / 1e9:.2f}B float64 masters on the host",
                 "seconds": time.perf_counter() - t, "peak_host_rss_bytes": rss.peak})
    log(f"built in {rows[-1]['seconds']:.1f} s")
    dev = device_backend("triton", device)
    reset_peak()
    t = time.perf_counter()
    model.weights(dev)
    sync()
    rows.append({"part": "build", "what": "weight upload: float32 cast on the device",
                 "seconds": time.perf_counter() - t, "peak_gpu_bytes": peak_gpu()})
    log(f"uploaded in {rows[-1]['seconds']:.1f} s")
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (n_tok,), generator=gen)

    if "tracing" in parts:
        log(f"tracing: {n_tok}-token prefill, batch 1, device side only, ubatch {trace_ub}")
        try:
            with cpu_threads_for(cfg):     # one thread for the small model on a CPU, as the engine does
                rows += part_tracing(model, dev, prompt[None], trace_ub, args.small)
        except Exception as exc:       # noqa: BLE001
            rows.append(error_row("tracing", "tracing overhead", exc))
        free_memory()
    e2e_ubs = [int(u) for u in args.e2e_ubatch.split(",")] if args.e2e_ubatch else \
        [pick_ubatch(cfg, n_tok + n_gen, args.small)]
    e2e_ub = e2e_ubs[0]
    ref_device = "cuda" if CUDA else "cpu"
    if "e2e" in parts:
        for ub, brk in [(u, False) for u in e2e_ubs] + ([(e2e_ubs[0], True)] if args.breakdown else []):
            try:
                r = part_e2e(model, prompt.tolist(), n_gen, ub, ref_device, device, breakdown=brk)
                if brk:
                    r["part"], r["what"] = "e2e breakdown", r["what"] + ", each side synced and timed"
                rows.append(r)
            except Exception as exc:       # noqa: BLE001
                rows.append(error_row("e2e", f"end-to-end comparison, ubatch {ub}", exc))
            free_memory()
    if "cpu_ref" in parts:
        if ref_device == "cpu":
            log("cpu reference estimate: skipped, the comparison above already ran its reference sides on the CPU")
        elif time.perf_counter() - T0 > args.time_budget_s:
            log(f"cpu reference estimate: skipped, past the {args.time_budget_s:.0f} s budget")
        else:
            try:
                rows.append(part_cpu_reference(model, prompt[:64].tolist(), 32, device, n_tok + n_gen))
            except Exception as exc:   # noqa: BLE001
                rows.append(error_row("e2e", "reference sides on the CPU", exc))

    for r in rows:
        r.setdefault("date", TODAY)
    rows = carried_rows(out_dir / "gpu_e2e.json", parts, args.small or args.only) + rows
    out = {"date": TODAY, "machine": f"{platform.node()}, {os.cpu_count()} cores", "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if CUDA else None, "model": repr(model), "config": cfg.to_dict(),
           "prompt_tokens": n_tok, "n_gen": n_gen, "trace_ubatch": trace_ub, "e2e_ubatch": e2e_ub,
           "wall_s": time.perf_counter() - T0, "rows": rows, "errors": [r for r in rows if "error" in r]}
    (out_dir / "gpu_e2e.json").write_text(json.dumps(out, indent=1, default=str))
    md = markdown(rows)
    (out_dir / "gpu_e2e.md").write_text(f"# gpu_e2e.py, {TODAY}: {repr(model)}, {out['gpu'] or 'no GPU'}\n\n" + md)
    print("\n" + md, flush=True)
    log(f"wrote {out_dir / 'gpu_e2e.json'} and {out_dir / 'gpu_e2e.md'}; {len(out['errors'])} error(s)")
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
