"""Probe (issue #14): at -ngl 0 on a CUDA build, op offload runs big matmuls on CUDA while the SSM ops stay on the
CPU. The 2.8B shape then read 'DIVERGED at layer 0 y_scan' (0.917) with logits fine. For a 2-layer model of
d_model 256 over 40 tokens (op offload on) and 8 tokens (off), this prints the verdict, layer 0's node map, and how
the y_scan values read compare with candidate tensors of the reference, to find what the side really read."""
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import mamba_debug as md  # noqa: E402
from mamba_debug.compare import run_compare  # noqa: E402
from mamba_debug.config import MambaConfig  # noqa: E402
from mamba_debug.settings import RunSettings  # noqa: E402
from mamba_debug.views.summary import to_json  # noqa: E402

from mamba_debug.sides.llamacpp import preload  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_e2e import mamba_ssm_params  # noqa: E402

preload.restart(ROOT / "build/llama-cuda/bin")     # a CUDA build after numpy: this script again, libstdc++ preloaded


def rel(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float((a - b).norm() / b.norm()) if a.shape == b.shape else float("nan")


cfg = MambaConfig(d_model=256, n_layer=2, vocab_size=512, d_state=16, d_conv=4, expand=2)
gguf = md.export_gguf(md.build_model(cfg, mamba_ssm_params(cfg, 0, "cuda"), source="probe"),
                      Path("/tmp/probe-256.gguf"), dtype="f32")
model = md.load_model(gguf)
for n_tok, ngl in ((40, 0), (40, 3), (8, 0)):
    ids = [(7 * i + 3) % cfg.vocab_size for i in range(n_tok)]
    res = run_compare(model, ids, RunSettings(engine="llama.cpp", device="cuda", offload=ngl, ubatch=512, n_gen=0,
                                              reference="float64", capture="all", local=True,
                                              llama_lib=str(ROOT / "build/llama-cuda/bin")))
    j = to_json(res)
    print(f"\n== {n_tok} tokens, ngl {ngl}: {j['verdict']}")
    for n in j["config"]["llama_cpp"].get("nodes", []):
        if n.get("layer") == 0 and n["op"] in ("SSM_SCAN", "ADD", "MUL", "CPY", "SWIGLU"):
            print("   ", {k: n.get(k) for k in ("index", "name", "op", "backend", "site", "ne")})
    tr = res.trace
    dev = tr.get(("dev", 0, "y_scan"))
    if dev is None:
        print("   no dev y_scan kept; keys:", sorted(k for k in tr if k[1] == 0)[:40])
        continue
    print("   dev y_scan", tuple(dev.shape), dev.flatten()[:5].tolist())
    for (side, layer, site), v in sorted(tr.items(), key=str):
        if side == "ref" and layer in (0, 1) and v.numel() == dev.numel():
            print(f"     vs ref {layer}.{site}: {rel(dev, v):.3g}   transposed: "
                  f"{rel(dev.reshape(-1), v.transpose(-1, -2).reshape(-1)) if v.dim() == 3 else float('nan'):.3g}")
    ref = tr[("ref", 0, "y_scan")]
    print("   ref y_scan", ref.flatten()[:5].tolist())
    print("   per token rel err:", [round(rel(dev[0, t], ref[0, t]), 3) for t in range(0, n_tok, max(1, n_tok // 8))])
    D = cfg.d_inner
    for sh in (D, 16 * D, D * n_tok):
        if sh < dev.numel():
            print(f"   shifted by {sh}: {rel(dev.flatten()[:-sh], ref.flatten()[sh:]):.3g} / "
                  f"{rel(dev.flatten()[sh:], ref.flatten()[:-sh]):.3g}")
