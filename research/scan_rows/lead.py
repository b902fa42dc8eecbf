"""Goal 4's last idea: loads issued further ahead in the prefill scan's step loop. kernels/triton.py kept four tokens
in flight (SLOTS 4: each token's x, dt, B, C loaded four steps before its step). This probe rewrites that loop for K
tokens in flight (K register sets, each loaded K steps ahead), leaving everything else in `_ssm_scan_kernel` as it is,
then

    PYTHONPATH=/tmp/t36 python3 research/scan_rows/lead.py sass     # no GPU: registers, spills, loop length (sm_90)
    PYTHONPATH=/tmp/t36 python3 research/scan_rows/lead.py same     # no GPU: kernels/triton.py's SLOTS 4, 8 = K 4, 8
    python3 research/scan_rows/lead.py check                         # no GPU: each K's answers under the interpreter
    TRITON_INTERPRET=0 python3 research/scan_rows/lead.py time      # GPU: each K beside the default, vs float64

`time` swaps the variant into the plug-in's pass launcher (`_launch_scan`) for its rows only, so the plans, the
chunking and the host work are the product's ("default": the kernel as it is, since 2026-12-06 eight tokens in
flight in a one-pass prompt, four in a chunked one); writes lead.json to $OUT and prints a table last.
Results: results/lead_h100_2026-12-06.json (K 6-16, before the default took eight), README.md.
"""
import importlib.util
import inspect
import json
import os
import re
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(Path(__file__).parent)]
WANT = sys.argv[1] if len(sys.argv) > 1 else "sass"
if WANT in ("sass", "same"):
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = "1" if WANT == "check" else "0"

from mamba_debug.plugins import load_plugin  # noqa: E402

MOD = load_plugin("triton", device="interpret" if WANT == "check" else "cuda").module
START = "    x0, dt0, B0, C0 = _token(x_p, dt_p, B_p, C_p, 0,"
END = "        i += SLOTS\n"
TOKEN = "    {v} = _token(x_p, dt_p, B_p, C_p, {j}, n_tok, *strides_t, mask_d, mask_n, IS_DELTA)\n"
BASE = dict(TILES=True, HAS_STATES_OUT=False, BLOCK_D=32, BLOCK_N=16, DELTA=False, REVERSE=False, CARRY2=False)
CASES = (("b1 pass 1", 1, 24, True), ("b1 pass 2", 1, 24, False), ("b8 one pass", 8, 1, False))  # S, chunks, pass 1
STEP = ("        h, dsum = _step(h, dsum, A, {v}, *out, i + {k}, n_tok, stride_y_t, stride_so_t, mask_d, mask_dn,\n"
        "                        SUMMARY, HAS_STATES_OUT, TILES, DELTA)\n")


def loop(k: int) -> str:
    """The step loop with k tokens in flight: slot s holds token i + s and is refilled with token i + k + s."""
    names = [f"x{s}, dt{s}, B{s}, C{s}" for s in range(k)]
    text = "".join(TOKEN.format(v=names[s], j=s) for s in range(k)) + "    i = 0\n    while i < n_tok:\n"
    for s in range(k):
        text += STEP.format(v=names[s], k=s) + "    " + TOKEN.format(v=names[s], j=f"i + {k + s}")
    return text + f"        i += {k}\n"


def variant(k: int):
    """`_ssm_scan_kernel` with k tokens in flight, a jit kernel in a module of its own (Triton reads its source)."""
    src = textwrap.dedent(inspect.getsource(MOD._ssm_scan_kernel.fn))
    a, b = src.index(START), src.index(END) + len(END)
    src = src[:a] + loop(k) + src[b:]
    src = re.sub(r"^def _ssm_scan_kernel\b", f"def lead{k}", src, flags=re.M)
    path = Path(tempfile.mkdtemp()) / f"lead{k}.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n" + src)
    spec = importlib.util.spec_from_file_location(f"lead{k}", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    m.__dict__.update({n: v for n, v in vars(MOD).items() if not n.startswith("__") and n not in m.__dict__})
    return getattr(m, f"lead{k}")


def sass():
    from sass import build, launch_values, longest_loop, _tool
    print("| K | case | registers | stack / local bytes | loop instructions | per token |")
    print("|---|---|---|---|---|---|")
    for k in (4, 6, 8, 12):
        kern = variant(k)
        for name, S, chunks, summary in CASES:
            c = build(kern, launch_values(S, 2048, 5120, 16, chunks),
                      dict(BASE, SLOTS=4, CHUNKED=chunks > 1, SUMMARY=summary))
            res = _tool("cuobjdump", "-res-usage", c)
            regs = re.search(r"REG:(\d+)", res).group(1)
            stack = re.search(r"STACK:(\d+)", res)
            local = re.search(r"LOCAL:(\d+)", res)
            n = sum(longest_loop(_tool("cuobjdump", "-sass", c)).values())
            spill = f"{stack and stack.group(1)} / {local and local.group(1)}"
            print(f"| {k} | {name} | {regs} | {spill} | {n} | {n / k:.1f} |")


def same():
    """The product kernel with SLOTS 4 and 8 against the probe's K 4 and 8, compiled for sm_90: the same SASS, so
    the probe's timings are the product's (the claim the plan's change rests on until its own CUDA run)."""
    from sass import build, instructions, launch_values, _tool

    def sass_of(kernel, values, consts):
        return [ins for _, ins in instructions(_tool("cuobjdump", "-sass", build(kernel, values, consts)))]
    for name, S, chunks, summary in CASES:
        consts, values = dict(BASE, CHUNKED=chunks > 1, SUMMARY=summary), launch_values(S, 2048, 5120, 16, chunks)
        for k in (4, 8):
            a = sass_of(MOD._ssm_scan_kernel, values, dict(consts, SLOTS=k))
            b = sass_of(variant(k), values, dict(consts, SLOTS=4))
            print(f"{name}, {k} in flight: {len(a)} / {len(b)} instructions, {'identical' if a == b else 'DIFFER'}")


def check():
    """Each K, forced onto the step schedule under the interpreter (awkward sizes, one pass and chunked), against
    float64: the rewrite changes when a token is loaded, never what is computed."""
    import torch
    from mamba_debug import ops
    from mamba_debug.metrics import nmse
    torch.manual_seed(0)
    S, T, D, N = 2, 37, 40, 16
    h0, x, dt = torch.randn(S, D, N), torch.randn(S, T, D), torch.randn(S, T, D)
    A, B, C = -torch.rand(D, N) - 0.5, torch.randn(S, T, N), torch.randn(S, T, N)
    ref = ops.ssm_scan(*(t.double() for t in (h0, x, dt, A, B, C)))
    kept = MOD._launch_scan
    for k in (4, 6, 8):
        MOD._launch_scan = MOD.Launch(variant(k), True)
        for chunks in (1, 3):
            plan = dict(schedule="steps", BLOCK_D=32, n_chunks=chunks, SLOTS=4, TILES=True, num_warps=1)
            got = MOD.ssm_scan(h0, x, dt, A, B, C, plan=plan)
            e = max(nmse(a, r) for a, r in zip(got, ref))
            print(f"K {k}, {chunks} chunk(s): nmse {e:.1e}")
            assert e < 1e-10, e
    MOD._launch_scan = kept


def time():
    import torch
    from h200 import bench_cold, scan_inputs
    from mamba_debug import ops
    from mamba_debug.metrics import nmse
    kept = MOD._launch_scan
    rows = []
    # d_inner 5120: L 2048 chunked (batch 1, 2) and in one pass (4, 8, 16), then shorter one-pass prompts
    for S, L in ((1, 2048), (2, 2048), (4, 2048), (8, 2048), (16, 2048), (8, 100), (64, 64), (8, 512)):
        h0, x, dt, A, B, C = scan_inputs(S, L, 5120)
        ref = ops.ssm_scan(*(t.double() for t in (h0, x, dt, A, B, C)))
        for k in ("default", 4, 8, 12):
            MOD._launch_scan = kept if k == "default" else MOD.Launch(variant(k), False)
            try:
                fn = lambda: MOD.ssm_scan(h0, x, dt, A, B, C)  # noqa: E731
                y, h = fn()
                e = max(nmse(a, r) for a, r in zip((y, h), ref))
                rows.append(dict(batch=S, L=L, K=k, time_us=round(bench_cold(fn), 2), nmse=e))
            except Exception as exc:        # a variant that does not compile or launch is a row, not the end
                rows.append(dict(batch=S, L=L, K=k, error=f"{type(exc).__name__}: {str(exc)[:120]}"))
            finally:
                MOD._launch_scan = kept
            print(rows[-1], flush=True)
    out = Path(os.environ.get("OUT", "/tmp"))
    (out / "lead.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), rows=rows), indent=1))
    print("\n| batch | L | K | us | nmse |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['L']} | {r['K']} | {r.get('time_us', r.get('error'))} | {r.get('nmse', '')} |")


if __name__ == "__main__":
    {"sass": sass, "same": same, "check": check, "time": time}[WANT]()
