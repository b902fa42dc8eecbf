"""Does --local's emulation of CUDA's vector kernel for quantized weights (mul_mat_vec_q, at most 8 columns) hold on a
real GPU? (activations.emulation; its rounding read from ggml-cuda's quantize.cu and vecdotq.cuh.)

For each of llama.cpp's own quantizations of a random 256-wide Mamba-1 (rows of 256, so every K-quant applies), two
runs on the CUDA build with local errors: clean, where every mmvq node must sit within k x the FP32 floor of its
emulation (no fault), and with one node 1e-4 off in half its values (layer 1's xz, second ubatch), which must be
named at that node with "emulated" in its reason. Before the emulation such a fault passed as precision unless it
reached 0.08. `-ub` 1 (one sequence) and 8 (two sequences: 4 columns), every layer on the GPU; and `-ngl 1`, which
leaves layer 0 on the CPU (the CPU's rounding emulated there), with the fault in layer 0. Then the three shipped
models as q8_0 GGUFs, clean, `-ub` 1 and 8, two sequences.

    python3 benchmarks/cuda_mmvq_check.py --lib build/llama-cuda/bin [--kinds Q8_0,Q4_0,...] [--out DIR]

--device cpu with a CPU build checks the script itself (its nodes emulated as a CPU build's).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

KINDS = "Q8_0,Q4_0,Q5_0,Q4_1,Q5_1,Q2_K,Q3_K_M,Q4_K_M,Q5_K_M,Q6_K"
QUANTIZE = """
import ctypes, importlib.util, sys, types
if importlib.util.find_spec("diskcache") is None:   # llama_cpp's package imports it; its quantizer does not use it
    sys.modules["diskcache"] = types.ModuleType("diskcache")
import llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + sys.argv[3])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))
"""


def quantize(f32: Path, kind: str, lib) -> Path:
    """llama.cpp's own quantizer, in a child process (llama_cpp's Python package on this build's library)."""
    out = f32.with_name(f"{kind}.gguf")
    env = dict(os.environ, **({"LLAMA_CPP_LIB_PATH": str(lib)} if lib else {}))
    done = subprocess.run([sys.executable, "-c", QUANTIZE, str(f32), str(out), kind], env=env, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"llama_model_quantize to {kind} failed:\n{done.stderr[-2000:]}")
    return out


def off_by(node, rel: float):
    """A fault in the node's own memory, host or device (lside.FAULT's array views host memory only): half its
    values times 1 + rel, written back through ggml, so the nodes after it read it too."""
    import numpy as np  # noqa: PLC0415
    from mamba_debug.sides.llamacpp import lib as libmod  # noqa: PLC0415
    from mamba_debug.sides.llamacpp.nodes import read_data  # noqa: PLC0415
    lib = libmod._LOADED
    data = np.ascontiguousarray(read_data(lib, node), dtype=np.float32)
    data.reshape(-1)[: data.size // 2] *= np.float32(1 + rel)
    assert data.nbytes == node.ne[0] * node.ne[1] * node.ne[2] * node.ne[3] * 4     # a contiguous float32 node
    lib.ggml_backend_tensor_set(node.addr, data.ctypes.data, 0, data.nbytes)


def summary(res) -> dict:
    """What a run said of its narrow-weight matmuls: paths, worst emulated error, the verdict's first divergence."""
    items = (res.precision or {}).get("items", [])
    emulated = [i["emulated_error"] for i in items if "emulated_error" in i]
    fd = res.first_divergence
    return {"mmvq_nodes": sum("CUDA mmvq" in i.get("path", "") for i in items), "narrow_items": len(items),
            "emulated": len(emulated), "worst_emulated": max(emulated, default=None),
            "worst_plain": max((i["error"] for i in items), default=None),
            "first_divergence": None if fd is None else {k: fd.get(k) for k in ("layer", "site", "ubatch", "by")}}


def shipped(md, a, out: Path) -> list:
    """The three shipped models as q8_0 GGUFs (this project's export), two sequences, `-ub` 1 and 8, clean: every
    mmvq node within the floor of its emulation (none of their matmuls is faulted here)."""
    rows = []
    for name in ("tiny-mamba", "tiny-mamba2", "tiny-granite-hybrid"):
        gguf = md.export_gguf(md.load_model(str(ROOT / "data" / name)), out / f"{name}-q8_0.gguf", dtype="q8_0")
        model = md.load_model(gguf)
        for ub in (1, 8):
            s = md.RunSettings(engine="llama.cpp", device=a.device, llama_lib=a.lib, ubatch=ub, n_seqs=2, n_gen=2,
                               local=True)
            clean = summary(md.run_compare(model, list(range(5, 30)), s))
            rows.append({"kind": f"{name} q8_0", "ubatch": ub, "n_seqs": 2, "offload": None, "clean": clean,
                         "clean_ok": clean["first_divergence"] is None, "fault_named": True})
            print(f"{name} q8_0 ub {ub} x2: clean {'ok' if rows[-1]['clean_ok'] else 'FLAGGED'} (mmvq nodes "
                  f"{clean['mmvq_nodes']}, emulated {clean['emulated']}/{clean['narrow_items']}, worst "
                  f"{clean['worst_emulated'] or 0:.2g}; plain {clean['worst_plain'] or 0:.2g})", flush=True)
        gguf.unlink()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lib", default=None, help="llama.cpp library folder (--llama-lib)")
    ap.add_argument("--kinds", default=KINDS)
    ap.add_argument("--out", default="out/cuda_mmvq_check")
    ap.add_argument("--d-model", type=int, default=256, help="the random Mamba-1's width (2560: mamba-2.8b's)")
    ap.add_argument("--no-shipped", dest="shipped", action="store_false", help="skip the shipped models' q8_0 runs")
    a = ap.parse_args()
    from mamba_debug.sides.llamacpp import preload  # noqa: PLC0415
    if a.lib:
        preload.restart(Path(a.lib))        # a CUDA build after numpy: this script again, libstdc++ preloaded
    import numpy as np  # noqa: PLC0415
    import mamba_debug as md  # noqa: PLC0415
    from conftest import random_model  # noqa: PLC0415
    from mamba_debug.sides.llamacpp import side as lside  # noqa: PLC0415
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    f32 = md.export_gguf(random_model(d_model=a.d_model, n_layer=2, vocab_size=512, d_state=16), out / "f32.gguf",
                         dtype="f32")
    ids = [int(i) for i in np.random.default_rng(1).integers(3, 499, 25)]

    rows = []
    for kind in a.kinds.split(","):
        model = md.load_model(quantize(f32, kind, a.lib))
        # (ubatch, sequences, offload, the faulty node's layer): all on the GPU; -ngl 1 leaves layer 0 on the CPU
        for ub, seqs, offload, layer in ((1, 1, None, 1), (8, 2, None, 1), (8, 2, 1, 0)):
            def fault(node, arr, u, first_seq, layer=layer):
                if node.layer == layer and node.site == "xz" and u == 1:
                    off_by(node, 1e-4)

            s = md.RunSettings(engine="llama.cpp", device=a.device, llama_lib=a.lib, ubatch=ub, n_seqs=seqs,
                               n_gen=2, local=True, offload=offload if a.device == "cuda" else None)
            lside.FAULT = None
            clean = summary(md.run_compare(model, ids, s))
            lside.FAULT = fault
            faulty = summary(md.run_compare(model, ids, s))
            lside.FAULT = None
            fd = faulty["first_divergence"] or {}
            named = (fd.get("layer"), fd.get("site"), fd.get("ubatch")) == (layer, "xz", 1) and "emulated" in fd["by"]
            rows.append({"kind": kind, "ubatch": ub, "n_seqs": seqs, "offload": offload, "fault_layer": layer,
                         "clean": clean, "faulty": faulty, "clean_ok": clean["first_divergence"] is None,
                         "fault_named": named})
            worst = "-" if clean["worst_emulated"] is None else f"{clean['worst_emulated']:.2g}"
            print(f"{kind:7s} ub {ub} x{seqs} -ngl {offload or 'all'}: clean "
                  f"{'ok' if rows[-1]['clean_ok'] else 'FLAGGED'} (mmvq nodes "
                  f"{clean['mmvq_nodes']}, emulated {clean['emulated']}/{clean['narrow_items']}, worst {worst}; "
                  f"plain {clean['worst_plain'] or 0:.2g}); 1e-4 fault {'named' if named else 'MISSED'}: "
                  f"{fd.get('by')}" + ("" if rows[-1]["clean_ok"] else f"; clean read {clean['first_divergence']}"),
                  flush=True)
    rows += shipped(md, a, out) if a.shipped else []
    (out / "cuda_mmvq_check.json").write_text(json.dumps(rows, indent=1))
    bad = [f"{r['kind']} ub {r['ubatch']} -ngl {r['offload'] or 'all'}" for r in rows
           if not (r["clean_ok"] and r["fault_named"])]
    print("all cells: clean read clean, the fault named" if not bad else f"NOT AS EXPECTED: {', '.join(bad)}")


if __name__ == "__main__":
    main()
