"""H200: kernels/triton.py's scan before and after the eighteenth session's change, default plans, three alternating
rounds, each output checked against float64; then chunk counts and (`decode`) decode blocks. Prints a table last,
writes paired.json to $OUT. The kernel before is the caller's to provide, untracked, for the device tool to carry:

    git show 3fa4b75:kernels/triton.py > kernels/zz_old_triton.py   # remove it afterwards

(`chunked` compared against 18e27ac's kernel the same way.)
"""
import json
import os
import statistics
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from h200 import bench_cold, scan_inputs, exp_rate, copy_bandwidth  # noqa: E402
from mamba_debug import ops  # noqa: E402
from mamba_debug.plugins import load_plugin  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp"))
new = load_plugin("triton", device="cuda").module
old = load_plugin("zz_old_triton", device="cuda").module
bw, er = copy_bandwidth(), exp_rate()
rows = []


def case(S, L, D, states=False, chunks=(), plans=()):
    h0, x, dt, A, B, C = scan_inputs(S, L, D)
    ref = ops.ssm_scan(*(t.double() for t in (h0, x, dt, A, B, C)))
    floor = max(4 * (3 * S * L * D + 2 * S * L * 16 + D * 16 + 2 * S * D * 16) / bw, S * L * D * 16 / er) * 1e6
    so = torch.empty(S, L, D, 16, device="cuda") if states else None
    fns = {"old": lambda: old.ssm_scan(h0, x, dt, A, B, C, states_out=so),
           "new": lambda: new.ssm_scan(h0, x, dt, A, B, C, states_out=so)}
    plan = new.scan_plan(S, L, D, 16, device=x.device)
    for nc in chunks:
        fns[f"new c{nc}"] = (lambda p: lambda: new.ssm_scan(h0, x, dt, A, B, C, states_out=so, plan=p))(
            dict(plan, n_chunks=nc))
    for bd, w in plans:
        fns[f"new bd{bd} w{w}"] = (lambda p: lambda: new.ssm_scan(h0, x, dt, A, B, C, states_out=so, plan=p))(
            dict(plan, BLOCK_D=bd, num_warps=w))
    times = {k: [] for k in fns}
    nm = {}
    for k, fn in fns.items():
        outs = fn()
        nm[k] = max(float(((a.double() - r) ** 2).sum() / (r ** 2).sum()) for a, r in zip(outs, ref))
    for _ in range(3):
        for k, fn in fns.items():
            times[k].append(do_bench_cudagraph(fn) * 1e3 if L == 1 else bench_cold(fn))
    for k in fns:
        med = statistics.median(times[k])
        rows.append(dict(S=S, L=L, D=D, states=states, kernel=k, plan=plan if k == "new" else None,
                         us_min=round(min(times[k]), 2), us_med=round(med, 2), x_floor=round(med / floor, 2),
                         floor_us=round(floor, 2), nmse=nm[k]))
        print(rows[-1], flush=True)
    (OUT / "paired.json").write_text(json.dumps(dict(triton=triton.__version__, torch=torch.__version__,
                                                     rows=rows), indent=1))


if sys.argv[1:] == ["decode"]:
    for S in (1, 8, 64):
        case(S, 1, 5120, plans=((16, 1), (32, 1), (64, 1), (64, 2)))
elif sys.argv[1:] == ["chunked"]:      # the chunked shapes only (pass 1 changed)
    case(1, 2048, 5120, chunks=(19, 28))
    case(1, 2048, 1536)
    case(1, 8192, 5120, chunks=(32,))
    case(1, 512, 5120)
    case(2, 2048, 5120, chunks=(9, 16))
    case(3, 2048, 5120, chunks=(6,))
    case(1, 2048, 5120, states=True)
else:
    case(1, 2048, 5120, chunks=(16, 20, 24, 28))
    case(8, 2048, 5120)
    case(1, 2048, 1536)
    case(1, 8192, 5120, chunks=(24, 32))
    case(1, 512, 5120)
    case(1, 64, 5120)
    case(8, 100, 5120)
    case(1, 2048, 5120, states=True)
    case(1, 512, 5120, states=True)
    case(1, 1, 5120)
    case(8, 1, 5120)
    case(64, 1, 5120)
print("\n| S | L | D | states | kernel | us med (min) | x floor | nmse vs fp64 |")
for r in rows:
    print(f"| {r['S']} | {r['L']} | {r['D']} | {r['states']} | {r['kernel']} | {r['us_med']} ({r['us_min']}) | "
          f"{r['x_floor']} | {r['nmse']:.2e} |")
