"""Site metrics on the GPU: the torch version of `site_errors` against the fused Triton kernel, per site shape.

The sites of a 2.8B-shaped Mamba-1 (d_model 2560, d_inner 5120, d_state 16) at ubatch 512 (S = 1, T = 512), the
device side in float32 against the float32 reference (the default) and the float64 one (--reference float64 and
the floor); the per-token SSM states are 43 of the 72 GB a 2048-token prefill captures. For each: the median
time of both (CUDA events, L2 flushed before each run), bytes read (dev + ref) per second, the host time per
call when calls go back to back (launch-bound small sites), the extra GPU memory, and a check that the fused
metrics equal the torch ones (1e-12 relative, NaN/inf patterns exact, one row with a NaN planted in dev). Then
other cuts of the kernel (block, warps, pieces per row) on the big shapes: the best should be its plan.

Run on the GPU machine:  python3 benchmarks/site_metrics_bench.py            (about a minute)
Check it on a CPU:       python3 benchmarks/site_metrics_bench.py --small    (T = 8, Triton's interpreter)
Prints a table; writes $OUT/site_metrics_bench.json ($OUT defaults to benchmarks/results; with --small, out/benchmarks-small).
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
os.environ["TRITON_INTERPRET"] = "0" if CUDA else "1"   # triton's library: compiled on a GPU (first import)
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mamba_debug.metrics import METRICS, _fused_module, _site_errors_torch, fused_site_errors  # noqa: E402

OUT = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
# --small (a check on a CPU) never overwrites the recorded GPU figures unless $OUT says where to write
SMALL_OUT = Path(os.environ.get("OUT", ROOT / "out" / "benchmarks-small"))
E, D, N = 2560, 5120, 16

# (what, trailing shape, per_token): per_token=False is a value taken once per ubatch, passed as v[:, None]
SITES = [
    ("x, z, conv, y_scan, gate, ... [S,T,D]", (D,), True),
    ("per-token SSM states [S,T,D,N]", (D, N), True),
    ("xz [S,T,2D]", (2 * D,), True),
    ("B, C [S,T,N]", (N,), True),
    ("norm, out, resid [S,T,E]", (E,), True),
    ("SSM state at the ubatch's end [S,1,D,N]", (D, N), False),
]
PAIRS = [(torch.float32, torch.float64), (torch.float32, torch.float32)]


def flush_l2(buf):
    if buf is not None:
        buf.zero_()


def gpu_time(fn, reps: int, flush, sleep: bool = False) -> float:
    """Median seconds of fn over reps runs, each after an L2 flush (CUDA events); wall clock without a GPU.
    sleep: the GPU sleeps ~2 ms before fn's kernels, so the host has enqueued them all (see kernel_time)."""
    if not CUDA:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)
    fn()                                    # warm-up: compile, allocator
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flush_l2(flush)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if sleep:
            torch.cuda._sleep(4_000_000)
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def host_time(fn, calls: int) -> float:
    """Seconds per call for back-to-back calls, one sync at the end: the host's launch cost shows here."""
    fn()
    if CUDA:
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    if CUDA:
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls


def extra_memory(fn) -> int | None:
    """Peak GPU memory allocated by fn beyond what was allocated before it."""
    if not CUDA:
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def compare(got: dict, want: dict) -> tuple[float, bool]:
    """Largest relative difference of the finite metrics (max_abs included) and whether NaN/inf patterns agree."""
    worst, same = 0.0, True
    for m in METRICS:
        g, w = got[m].double(), want[m].double()
        for pattern in (torch.isnan, torch.isposinf, torch.isneginf):
            same &= bool(torch.equal(pattern(g), pattern(w)))
        fin = torch.isfinite(w) & torch.isfinite(g)
        if fin.any():
            gf, wf = g[fin], w[fin]
            err = torch.where(gf == wf, torch.zeros_like(wf), (gf - wf).abs() / wf.abs())
            worst = max(worst, float(err.max()))
    return worst, same


def make(T: int, trailing: tuple, per_token: bool, dev_dtype, ref_dtype, device):
    g = torch.Generator(device).manual_seed(0)
    S = 1
    shape = (S, T) + trailing if per_token else (S,) + trailing
    ref = torch.randn(shape, generator=g, device=device, dtype=torch.float64)
    dev = ref * (1 + 1e-6 * torch.randn(shape, generator=g, device=device, dtype=torch.float64))
    ref, dev = ref.to(ref_dtype), dev.to(dev_dtype)
    if not per_token:
        ref, dev = ref[:, None], dev[:, None]
    return dev, ref


def bench_rows(date: str, T: int = 512, reps: int = 20, calls: int = 200, sweep: bool = True) -> list[dict]:
    """One row per (site shape, dtype pair): torch vs fused; then the cut sweep rows."""
    device = "cuda" if CUDA else "cpu"
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.float32, device=device) if CUDA else None
    sms = torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 0
    mod = _fused_module(interpret=not CUDA)
    rows = []
    for what, trailing, per_token in SITES:
        for dev_dtype, ref_dtype in PAIRS:
            dev, ref = make(T, trailing, per_token, dev_dtype, ref_dtype, device)
            nbytes = dev.numel() * dev.element_size() + ref.numel() * ref.element_size()
            S, TT = ref.shape[0], ref.shape[1]
            plan = mod.plan(S * TT, ref[0, 0].numel(), sms)
            t_torch = gpu_time(lambda: _site_errors_torch(dev, ref), reps, flush)
            t_fused = gpu_time(lambda: fused_site_errors(dev, ref), reps, flush)
            h_torch = host_time(lambda: _site_errors_torch(dev, ref), calls if CUDA else 2)
            h_fused = host_time(lambda: fused_site_errors(dev, ref), calls if CUDA else 2)
            m_torch = extra_memory(lambda: _site_errors_torch(dev, ref))
            m_fused = extra_memory(lambda: fused_site_errors(dev, ref))
            worst, same = compare(fused_site_errors(dev, ref), _site_errors_torch(dev, ref))
            bad_dev = dev.clone()                       # a NaN where ref is finite: inf errors, NaN cosine
            bad_dev.view(-1)[bad_dev.numel() // 3] = math.nan
            worst_nan, same_nan = compare(fused_site_errors(bad_dev, ref), _site_errors_torch(bad_dev, ref))
            again = fused_site_errors(dev, ref)
            first = fused_site_errors(dev, ref)
            deterministic = all(torch.equal(again[m], first[m]) for m in METRICS)
            ok = max(worst, worst_nan) <= 1e-12 and same and same_nan and deterministic
            rows.append({
                "date": date, "part": "site", "what": what, "shape": list(ref.shape),
                "dev": str(dev_dtype).replace("torch.", ""), "ref": str(ref_dtype).replace("torch.", ""),
                "bytes": nbytes, "torch_us": t_torch * 1e6, "fused_us": t_fused * 1e6, "speedup": t_torch / t_fused,
                "torch_gb_s": nbytes / t_torch / 1e9, "fused_gb_s": nbytes / t_fused / 1e9,
                "host_us_per_call_torch": h_torch * 1e6, "host_us_per_call_fused": h_fused * 1e6,
                "extra_gpu_bytes_torch": m_torch, "extra_gpu_bytes_fused": m_fused, "plan": plan,
                "max_rel_diff": max(worst, worst_nan), "patterns_equal": same and same_nan,
                "deterministic": deterministic, "ok": ok})
            print(f"  {what:42s} {rows[-1]['dev']:>7s} vs {rows[-1]['ref']:7s} torch {t_torch * 1e6:9.1f} us  "
                  f"fused {t_fused * 1e6:8.1f} us  {nbytes / t_fused / 1e9:7.1f} GB/s  {'ok' if ok else 'MISMATCH'}",
                  flush=True)
    if CUDA:
        rows += layer_rows(date, T, reps, flush)
    if sweep and CUDA:
        rows += sweep_rows(date, T, reps, flush, sms)
    return rows


def kernel_time(fn, reps: int, flush) -> float:
    """GPU seconds of fn's kernels alone: the host enqueues them while the GPU sleeps (timed alone and subtracted),
    so the host's own work per call (a layer's 17 pairs: signature, launches, views) is not counted."""
    return gpu_time(fn, reps, flush, sleep=True) - gpu_time(lambda: None, reps, flush, sleep=True)


def layer_pairs(T: int, seed: int, near: int | None = None) -> dict:
    """One 2.8B layer's sites at birth, as the engine lays them out (x, z halves of xz; B, C slices of x_proj's
    output), float32, the per-token states and the states at the ubatch's end included. near: the seed whose sites
    these are with a relative error of 1e-3, as a device side's are to its reference (independent random pairs have
    cosines near 0 in some rows, whose relative differences between summation orders exceed 1e-12 by cancellation
    alone: three of seven cuts were "not ok" on an H100 for that reason, 2026-12-05)."""
    g = torch.Generator("cuda").manual_seed(seed)
    base = None if near is None else torch.Generator("cuda").manual_seed(near)

    def r(*shape):
        x = torch.randn(*shape, generator=g if base is None else base, device="cuda")
        return x if base is None else x * (1 + 1e-3 * torch.randn(*shape, generator=g, device="cuda"))
    xz, xp = r(1, T, 2 * D), r(1, T, 160 + 2 * N)
    return dict(xz=xz, x=xz[..., :D], z=xz[..., D:], conv=r(1, T, D), conv_act=r(1, T, D), dt=r(1, T, D),
                B=xp[..., 160:160 + N], C=xp[..., 160 + N:], y_scan=r(1, T, D), gate=r(1, T, D), y=r(1, T, D),
                out=r(1, T, E), norm=r(1, T, E), resid=r(1, T, E), states=r(1, T, D, N),
                ssm_state=r(1, D, N)[:, None], conv_state=r(1, 3, D)[:, None])


def layer_rows(date, T, reps, flush) -> list[dict]:
    """A layer's 17 pairs through `site_errors_sites` (two launches of the sites kernel: 15 like pairs, and B, C;
    one combine), GPU time only: the plan's cut against other steps x warps for the rows the plan gives full steps
    (512 elements); each cut's values checked against the torch version."""
    mod = _fused_module(interpret=False)
    a, b = layer_pairs(T, 2, near=1), layer_pairs(T, 1)
    pairs = [(a[k], b[k]) for k in a]
    nbytes = sum(x.numel() * x.element_size() * 2 for x, _ in pairs)
    plan, rows, full = mod.plan, [], mod.plan(T, 5120, 132)["BLOCK_X"]
    for block_x, warps in (None, None), (1024, 8), (1024, 4), (512, 8):
        if block_x:
            mod.plan = lambda R, X, sms=0, bx=block_x, w=warps: (
                lambda c: dict(c, BLOCK_X=bx, num_warps=w) if c["BLOCK_X"] == full else c)(plan(R, X, sms))
        try:
            mod._PLANS.clear()
            t = kernel_time(lambda: mod.site_errors_sites(pairs), reps, flush)
            checks = [compare(e, _site_errors_torch(*p)) for e, p in zip(mod.site_errors_sites(pairs), pairs)]
        finally:
            mod.plan = plan
        ok = all(worst <= 1e-12 and same for worst, same in checks)
        worst = max(w for w, _ in checks)
        what = "plan" if block_x is None else f"steps of {block_x} over {warps} warps"
        rows.append({"date": date, "part": "layer", "what": f"a 2.8B layer's 17 sites at birth, T={T}: {what}",
                     "bytes": nbytes, "fused_us": t * 1e6, "fused_gb_s": nbytes / t / 1e9, "ok": ok})
        print(f"  layer, {what:28s} {t * 1e6:8.1f} us  {nbytes / t / 1e9:7.1f} GB/s  "
              f"{'ok' if ok else 'MISMATCH'} (worst {worst:.1e})", flush=True)
    mod._PLANS.clear()
    return rows


def sweep_rows(date, T, reps, flush, sms) -> list[dict]:
    """Other cuts of the kernel on the per-token states and the [S, T, D] sites (float32 vs float64)."""
    rows = []
    for what, trailing in (("per-token SSM states [S,T,D,N]", (D, N)), ("x, z, conv, ... [S,T,D]", (D,))):
        dev, ref = make(T, trailing, True, torch.float32, torch.float64, "cuda")
        nbytes = dev.numel() * dev.element_size() + ref.numel() * ref.element_size()
        want = _site_errors_torch(dev, ref)
        X = ref[0, 0].numel()
        for block_x in (512, 1024, 2048):
            for warps in (4, 8):
                for split in (1, 2, 3, 4, 8):
                    if split > 1 and X < 4 * split * block_x:
                        continue
                    cut = dict(BLOCK_X=block_x, ROWS=1, SPLIT=split, num_warps=warps)
                    try:
                        t = gpu_time(lambda: fused_site_errors(dev, ref, config=cut), reps, flush)
                        worst, same = compare(fused_site_errors(dev, ref, config=cut), want)
                        rows.append({"date": date, "part": "cut", "what": what, "shape": list(ref.shape),
                                     "cut": cut, "fused_us": t * 1e6, "fused_gb_s": nbytes / t / 1e9,
                                     "ok": worst <= 1e-12 and same})
                    except Exception as exc:      # noqa: BLE001 - a cut that does not compile is a result too
                        rows.append({"date": date, "part": "cut", "what": what, "cut": cut,
                                     "error": f"{type(exc).__name__}: {exc}"})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| site | shape | dev vs ref | MB read | torch us | fused us | x faster | fused GB/s | host us/call "
             "torch / fused | extra GPU MB torch / fused | max rel diff | ok | plan |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    mb = lambda v: "" if v is None else f"{v / 1e6:.0f}"  # noqa: E731
    for r in rows:
        if r["part"] != "site":
            continue
        lines.append(f"| {r['what']} | {'x'.join(map(str, r['shape']))} | {r['dev']} vs {r['ref']} | "
                     f"{r['bytes'] / 1e6:.1f} | {r['torch_us']:.1f} | {r['fused_us']:.1f} | {r['speedup']:.1f} | "
                     f"{r['fused_gb_s']:.0f} | {r['host_us_per_call_torch']:.0f} / {r['host_us_per_call_fused']:.0f} | "
                     f"{mb(r['extra_gpu_bytes_torch'])} / {mb(r['extra_gpu_bytes_fused'])} | "
                     f"{r['max_rel_diff']:.1e} | {'yes' if r['ok'] else 'NO'} | {r['plan']} |")
    layer = [r for r in rows if r["part"] == "layer"]
    if layer:
        lines += ["", "| one layer's sites in one call (GPU time only) | MB read | us | GB/s |", "|---|---|---|---|"]
        lines += [f"| {r['what']} | {r['bytes'] / 1e6:.0f} | {r['fused_us']:.1f} | {r['fused_gb_s']:.0f} |"
                  for r in layer]
    cuts = [r for r in rows if r["part"] == "cut"]
    if cuts:
        lines += ["", "| cut sweep (float32 vs float64) | BLOCK_X | warps | SPLIT | us | GB/s | ok |",
                  "|---|---|---|---|---|---|---|"]
        for r in sorted(cuts, key=lambda r: (r["what"], r.get("fused_us", math.inf))):
            c = r["cut"]
            if "error" in r:
                lines.append(f"| {r['what']} | {c['BLOCK_X']} | {c['num_warps']} | {c['SPLIT']} | "
                             f"ERROR {r['error'][:120]} | | |")
            else:
                lines.append(f"| {r['what']} | {c['BLOCK_X']} | {c['num_warps']} | {c['SPLIT']} | "
                             f"{r['fused_us']:.1f} | {r['fused_gb_s']:.0f} | {'yes' if r['ok'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="T = 8 under Triton's interpreter: a check on a CPU")
    ap.add_argument("--tokens", type=int, default=None, help="T of the sites (default 512; 8 with --small)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-sweep", action="store_true", help="skip the sweep of other kernel cuts")
    args = ap.parse_args(argv)
    if not CUDA and not args.small:
        sys.exit("site_metrics_bench.py: torch sees no GPU (use --small to check the script on a CPU)")
    date = datetime.date.today().isoformat()
    T = args.tokens or (8 if args.small else 512)
    print(f"site metrics, S=1 T={T}, {torch.cuda.get_device_name() if CUDA else 'CPU (interpreter)'}, "
          f"torch {torch.__version__}", flush=True)
    rows = bench_rows(date, T=T, reps=args.reps if CUDA else 1, sweep=not args.no_sweep)
    md = markdown(rows)
    print("\n" + md, flush=True)
    out_dir = SMALL_OUT if args.small else OUT
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "site_metrics_bench.json").write_text(json.dumps(
        {"date": date, "gpu": torch.cuda.get_device_name() if CUDA else None, "torch": torch.__version__,
         "T": T, "rows": rows}, indent=1, default=str))
    (out_dir / "site_metrics_bench.md").write_text(f"# site_metrics_bench.py, {date}\n\n" + md)
    bad = [r for r in rows if not r.get("ok", False)]
    print(f"wrote {out_dir / 'site_metrics_bench.json'} and .md; {len(bad)} row(s) not ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
