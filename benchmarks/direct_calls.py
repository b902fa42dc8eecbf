"""Issue #18 goal 4's last part: a kernel called directly from Python against the same kernel replayed in a CUDA graph.

Run on the GPU machine: TRITON_INTERPRET=0 python3 benchmarks/direct_calls.py  (writes $OUT/direct_calls.json)

Per case, all with a warm L2 (the graphed and the direct figure see the same caches):
* graphed: `do_bench_cudagraph`, no host work at all;
* direct: one call on an idle GPU, then `torch.cuda.synchronize()`, wall clock, median of 100: what a user's
  `ssm_scan(...)` in a notebook or a test costs, host work (checks, plan, allocations, Triton's launcher) included;
  host: the same call until it returns (its host work alone). The kept launchers and Triton's own launch alternate
  call by call (the machine's host speed drifts within a run);
* pipelined: 50 calls back to back and one synchronize, per call: the host work hidden behind the GPU's, as in a
  model's forward pass.
The kernels' own launchers (`kernels/triton.py`, with the kept launchers of mamba_debug.triton_launch and again
through Triton's own `kernel[grid](...)` for comparison) and the engine's validating wrapper (`--kernels triton`:
contract checks on every call) are timed, each against the kernels' graphed time (the wrapper's input check waits
for the GPU, which a CUDA graph capture refuses). A first row times `z.add_(1)` the same ways: the floor of any
direct call of a GPU op on that machine.

`--breakdown` prints where one call's host time goes instead (no result file): the whole call, its two allocations,
each launch alone with the arguments the call gave it, the compiled kernel's own launcher alone, and cProfile's
heaviest functions over 300 calls.
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
from mamba_debug.triton_launch import Launch  # noqa: E402

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


def timed(fn) -> tuple[float, float]:
    """One call on an idle GPU: (call + wait, call alone = host time until it returns), seconds."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, t1 - t0


def direct_us(fn, reps=100) -> tuple[float, float]:
    """Medians of `timed` in us: (call + wait, host)."""
    times = [timed(fn) for _ in range(reps)]
    return tuple(statistics.median(t[i] for t in times) * 1e6 for i in (0, 1))


def paired_us(fn, module, reps=100) -> tuple:
    """direct_us of the kept launchers and of Triton's own launch, alternating call by call (the machine's host
    speed drifts within a run)."""
    times: dict = {False: [], True: []}
    for _ in range(reps):
        for own in (False, True):
            tritons_own_launch(module, own)
            times[own].append(timed(fn))
    tritons_own_launch(module, False)
    return tuple(tuple(statistics.median(t[i] for t in times[own]) * 1e6 for i in (0, 1)) for own in (False, True))


def pipelined_us(fn, reps=50) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e6


def tritons_own_launch(module, own: bool):
    """Every launch of the kernels through Triton's own `kernel[grid](...)` (own) or the kept launchers
    (mamba_debug.triton_launch, the default), to time the two in one run."""
    for launch in (module._launch_conv, module._launch_scan, module._launch_tiled):
        launch.interpret = own


def row_of(op, mode, impl, L, S, graphed, direct_host, piped) -> dict:
    row = {"op": op, "mode": mode, "impl": impl, "d_inner": 5120, "L": L, "batch": S, "graphed_us": round(graphed, 2),
           "direct_us": round(direct_host[0], 2), "host_us": round(direct_host[1], 2), "pipelined_us": round(piped, 2),
           "date": datetime.date.today().isoformat()}
    row["direct_x_graphed"] = round(row["direct_us"] / graphed, 2)
    row["pipelined_x_graphed"] = round(row["pipelined_us"] / graphed, 2)
    print(json.dumps(row), flush=True)
    return row


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    module = load_plugin("triton", device="cuda").module
    kernels = module.OPS
    engine = device_backend("triton", "cuda").ops
    rows = []
    z = torch.zeros(1, device="cuda")
    rows.append(row_of("torch add_", "any", "torch: z.add_(1), the floor of any direct call", 1, 1,
                       do_bench_cudagraph(lambda: z.add_(1)) * 1e3, direct_us(lambda: z.add_(1)),
                       pipelined_us(lambda: z.add_(1))))
    for mode, L, S in (("prefill", 2048, 1), ("prefill", 2048, 8), ("decode", 1, 1), ("decode", 1, 64)):
        v = inputs(S, L, 5120, g)
        for op, name in (("ssm_scan", "ssm_scan"), ("ssm_conv", "ssm_conv")):
            fns = {impl: (lambda ops=ops: (ops[name] if isinstance(ops, dict) else getattr(ops, name))(
                *((v["h0"], v["x"], v["dt"], v["A"], v["B"], v["C"]) if op == "ssm_scan" else (v["st"], v["x"], v["w"]))))
                for impl, ops in (("kernels", kernels), ("engine", engine))}
            for fn in fns.values():
                for _ in range(3):
                    fn()                       # compiled and warm
            graphed = do_bench_cudagraph(fns["kernels"]) * 1e3
            kept, own = paired_us(fns["kernels"], module)
            piped = pipelined_us(fns["kernels"])
            tritons_own_launch(module, True)
            piped_own = pipelined_us(fns["kernels"])
            tritons_own_launch(module, False)
            # the wrapper's input check waits for the GPU, which a graph capture refuses: its figures are against
            # the kernels' own graphed time, the time the GPU work takes
            for impl, d, p in (("kernels/triton.py", kept, piped), ("kernels/triton.py, Triton's own launch", own,
                                                                    piped_own),
                               ("engine wrapper (--kernels triton)", direct_us(fns["engine"]),
                                pipelined_us(fns["engine"]))):
                rows.append(row_of(op, mode, f"triton, direct Python call: {impl}", L, S, graphed, d, p))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "direct_calls.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                      indent=1))
    print(f"\n{'op':10} {'mode':8} {'b':>3} {'graphed':>8} {'direct':>8} {'host':>7} {'piped':>8}  x(direct)  what")
    for r in rows:
        print(f"{r['op']:10} {r['mode']:8} {r['batch']:>3} {r['graphed_us']:8.1f} {r['direct_us']:8.1f} "
              f"{r['host_us']:7.1f} {r['pipelined_us']:8.1f}  {r['direct_x_graphed']:9.2f}  "
              f"{r['impl'].replace('triton, direct Python call: ', '')}")


class _Recorded:
    """A launcher that notes its calls' arguments and forwards them."""

    def __init__(self, launch):
        self.launch, self.calls = launch, []

    def __call__(self, *args):
        self.calls.append(args)
        self.launch(*args)


def host_us(fn) -> float:
    """Median host time of 200 calls on an idle GPU, us (`direct_us`'s second figure)."""
    return direct_us(fn, reps=200)[1]


def _recorded_launches(module, call) -> list:
    """(launcher, its arguments) of each launch one `call()` makes, in order."""
    names = [n for n, v in vars(module).items() if isinstance(v, Launch)]
    real = {n: getattr(module, n) for n in names}
    rec = {n: _Recorded(real[n]) for n in names}
    try:
        for n in names:
            setattr(module, n, rec[n])
        call()
    finally:
        for n in names:
            setattr(module, n, real[n])
    return [(real[n], a) for n in names for a in rec[n].calls]


def _launch_parts(i: int, launch, args: tuple) -> dict:
    """Host us of one recorded launch through the kept launcher, and of its compiled launcher alone (printing the
    compiled kernel's registers, spills and scratch)."""
    grid, tensors, scalars, meta = args
    parts = {f"launch {i}, grid {grid}": host_us(lambda: launch(*args))}
    kept = next((k for key, k in launch.kept.items() if key[1] == (*meta.values(), *scalars)), None)
    if kept is None:
        return parts
    c, tail = kept
    g, stream = (*grid, 1, 1), torch.cuda.current_stream().cuda_stream
    parts[f"  launch {i}: its compiled launcher alone"] = host_us(lambda: c.run(
        g[0], g[1], g[2], stream, c.function, c.packed_metadata, None, None, None, *tensors, *scalars, *tail))
    c._init_handles()
    print(f"launch {i} {grid}: {len(tensors)} tensors, {len(scalars)} scalars, {len(tail)} after them; registers "
          f"{getattr(c, 'n_regs', '?')}, spills {getattr(c, 'n_spills', '?')}, shared {c.metadata.shared}, global "
          f"scratch {getattr(c.metadata, 'global_scratch_size', '?')}")
    return parts


def breakdown():
    import cProfile  # noqa: PLC0415
    import pstats  # noqa: PLC0415
    g = torch.Generator(device="cuda").manual_seed(0)
    module = load_plugin("triton", device="cuda").module
    print(f"torch add_ host: {host_us(lambda: torch.zeros(1, device='cuda').add_(1)):.1f} us (with its zeros)")
    for mode, L, S in (("prefill", 2048, 1), ("prefill", 2048, 8), ("decode", 1, 1)):
        v = inputs(S, L, 5120, g)
        call = lambda: module.ssm_scan(v["h0"], v["x"], v["dt"], v["A"], v["B"], v["C"])  # noqa: E731
        for _ in range(3):
            call()
        parts = {"whole call": host_us(call),
                 "torch.empty y, state": host_us(lambda: (torch.empty((S, L, 5120), device="cuda"),
                                                         torch.empty((S, 5120, N), device="cuda")))}
        for i, (launch, args) in enumerate(_recorded_launches(module, call)):
            parts.update(_launch_parts(i, launch, args))
        print(f"\nssm_scan {mode} S={S} L={L}: host us (median of 200)")
        for k, us in parts.items():
            print(f"  {k:60} {us:8.1f}")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(300):
            call()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    breakdown() if "--breakdown" in sys.argv else main()
