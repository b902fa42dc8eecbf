import os, json, sys, torch
from pathlib import Path
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # this checkout's code
import mamba_debug as md
from mamba_debug import ops
k = md.load_kernels("triton", "cuda")
rows = []
def t(fn, n=20):
    fn(); torch.cuda.synchronize(); e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(n): fn()
    e1.record(); torch.cuda.synchronize(); return e0.elapsed_time(e1) * 1000 / n
for S, T in ((1, 2048), (8, 512), (64, 1)):
    H, P, G, N = 80, 64, 1, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)
    st, x, dt, A = torch.zeros(S, H, P, N, device="cuda"), r(S, T, H, P), r(S, T, H) - 2, -torch.rand(H, device="cuda") - 0.5
    B, C = r(S, T, G, N), r(S, T, G, N)
    y, h = k["ssd_scan"](st, x, dt, A, B, C)
    y64, h64 = ops.ssd_scan_chunked(*(a.double() for a in (st, x, dt, A, B, C)))
    rel = float((y.double() - y64).norm() / y64.norm())
    tt = t(lambda: k["ssd_scan"](st, x, dt, A, B, C))
    tr = t(lambda: ops.ssd_scan_chunked(st, x, dt, A, B, C), 3)
    rows.append({"op": "ssd_scan", "S": S, "T": T, "H": H, "P": P, "G": G, "N": N, "triton_us": round(tt, 1),
                 "torch_chunked_fp32_us": round(tr, 1), "rel_err_vs_float64": rel})
    print(rows[-1], flush=True)
json.dump(rows, open(os.environ.get("OUT", "/tmp") + "/mamba2_h200.json", "w"), indent=1)
