"""Which activation rounding does llama.cpp's CUDA build apply to a narrow-weight matmul? (a probe, not a product path)

On a CPU build the rounding is known and emulated (mamba_debug/sides/llamacpp/activations.py), so a clean f16 / q8_0
node sits within ~1e-7 of the emulation and a 1e-4 fault is named at its node. On a CUDA build only the quantized
vector kernel (mmvq, at most 8 columns) is emulated since this probe found its rounding (cuda_mmvq_check.py checks
it); elsewhere such a node is excused up to its family's limit (2e-3 for f16, 0.08 for 8-bit), so a fault below that
reads as precision: this probe is how a candidate for those paths is tried. This probe runs the shipped models as f16 and q8_0 GGUFs with --local and, for every
MUL_MAT of narrow weights, prints its local error against the float64 product with each candidate rounding of its
activations (none; f16; bf16; q8 blocks in ggml-cpu's three forms; CUDA's quantize_q8_1, roundf(x / d), and its MMQ
form, roundf(x * 127 / amax), each with the block scale kept as f16 or as float32). A candidate at ~1e-7 on every
node of a path is what that path does: then it can be emulated as on the CPU.

    python3 benchmarks/cuda_rounding_probe.py [--device cuda|cpu] [--lib DIR] [--out DIR]

(--device cpu on a CPU build checks the probe itself: the "q8 x86" or "f16" candidate must read ~1e-7.)
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import mamba_debug as md  # noqa: E402
from mamba_debug.sides.llamacpp import activations as act, local, preload  # noqa: E402

SEEN: list = []


def _roundf(v: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero."""
    return np.sign(v) * np.floor(np.abs(v.astype(np.float64)) + 0.5)


def candidates(x: np.ndarray) -> dict:
    """The activations (..., K) as float64 after each candidate rounding."""
    x32 = np.ascontiguousarray(x, dtype=np.float32)
    out = {"none": x32.astype(np.float64), "f16": x32.astype(np.float16).astype(np.float64),
           "bf16": act._bf16(x32)}
    if x32.shape[-1] % 32:
        return out
    for form in act.Q8_FORMS:
        out[f"q8 cpu {form}"] = act._q8_0(x32, form)
    b = x32.reshape(-1, 32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    d = amax / np.float32(127)
    q_div = np.where(amax > 0, _roundf(b / np.where(d > 0, d, 1)), 0)
    q_mmq = np.where(amax > 0, _roundf(b * (np.float32(127) / np.where(amax > 0, amax, 1))), 0)
    for name, q in (("cuda x/d", q_div), ("cuda mmq", q_mmq)):
        out[f"q8 {name}, d f16"] = (q * d.astype(np.float16).astype(np.float64)).reshape(x32.shape)
        out[f"q8 {name}, d f32"] = (q * d.astype(np.float64)).reshape(x32.shape)
    return out


def _hook():
    """Wrap LocalErrors.add: every MUL_MAT of narrow weights is measured against each candidate first."""
    add = local.LocalErrors.add

    def probing(self, node, srcs, got, u, first_seq=0, weights=0, mins=None):
        name = local.WEIGHT_TYPES.get(weights)
        if node.op == "MUL_MAT" and name and all(a is not None for a in srcs[:2]):
            w = srcs[0].astype(np.float64, copy=False)
            errs = {}
            for cand, x in candidates(srcs[1]).items():
                want = local.recompute("MUL_MAT", [w, x], got.shape, ())
                if want is not None and want.shape == got.shape:
                    errs[cand] = local.rel_l2(got.astype(np.float64), want)
            SEEN.append({"weights": name, "path": local.path_of(node, weights), "backend": node.backend,
                         "cols": int(np.prod(node.ne[1:])), "K": int(srcs[1].shape[-1]), "site": node.site,
                         "errors": errs})
        return add(self, node, srcs, got, u, first_seq, weights, mins)

    local.LocalErrors.add = probing


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--lib", default=None, help="llama.cpp library folder (--llama-lib)")
    ap.add_argument("--out", default="out/cuda_rounding_probe")
    ap.add_argument("--ubatches", default="1,8,512")
    a = ap.parse_args()
    if a.lib:
        preload.restart(Path(a.lib))        # a CUDA build after numpy: this script again, libstdc++ preloaded
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    _hook()
    ids = list(range(5, 30))
    table = collections.defaultdict(lambda: collections.defaultdict(float))
    for data in ("tiny-mamba", "tiny-mamba2"):
        for dtype in ("f16", "q8_0"):
            gguf = md.export_gguf(md.load_model(str(ROOT / "data" / data)), out / f"{data}-{dtype}.gguf", dtype=dtype)
            model = md.load_model(gguf)
            for ub in (int(u) for u in a.ubatches.split(",")):
                SEEN.clear()
                s = md.RunSettings(engine="llama.cpp", device=a.device, llama_lib=a.lib, ubatch=ub, n_seqs=2,
                                   n_gen=2, local=True)
                res = md.run_compare(model, ids, s)
                for r in SEEN:
                    key = (data, dtype, ub, r["path"].split(";")[0], r["backend"])
                    for cand, e in r["errors"].items():
                        table[key][cand] = max(table[key][cand], e)
                print(f"{data} {dtype} ub {ub}: {len(SEEN)} narrow matmuls, verdict "
                      f"{res.first_divergence and res.first_divergence['by']}", flush=True)
    rows = [{"model": k[0], "gguf": k[1], "ubatch": k[2], "path": k[3], "backend": k[4], "worst": dict(v)}
            for k, v in table.items()]
    (out / "cuda_rounding_probe.json").write_text(json.dumps(rows, indent=1))
    for r in rows:     # the best three candidates per cell: the path's rounding is the one near 1e-7
        best = sorted(r["worst"].items(), key=lambda kv: kv[1])[:3]
        print(f"{r['model']:12s} {r['gguf']:5s} ub {r['ubatch']:3d} {r['backend']:10s} {r['path'][:22]:22s} " +
              "  ".join(f"{c}: {e:.2g}" for c, e in best))


if __name__ == "__main__":
    main()
