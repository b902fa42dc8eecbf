"""Mamba-2's `ssd_scan` Triton schedules on one NVIDIA GPU: each against float64 and timed, beside the plain torch
chunked form (the reference op, float32 on the same GPU), at mamba2-2.7b's head shape (H 80, P 64, G 1, N 128).

    TRITON_INTERPRET=0 python3 benchmarks/mamba2_gpu.py [--quick]      # writes $OUT/mamba2_gpu.json, a table last

Prompts without per-token states: `chunked` (a program per head walks the chunks: the default before 2026-12-06)
and `steps` over rows a program, warps and loads in flight; with per-token states (what a traced compare asks)
and decode: `steps`. The default plan is marked. Times: CUDA events around 20 back-to-back
calls after a warm-up (a call's host work overlaps the GPU's), microseconds a call.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # this checkout's code
import torch  # noqa: E402
import triton  # noqa: E402

from mamba_debug import ops  # noqa: E402
from mamba_debug.plugins import load_plugin  # noqa: E402

H, P, G, N = 80, 64, 1, 128
SHAPES = ((1, 2048), (8, 512), (1, 512), (64, 1))


def timed(fn, n=20) -> float:
    fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1000 / n


def inputs(S, T, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    conv = r(S, T, H * P + 2 * G * N)              # x, B, C as views of one conv output, as the layer hands them
    x = conv[..., :H * P].unflatten(-1, (H, P))
    B = conv[..., H * P:H * P + G * N].unflatten(-1, (G, N))
    C = conv[..., H * P + G * N:].unflatten(-1, (G, N))
    return 0.5 * r(S, H, P, N), x, r(S, T, H) - 2, -torch.rand(H, device="cuda") - 0.5, B, C


def rel(a, b) -> float:
    return float((a.double() - b).abs().max() / b.abs().max())


# (BLOCK_P, num_warps, STAGES) of the `steps` plans timed: the defaults first (4 stages from 4 tokens on); 64 rows
# over 4 warps with no loads in flight was the compiled decode and per-token-states plan before 2026-12-06
STEPS = [(8, 1, 4), (8, 1, 1), (4, 1, 4), (4, 1, 1), (8, 4, 1), (64, 4, 1)]


def plans(T: int, quick: bool) -> list:
    """The plans timed: `chunked` for prompts (the compiled prompt default before 2026-12-06) and `steps` over rows
    a program, warps and loads in flight (the default for every call now: 8 rows, 1 warp; 4 stages, 1 in decode)."""
    steps = [{"schedule": "steps", "BLOCK_P": bp, "num_warps": w, "STAGES": sg} for bp, w, sg in STEPS
             if not quick or (bp, w, sg) in ((8, 1, 4), (8, 1, 1), (64, 4, 1))]
    return steps if T <= 2 else [{"schedule": "chunked", "chunk_size": 64}] + steps


# The torch ops timed beside the kernels: the chunked form in float32, and the float64 recurrence a compare's
# reference side runs (ops.ssd_scan: two launches a token)
REFERENCE = {
    "torch": lambda *a: lambda: ops.ssd_scan_chunked(*a),
    "float64": lambda *a: (lambda w: lambda: ops.ssd_scan(*w))([t.double() for t in a]),
}
IMPL = {"torch": "torch chunked (reference op, fp32)", "float64": "ops.ssd_scan float64 (the reference side's op)"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer plans")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("mamba2_gpu.py: no GPU (the kernels' CPU check is tests/test_triton_mamba2.py)")
    k = load_plugin("triton_mamba2", "cuda").module
    gpu, rows = torch.cuda.get_device_name(), []
    for S, T in SHAPES:
        st, x, dt, A, B, C = inputs(S, T)
        y64, h64 = ops.ssd_scan(*(a.double() for a in (st, x, dt, A, B, C)))
        default = (k.scan_plan(S, T, H, P, N, states_out=False), k.scan_plan(S, T, H, P, N, states_out=True))
        cases = [(p, False) for p in plans(T, args.quick)]
        if T > 2:                                   # per-token states: steps only
            cases += [(p, True) for p in plans(T, args.quick) if p["schedule"] == "steps"]
            cases += [("torch", False), ("float64", False)]
        for plan, per_token in cases:
            so = torch.empty((S, T, H, P, N), device="cuda") if per_token else None
            fn = (REFERENCE[plan](st, x, dt, A, B, C) if isinstance(plan, str) else
                  lambda plan=plan, so=so: k.ssd_scan(st, x, dt, A, B, C, plan=plan, states_out=so))
            y, h = fn()
            us = timed(fn, 3 if isinstance(plan, str) or plan.get("schedule") == "chunked" else 20)
            row = {"op": "ssd_scan", "S": S, "T": T, "H": H, "P": P, "G": G, "N": N, "gpu": gpu,
                   "impl": IMPL[plan] if isinstance(plan, str) else "triton",
                   "plan": None if isinstance(plan, str) else plan, "states_out": per_token,
                   "default": plan == default[per_token], "time_us": round(us, 1),
                   "rel_err_y": rel(y, y64), "rel_err_state": rel(h, h64),
                   "date": datetime.date.today().isoformat()}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del st, x, dt, A, B, C, y64, h64
        torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", "out/benchmarks-gpu"))    # results/mamba2_gpu.json is copied from here
    out.mkdir(parents=True, exist_ok=True)
    (out / "mamba2_gpu.json").write_text(json.dumps({"gpu": gpu, "torch": torch.__version__,
                                                     "triton": triton.__version__, "rows": rows}, indent=1))
    print(f"\n{gpu}, torch {torch.__version__}, Triton {triton.__version__}")
    print("| S x T | plan | per-token states | us | rel err y |\n|---|---|---|---|---|")
    for r in rows:
        name = r["impl"] if r["plan"] is None else ", ".join(f"{k}={v}" for k, v in r["plan"].items())
        mark = " (default)" if r["default"] else ""
        print(f"| {r['S']} x {r['T']} | {name}{mark} | {r['states_out']} | {r['time_us']} | {r['rel_err_y']:.1e} |")
    bad = [r for r in rows if not r["rel_err_y"] < 1e-4 or not r["rel_err_state"] < 1e-4]
    print(f"{len(bad)} row(s) past 1e-4 of float64" if bad else "every row within 1e-4 of float64")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
