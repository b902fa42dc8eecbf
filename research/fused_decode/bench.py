"""The fused one-launch decode step (fused_decode.py) on a GPU: correctness, then timings in CUDA graphs.

For a 2.8B-shaped layer (d_model 2560: D = 5120, N = 16, K = 4, R = 160) at S = 1, 8, 64 sequences, one token:
  * checks: the one-launch step equals the per-phase launches bit for bit, and its NMSE against the float64
    reference (`decode_step_reference`, float64 torch ops on the GPU);
  * timings, each a CUDA graph of STEPS decode steps (states updated in place, as mamba_ssm's decode does; the
    unfused sequence rebinds its states like the engine), replayed REPLAYS times; the median replay / STEPS:
      - fused, one launch (grid barriers);
      - fused, one launch per phase (the same kernel: 3 launches, or 2 with conv="recompute");
      - the unfused sequence the engine runs today for the same math: kernels/triton.py ssm_conv, + conv_b, silu,
        F.linear(x_proj), F.linear(dt_proj, dt_bias), kernels/triton.py ssm_scan, skip and gate in torch;
      - a few other plans of the fused kernel (conv recomputed: one barrier; other block sizes);
    "warm" rows reuse one layer's weights in every step (7.2 MB: they stay in the 50 MB L2); "hbm" rows cycle
    through LAYERS layers' weights and states, as a real model does, so the weights come from HBM each step.
  * floor: the bytes that must move (x_proj, dt_proj, conv_w, conv_b, A, D, dt_bias, both states read and written,
    xz, y) / the copy bandwidth (`copy_gb_s` if the caller measured it, else 3.3 TB/s).

Called as `bench_rows(date, copy_gb_s=...)`, or alone on the GPU machine:
    TRITON_INTERPRET=0 python research/fused_decode/bench.py [--copy-gb-s 4220] [--batches 1,8,64]
which prints a table and, when $OUT is set, writes $OUT/fused_decode.json. Each batch size runs on its own: a
failure is printed with its traceback and recorded as a row with "error", and the other sizes still run, except
after a step that never finishes (a grid barrier that deadlocks wedges the GPU: nothing more can run; the script
then exits with status 3).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mamba_debug import ops  # noqa: E402
from mamba_debug.triton_env import exec_file  # noqa: E402

D_INNER, D_STATE, D_CONV, DT_RANK = 5120, 16, 4, 160          # a 2.8B layer (d_model 2560)
BATCHES = (1, 8, 64)
STEPS = 20                  # decode steps captured per CUDA graph
REPLAYS = 50                # graph replays timed (median)
LAYERS = 16                 # layers cycled through by the "hbm" rows (16 x 7.2 MB of weights: well past L2)
HBM_BYTES_PER_S = 3.3e12    # when the caller measured no copy bandwidth
STEP_TIMEOUT_S = 30.0       # a first one-launch step slower than this is a deadlocked grid barrier


class Wedged(RuntimeError):
    """A kernel never finished (deadlocked grid barrier): the GPU cannot run anything else in this process."""


def _load(name: str, path: Path):
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: this benchmark compiles the kernels for the GPU")
    return sys.modules.get(name) or exec_file(path, name)


def kernels():
    """(research/fused_decode/fused_decode.py, kernels/triton.py), compiled for cuda, loaded by path."""
    return (_load("mamba_debug_bench_fused_decode", HERE / "fused_decode.py"),
            _load("mamba_debug_bench_triton", ROOT / "kernels" / "triton.py"))


# -- inputs --------------------------------------------------------------------------------------------------------
def layer_weights(D, N, K, R, seed, device="cuda") -> dict:
    """One layer's weights at mamba_ssm's initial scales (A = -[1..N], softplus(dt_bias) in 1e-3..0.1)."""
    g = torch.Generator().manual_seed(seed)
    dt0 = torch.exp(torch.rand(D, generator=g) * 4.6 - 6.9)
    w = dict(conv_w=torch.randn(D, K, generator=g) / K ** 0.5, conv_b=0.1 * torch.randn(D, generator=g),
             x_proj=torch.randn(R + 2 * N, D, generator=g) / D ** 0.5,
             dt_proj=torch.randn(D, R, generator=g) / R ** 0.5, dt_bias=dt0 + torch.log(-torch.expm1(-dt0)),
             A=-torch.arange(1, N + 1, dtype=torch.float32).repeat(D, 1), D=torch.ones(D))
    return {k: v.to(device) for k, v in w.items()}


def layer_inputs(S, D, N, K, seed, device="cuda"):
    """xz [S, 2D] (the engine's [S, 1, 2D] in_proj output of one token, as a view), conv and ssm states."""
    g = torch.Generator().manual_seed(seed)
    xz = torch.randn(S, 1, 2 * D, generator=g).to(device)[:, 0]
    return xz, torch.randn(S, K - 1, D, generator=g).to(device), (0.5 * torch.randn(S, D, N, generator=g)).to(device)


def floor_bytes(S, D, N, K, R) -> int:
    weights = (R + 2 * N) * D + D * R + D * K + D + D * N + D + D
    states = 2 * (S * (K - 1) * D + S * D * N)
    return 4 * (weights + states + S * 2 * D + S * D)


def nmse(a, b) -> float:
    a, b = a.double(), b.double()
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


# -- the steps -----------------------------------------------------------------------------------------------------
def unfused_step(trit, xz, conv_state, ssm_state, w):
    """The engine's decode sequence for xz -> y_gated (mamba_debug.model `_layer` with the triton plug-in)."""
    D, N, R = w["A"].shape[0], w["A"].shape[1], w["dt_proj"].shape[1]
    xz = xz[:, None]                                                   # [S, 1, 2D]
    x, z = xz[..., :D], xz[..., D:]
    conv, conv_state = trit.ssm_conv(conv_state, x, w["conv_w"])
    conv_act = ops.silu(conv + w["conv_b"])
    dbc = ops.linear(conv_act, w["x_proj"])
    dt, B, C = dbc[..., :R], dbc[..., R:R + N], dbc[..., R + N:]
    dt = ops.linear(dt, w["dt_proj"], w["dt_bias"])
    y_scan, ssm_state = trit.ssm_scan(ssm_state, conv_act, dt, w["A"], B, C)
    y = (y_scan + conv_act * w["D"]) * ops.silu(z)
    return y[:, 0], conv_state, ssm_state


def _finish(timeout_s: float = STEP_TIMEOUT_S):
    """Wait for the GPU, but not forever: a one-launch step whose grid barrier deadlocks never finishes."""
    ev = torch.cuda.Event()
    ev.record()
    t0 = time.monotonic()
    while not ev.query():
        if time.monotonic() - t0 > timeout_s:
            raise Wedged(f"a fused decode step did not finish within {timeout_s:.0f} s: the grid barrier deadlocked "
                         f"(programs not all resident?). The GPU is wedged for this process.")
        time.sleep(0.001)


def graph_us(step, n_steps: int = STEPS, replays: int = REPLAYS) -> float:
    """µs per step: a CUDA graph of n_steps calls of step(i) (i = 0..n_steps-1), median over replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                # warm-up (compiles, allocates the barrier counter) outside capture
        for i in range(2):
            step(i)
    torch.cuda.current_stream().wait_stream(side)
    _finish()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_steps):
            step(i)
    graph.replay()
    _finish()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) * 1e3 / n_steps


# -- one batch size ------------------------------------------------------------------------------------------------
def _plans(S: int) -> list[tuple[str, dict]]:
    """(label, config) of the fused plans timed: the default first."""
    # runs of 2026-11-30 (results/fused_decode_run1.json, fused_decode.json) also timed the weights
    # loaded at the start or just before each barrier (the kernel's option then: no faster, removed since),
    # "16 x_proj rows x 11 slices" (slower) and 2 warps (slower)
    plans = [("default", {}), ("conv recomputed (one barrier)", {"conv": "recompute"}),
             ("4 warps", {"num_warps": 4}), ("8 warps", {"num_warps": 8}),
             ("4 warps, conv recomputed", {"num_warps": 4, "conv": "recompute"})]
    if S >= 8:
        plans.append(("4 sequences per phase-2 step", {"bs2": 4}))
    return plans


CHECK_PER_PHASE = ("default", "conv recomputed (one barrier)")   # plans also run (and timed) one launch per phase


def batch_rows(S: int, date: str, bw: float, fd, trit, log=print) -> list[dict]:
    D, N, K, R = D_INNER, D_STATE, D_CONV, DT_RANK
    floor_us = floor_bytes(S, D, N, K, R) / bw * 1e6
    base = {"op": "fused_decode", "mode": "decode", "d_inner": D, "L": 1, "batch": S, "floor_us": round(floor_us, 2),
            "date": date}
    rows = []

    def add(impl, us, *, l2, config=None, nmse_=None, bitwise=None, launches=None):
        rows.append(dict(base, impl=impl, time_us=round(us, 2), x_floor=round(us / floor_us, 2), l2=l2,
                         config=config, launches=launches, nmse_vs_fp64=nmse_, bitwise_one_vs_three=bitwise))
        log(rows[-1])

    w = layer_weights(D, N, K, R, seed=0)
    xz, cs0, ss0 = layer_inputs(S, D, N, K, seed=S)
    ref = fd.decode_step_reference(xz, cs0, ss0, w)                     # float64, on the GPU
    ref_y = ref[0]

    # unfused: what the engine runs today
    y_u, cs_u, ss_u = unfused_step(trit, xz, cs0, ss0, w)
    torch.cuda.synchronize()
    nmse_unfused = nmse(y_u, ref_y)

    def unfused(state):
        def step(i):
            y, state[0], state[1] = unfused_step(trit, xz, state[0], state[1], w)
        return step

    add("unfused: triton ssm_conv + torch bias/silu + F.linear x2 + triton ssm_scan + torch skip/gate",
        graph_us(unfused([cs0.clone(), ss0.clone()])), l2="warm", nmse_=nmse_unfused, launches=None)

    # the fused plans
    hbm_done = False
    for label, cfg in _plans(S):
        try:
            one = fd.fused_decode_step(xz, cs0, ss0, w, one_launch=True, config=cfg)
            _finish()
            bitwise = None
            if label in CHECK_PER_PHASE:
                per_phase = fd.fused_decode_step(xz, cs0, ss0, w, one_launch=False, config=cfg)
                torch.cuda.synchronize()
                bitwise = all(torch.equal(a, b) for a, b in zip(one, per_phase))
            err = nmse(one[0], ref_y)
            states_err = max(nmse(one[1], ref[1]), nmse(one[2], ref[2]))
            # compiled, one launch and one launch per phase may round differently (FMA contraction): the check is
            # against float64; the bitwise flag is recorded
            if err > 1e-10 or states_err > 1e-10:
                log(f"S={S} {label}: CHECK FAILED: NMSE y {err:.3g}, states {states_err:.3g} (bitwise one == "
                    f"per-phase: {bitwise})")
            n_launch = 3 if cfg.get("conv", "phase") == "phase" else 2
            cs, ss = cs0.clone(), ss0.clone()

            def fused_step(one_launch, cs=cs, ss=ss, cfg=cfg):
                return lambda i: fd.fused_decode_step(xz, cs, ss, w, conv_state_out=cs, ssm_state_out=ss,
                                                      one_launch=one_launch, config=cfg)

            add(f"fused, one launch ({label})", graph_us(fused_step(True)), l2="warm", config=cfg, nmse_=err,
                bitwise=bitwise, launches=1)
            if label in CHECK_PER_PHASE:
                add(f"fused, one launch per phase ({label})", graph_us(fused_step(False)), l2="warm", config=cfg,
                    nmse_=err, bitwise=bitwise, launches=n_launch)
        except Wedged:
            raise
        except Exception as exc:                                         # this plan only; the others still run
            log(f"S={S} plan {label} {cfg}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            rows.append(dict(base, impl=f"fused, one launch ({label})", config=cfg, time_us=None,
                             error=f"{type(exc).__name__}: {exc}"))
            continue
        if not hbm_done:
            hbm_done = True
            rows.extend(_hbm_rows(S, base, floor_us, fd, trit, log))
    return rows


def _hbm_rows(S, base, floor_us, fd, trit, log) -> list[dict]:
    """The default fused step and the unfused sequence over LAYERS layers' weights and states: each step's weights
    come from HBM (the floor's assumption), as in a real model."""
    D, N, K, R = D_INNER, D_STATE, D_CONV, DT_RANK
    ws = [layer_weights(D, N, K, R, seed=100 + i) for i in range(LAYERS)]
    xzs, css, sss = zip(*(layer_inputs(S, D, N, K, seed=200 + i) for i in range(LAYERS)))
    css, sss = list(css), list(sss)
    out = []

    def fused(i):
        j = i % LAYERS
        fd.fused_decode_step(xzs[j], css[j], sss[j], ws[j], conv_state_out=css[j], ssm_state_out=sss[j])

    def unfused(i):
        j = i % LAYERS
        _, css[j], sss[j] = unfused_step(trit, xzs[j], css[j], sss[j], ws[j])

    for impl, step in ((f"fused, one launch (default), {LAYERS} layers' weights from HBM", fused),
                       (f"unfused (engine today), {LAYERS} layers' weights from HBM", unfused)):
        us = graph_us(step, n_steps=2 * LAYERS)
        out.append(dict(base, impl=impl, time_us=round(us, 2), x_floor=round(us / floor_us, 2), l2="hbm",
                        config={} if step is fused else None, launches=1 if step is fused else None,
                        nmse_vs_fp64=None, bitwise_one_vs_three=None))
        log(out[-1])
    return out


def bench_rows(date: str, copy_gb_s: float | None = None, batches=BATCHES, log=print) -> list[dict]:
    """Rows {"op": "fused_decode", "mode": "decode", "d_inner", "L": 1, "batch", "time_us", "floor_us", "impl",
    "date", "nmse_vs_fp64", "bitwise_one_vs_three", ...} for every batch size; a failing size gives a row with
    "error" and the others still run. copy_gb_s: the device-to-device copy bandwidth measured by the caller (GB/s)."""
    if not torch.cuda.is_available():
        raise RuntimeError("research/fused_decode/bench.py needs a CUDA GPU")
    fd, trit = kernels()
    bw = copy_gb_s * 1e9 if copy_gb_s else HBM_BYTES_PER_S
    rows = []
    for S in batches:
        t = time.perf_counter()
        try:
            rows.extend(batch_rows(S, date, bw, fd, trit, log))
        except Wedged as exc:
            log(f"S={S}: {exc}")
            rows.append({"op": "fused_decode", "mode": "decode", "d_inner": D_INNER, "L": 1, "batch": S,
                         "time_us": None, "date": date, "error": str(exc), "wedged": True})
            break                               # the GPU cannot run anything else in this process
        except Exception as exc:
            log(f"S={S}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            rows.append({"op": "fused_decode", "mode": "decode", "d_inner": D_INNER, "L": 1, "batch": S,
                         "time_us": None, "date": date, "error": f"{type(exc).__name__}: {exc}"})
        log(f"S={S}: {time.perf_counter() - t:.1f} s")
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'batch':>5} {'µs':>8} {'floor':>6} {'x floor':>7} {'L2':>4} {'NMSE vs fp64':>12} {'1=3':>5}  impl",
             "-" * 110]
    for r in rows:
        if r.get("time_us") is None:
            lines.append(f"{r['batch']:>5} {'-':>8} {'':>6} {'':>7} {'':>4} {'':>12} {'':>5}  "
                         f"{r.get('impl', '')} ERROR {r.get('error')}")
            continue
        e = r.get("nmse_vs_fp64")
        b = r.get("bitwise_one_vs_three")
        lines.append(f"{r['batch']:>5} {r['time_us']:>8.2f} {r['floor_us']:>6.2f} {r['x_floor']:>7.2f} {r['l2']:>4} "
                     f"{(f'{e:.1e}' if e is not None else ''):>12} {('' if b is None else str(b)):>5}  {r['impl']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--copy-gb-s", type=float, default=None, help="copy bandwidth for the floor (default 3300)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    args = ap.parse_args(argv)
    rows = bench_rows(datetime.date.today().isoformat(), args.copy_gb_s,
                      batches=tuple(int(b) for b in args.batches.split(",")))
    print(table(rows))
    if os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "fused_decode.json"
        out.write_text(json.dumps(rows, indent=1))
        print(f"wrote {out}")
    if any(r.get("wedged") for r in rows):
        sys.stdout.flush()
        os._exit(3)                             # a wedged GPU would hang the interpreter's exit
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
