"""Issue #18 goal 4's last part: a kernel called directly from Python against the same kernel replayed in a CUDA graph.

Run on the GPU machine: TRITON_INTERPRET=0 python3 benchmarks/direct_calls.py  (writes $OUT/direct_calls.json)

Per case, all with a warm L2 (the graphed and the direct figure see the same caches):
* graphed: `do_bench_cudagraph`, no host work at all;
* direct: one call, then `torch.cuda.synchronize()`, wall clock, median of 50: what a user's `ssm_scan(...)` in a
  notebook or a test costs, host work (checks, plan, allocations, Triton's launcher) included;
* pipelined: 50 calls back to back and one synchronize, per call: the host work hidden behind the GPU's, as in a
  model's forward pass.
Both the kernels' own launchers (`kernels/triton.py`) and the engine's validating wrapper (`--kernels triton`:
contract checks on every call) are timed, each against the kernels' graphed time (the wrapper's input check waits
for the GPU, which a CUDA graph capture refuses).
"""
from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from mamba_debug.backends import device_backend  # noqa: E402
from mamba_debug.plugins import load_plugin  # noqa: E402

OUT = Path(os.environ.get("OUT", ROOT / "out" / "benchmarks-h200"))
N = 16


def inputs(S, L, D, g):
    x = torch.randn(S, L, D, device="cuda", generator=g)
    dt = torch.nn.functional.softplus(torch.randn(S, L, D, device="cuda", generator=g) - 3)
    B, C = (torch.randn(S, L, N, device="cuda", generator=g) for _ in range(2))
    A = -torch.exp(torch.randn(D, N, device="cuda", generator=g) * 0.5)
    h0 = torch.randn(S, D, N, device="cuda", generator=g) * 0.1
    return dict(h0=h0, x=x, dt=dt, A=A, B=B, C=C, st=torch.randn(S, 3, D, device="cuda", generator=g),
                w=torch.randn(D, 4, device="cuda", generator=g))


def direct_us(fn, reps=50) -> float:
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def pipelined_us(fn, reps=50) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    kernels = load_plugin("triton", device="cuda").module.OPS
    engine = device_backend("triton", "cuda").ops
    rows = []
    for mode, L, S in (("prefill", 2048, 1), ("prefill", 2048, 8), ("decode", 1, 1), ("decode", 1, 64)):
        v = inputs(S, L, 5120, g)
        graphed_of = {}
        for name, ops in (("kernels/triton.py", kernels), ("engine wrapper (--kernels triton)", engine)):
            scan, conv = (ops["ssm_scan"], ops["ssm_conv"]) if isinstance(ops, dict) else (ops.ssm_scan, ops.ssm_conv)
            for op, fn in (("ssm_scan", lambda: scan(v["h0"], v["x"], v["dt"], v["A"], v["B"], v["C"])),
                           ("ssm_conv", lambda: conv(v["st"], v["x"], v["w"]))):
                for _ in range(3):
                    fn()                       # compiled and warm
                if name.startswith("kernels"):
                    graphed_of[op] = do_bench_cudagraph(fn) * 1e3
                graphed = graphed_of[op]
                # else: the wrapper's input check waits for the GPU, which a graph capture refuses: its figures are
                # against the kernels' own graphed time, the time the GPU work takes
                row = {"op": op, "mode": mode, "impl": f"triton, direct Python call: {name}", "d_inner": 5120,
                       "L": L, "batch": S, "graphed_us": round(graphed, 2), "direct_us": round(direct_us(fn), 2),
                       "pipelined_us": round(pipelined_us(fn), 2), "date": datetime.date.today().isoformat()}
                row["direct_x_graphed"] = round(row["direct_us"] / graphed, 2)
                row["pipelined_x_graphed"] = round(row["pipelined_us"] / graphed, 2)
                rows.append(row)
                print(json.dumps(row), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "direct_calls.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                      indent=1))
    print(f"\n{'op':9} {'mode':8} {'b':>3} {'graphed':>8} {'direct':>8} {'piped':>8}  x(direct)  what")
    for r in rows:
        print(f"{r['op']:9} {r['mode']:8} {r['batch']:>3} {r['graphed_us']:8.1f} {r['direct_us']:8.1f} "
              f"{r['pipelined_us']:8.1f}  {r['direct_x_graphed']:9.2f}  {r['impl'][28:]}")


if __name__ == "__main__":
    main()
