"""H200: kernels/triton.py's ssm_scan under forced plans (block, warps, chunks, slots, tiles) and its default plan;
each checked against float64. Prints a table last; writes tune.json to $OUT.

    TRITON_INTERPRET=0 python3 research/scan_rows/tune.py [b1] [b8] [other] [waves] [lead]   # groups (default: all)

The groups split the run across device calls (600 s each) if the whole one does not fit: b1 the d_inner-5120, L-2048
batch-1 and batch-2 prompts, b8 batch 8, other the rest; waves: chunk counts around whole waves of the batch-1 and
batch-2 prompts (16 one-warp programs an SM at 100-108 registers: 2112 on 132 SMs); lead: eight tokens in flight in
pass 1 alone (SLOTS_PASS1, the default since 2026-12-06), and in both passes, at batch 1 and 2, and the default
against four in pass 1 (the plan before) at the other chunked shapes."""
import json
import os
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
mod = load_plugin("triton", device="cuda").module
bw, er = copy_bandwidth(), exp_rate()
rows = []


def plan(bd, w, nc, slots=4, tiles=True, **opts):
    return dict(schedule="steps", BLOCK_D=bd, n_chunks=nc, SLOTS=slots, TILES=tiles, num_warps=w, **opts)


KNOWN = {"b1", "b8", "other", "waves", "lead"}
GROUPS = set(sys.argv[1:]) or KNOWN
if GROUPS - KNOWN:
    sys.exit(f"tune.py: unknown group(s) {sorted(GROUPS - KNOWN)}; choose from {', '.join(sorted(KNOWN))}")


def group(S, L, D, states):
    if (L, D) == (2048, 5120) and S in (1, 2) and not states:
        return "b1"
    return "b8" if (S, L, D) == (8, 2048, 5120) else "other"


def run(S, L, D, plans, states=False, grp=None):
    if (grp or group(S, L, D, states)) not in GROUPS:
        return
    h0, x, dt, A, B, C = scan_inputs(S, L, D)
    ref = ops.ssm_scan(*(t.double() for t in (h0, x, dt, A, B, C)))
    floor = max(4 * (3 * S * L * D + 2 * S * L * 16 + D * 16 + 2 * S * D * 16) / bw, S * L * D * 16 / er) * 1e6
    so = torch.empty(S, L, D, 16, device="cuda") if states else None
    for name, p in [("default " + json.dumps(mod.scan_plan(S, L, D, 16, device=x.device)), None)] + plans:
        name = name if isinstance(name, str) else str(name)
        try:
            fn = lambda: mod.ssm_scan(h0, x, dt, A, B, C, states_out=so, plan=p)  # noqa: E731
            y, h = fn()
            e = max(float(((a.double() - r) ** 2).sum() / (r ** 2).sum()) for a, r in zip((y, h), ref))
            us = do_bench_cudagraph(fn) * 1e3 if L == 1 else bench_cold(fn)
            rows.append(dict(S=S, L=L, D=D, states=states, plan=name, us=round(us, 2), x_floor=round(us / floor, 2),
                             nmse=e))
        except Exception as ex:  # noqa: BLE001
            rows.append(dict(S=S, L=L, D=D, states=states, plan=name, error=repr(ex)[:300]))
        print(rows[-1], flush=True)
    (OUT / "tune.json").write_text(json.dumps(dict(triton=triton.__version__, rows=rows), indent=1))


def P(bd, w, nc, slots=4, tiles=True, **opts):
    return (f"bd{bd} w{w} c{nc} s{slots}{'' if tiles else ' 1-D'}"
            f"{''.join(' ' + (k if v is True else f'{k}={v}') for k, v in opts.items())}",
            plan(bd, w, nc, slots, tiles, **opts))


# the chunked plans' options (kernels/triton.py _scan_steps; research/scan_rows/sass.py counts their instructions)
D_, R_, C_ = dict(DELTA=True), dict(REVERSE=True), dict(CARRY2=True)
ALL = dict(DELTA=True, REVERSE=True, CARRY2=True)
# 64 channels in one warp (two state rows a lane, never timed with four slots): 8.9 instructions a state element
# against 10.9 in one pass, 6.5 in DELTA's pass 2 (sass.py), at 168 registers (254 in DELTA's pass 1)
run(1, 2048, 5120, [P(32, 1, 24, **o) for o in (D_, R_, C_, dict(D_, **R_), ALL)] + [P(32, 1, c, **ALL) for c in (
    16, 20, 28, 30)] + [P(32, 1, c) for c in (16, 20)] + [P(64, 1, c, **o) for c in (12, 16, 19, 24) for o in (
    R_, ALL, dict(ALL, BLOCK_D_PASS1=32))])
run(2, 2048, 5120, [P(32, 1, 12, **ALL), P(32, 1, 12, **R_), P(64, 1, 10, **ALL), P(64, 1, 10, **R_)])
run(8, 2048, 5120, [P(32, 1, 1), P(32, 1, 2), P(32, 1, 3), P(32, 1, 2, **R_), P(32, 1, 3, **R_), P(32, 1, 3, **ALL),
                    P(64, 1, 1), P(64, 1, 1, 1), P(64, 1, 2, **R_), P(64, 1, 2, **ALL), P(128, 1, 1)])
run(1, 2048, 1536, [P(32, 1, c, **ALL) for c in (32, 38)] + [P(64, 1, c, **ALL) for c in (32, 48)])
run(1, 8192, 5120, [P(32, 1, 24, **ALL), P(32, 1, 24, **R_), P(64, 1, 19, **ALL), P(64, 1, 24, **ALL)])
run(1, 512, 5120, [P(32, 1, 8, **ALL), P(64, 1, 8, **ALL)])
run(1, 2048, 5120, [P(32, 1, 24, **ALL), P(64, 1, 19, **ALL)], states=True)
run(1, 1, 5120, [P(64, 1, 1, 1, False)])
# pass 2 runs 160 x chunks programs at batch 1: 13 chunks fill one wave of 2112, 26 two (24, the default, 1.82)
run(1, 2048, 5120, [P(32, 1, c) for c in (12, 13, 22, 25, 26)] + [P(32, 1, 26, **C_)], grp="waves")
run(2, 2048, 5120, [P(32, 1, c) for c in (6, 13)], grp="waves")
# eight tokens in flight in pass 1 only (128 registers, still four warps a scheduler; pass 2 would take 133: lead.py),
# the default since the thirty-fourth session
run(1, 2048, 5120, [P(32, 1, 24, SLOTS_PASS1=8), P(32, 1, 24, 8), P(32, 1, 26, SLOTS_PASS1=8)], grp="lead")
run(2, 2048, 5120, [P(32, 1, 12, SLOTS_PASS1=8), P(32, 1, 12, 8)], grp="lead")


def default_with(S, L, D, **opts):
    """The default plan at this shape with options added (a chunked plan's option timed at every chunked shape)."""
    return (f"default {' '.join(f'{k}={v}' for k, v in opts.items())}",
            dict(mod.scan_plan(S, L, D, 16, device=torch.device("cuda")), **opts))


# the default chunked plans take eight in pass 1 since the thirty-fourth session; four there is the plan before
# (results/lead_pass1_h100_2026-12-06.json: 1-12% slower)
for S, L, D, states in ((1, 512, 5120, False), (1, 8192, 5120, False), (1, 2048, 1536, False), (1, 2048, 3072, False),
                        (1, 128, 5120, False), (2, 512, 5120, False), (1, 2048, 5120, True)):
    run(S, L, D, [default_with(S, L, D, SLOTS_PASS1=4)], states=states, grp="lead")
run(64, 1, 5120, [P(32, 1, 1, 1, False), P(64, 2, 1, 1, False)])
run(1, 64, 5120, [P(32, 1, 1, 4)])
run(8, 100, 5120, [P(32, 1, 1, 4)])
print("\n| S | L | D | states | plan | us | x floor | nmse |")
for r in rows:
    print(f"| {r['S']} | {r['L']} | {r['D']} | {r['states']} | {r['plan'][:90]} | {r.get('us')} | {r.get('x_floor')} | "
          f"{r.get('nmse', r.get('error'))} |")
