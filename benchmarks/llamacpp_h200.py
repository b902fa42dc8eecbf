"""llama.cpp's CUDA build traced on the H200: the grid of issue #14 (item 11).

Run on the GPU machine after benchmarks/llamacpp_h200_build.sh (LLAMA_CPP_LIB_PATH=build/llama-cuda/bin):
    python3 benchmarks/llamacpp_h200.py [smoke|grid|big|three] [--out DIR]
(three: the three-way, llama.cpp CUDA vs its CPU backend vs float64, on the shipped model; big: the 2.8B shape)
Prints one row per cell (engine, -ngl, -ub, sequences): the verdict, the first divergence, the largest logit error
against the float64 reference, the arithmetic paths that ran, tracing cost; writes the rows as JSON to --out.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import hashlib
import json
import os
import pstats
import resource
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mamba_debug as md  # noqa: E402
from mamba_debug.compare import run_compare  # noqa: E402
from mamba_debug.settings import RunSettings  # noqa: E402
from mamba_debug.sides.llamacpp import preload  # noqa: E402
from mamba_debug.views.summary import local_line, to_json  # noqa: E402

N_GEN = 4
PROMPT = "It was a fine morning in the country, and Mr. Darcy had gone out early to walk along the river with his"


class MemoryPeak:
    """Peak memory of one cell: the GPU's (device-wide, so llama.cpp's own allocations count, sampled every 20 ms
    by a thread) and this process's resident host memory (the kernel's high-water mark, never reset)."""

    def __init__(self):
        self.gpu, self._stop = 0, threading.Event()

    def __enter__(self):
        import torch  # noqa: PLC0415
        self._free_total = torch.cuda.mem_get_info if torch.cuda.is_available() else None
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self):
        while self._free_total is not None and not self._stop.is_set():
            free, total = self._free_total()
            self.gpu = max(self.gpu, total - free)
            self._stop.wait(0.02)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def row(self) -> dict:
        return {"peak_gpu_used_gb": round(self.gpu / 1e9, 2),
                "peak_host_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)}


def cell(model, ids, n_gen=N_GEN, **kw) -> dict:
    t0 = time.perf_counter()
    with MemoryPeak() as mem:
        res = run_compare(model, ids, RunSettings(engine="llama.cpp", reference="float64", n_gen=n_gen,
                                                  capture="metrics", **kw))
    j = to_json(res)
    lc = j["config"].get("llama_cpp", {})
    paths = collections.Counter((n["backend"], n["path"]) for n in lc.get("nodes", []) if n["op"] == "MUL_MAT")
    fd = j["first_divergence"]
    oe = lc.get("observer_effect", {})
    return {"answers_sha": answers_sha(j), "copies": lc.get("copies"),**{k: v for k, v in kw.items() if k != "llama_lib"}, "seconds": round(time.perf_counter() - t0, 2),
            "verdict": j["verdict"] if isinstance(j["verdict"], str) else j["verdict"].get("text", str(j["verdict"])),
            "first_divergence": None if fd is None else {k: fd.get(k) for k in ("seq", "token", "layer", "site", "by")},
            # per-token local evidence at fd, or at the divergence a precision verdict explained
            "token_local": (fd or (j.get("precision_summary") or {}).get("drift_from") or {}).get("token_local"),
            "local_line": local_line(res),
            "precision": j.get("precision"), "precision_text": (j.get("precision_summary") or {}).get("text"),
            "logits_rel_l2_max": _max_logit_err(res), "kld_max": j["logits"]["kld_max"],
            "top1": j["logits"]["top1_agreement"],
            "matmul_paths": {f"{b}:{p}": c for (b, p), c in paths.items()},
            "local_first_over": (lc.get("local") or {}).get("first_over"),
            "local_replay_s": (lc.get("local_replay") or {}).get("seconds"),
            "fp32_everywhere": bool((lc.get("fp32_everywhere") or {}).get("asked")),
            "observer_bitwise": oe.get("logits_bitwise_identical"), "traced_s": oe.get("traced_s"),
            "untraced_s": oe.get("untraced_s"), "context": lc.get("context"), "callback": lc.get("callback"),
            "n_gen": n_gen, **mem.row()}


def answers_sha(j: dict) -> str:
    """A digest of what a run answered (every site's errors, the verdict, the generations), without how fast or
    through which context, callback and copies it came: runs that answered alike have the same digest (as
    tests/conftest.py's llama_answers)."""
    j = json.loads(json.dumps(j))
    j.pop("timings", None)
    lc = j["config"]["llama_cpp"]
    for k in ("context", "callback", "copies"):
        lc.pop(k, None)

    def timeless(v):            # every duration inside (traced_s, untraced_s, a replay's seconds) left out
        if isinstance(v, dict):
            return {k: timeless(x) for k, x in v.items() if not (k == "seconds" or k.endswith("_s"))}
        return [timeless(x) for x in v] if isinstance(v, list) else v
    j["config"]["llama_cpp"] = timeless(lc)
    return hashlib.sha256(json.dumps(j, sort_keys=True).encode()).hexdigest()[:16]


# --cells' fifth field: how the values are copied (sides/llamacpp/defer.py); a change frees the kept context, so the
# next cell makes a new one (its Tracer reads these switches)
COPIES = {"split": {"MAMBA_DEBUG_DEFER": "0", "MAMBA_DEBUG_ASYNC": "0"},     # a stop per read, synchronous copies
          "sync": {"MAMBA_DEBUG_DEFER": "1", "MAMBA_DEBUG_ASYNC": "0"},      # deferred, synchronous copies
          "async": {"MAMBA_DEBUG_DEFER": "1", "MAMBA_DEBUG_ASYNC": "1"}}     # the default


def three_cell(model, ids, **kw) -> dict:
    """compare --three-way: one CUDA run and one CPU run of the same library against one float64 reference."""
    from mamba_debug.three_way import run_three_way, to_json_three_way  # noqa: PLC0415
    t0 = time.perf_counter()
    tw = run_three_way(model, ids, RunSettings(engine="llama.cpp", reference="float64", n_gen=N_GEN, capture="all",
                                               **kw))
    j = to_json_three_way(tw)["three_way"]
    runs = {label: {k: r[k] for k in ("verdict", "first_divergence", "logits_rel_l2_max_vs_reference")}
            for label, r in j["runs"].items()}
    cross = {k: j["cross"].get(k) for k in ("first_difference", "sites_compared", "logits_rel_l2_max", "note")}
    return {**{k: v for k, v in kw.items() if k != "llama_lib"}, "device": "three-way",
            "seconds": round(time.perf_counter() - t0, 2), "runs": runs, "cross": cross}


def _tiny(out: Path):
    gguf = md.export_gguf(md.load_model(None), out / "tiny-f32.gguf", dtype="f32")
    model = md.load_model(gguf)
    return model, model.encode(PROMPT)


def _big(out: Path, n_prompt: int = 40, dtype: str = "f32"):
    """A random Mamba-1 shaped like mamba-2.8b (64 layers, d_model 2560), written as a GGUF of `dtype` (f32: 11 GB;
    f16 and q8_0: the big matrices narrower, export-gguf's rule)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_e2e import BIG, mamba_ssm_params  # noqa: PLC0415
    from mamba_debug.config import MambaConfig  # noqa: PLC0415
    cfg = MambaConfig(**BIG)
    t0 = time.perf_counter()
    gguf = Path(f"/tmp/mamba-2.8b-random-{dtype}.gguf")
    if not gguf.exists():            # a warm machine keeps it between calls (the weights are seeded: the same file)
        model = md.build_model(cfg, mamba_ssm_params(cfg, 0, "cuda"), source="random 2.8B-shaped")
        tmp = gguf.with_suffix(".part")
        md.export_gguf(model, tmp, dtype=dtype)
        tmp.rename(gguf)
        del model
    model = md.load_model(gguf)
    print(f"2.8B-shaped GGUF written and loaded in {time.perf_counter() - t0:.0f} s", flush=True)
    return model, [(7 * i + 3) % cfg.vocab_size for i in range(n_prompt)]


def _max_logit_err(res) -> float:
    e = res.errors.get((None, "logits"))
    return None if e is None else float(e["rel_l2"].nan_to_num(0).max())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("smoke", "grid", "big", "three", "cells"),
                    help="cells: --cells on the shipped model (as big does on the 2.8B shape)")
    ap.add_argument("--offloads", default="all,0", help="big: the -ngl values (all, half or a number)")
    ap.add_argument("--ubatches", default="512", help="big: the -ub values")
    ap.add_argument("--seqs", default="1", help="big: the numbers of sequences")
    ap.add_argument("--prompt-tokens", type=int, default=40, help="big: prompt length (short keeps -ub 1 cheap)")
    ap.add_argument("--cells", default=None,
                    help="big: cells in this order, NGL:UB:S[:P],... (NGL all, half or a number; P prompt tokens, at most "
                         "--prompt-tokens); overrides the grid")
    ap.add_argument("--n-gen", type=int, default=N_GEN, help="big: generated tokens per cell")
    ap.add_argument("--dtype", default="f32", choices=("f32", "f16", "q8_0"), help="big: the GGUF's big matrices")
    ap.add_argument("--on-demand", action="store_true",
                    help="big: local errors only when the verdict needs them (a divergence: the schedule replayed "
                         "with them), the default of compare; without it every cell runs with --local")
    ap.add_argument("--fp32-everywhere", action="store_true", help="big: every cell with --fp32-everywhere")
    ap.add_argument("--profile", action="store_true",
                    help="print a cProfile of each cell (top 25 by own time): where the traced seconds go")
    ap.add_argument("--python-callback-first", action="store_true",
                    help="run the first cell with the Python eval callback alone in a new context (MAMBA_DEBUG_NO_"
                         "FASTPATH=1, MAMBA_DEBUG_LLAMA_KEEP=0): the baseline of the C fast path and kept contexts")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no new cell after this many seconds (the rows so far are written)")
    ap.add_argument("--device", default="cuda", help="big, cells: --device of every cell (cpu: a check off the GPU)")
    ap.add_argument("--out", default="out/llamacpp_h200")
    ap.add_argument("--lib", default=str(ROOT / "build/llama-cuda/bin"))
    a = ap.parse_args()
    preload.restart(Path(a.lib))        # a CUDA build after numpy: this script again, libstdc++ preloaded
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    model, ids = (_big(out, a.prompt_tokens, a.dtype) if a.mode == "big" else _tiny(out))
    copies = None
    n = model.config.n_layer
    rows = []
    if a.mode == "smoke":
        grid = [dict(device="cuda", offload=n + 1, ubatch=ub, n_seqs=1, local=True) for ub in (1, 8, 512)]
        grid += [dict(device="cpu", ubatch=512, n_seqs=1, local=True)]
    elif a.mode == "grid":
        grid = [dict(device="cuda", offload=ngl, ubatch=ub, n_seqs=S, local=True)
                for ngl in (0, n // 2, n + 1) for ub in (1, 4, 17, 512) for S in (1, 2, 3)]
        grid += [dict(device="cpu", ubatch=ub, n_seqs=S, local=True) for ub in (1, 17, 512) for S in (1, 3)]
    elif a.mode == "three":
        grid = [dict(offload=ngl, ubatch=ub, n_seqs=S) for ngl in (n + 1, n // 2) for ub in (1, 17, 512)
                for S in (1, 3)]
    else:
        ngls = {"all": n + 1, "half": n // 2}
        cells = ([(c + "::").split(":")[:5] for c in a.cells.split(",")] if a.cells else
                 [(v, ub, S, "", "") for v in a.offloads.split(",") for ub in a.ubatches.split(",")
                  for S in a.seqs.split(",")])
        grid = [dict(device=a.device, offload=ngls[v] if v in ngls else int(v), ubatch=int(ub), n_seqs=int(S),
                     local=not a.on_demand, ref_device="cuda" if a.mode == "big" else "cpu", n_gen=a.n_gen,
                     prompt_tokens=int(P or len(ids)), copies=C or "async",
                     **({"fp32_everywhere": True} if a.fp32_everywhere else {}))
                for v, ub, S, P, C in cells]
    for i, kw in enumerate(grid):
        baseline = a.python_callback_first and i == 0
        os.environ.update({"MAMBA_DEBUG_NO_FASTPATH": "1", "MAMBA_DEBUG_LLAMA_KEEP": "0"} if baseline else {})
        if a.python_callback_first and i == 1:
            for k in ("MAMBA_DEBUG_NO_FASTPATH", "MAMBA_DEBUG_LLAMA_KEEP"):
                os.environ.pop(k, None)
        if a.budget_s is not None and time.perf_counter() - t_start > a.budget_s:
            print(f"budget of {a.budget_s:.0f} s spent: {len(grid) - len(rows)} cell(s) not run", flush=True)
            break
        how = kw.pop("copies", None)
        if how is not None and how != copies:
            md.release_llama_cpp()              # a new context, whose Tracer reads the switches
            os.environ.update(COPIES[how])
            copies = how
        try:
            n_prompt = kw.pop("prompt_tokens", len(ids))
            run = (three_cell if a.mode == "three" else cell)
            prof = cProfile.Profile() if a.profile else None
            if prof is not None:
                prof.enable()
            row = run(model, ids[:n_prompt], llama_lib=a.lib, **kw)
            if prof is not None:
                prof.disable()
                pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            row["prompt_tokens"] = n_prompt
            row["copies_mode"] = how
        except Exception as exc:  # noqa: BLE001 (a benchmark row records what failed and goes on)
            row = {**kw, "error": f"{type(exc).__name__}: {exc}"[:600]}
        row.pop("llama_lib", None)
        row["gguf"] = a.dtype if a.mode == "big" else "f32"
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / f"{a.mode}.json").write_text(json.dumps(rows, indent=1))    # kept if the call is cut short
    if a.mode == "three":
        print("\nngl  ub  S  CUDA verdict / CPU verdict / CUDA vs CPU")
        for r in rows:
            v = r.get("error") or " / ".join(str(x["verdict"])[:40] for x in r["runs"].values())
            fd = (r.get("cross") or {}).get("first_difference")
            print(f"{r['offload']:>3} {r['ubatch']:>3} {r['n_seqs']:>2}  {v}  |  "
                  f"{'differ at ' + str(fd) if fd else 'agree within float32 thresholds'}")
        return
    print("\ndevice ngl  ub  S  verdict / first divergence                          logit err   paths")
    for r in rows:
        fd = r.get("first_divergence")
        what = r.get("error") or (f"{fd['layer']}.{fd['site']} tok {fd['token']} seq {fd['seq']}" if fd else
                                  "precision" if r.get("precision_text") else "clean")
        print(f"{r['device']:5} {r.get('offload', '-')!s:>4} {r['ubatch']:>3} {r['n_seqs']:>2}  {what[:50]:50} "
              f"{r.get('logits_rel_l2_max') or 0:9.2e}   {r.get('matmul_paths')}")
    print("\ndevice ngl  ub  S  local      fp32  copies  traced s  untraced s  x untraced  C stops  deferred  calls  "
          "copy s  replay s  cell s  answers           context")
    for r in rows:
        if r.get("traced_s") and r.get("untraced_s"):
            c = r.get("copies") or {}
            print(f"{r['device']:5} {r.get('offload', '-')!s:>4} {r['ubatch']:>3} {r['n_seqs']:>2}  "
                  f"{'always' if r.get('local') else 'on demand':9}  {'yes' if r.get('fp32_everywhere') else 'no':4}  "
                  f"{r.get('copies_mode') or '-':6}  {r['traced_s']:8.3f}  {r['untraced_s']:10.4f}  "
                  f"{r['traced_s'] / r['untraced_s']:10.1f}  {c.get('stops_in_c', '-')!s:>7}  "
                  f"{c.get('deferred', '-')!s:>8}  {c.get('copy_calls', '-')!s:>5}  {c.get('copy_s', '-')!s:>6}  "
                  f"{r.get('local_replay_s') or 0:8.2f}  {r['seconds']:6.1f}  "
                  f"{r.get('answers_sha')}  {r.get('context')}")


if __name__ == "__main__":
    main()
