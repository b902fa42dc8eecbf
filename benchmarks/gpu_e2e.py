"""Issue "GPU performance", tracing and end to end: what tracing costs on the GPU, and one comparison of a
2.8B-shaped Mamba-1 (random weights at mamba_ssm's initial scale) over a 2048-token prompt on one GPU.

Part 1  build the model in memory (float64 masters on the host, as the loaders keep them) and upload it.
Part 2  tracing overhead: a 2048-token prefill (batch 1) of the device side only (every layer and the head on
        the GPU, Triton kernels), untraced and with each capture level the engine uses; CUDA events, warmed up,
        median of a few runs; ratio vs untraced, bytes captured, peak GPU memory, host copy bandwidth.
Part 3  end to end: `run_compare` with the reference sides' torch ops on the GPU (`ref_device="cuda"`) and
        capture="metrics"; wall time, peak GPU memory, peak host RSS, first divergence (None expected), KLD.
Part 4  the same with the reference sides on the CPU (the default), over a short prompt, extrapolated to 2048.
Part 5  (`cli`) what a user runs: `mamba-debug compare` on the model saved as a transformers folder, twice, each
        first in its process (imports, the checkpoint's load, CUDA's start, the comparison, its report); wall time.

Run on the GPU machine:  TRITON_INTERPRET=0 python3 benchmarks/gpu_e2e.py          (about 3-4 minutes)
Check it on a CPU:       python3 benchmarks/gpu_e2e.py --small    (4 layers, d_model 256, 256 tokens, Triton's
                         interpreter; the CUDA-only measurements are skipped and say so)
Writes $OUT/gpu_e2e.json and $OUT/gpu_e2e.md ($OUT defaults to benchmarks/results; with --small, out/benchmarks-small). Each part records its error
in the JSON and the script goes on, so one failure does not lose the other measurements.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# gpu_common first: it fixes Triton's mode before mamba_debug imports Triton
from gpu_common import (BIG, CUDA, GB, ROOT, SMALL, T0, TODAY, RssPeak, error_row, free_memory,  # noqa: F401
                        log, mamba_ssm_params, param_count, master_bytes, peak_gpu, reset_peak, sync)
import gpu_tracing  # noqa: E402
from mamba_debug.backends import cpu_threads_for, device_backend  # noqa: E402
from mamba_debug.compare import (CompareSettings, comparison_gpu_bytes, run_compare,  # noqa: E402
                                 ubatch_capture_bytes)
from mamba_debug.config import MambaConfig  # noqa: E402
from mamba_debug.model import MambaModel  # noqa: E402

OUT = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
# --small (a check on a CPU) never overwrites the recorded GPU figures unless $OUT says where to write
SMALL_OUT = Path(os.environ.get("OUT", ROOT / "out" / "benchmarks-small"))


# -- parts 3 and 4: end to end -----------------------------------------------------------------------------------
def e2e_memory(cfg: MambaConfig, ubatch: int, n_tok: int, ref_device: str, wide: int | None = None) -> dict:
    """Bytes the comparison holds: weights per side, and one ubatch of every site for the three runners. wide: the
    weight elements that are not float32 values (`Model.wide_elements`; None: the bound that counts all of them)."""
    p = param_count(cfg)
    per_ubatch = ubatch_capture_bytes(cfg, ubatch)                         # dev f32, ref32 f32, ref64 f64
    logits = 2 * n_tok * cfg.vocab_size * 4                                # kept for perplexity: ref and dev
    on_gpu = ref_device == "cuda"
    gpu = comparison_gpu_bytes(cfg, ubatch, 1, n_tok, wide) if on_gpu else p * 4
    host = master_bytes(cfg) + (0 if on_gpu else p * 4 + per_ubatch + logits)
    return {"gpu_bytes": gpu, "host_bytes": host, "capture_per_ubatch_bytes": per_ubatch}


def pick_ubatch(cfg, n_tok, small, wide) -> int:
    """The largest llama.cpp-like ubatch whose estimate stays within the issue's 48 GB of GPU memory, with 5% to spare
    (the estimate is within 2% of the measured peaks: tests/test_engine.py)."""
    if small or not CUDA:
        return 64
    return next((u for u in (512, 256, 128, 64, 32)
                 if e2e_memory(cfg, u, n_tok, "cuda", wide)["gpu_bytes"] < 0.95 * 48e9), 16)


def progress_printer(label):
    t0 = time.perf_counter()
    stamps = []

    def update(done, total):
        stamps.append(time.perf_counter() - t0)
        log(f"  {label}: ubatch {done}/{total} at {stamps[-1]:.1f} s")
    update.stamps = stamps
    return update


class Breakdown:
    """Where an end-to-end comparison's time goes: each side's `step` and the Accumulator's `add` (the metrics),
    timed with a device sync on both ends (benchmark-only wrappers; the sync costs a few ms per ubatch)."""

    def __init__(self):
        self.seconds = {}

    def _wrap(self, cls, attr, key):
        fn = getattr(cls, attr)

        def timed(obj, *a, **kw):
            sync()
            t = time.perf_counter()
            try:
                return fn(obj, *a, **kw)
            finally:
                sync()
                k = key(obj)
                self.seconds[k] = self.seconds.get(k, 0.0) + time.perf_counter() - t
        setattr(cls, attr, timed)
        self._undo.append((cls, attr, fn))

    def __enter__(self):
        from mamba_debug.accumulate import Accumulator
        from mamba_debug.sides.torch_side import TorchSide
        self._undo = []
        self._wrap(TorchSide, "step", lambda side: f"side {side.info.name}")
        self._wrap(Accumulator, "add", lambda acc: "metrics (Accumulator.add)")
        return self

    def __exit__(self, *exc):
        for cls, attr, fn in self._undo:
            setattr(cls, attr, fn)


def part_e2e(model, prompt, n_gen, ubatch, ref_device, device, wide, breakdown=False) -> dict:
    cfg = model.config
    est = e2e_memory(cfg, ubatch, len(prompt) + n_gen, ref_device, wide)
    steps = 2 * cfg.n_layer * (len(prompt) + n_gen)
    log(f"end to end: {len(prompt)} + {n_gen} tokens, ubatch {ubatch}, reference sides on {ref_device}; estimate: "
        f"GPU {est['gpu_bytes'] / GB:.1f} GB, host {est['host_bytes'] / GB:.1f} GB (one ubatch of every site for "
        f"the three runners: {est['capture_per_ubatch_bytes'] / GB:.1f} GB); the reference scans are plain torch "
        f"loops: {steps} steps of ~10 small ops, ~{steps * 10 * 8e-6:.0f} s at ~8 us per op launch")
    s = CompareSettings(kernels="triton", device=device, ubatch=ubatch, n_gen=n_gen, capture="metrics",
                        ref_device=ref_device)
    reset_peak()
    with RssPeak() as rss, (Breakdown() if breakdown else contextlib.nullcontext()) as parts:
        t = time.perf_counter()
        res = run_compare(model, prompt, s, progress=progress_printer("compare"))
        sync()
        wall = time.perf_counter() - t
    split = {k: round(v, 3) for k, v in parts.seconds.items()} if breakdown else None
    if split:
        log("  where the time went (synced): " + ", ".join(f"{k} {v:.2f} s" for k, v in split.items()))
    kld, fd = res.logits["kld"], res.first_divergence
    verdict = ("first divergence None" if fd is None else
               f"DIVERGED at token {fd['token']} layer {fd['layer']} site {fd['site']}")
    return {"part": "e2e", "what": f"run_compare {cfg.n_layer} layers, {len(prompt)}+{n_gen} tokens, ubatch {ubatch}, "
                                   f"capture metrics, reference on {ref_device}, device {device}",
            "seconds": wall, "ratio": None, "bytes": None, "peak_gpu_bytes": peak_gpu(),
            "peak_host_rss_bytes": rss.peak, "host_gb_s": None, "first_divergence": fd,
            "kld_max": float(kld.max()), "kld_mean": float(kld.mean()),
            "top1_agreement": float(res.logits["top1"].mean()), "estimate": est, "device_label": res.device_label,
            "breakdown_s": split, "ubatch": ubatch,
            "note": f"{verdict}; KLD max {float(kld.max()):.3g}, top-1 {float(res.logits['top1'].mean()):.3f}"}


def part_cpu_reference(model, prompt, ubatch, device, n_full) -> dict:
    """The reference sides on the CPU over a short prompt; the time per token after the first ubatch (which also
    casts the weights) extrapolated to the full prompt."""
    s = CompareSettings(kernels="triton", device=device, ubatch=ubatch, n_gen=0, capture="metrics", ref_device="cpu")
    prog = progress_printer("cpu reference")
    with RssPeak() as rss:
        t = time.perf_counter()
        res = run_compare(model, prompt, s, progress=prog)
        wall = time.perf_counter() - t
    per_token = (prog.stamps[-1] - prog.stamps[0]) / (len(prompt) - ubatch)
    return {"part": "e2e", "what": f"reference sides on the CPU: {len(prompt)} tokens measured (ubatch {ubatch}), "
                                   f"extrapolated to {n_full}", "seconds": per_token * n_full, "ratio": None,
            "bytes": None, "peak_gpu_bytes": peak_gpu(), "peak_host_rss_bytes": rss.peak, "host_gb_s": None,
            "first_divergence": res.first_divergence,
            "note": f"estimate: {per_token * 1e3:.0f} ms/token after the first ubatch; measured run {wall:.1f} s"}


def part_cli(model, prompt, n_gen, ubatch, ref_device, device, runs=2) -> list:
    """What a user runs: `mamba-debug compare` on a saved transformers folder, each run first in its own process
    (Python's and torch's imports, the checkpoint's load into float64 masters and their checks, CUDA's start, the
    comparison, its report): wall clock. Also the load alone, timed here. The folder (float32, 11.6 GB for the 2.8B
    shape) lies in a temporary directory, removed after. This process's device weights are dropped first: the
    command's process holds its own."""
    from mamba_debug.io import load_model, save_hf  # noqa: PLC0415
    model._cast.clear()                 # the weights this process cast for the parts before (GPU memory)
    free_memory()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu_e2e_cli_") as tmp:
        folder = save_hf(model, Path(tmp) / "model")
        t = time.perf_counter()
        loaded = load_model(folder)
        rows.append({"part": "cli", "what": "load_model of the saved folder, in this process (float64 masters, their "
                                            "checks)", "seconds": time.perf_counter() - t, "ratio": None,
                     "note": f"{sum(f.stat().st_size for f in folder.iterdir()) / GB:.1f} GB folder"})
        del loaded
        free_memory()
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "mamba_debug.cli", "compare", "--model", str(folder), "--prompt",
               " ".join(map(str, prompt)), "--ubatch", str(ubatch), "--n-gen", str(n_gen), "--device", device,
               "--ref-device", ref_device, "--capture", "metrics", "--json", str(out)]
        for k in range(runs):
            t = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            wall = time.perf_counter() - t
            if p.returncode != 0:
                raise RuntimeError(f"mamba-debug compare exited {p.returncode}: {p.stderr.strip()[-600:]}")
            j = json.loads(out.read_text())
            rows.append({"part": "cli", "what": f"mamba-debug compare, {len(prompt)}+{n_gen} tokens, ubatch {ubatch}, "
                                                f"capture metrics, reference on {ref_device}, first in its process "
                                                f"(run {k + 1} of {runs}: Triton's disk cache "
                                                f"{'as found' if k == 0 else 'warm'})",
                         "seconds": wall, "ratio": None, "first_divergence": j["first_divergence"],
                         "note": f"the comparison itself {j['timings']['compare_s']:.1f} s; first divergence "
                                 f"{j['first_divergence']}"})
            log(f"cli run {k + 1}: {wall:.1f} s ({rows[-1]['note']})")
    return rows


# -- report --------------------------------------------------------------------------------------------------
def _gb(v):
    return "" if v is None else f"{v / GB:.2f} GB"


def markdown(rows) -> str:
    lines = ["| part | what | s | x untraced | captured | peak GPU | peak host RSS | host GB/s | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r or "skipped" in r:
            why = f"ERROR {r['error'][:200]}" if "error" in r else f"skipped: {r['skipped']}"
            lines.append(f"| {r['part']} | {r['what']} | | | | | | | {why} |")
            continue
        ratio = "" if r.get("ratio") is None else f"{r['ratio']:.2f}"
        bw = "" if r.get("host_gb_s") is None else f"{r['host_gb_s']:.1f}"
        lines.append(f"| {r['part']} | {r['what']} | {r['seconds']:.3f} | {ratio} | {_gb(r.get('bytes'))} | "
                     f"{_gb(r.get('peak_gpu_bytes'))} | {_gb(r.get('peak_host_rss_bytes'))} | {bw} | "
                     f"{r.get('note', '')} |")
    return "\n".join(lines) + "\n"


def carried_rows(path: Path, parts: set, small: bool) -> list:
    """The recorded rows of the parts this run skipped (each keeps its own date): the file stays whole when one
    part is re-measured."""
    if small or not path.is_file():
        return []
    skipped = {"tracing", "e2e", "cpu_ref", "cli"} - parts
    kind = lambda r: "cpu_ref" if "CPU" in r.get("what", "") and r["part"] == "e2e" else r["part"]  # noqa: E731
    return [r for r in json.loads(path.read_text())["rows"] if kind(r) in skipped]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="4 layers, d_model 256, 256 tokens: a check on a CPU")
    ap.add_argument("--tokens", type=int, default=None, help="prompt tokens (default 2048; 256 with --small)")
    ap.add_argument("--n-gen", type=int, default=None, help="generated tokens in the comparison (default 4; 2)")
    ap.add_argument("--trace-ubatch", type=int, default=None, help="ubatch of the tracing runs (default 512; 64)")
    ap.add_argument("--e2e-ubatch", default=None,
                    help="ubatch(es) of the comparison, comma-separated (default: the largest within 48 GB)")
    ap.add_argument("--breakdown", action="store_true",
                    help="after the timed comparisons, one more at the first ubatch with each side synced and timed")
    ap.add_argument("--profile", default=None, help="print a cProfile (and on a GPU a kernel profile) of the tracing "
                                                    "level whose description contains this text (e.g. 'at birth'; several: 'a|b')")
    ap.add_argument("--only", default=None, help="run only the tracing levels whose description contains this "
                                                 "text ('a|b': either); nothing is recorded then (a partial run)")
    ap.add_argument("--parts", default="tracing,e2e,cpu_ref,cli",
                    help="comma-separated subset of tracing,e2e,cpu_ref,cli")
    ap.add_argument("--time-budget-s", type=float, default=240, help="skip the CPU-reference estimate past this")
    args = ap.parse_args(argv)
    gpu_tracing.PROFILE, gpu_tracing.ONLY = args.profile, args.only
    if not CUDA and not args.small:
        sys.exit("gpu_e2e.py: torch sees no GPU; the 2.8B run needs one (use --small to check the script on a CPU)")
    cfg = MambaConfig(**(SMALL if args.small else BIG))
    n_tok = args.tokens or (256 if args.small else 2048)
    n_gen = args.n_gen if args.n_gen is not None else (2 if args.small else 4)
    trace_ub = args.trace_ubatch or (64 if args.small else 512)
    device = "cuda" if CUDA else "interpret"
    parts = set(args.parts.split(","))
    out_dir = SMALL_OUT if args.small or args.only else OUT     # a partial run never replaces the record
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    log(f"{'small' if args.small else '2.8B-shaped'} Mamba-1: {param_count(cfg) / 1e9:.2f}B weights "
        f"(lm_head counted), device {device}, torch {torch.__version__}, TF32 matmul "
        f"{torch.backends.cuda.matmul.allow_tf32}")
    if not CUDA:
        log("no GPU: CUDA events, peak GPU memory, pinned copies and copy ceilings are skipped; the Triton kernels "
            "run under the interpreter")

    t = time.perf_counter()
    with RssPeak() as rss:
        model = MambaModel(cfg, mamba_ssm_params(cfg, 0, "cuda" if CUDA else "cpu"), source="random mamba_ssm init")
    rows.append({"part": "build", "what": f"random weights, {param_count(cfg) / 1e9:.2f}B float64 masters on the host",
                 "seconds": time.perf_counter() - t, "peak_host_rss_bytes": rss.peak})
    log(f"built in {rows[-1]['seconds']:.1f} s")
    dev = device_backend("triton", device)
    reset_peak()
    t = time.perf_counter()
    model.weights(dev)
    sync()
    rows.append({"part": "build", "what": "weight upload: float32 cast on the device",
                 "seconds": time.perf_counter() - t, "peak_gpu_bytes": peak_gpu()})
    log(f"uploaded in {rows[-1]['seconds']:.1f} s")
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (n_tok,), generator=gen)

    if "tracing" in parts:
        log(f"tracing: {n_tok}-token prefill, batch 1, device side only, ubatch {trace_ub}")
        try:
            with cpu_threads_for(cfg):     # one thread for the small model on a CPU, as the engine does
                rows += gpu_tracing.part_tracing(model, dev, prompt[None], trace_ub, args.small)
        except Exception as exc:       # noqa: BLE001
            rows.append(error_row("tracing", "tracing overhead", exc))
        free_memory()
    wide = model.wide_elements()      # the float64 reference's float64 weights on a GPU: the random init's A
    e2e_ubs = [int(u) for u in args.e2e_ubatch.split(",")] if args.e2e_ubatch else \
        [pick_ubatch(cfg, n_tok + n_gen, args.small, wide)]
    e2e_ub = e2e_ubs[0]
    ref_device = "cuda" if CUDA else "cpu"
    if "e2e" in parts:
        for ub, brk in [(u, False) for u in e2e_ubs] + ([(e2e_ubs[0], True)] if args.breakdown else []):
            try:
                r = part_e2e(model, prompt.tolist(), n_gen, ub, ref_device, device, wide, breakdown=brk)
                if brk:
                    r["part"], r["what"] = "e2e breakdown", r["what"] + ", each side synced and timed"
                rows.append(r)
            except Exception as exc:       # noqa: BLE001
                rows.append(error_row("e2e", f"end-to-end comparison, ubatch {ub}", exc))
            free_memory()
    if "cpu_ref" in parts:
        if ref_device == "cpu":
            log("cpu reference estimate: skipped, the comparison above already ran its reference sides on the CPU")
        elif time.perf_counter() - T0 > args.time_budget_s:
            log(f"cpu reference estimate: skipped, past the {args.time_budget_s:.0f} s budget")
        else:
            try:
                rows.append(part_cpu_reference(model, prompt[:64].tolist(), 32, device, n_tok + n_gen))
            except Exception as exc:   # noqa: BLE001
                rows.append(error_row("e2e", "reference sides on the CPU", exc))

    if "cli" in parts:                 # last: it drops this process's device weights
        try:
            rows += part_cli(model, prompt.tolist(), n_gen, e2e_ub, ref_device, device)
        except Exception as exc:       # noqa: BLE001
            rows.append(error_row("cli", "mamba-debug compare on a saved folder", exc))

    for r in rows:
        r.setdefault("date", TODAY)
    rows = carried_rows(out_dir / "gpu_e2e.json", parts, args.small or args.only) + rows
    out = {"date": TODAY, "machine": f"{platform.node()}, {os.cpu_count()} cores", "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if CUDA else None, "model": repr(model), "config": cfg.to_dict(),
           "prompt_tokens": n_tok, "n_gen": n_gen, "trace_ubatch": trace_ub, "e2e_ubatch": e2e_ub,
           "wall_s": time.perf_counter() - T0, "rows": rows, "errors": [r for r in rows if "error" in r]}
    (out_dir / "gpu_e2e.json").write_text(json.dumps(out, indent=1, default=str))
    md = markdown(rows)
    (out_dir / "gpu_e2e.md").write_text(f"# gpu_e2e.py, {TODAY}: {repr(model)}, {out['gpu'] or 'no GPU'}\n\n" + md)
    print("\n" + md, flush=True)
    log(f"wrote {out_dir / 'gpu_e2e.json'} and {out_dir / 'gpu_e2e.md'}; {len(out['errors'])} error(s)")
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
