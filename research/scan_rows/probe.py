"""H200 probe: two prototype step scans against kernels/triton.py's ssm_scan as it was (3fa4b75): rows_k.py (whole
state rows per lane, built by tl.join; four tokens in flight after the first run) and deep_k.py (four tokens in flight).

Correctness against float64 (ops.ssm_scan) and cold timings (bench_cold) over block sizes and chunk counts.
Writes probe.json to $OUT and prints a table last."""
import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(Path(__file__).parent)]
import torch  # noqa: E402
import triton  # noqa: E402

from h200 import bench_cold, scan_inputs, exp_rate, copy_bandwidth  # noqa: E402
from mamba_debug import ops  # noqa: E402
from mamba_debug.plugins import load_plugin  # noqa: E402
import rows_k  # noqa: E402
import deep_k  # noqa: E402
KERNELS = dict(rows=rows_k, deep=deep_k)

OUT = Path(os.environ.get("OUT", "/tmp"))
trit = load_plugin("triton", device="cuda").module.OPS
bw, er = copy_bandwidth(), exp_rate()
rows = []


def err(y, h, yr, hr):
    return dict(y_nmse=float(((y.double() - yr) ** 2).sum() / (yr ** 2).sum()),
                h_nmse=float(((h.double() - hr) ** 2).sum() / (hr ** 2).sum()))


def run(S, L, D, variants):
    h0, x, dt, A, B, C = scan_inputs(S, L, D)
    yr, hr = ops.ssm_scan(*(t.double() for t in (h0, x, dt, A, B, C)))
    floor = max(4 * (3 * S * L * D + 2 * S * L * 16 + D * 16 + 2 * S * D * 16) / bw, S * L * D * 16 / er) * 1e6
    y, h = trit["ssm_scan"](h0, x, dt, A, B, C)
    us = bench_cold(lambda: trit["ssm_scan"](h0, x, dt, A, B, C))
    rows.append(dict(S=S, L=L, D=D, variant="current", us=round(us, 1), x_floor=round(us / floor, 2),
                     floor_us=round(floor, 1), **err(y, h, yr, hr)))
    print(rows[-1], flush=True)
    for kind, bd, w, nc in variants:
        name = f"{kind} bd{bd} w{w} c{nc}"
        try:
            kw = dict(block_d=bd, warps=w, n_chunks=nc)
            if kind.startswith("deep"):
                kw["slots"] = int(kind[4:] or 4)
            mod = KERNELS[kind[:4]]
            y, h = mod.launch(h0, x, dt, A, B, C, **kw)
            us = bench_cold(lambda: mod.launch(h0, x, dt, A, B, C, **kw))
            rows.append(dict(S=S, L=L, D=D, variant=name, us=round(us, 1),
                             x_floor=round(us / floor, 2), floor_us=round(floor, 1), **err(y, h, yr, hr)))
        except Exception as e:  # noqa: BLE001
            rows.append(dict(S=S, L=L, D=D, variant=name, error=repr(e)[:300]))
        print(rows[-1], flush=True)
    (OUT / "probe.json").write_text(json.dumps(dict(triton=triton.__version__, torch=torch.__version__, rows=rows),
                                               indent=1))


K1 = [("deep", 64, 2), ("deep2", 64, 2), ("deep", 32, 1), ("rows", 32, 1), ("rows", 64, 2), ("rows", 64, 1)]
run(1, 2048, 5120, [(k, bd, w, nc) for k, bd, w in K1 for nc in (8, 12, 16, 20)])
run(8, 2048, 5120, [(k, bd, w, nc) for k, bd, w in K1 for nc in (1, 2)] + [("deep", 32, 2, 1), ("rows", 16, 1, 1)])
run(1, 2048, 1536, [(k, bd, w, nc) for k, bd, w in K1[:4] for nc in (16, 32, 48)])
run(1, 8192, 5120, [(k, bd, w, nc) for k, bd, w in K1[:4] for nc in (16, 24, 32)])
run(1, 512, 5120, [(k, bd, w, nc) for k, bd, w in K1[:4] for nc in (4, 8)])
run(64, 1, 5120, [(k, bd, w, 1) for k, bd, w in (("deep", 32, 1), ("rows", 32, 1), ("deep", 64, 2))])
print("\n| S | L | D | variant | us | x floor | y nmse |")
for r in rows:
    print(f"| {r['S']} | {r['L']} | {r['D']} | {r['variant']} | {r.get('us')} | {r.get('x_floor')} | "
          f"{r.get('y_nmse', r.get('error'))} |")
