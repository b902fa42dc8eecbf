"""The reference sides' scans on one NVIDIA GPU, alone and in a Mamba-2 comparison end to end.

Part 1  `ops.ssm_scan` (a Mamba-1 2.8B layer: D 5120, N 16) and `ops.ssd_scan` (a Mamba-2 2.7B layer: H 80, P 64,
        G 1, N 128), float64 and float32, over the calls a comparison makes (ubatch 64) and one 2048-token call:
        the recurrence as one Triton launch a block (`ops.RECURRENCE_KERNEL = "cuda"`, the default) against torch's
        per-token loop ("off"), the same bits checked (y, last state, per-token states), then timed.
Part 2  `run_compare` of a Mamba-2 2.7B-shaped model (random weights at mamba_ssm's initial scale, float32 values),
        2048 + 4 tokens, ubatch 32, capture metrics, reference sides on the GPU, Triton kernels: with each recurrence,
        alternating; wall time, peak GPU memory, first divergence.

    TRITON_INTERPRET=0 python3 benchmarks/reference_gpu.py [--parts ops,e2e] [--layers N]
    python3 benchmarks/reference_gpu.py --small            # a check on a CPU: tiny shapes, the interpreter, no times

An older checkout has no `RECURRENCE_KERNEL`: run this file from a copy of it beside this one (with gpu_common.py)
and its rows say "as found". Writes $OUT/reference_gpu.json (default out/benchmarks-gpu), a table last.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

from gpu_common import CUDA, GB, ROOT, TODAY, free_memory, log, peak_gpu, reset_peak, sync  # fixes Triton's mode first
from mamba_debug import ops  # noqa: E402
from mamba_debug.compare import CompareSettings, run_compare  # noqa: E402
from mamba_debug.config import MambaConfig  # noqa: E402
from mamba_debug.model import MambaModel  # noqa: E402
from mamba_debug.arch import param_shapes  # noqa: E402

# the recurrences timed: the Triton launch ("cuda"; "always" on a CPU: interpreted) and torch's loop
MODES = ("cuda", "off") if hasattr(ops, "RECURRENCE_KERNEL") else ("as found",)
M1 = dict(D=5120, N=16)
M2 = dict(H=80, P=64, G=1, N=128)
MAMBA2_2P7B = dict(d_model=2560, n_layer=64, vocab_size=50288, d_state=128, d_conv=4, expand=2, head_dim=64,
                   n_groups=1, chunk_size=256)


def _set(mode):
    if mode != "as found":
        ops.RECURRENCE_KERNEL = mode


def timed(fn, reps: int) -> float:
    """Milliseconds a call: CUDA events around reps back-to-back calls after one warm-up."""
    fn()
    sync()
    if not CUDA:
        return float("nan")
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    sync()
    return e0.elapsed_time(e1) / reps


def scan_inputs(arch, S, T, dtype, dev):
    g = torch.Generator(device=dev).manual_seed(S * 7 + T)
    r = lambda *s: torch.randn(*s, device=dev, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    if arch == "mamba1":
        D, N = M1["D"], M1["N"]
        x = r(S, T, 2 * D)[..., :D]                           # a view of a wider projection, as the layer hands it
        return ops.ssm_scan, (0.5 * r(S, D, N), x, r(S, T, D) - 2, -torch.arange(1, N + 1, device=dev, dtype=dtype)
                              .expand(D, N), r(S, T, N), r(S, T, N)), (S, T, D, N)
    H, P, G, N = M2["H"], M2["P"], M2["G"], M2["N"]
    xbc = r(S, T, H * P + 2 * G * N)
    x, B, C = xbc[..., :H * P].unflatten(-1, (H, P)), xbc[..., H * P:-G * N].unflatten(-1, (G, N)), \
        xbc[..., -G * N:].unflatten(-1, (G, N))
    return ops.ssd_scan, (0.5 * r(S, H, P, N), x, r(S, T, H) - 2, -torch.rand(H, device=dev, dtype=dtype) - 0.5,
                          B, C), (S, T, H, P, N)


def part_ops(small: bool, modes: tuple) -> list:
    dev = "cuda" if CUDA else "cpu"
    calls = [(1, 8), (2, 5)] if small else [(1, 64), (1, 2048)]   # (S, T): a call at ubatch 64, a whole prompt
    rows = []
    for arch in ("mamba1", "mamba2"):
        for dtype in (torch.float64, torch.float32):
            for S, T in calls:
                fn, args, so_shape = scan_inputs(arch, S, T, dtype, dev)
                if small:
                    args = _shrink(arch, args)
                    so_shape = (*so_shape[:2], *args[0].shape[1:])
                outs, row = {}, {"op": fn.__name__, "dtype": str(dtype)[6:], "S": S, "T": T, "date": TODAY}
                for mode in modes:
                    _set(mode)
                    so = torch.empty(so_shape, dtype=dtype, device=dev)
                    outs[mode] = (*fn(*args, states_out=so), so, *fn(*args))
                    row[f"{mode} ms"] = round(timed(lambda: fn(*args), 1 if small else 3), 3)
                    row[f"{mode} with states ms"] = round(timed(lambda: fn(*args, states_out=so), 1 if small else 3), 3)
                row["same bits"] = len(modes) == 1 or all(torch.equal(a, b) for a, b in zip(*outs.values()))
                rows.append(row)
                log(json.dumps(row))
                del outs, args
                free_memory(host_cache=False)
    _set(modes[0])
    return rows


def _shrink(arch, args):
    """--small: a few state elements, the same structure."""
    h0, x, dt, A, B, C = args
    if arch == "mamba1":
        return h0[:, :24], x[..., :24], dt[..., :24], A[:24], B, C
    return h0[:, :3, :8, :16], x[:, :, :3, :8], dt[..., :3], A[:3], B[..., :16], C[..., :16]


def mamba2_params(cfg: MambaConfig, seed: int, device: str) -> dict:
    """mamba_ssm Mamba2's initial scale, rounded to float32 values (as a checkpoint holds them), float64 masters on
    the host; A = -exp(A_log) from a float32 A_log in [log 1, log 16], as the transformers loader makes it."""
    g = torch.Generator(device).manual_seed(seed)
    u = lambda s, b: (torch.rand(s, generator=g, device=device, dtype=torch.float64) * 2 - 1) * b  # noqa: E731
    K, L = cfg.d_conv, cfg.n_layer
    out = {}
    for name, shape in param_shapes(cfg).items():
        leaf = name.split(".")[-1]
        if name == "lm_head":
            continue
        if name == "embed":
            t = torch.randn(shape, generator=g, device=device, dtype=torch.float64) * 0.02
        elif leaf in ("norm", "norm_f", "ssm_norm", "D"):
            t = torch.ones(shape, dtype=torch.float64, device=device)
        elif leaf in ("conv_w", "conv_b"):
            t = u(shape, 1 / math.sqrt(K))
        elif leaf == "dt_bias":
            dt = torch.exp(u(shape, 1.0) * 0.5 * math.log(100) + math.log(1e-2)).clamp(min=1e-4)
            t = dt + torch.log(-torch.expm1(-dt))
        elif leaf == "A":
            a_log = torch.log(1 + 15 * torch.rand(shape, generator=g, device=device, dtype=torch.float64))
            t = -torch.exp(a_log.to(torch.float32).to(torch.float64))
        else:                                            # in_proj, out_proj (rescaled for the residual stream)
            t = u(shape, 1 / math.sqrt(shape[1])) / (math.sqrt(L) if leaf == "out_proj" else 1)
        out[name] = (t if leaf == "A" else t.to(torch.float32).to(torch.float64)).cpu()
    out["lm_head"] = out["embed"]
    return out


def part_e2e(small: bool, layers: int | None, rounds: int, modes: tuple, ubatch: int, breakdown: bool,
             profile: bool = False) -> list:
    cfg = MambaConfig(**dict(MAMBA2_2P7B, **(dict(d_model=64, n_layer=2, vocab_size=97, d_state=16, head_dim=16)
                                            if small else {}), **({"n_layer": layers} if layers else {})),
                      layer_types=("mamba2",) * (2 if small else layers or 64))
    model = MambaModel(cfg, mamba2_params(cfg, 0, "cuda" if CUDA else "cpu"), source="random mamba_ssm init")
    gen = torch.Generator().manual_seed(1)
    n_tok = 24 if small else 2048
    prompt = torch.randint(0, cfg.vocab_size, (n_tok,), generator=gen).tolist()
    s = CompareSettings(kernels="triton", device="cuda" if CUDA else "interpret", ubatch=8 if small else ubatch,
                        n_gen=2 if small else 4, capture="metrics", ref_device="cuda" if CUDA else "cpu")
    log(f"e2e: {model!r}, {n_tok}+{s.n_gen} tokens, ubatch {s.ubatch}; a warm-up over {len(prompt[:256])} tokens")
    run_compare(model, prompt[:256], s)                  # Triton's compiles, the weights' casts
    rows = []
    for k in range(rounds):
        for mode in modes:
            _set(mode)
            reset_peak()
            t = time.perf_counter()
            res = run_compare(model, prompt, s)
            sync()
            rows.append({"part": "e2e", "recurrence": mode, "round": k, "seconds": round(time.perf_counter() - t, 2),
                         "peak_gpu_gb": round((peak_gpu() or 0) / GB, 2), "first_divergence": res.first_divergence,
                         "kld_max": float(res.logits["kld"].max()), "layers": cfg.n_layer, "tokens": n_tok,
                         "ubatch": s.ubatch, "date": TODAY})
            log(json.dumps(rows[-1], default=str))
    if profile:                                          # one more under cProfile: where the host's time goes
        import cProfile  # noqa: PLC0415
        import pstats  # noqa: PLC0415
        prof = cProfile.Profile()
        prof.runcall(run_compare, model, prompt, s)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    if breakdown:                                        # one more with each side synced and timed
        from gpu_e2e import Breakdown  # noqa: PLC0415
        _set(modes[0])
        with Breakdown() as parts:
            t = time.perf_counter()
            run_compare(model, prompt, s)
        rows.append({"part": "e2e breakdown", "recurrence": modes[0], "seconds": round(time.perf_counter() - t, 2),
                     "split_s": {k: round(v, 2) for k, v in parts.seconds.items()}, "date": TODAY})
        log(json.dumps(rows[-1]))
    _set(modes[0])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes on a CPU (the interpreter): the script's check")
    ap.add_argument("--parts", default="ops,e2e", help="comma-separated subset of ops,e2e")
    ap.add_argument("--layers", type=int, default=None, help="part 2's layers (default 64)")
    ap.add_argument("--rounds", type=int, default=2, help="part 2's alternating rounds")
    ap.add_argument("--breakdown", action="store_true", help="part 2: one more run, each side synced and timed")
    ap.add_argument("--profile", action="store_true", help="part 2: one more run under cProfile (printed)")
    ap.add_argument("--ubatch", type=int, default=32, help="part 2's ubatch (64 needs ~78 GB for the 2.7B: refused "
                                                            "on an 80 GB card)")
    args = ap.parse_args(argv)
    if not CUDA and not args.small:
        sys.exit("reference_gpu.py: no GPU (use --small to check the script on a CPU)")
    modes = ("always", "off") if args.small and MODES[0] == "cuda" else MODES
    gpu = torch.cuda.get_device_name() if CUDA else "no GPU"
    parts = set(args.parts.split(","))
    rows = part_ops(args.small, modes) if "ops" in parts else []
    if "e2e" in parts:
        rows += part_e2e(args.small, args.layers, 1 if args.small else args.rounds, modes, args.ubatch,
                         args.breakdown, args.profile)
    out = Path(os.environ.get("OUT", ROOT / "out" / "benchmarks-gpu"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "reference_gpu.json").write_text(json.dumps({"gpu": gpu, "torch": torch.__version__, "modes": modes,
                                                        "rows": rows}, indent=1, default=str))
    print(f"\n{gpu}, torch {torch.__version__}; recurrence modes {modes}")
    for r in rows:
        print(" | ".join(f"{k} {v}" for k, v in r.items() if k != "date"))
    bad = [r for r in rows if r.get("same bits") is False or r.get("first_divergence")]
    print(f"{len(bad)} row(s) with other bits or a divergence" if bad else "every mode gave the same bits")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
