"""Engine speed on a CPU (issue: divergence engine, "Speed"): one compare of the shipped tiny model over a
64-token prompt plus 16 generated tokens with the Triton kernels under the interpreter (and with a bug variant),
the same compare of the shipped tiny Mamba-2 and hybrid models, and a full offload 0..n_layer+1 x 4-ubatch sweep
of the tiny Mamba-1. Prints a table and writes $OUT/engine_cpu.json ($OUT defaults to benchmarks/results: set it
for a check that must not replace the recorded figures).

Run: python benchmarks/engine_cpu.py     (goals, issue #18: compare <= 3 s, sweep <= 60 s on 2 cores)
"""
import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))      # this checkout's code, whatever checkout an editable install points at

import torch  # noqa: E402

import mamba_debug as md  # noqa: E402
from mamba_debug.compare import CompareSettings, run_compare  # noqa: E402
from mamba_debug.sweep import run_sweep  # noqa: E402

VAL_TEXT = Path(__file__).resolve().parent.parent / "data" / "tiny-mamba" / "val.txt"   # held-out Austen


OTHER_MODELS = ("tiny-mamba2", "tiny-granite-hybrid")      # shipped beside the tiny Mamba-1: one compare each


def _prompt(model) -> list:
    """The 64-token held-out prompt, in the model's own tokens."""
    ids = model.encode(VAL_TEXT.read_text()[:2000])[:64]
    assert len(ids) == 64, len(ids)
    return ids


def _compare_row(model, name, kernels):
    ids = _prompt(model)
    s = CompareSettings(kernels=kernels, device="interpret", ubatch=512, n_gen=16)
    run_compare(model, ids[:8], CompareSettings(kernels=kernels, device="interpret", n_gen=1))   # warm-up
    t = time.perf_counter()
    res = run_compare(model, ids, s)
    return {"what": f"compare 64+16, kernels {kernels}, offload all, ubatch 512", "model": name,
            "seconds": time.perf_counter() - t, "diverged": res.first_divergence is not None, "goal_s": 3}


def main():
    model = md.load_model()
    ids = _prompt(model)
    rows = [_compare_row(model, "tiny-mamba", kernels) for kernels in ("triton", "bug_strided_gate")]
    for name in OTHER_MODELS:
        rows.append(_compare_row(md.load_model(str(ROOT / "data" / name)), name, "triton"))
    t = time.perf_counter()
    sw = run_sweep(model, ids, CompareSettings(kernels="triton", device="interpret", n_gen=16),
                   ubatches=(1, 8, 32, 512), progress=False, workers=os.cpu_count() or 1)
    rows.append({"what": f"sweep offload 0..{model.config.n_layer + 1} x ubatch 1,8,32,512 ({len(sw['cells'])} runs), "
                         f"64+16 tokens, triton, {sw['workers']} processes", "model": "tiny-mamba",
                 "seconds": time.perf_counter() - t,
                 "diverged": any(c["first_divergence"] for c in sw["cells"]), "goal_s": 60})
    from mamba_debug.plugins import load_plugin  # noqa: PLC0415
    from mamba_debug.triton_launch import launch_paths  # noqa: PLC0415
    paths = sorted(set(launch_paths(load_plugin("triton").module).values()))
    out = {"date": datetime.date.today().isoformat(), "machine": f"{platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} cores, torch {torch.__version__}", "kernel_launches": paths, "model": repr(model),
           "rows": rows}
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    out_dir.joinpath("engine_cpu.json").write_text(json.dumps(out, indent=1))
    print(f"{'model':20s} {'what':100s} {'s':>7s} {'goal':>5s} diverged")
    for r in rows:
        print(f"{r['model']:20s} {r['what']:100s} {r['seconds']:7.2f} {r['goal_s']:5d} {r['diverged']}")


if __name__ == "__main__":
    main()
