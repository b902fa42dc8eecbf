"""What measuring the per-token SSM states costs one scan call, the two ways the engine can: written out
(`states_out`) and then measured by the metrics kernel, or measured in the scan (`states_ref`, kernels/
_triton_measure.py). 2.8B shape (d_inner 5120, d_state 16), one 512-token ubatch (the tracing runs' ubatch) and a
2048-token prompt, batch 1 and 8; the reference float32 and float64. Prints a table (GPU event times, medians of
alternating calls); the figures go into benchmarks/README.md with the date. Needs a GPU."""
from __future__ import annotations

import statistics
import sys

import torch

from gpu_common import CUDA, log, once  # noqa: E402  (fixes Triton's mode, puts the repository on the path)
from mamba_debug.metrics import errors_of_sums, site_errors  # noqa: E402
from mamba_debug.plugins import load_plugin  # noqa: E402

D, N = 5120, 16
REPS = 15
PIECES = tuple(int(p) for p in sys.argv[1].split(",")) if len(sys.argv) > 1 else ()   # MEASURE_PIECES to try too


def inputs(S, L, g):
    x = torch.randn(S, L, D, device="cuda", generator=g)
    dt = torch.randn(S, L, D, device="cuda", generator=g) - 3
    B, C = (torch.randn(S, L, N, device="cuda", generator=g) for _ in range(2))
    A = -torch.exp(torch.randn(D, N, device="cuda", generator=g) * 0.5)
    h0 = torch.randn(S, D, N, device="cuda", generator=g) * 0.1
    return h0, x, dt, A, B, C


def main():
    if not CUDA:
        sys.exit("measured_scan.py times compiled kernels: it needs a GPU")
    mod = load_plugin("triton", device="cuda").module
    scan = mod.ssm_scan
    g = torch.Generator("cuda").manual_seed(0)
    rows = []
    for S, L in ((1, 512), (1, 2048), (8, 512)):
        args = inputs(S, L, g)
        states = torch.empty(S, L, D, N, device="cuda")
        scan(*args, states_out=states)
        for dtype in (torch.float32, torch.float64):
            ref = (states + 1e-3 * torch.randn(states.shape, device="cuda", generator=g)).to(dtype)
            def written_out():
                scan(*args, states_out=states)
                return site_errors(states, ref)

            def in_scan(pieces):
                plan = dict(mod.scan_plan(S, L, D, N, device=ref.device, measured=True), **(
                    {} if pieces is None else {"MEASURE_PIECES": pieces}))
                return lambda: errors_of_sums(scan(*args, states_ref=ref, plan=plan)[2])

            ways = {"scan alone": lambda: scan(*args), "states_out, then the metrics kernel": written_out,
                    "measured in the scan (states_ref), the default plan": in_scan(None),
                    **{f"measured in the scan, {p} pieces per program": in_scan(p) for p in PIECES}}
            for fn in ways.values():       # compile, warm
                fn()
            times = {k: [] for k in ways}
            for _ in range(REPS):
                for k, fn in ways.items():
                    times[k].append(once(fn) * 1e6)
            a = site_errors(states, ref)
            b = errors_of_sums(scan(*args, states_ref=ref)[2])
            worst = max(float(((a[m] - b[m]).abs() / a[m].abs().clamp_min(1e-300)).max()) for m in ("rel_l2", "nmse"))
            base = statistics.median(times["scan alone"])
            for k, t in times.items():
                rows.append((S, L, str(dtype).replace("torch.", ""), k, statistics.median(t),
                             statistics.median(t) - base, worst))
            log(f"S {S} L {L} ref {dtype}: done, metrics agree to {worst:.1e} (relative)")
            del ref
        del states
        torch.cuda.empty_cache()
    print("\n| batch | L | reference | way | us | over the scan alone | rel. diff of the two ways' metrics |")
    print("|---|---|---|---|---|---|---|")
    for S, L, dt, k, t, over, worst in rows:
        print(f"| {S} | {L} | {dt} | {k} | {t:.1f} | {over:+.1f} | {worst:.1e} |")


if __name__ == "__main__":
    main()
