"""Part 2 of gpu_e2e.py: what each capture level costs a 2048-token prefill of the device side (the tracing
levels, their profiles, the host copy ceilings). Run through gpu_e2e.py (--parts tracing, --only, --profile)."""
from __future__ import annotations

import cProfile
import dataclasses
import os
import pstats
import statistics
import time
from pathlib import Path

import torch

from gpu_common import (CUDA, GB, error_row, free_memory, log, median_time, paired_times, peak_gpu,  # noqa: E402
                        prefill, reset_peak, sync)
from mamba_debug.compare import ubatch_capture_bytes  # noqa: E402
from mamba_debug.metrics import METRICS, site_errors_many  # noqa: E402
from mamba_debug.model import Runner  # noqa: E402
from mamba_debug.ops import OpTable  # noqa: E402
from mamba_debug.sides import Capture as _Capture  # noqa: E402

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
    Capture: each site measured where it is born, whole layers' sites together once `held_cap` bytes wait
    (`site_errors_many`: on a GPU a launch of the fused kernel per 16 like sites, each read in place, and one combine
    launch), nothing copied, the metrics kept on the device. No reference side here, so each site is measured
    against itself. It is the runner's observer itself, as the engine's Capture is: no `Tap` in between, whose
    Python call and byte count per site the engine does not make (3840 sites a prefill, on a run bound by its host)."""

    def __init__(self):
        super().__init__(to_host=False)
        self.kept = []             # each ubatch's Measured sites (the keep protocol)
        self.host_s = 0.0          # host time in the layer measurements (grouping, tables, launches, result views)
        self.bytes, self.inner = 0, self      # what the levels' loop reads of a Tap
        self.current = None
        self.against = _Itself(self)

    def site(self, layer, site, value, per_token):
        self.current = (value, per_token)
        super().site(layer, site, value, per_token)

    def _measure_born(self):
        self.bytes += sum(pair[0].nbytes for _, _, pair, _ in self.born)   # the device values measured
        t0 = time.perf_counter()
        super()._measure_born()
        self.host_s += time.perf_counter() - t0

    def take(self):
        self.kept.append(super().take())
        self.against = _Itself(self)       # Capture.take drops its ubatch's reference values


class _Itself:
    """An AtBirth capture's reference values: each site's own (no reference side here)."""

    def __init__(self, capture):
        self.capture = capture

    def get(self, key):
        return self.capture.current


class AtBirthOther(AtBirth):
    """AtBirth on the engine's other stream choice (`Capture.beside`, MAMBA_DEBUG_SIDE_STREAM): a side stream beside
    the next layer's kernels where the engine measures on the run's own stream, and the other way round."""
    beside = not _Capture.beside


class AtBirthBesideFirst(AtBirth):
    """AtBirth on a side stream ahead of the run's in the block scheduler (CUDA priority -1)."""
    beside, side_priority = True, -1


class AtBirthHeld(AtBirth):
    """AtBirth with more device sites waiting before a measurement (`Capture.held_cap`): fewer measurements, each
    with more pairs for the same fixed host work (a plan's signature, its result blocks, a combine launch)."""

    def __init__(self, cap: int):
        super().__init__()
        self.held_cap = cap


def waiting(capture) -> str:
    """Which sites a measurement takes (an engine before 2026-12-05 measured each layer as the next one started)."""
    cap = getattr(capture, "held_cap", None)
    return f"whole layers' sites (up to {cap / 2**30:g} GiB waiting)" if cap else "a layer's sites"


def tracing_levels(dev) -> list[dict]:
    """The capture levels, cheapest first. what; backend; tap (the hook); after (run after each ubatch, as the
    engine takes its capture there); to_host (bytes cross to the host); keep (kept for the whole prefill);
    once (one run, no warm-up: too slow to repeat at 2.8B); check (compare host copies with the device values)."""
    no_states_out = dataclasses.replace(dev, ops=OpTable(dev.ops.name, dev.ops.ops, supports_states_out=False))
    gpu, keep, states, pinned, pageable = (_Capture(to_host=False), KeepOnDevice(), _Capture(), _Capture(),
                                          PageableCapture())
    born, other, first = AtBirth(), AtBirthOther(), AtBirthBesideFirst()
    where = {True: "on a side stream beside the next layer's kernels", False: "on the run's own stream"}
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
        {**level, "what": "capture='metrics' device half, measured at birth: "
                          f"{waiting(born)} by "
                          f"{'the fused kernel, read in place' if CUDA else 'the torch version'}"
                          f"{', ' + where[born.beside] if CUDA else ''} (against themselves: no reference "
                          "here), nothing copied, metrics kept on the device",
         "tap": born, "after": born.take, "keep": born},
        {**level, "what": f"capture='metrics' device half, at birth {where[other.beside]} (the engine's other path, "
                          "MAMBA_DEBUG_SIDE_STREAM)", "cuda_only": True,
         "tap": other, "after": other.take, "keep": other},
        {**level, "what": "capture='metrics' device half, at birth on a side stream ahead of the run's (CUDA "
                          "priority -1)", "cuda_only": True,
         "tap": first, "after": first.take, "keep": first},
        *({**level, "what": f"capture='metrics' device half, at birth with {waiting(held)} (the engine waits "
                            f"{_Capture.held_cap / 2**30:g} GiB)", "cuda_only": True,
           "tap": held, "after": held.take, "keep": held} for held in (AtBirthHeld(2 << 30), AtBirthHeld(4 << 30))),
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
PAIRS = 9             # alternating traced / untraced runs per level on a GPU
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

    def row(what, seconds, base, captured=0, to_host=False, peak=None, ratios=None):
        ratio = statistics.median(ratios) if ratios else seconds / base
        r = {"part": "tracing", "what": what, "seconds": seconds, "ratio": ratio, "bytes": captured,
             "peak_gpu_bytes": peak, "host_gb_s": captured / seconds / GB if to_host and CUDA else None, "note": ""}
        log(f"  {seconds:8.3f} s  x{r['ratio']:6.2f}  {captured / GB:7.2f} GB  {what}")
        rows.append(r)
        return r

    plain = Runner(model, dev)
    reset_peak()
    base = median_time(lambda: prefill(plain, tokens, ubatch), reps + 2, warm)
    base_queued = host_queue(lambda: prefill(plain, tokens, ubatch)) if CUDA else None
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
            log(f"  skipped (needs a GPU): {lv['what']}")
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
            # the ratio is to untraced runs alternating with this level's: one machine's speed drifts by tens of
            # percent over a run (0.61 s untraced at the start of a run whose hook-only levels took 0.51 s)
            untraced = lambda: prefill(plain, tokens, ubatch)  # noqa: E731
            if lv["once"]:
                t, beside, ratios = median_time(run, 1, 0), median_time(untraced, reps, 0), None
            else:
                t, beside, ratios = paired_times(run, untraced, PAIRS if CUDA else reps, warm)
            peak = peak_gpu()
            queued = host_queue(run) if CUDA and not lv["once"] else None
            r = row(lv["what"], t, beside, tap.bytes, lv["to_host"], peak, ratios)
            host = getattr(tap.inner, "host_s", None)
            pairs = (f" (median of {len(ratios)} alternating pairs, each {ratios[0]:.3f}-{ratios[-1]:.3f})"
                     if ratios else "")
            notes = [f"untraced beside it {beside:.3f} s{pairs}",
                     f"host time measuring the layers {host:.3f} s in the last run" if host else "",
                     f"the host queued a run in {queued[0]:.3f} s of its {queued[1]:.3f} s (untraced "
                     f"{base_queued[0]:.3f} of {base_queued[1]:.3f})" if queued else "",
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


def host_queue(run, reps: int = 3) -> tuple[float, float]:
    """Medians of the host's seconds to queue one run (until it returns, before the wait) and of the run's seconds
    to the GPU's end: a host time near the whole means the GPU waited for the host (a run bound by the host, which
    no faster kernel shortens), well under it means the host ran ahead."""
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        run()
        t1 = time.perf_counter()
        sync()
        times.append((t1 - t0, time.perf_counter() - t0))
    return statistics.median(q for q, _ in times), statistics.median(w for _, w in times)


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
