"""One H200 call: correctness of the Triton kernels and of the engine with the kernels compiled for CUDA, then
kernel timings with their byte floors. Writes h200.json (+ .md) into $OUT (default benchmarks/results/; a partial
run, H200_QUICK, H200_TIMINGS_ONLY or H200_TUNE, defaults to out/benchmarks-h200/).

Run on the GPU machine (TRITON_INTERPRET must be unset or 0 when triton is first imported):
    TRITON_INTERPRET=0 python benchmarks/h200.py
Prefill rows: CUDA graphs of (L2 flush, kernel) minus graphs of the flush alone (`bench_cold`); decode rows:
CUDA graphs (do_bench_cudagraph). Floor = bytes that must move / the device-to-device copy bandwidth measured in this run,
or for the scan the exp-unit floor where that is larger (one exp per state element and token, 16 exp2 per SM and
clock).
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

import mamba_debug as md  # noqa: E402
from mamba_debug import ops  # noqa: E402

# H200_QUICK=1: the correctness checks in full, the timings only at the shapes with reference figures (a short lease)
QUICK = os.environ.get("H200_QUICK") == "1"
# a partial run (quick, timings only, or the launch-plan search H200_TUNE=1) never overwrites the recorded full run
# in benchmarks/results unless $OUT says where to write
PARTIAL = QUICK or any(os.environ.get(k) == "1" for k in ("H200_TUNE", "H200_TIMINGS_ONLY"))
OUT = Path(os.environ.get("OUT", ROOT / ("out/benchmarks-h200" if PARTIAL else "benchmarks/results")))
OUT.mkdir(parents=True, exist_ok=True)
TODAY = datetime.date.today().isoformat()
# measured on an H200 on 2026-11-30 (research/perf-anchors.md §8): (op, d_inner, L, batch) -> µs
REFERENCE_US = {("ssm_scan", 1536, 2048, 1): ("mamba_ssm selective_scan", 127.3),
                ("ssm_scan", 5120, 512, 1): ("mamba_ssm selective_scan", 112.5),
                ("ssm_scan", 5120, 2048, 1): ("mamba_ssm selective_scan", 387.1),
                ("ssm_scan", 5120, 2048, 8): ("mamba_ssm selective_scan", 2859.1),
                ("ssm_scan", 5120, 8192, 1): ("mamba_ssm selective_scan", 1614.3),
                ("ssm_conv", 5120, 2048, 1): ("causal-conv1d fwd", 27.1),
                ("ssm_conv", 5120, 2048, 8): ("causal-conv1d fwd", 167.9),
                ("ssm_conv", 1536, 2048, 1): ("causal-conv1d fwd", 11.9),
                ("ssm_scan", 5120, 1, 1): ("selective_state_update", 1.7),
                ("ssm_scan", 5120, 1, 64): ("selective_state_update", 12.1),
                ("ssm_conv", 5120, 1, 1): ("causal_conv1d_update", 1.9),
                ("ssm_conv", 5120, 1, 64): ("causal_conv1d_update", 8.5)}


def log(*a):
    print(*a, flush=True)


def _pytest(path: str) -> dict:
    """A test file with the Triton kernels compiled for cuda (one device per process: Triton fixes its mode)."""
    env = dict(os.environ, MAMBA_DEBUG_TEST_DEVICE="cuda", TRITON_INTERPRET="0")
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", path], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-500:]
    if r.returncode:
        log(r.stdout[-3000:], r.stderr[-2000:])
    log(f"{path} on cuda:", tail)
    return {"what": f"{path} on cuda", "rc": r.returncode, "summary": tail, "seconds": round(time.perf_counter() - t, 1)}


def engine_on_cuda() -> list[dict]:
    """No divergence anywhere on the offload x ubatch x S grid for the correct kernels; gallery expectations."""
    from mamba_debug.compare import CompareSettings
    from mamba_debug.sweep import run_sweep
    rows = []
    model = md.load_model()
    text = "It was a bright cold day in April, and the clocks were striking thirteen. The old man said"
    ids = model.encode(text)[:40]
    for S, ubatches in (((1, (1, 7, 512)), (3, (7,))) if QUICK else ((1, (1, 7, 32, 512)), (3, (7, 512)))):
        t = time.perf_counter()
        sw = run_sweep(model, ids, CompareSettings(kernels="triton", device="cuda", n_gen=8), ubatches=ubatches,
                       n_seqs_list=(S,), progress=False)
        bad = [c for c in sw["cells"] if c["first_divergence"]]
        rows.append({"what": f"tiny model, triton on cuda, offload 0..{model.config.n_layer + 1} x ubatch {ubatches}, "
                             f"S={S}, {len(ids)}+8 tokens", "runs": len(sw["cells"]), "diverged": len(bad),
                     "max_kld": max(c["kld_max"] for c in sw["cells"]), "seconds": round(time.perf_counter() - t, 1)})
        log(rows[-1])
    rows.append(_pytest("tests/test_gallery.py"))
    return rows


# -- timings -------------------------------------------------------------------------------------------------
def copy_bandwidth() -> float:
    x = torch.empty(2 ** 28, device="cuda")          # 1 GiB
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x), rep=200)
    return 2 * x.numel() * 4 / (ms * 1e-3)            # bytes read + written per second


def exp_rate() -> float:
    """exp2 per second at the MUFU's peak: 16 per SM and clock on compute capability 9.0 (CUDA guide,
    arithmetic instruction throughput), at the SM clock nvidia-smi gives as maximum (1.98 GHz on an H200)."""
    try:
        mhz = float(subprocess.run(["nvidia-smi", "--query-gpu=clocks.max.sm", "--format=csv,noheader,nounits"],
                                   capture_output=True, text=True, check=True).stdout.split()[0])
    except Exception:  # noqa: BLE001 - no nvidia-smi: the H200's figure
        mhz = 1980.0
    return 16 * torch.cuda.get_device_properties(0).multi_processor_count * mhz * 1e6


def scan_inputs(S, L, D, N=16, R=None):
    g = torch.Generator(device="cuda").manual_seed(0)
    R = R or -(-D // 32)
    xz = torch.randn(S, L, 2 * D, device="cuda", generator=g)
    dbc = torch.randn(S, L, R + 2 * N, device="cuda", generator=g)
    x = xz[..., :D]
    dt = torch.randn(S, L, D, device="cuda", generator=g) - 3
    B, C = dbc[..., R:R + N], dbc[..., R + N:]
    A = -torch.exp(torch.randn(D, N, device="cuda", generator=g) * 0.5)
    h0 = torch.randn(S, D, N, device="cuda", generator=g) * 0.1
    return h0, x, dt, A, B, C


def bench_cold(fn, n: int = 20) -> float:
    """GPU time of fn in µs with a cold L2 and no host launch overhead: a CUDA graph of n x (256 MB memset, fn)
    minus one of n x memset, median of 5 replays each. (do_bench's per-call timing includes the Python launch
    cost of any kernel shorter than the L2 flush, which made short prefill rows vary 2-4x from run to run.)"""
    flush = torch.empty(64 * 2 ** 20, dtype=torch.int32, device="cuda")

    def graph(with_fn: bool):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):          # warm up (and compile) outside the capture
            for _ in range(2):
                flush.zero_()
                if with_fn:
                    fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(n):
                flush.zero_()
                if with_fn:
                    fn()
        return g

    def replay_ms(g) -> float:
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[2]

    return (replay_ms(graph(True)) - replay_ms(graph(False))) / n * 1e3


def time_rows(bw) -> list[dict]:
    # The kernels' own launchers, not the engine's validating wrapper around them (its shape/dtype/device checks
    # are ~10 us of Python per call, which decides the figure of any kernel shorter than a few tens of us)
    from mamba_debug.plugins import load_plugin
    trit = load_plugin("triton", device="cuda").module.OPS
    rows = []

    def add(op, mode, D, L, S, us, nbytes, impl):
        # the scan's floor is the larger of its bytes and its exps (one exp per state element and token)
        exp_floor = S * L * D * 16 / exp_rate() * 1e6 if op == "ssm_scan" else 0.0
        floor = max(nbytes / bw * 1e6, exp_floor)
        ref = REFERENCE_US.get((op, D, L, S)) if impl == "triton" else None
        rows.append({"op": op, "mode": mode, "impl": impl, "d_inner": D, "L": L, "batch": S, "time_us": round(us, 2),
                     "floor_us": round(floor, 2), "x_floor": round(us / floor, 2), "date": TODAY,
                     "bytes_floor_us": round(nbytes / bw * 1e6, 2), "exp_floor_us": round(exp_floor, 2),
                     "reference_kernel": ref[0] if ref else None, "reference_us": ref[1] if ref else None})
        log(rows[-1])

    for D in (1536, 3072, 5120):
        for L in (128, 512, 2048, 8192):
            for S in (1, 8):
                if S * L * D > 8 * 2048 * 5120 or (QUICK and (D, L, S) not in {k[1:] for k in REFERENCE_US}):
                    continue
                h0, x, dt, A, B, C = scan_inputs(S, L, D)
                scan_bytes = 4 * (3 * S * L * D + 2 * S * L * 16 + D * 16 + 2 * S * D * 16)
                us = bench_cold(lambda: trit["ssm_scan"](h0, x, dt, A, B, C))
                add("ssm_scan", "prefill", D, L, S, us, scan_bytes, "triton")
                if L <= 512 and D == 1536 and not QUICK:
                    us = do_bench(lambda: ops.ssm_scan(h0, x, dt, A, B, C), rep=50) * 1e3
                    add("ssm_scan", "prefill", D, L, S, us, scan_bytes, "torch reference (sequential loop)")
                st = torch.randn(S, 3, D, device="cuda")
                w = torch.randn(D, 4, device="cuda")
                conv_bytes = 4 * (2 * S * L * D + 2 * S * 3 * D + 4 * D)
                us = bench_cold(lambda: trit["ssm_conv"](st, x, w))
                add("ssm_conv", "prefill", D, L, S, us, conv_bytes, "triton")
                if L <= 2048 and D == 5120 and not QUICK:
                    us = do_bench(lambda: ops.ssm_conv(st, x, w)) * 1e3
                    add("ssm_conv", "prefill", D, L, S, us, conv_bytes, "torch reference")
    for S in (1, 8, 64):
        D = 5120
        h0, x, dt, A, B, C = scan_inputs(S, 1, D)
        st = torch.randn(S, 3, D, device="cuda")
        w = torch.randn(D, 4, device="cuda")
        for op, fn, nbytes in (("ssm_scan", lambda: trit["ssm_scan"](h0, x, dt, A, B, C), 4 * (2 * S * D * 16 + 3 * S * D + D * 16)),
                               ("ssm_conv", lambda: trit["ssm_conv"](st, x, w), 4 * (2 * S * D + 2 * S * 3 * D + 4 * D))):
            try:
                us = do_bench_cudagraph(fn) * 1e3
                impl = "triton"
            except Exception as exc:   # graph capture can fail on some stacks: say so, time eagerly
                log(f"cuda graph failed for {op}: {exc}")
                us, impl = do_bench(fn) * 1e3, "triton (eager, graph capture failed)"
            add(op, "decode", D, 1, S, us, nbytes, impl)
        # one layer's decode update as the engine runs it: the conv launch then the scan launch, one graph
        pair = 4 * (2 * S * D * 16 + 3 * S * D + D * 16) + 4 * (2 * S * D + 2 * S * 3 * D + 4 * D)
        try:
            us = do_bench_cudagraph(lambda: (trit["ssm_conv"](st, x, w), trit["ssm_scan"](h0, x, dt, A, B, C))) * 1e3
            add("ssm_conv+ssm_scan", "decode", D, 1, S, us, pair, "triton, 2 launches in one CUDA graph")
        except Exception as exc:
            log(f"cuda graph failed for the pair: {exc}")
    return rows


def tune_rows(bw) -> list[dict]:
    """Launch plans of the scan (channel block x time chunks) and conv (channel x token blocks) at the gated
    shapes, each checked against the default plan's output before it is timed."""
    from mamba_debug.plugins import load_plugin
    mod = load_plugin("triton", device="cuda").module
    rows = []
    for D, L, S in ((5120, 2048, 1), (5120, 2048, 8), (1536, 2048, 1)):
        h0, x, dt, A, B, C = scan_inputs(S, L, D)
        y0, s0 = mod.ssm_scan(h0, x, dt, A, B, C)
        scan_bytes = 4 * (3 * S * L * D + 2 * S * L * 16 + D * 16 + 2 * S * D * 16)
        default = mod.scan_plan(S, L, D, 16, device=x.device)
        plans = [dict(default, label="default")]
        # channel block x warps x time chunks, four tokens in flight (research/scan_rows/ has the wider search)
        shapes = {(5120, 1): ((32, 1, 16), (32, 1, 24), (64, 2, 12), (64, 2, 16)),
                  (5120, 8): ((32, 1, 1), (64, 2, 1), (16, 1, 1)),
                  (1536, 1): ((32, 1, 32), (16, 1, 32), (64, 2, 32))}[(D, S)]
        for bd, warps, nc in shapes:
            plans.append(dict(schedule="steps", BLOCK_D=bd, n_chunks=nc, SLOTS=4, num_warps=warps,
                              label=f"BD{bd} w{warps} chunks{nc} slots4"))
        for plan in plans:
            try:
                y, st = mod.ssm_scan(h0, x, dt, A, B, C, plan=plan)
                err = float(((y - y0).double().norm() / y0.double().norm()))
                us = bench_cold(lambda: mod.ssm_scan(h0, x, dt, A, B, C, plan=plan))
            except Exception as exc:
                log("plan failed", plan, repr(exc)[:300])
                continue
            rows.append({"op": "ssm_scan", "mode": "prefill", "impl": f"triton {plan['label']}", "d_inner": D, "L": L,
                         "batch": S, "time_us": round(us, 2), "floor_us": round(scan_bytes / bw * 1e6, 2),
                         "x_floor": round(us / (scan_bytes / bw * 1e6), 2), "rel_err_vs_default": err, "date": TODAY,
                         "reference_kernel": None, "reference_us": None})
            log(rows[-1])
        if os.environ.get("H200_TUNE_CONV") != "1":
            continue
        st0 = torch.randn(S, 3, D, device="cuda")
        w = torch.randn(D, 4, device="cuda")
        out0, _ = mod.ssm_conv(st0, x, w)
        conv_bytes = 4 * (2 * S * L * D + 2 * S * 3 * D + 4 * D)
        for bd in (64, 128, 256):
            for bt in (8, 16, 32, 64):
                for warps in (2, 4, 8):
                    cfg = dict(BLOCK_D=bd, BLOCK_T=bt, num_warps=warps)
                    try:
                        out, _ = mod.ssm_conv(st0, x, w, config=cfg)
                        assert torch.allclose(out, out0, rtol=1e-5, atol=1e-5)
                        us = do_bench(lambda: mod.ssm_conv(st0, x, w, config=cfg)) * 1e3
                    except Exception as exc:
                        log("conv config failed", cfg, repr(exc)[:300])
                        continue
                    rows.append({"op": "ssm_conv", "mode": "prefill", "impl": f"triton BD{bd} BT{bt} w{warps}",
                                 "d_inner": D, "L": L, "batch": S, "time_us": round(us, 2),
                                 "floor_us": round(conv_bytes / bw * 1e6, 2),
                                 "x_floor": round(us / (conv_bytes / bw * 1e6), 2), "date": TODAY,
                                 "reference_kernel": None, "reference_us": None})
                    log(rows[-1])
    return rows


def markdown(meta, correctness, rows) -> str:
    lines = [f"# H200 run, {meta['date']}", "", f"{meta['gpu']}; torch {meta['torch']}, Triton {meta['triton']}; "
             f"copy bandwidth measured {meta['copy_TBps']:.2f} TB/s (read + write).", "", "## Correctness on cuda", ""]
    for c in correctness:
        lines.append(f"- {json.dumps(c)}")
    lines += ["", "## Kernel timings (fp32)", "",
              "| op | mode | impl | d_inner | L | batch | µs | floor µs (bytes / exps) | x floor | "
              "reference kernel µs (perf-anchors §8) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = f"{r['reference_kernel']}: {r['reference_us']}" if r["reference_us"] else ""
        parts = f" ({r['bytes_floor_us']} / {r['exp_floor_us']})" if r.get("exp_floor_us") else ""
        lines.append(f"| {r['op']} | {r['mode']} | {r['impl']} | {r['d_inner']} | {r['L']} | {r['batch']} | "
                     f"{r['time_us']} | {r['floor_us']}{parts} | {r['x_floor']} | {ref} |")
    return "\n".join(lines) + "\n"


def main():
    assert torch.cuda.is_available(), "run this on the GPU machine"
    meta = {"date": TODAY, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    correctness, rows = [], []

    def save():   # after every phase, so a run cut short still brings back what it measured
        (OUT / "h200.json").write_text(json.dumps({"meta": meta, "correctness": correctness, "rows": rows}, indent=1))
        (OUT / "h200.md").write_text(markdown(meta, correctness, rows))

    bw = copy_bandwidth()
    meta["copy_TBps"] = bw / 1e12
    log("copy bandwidth TB/s", meta["copy_TBps"])
    if os.environ.get("H200_TUNE") == "1":     # only the launch-plan search (first call of a tuning session)
        rows.extend(tune_rows(bw))
        save()
        return
    if os.environ.get("H200_TIMINGS_ONLY") != "1":
        for path in ("tests/test_triton_kernels.py", "research/fused_decode/test_fused_decode.py",
                     "tests/test_site_metrics.py"):
            correctness.append(_pytest(path))
            save()
        correctness.extend(engine_on_cuda())
        save()
    rows.extend(time_rows(bw))
    save()
    log(markdown(meta, correctness, rows))


if __name__ == "__main__":
    main()
