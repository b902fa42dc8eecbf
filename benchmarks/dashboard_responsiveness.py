#!/usr/bin/env python3
"""How responsive is the notebook dashboard on the shipped tiny model, on this CPU?

Measures, in milliseconds (the dashboard's own `timings`, plus wall time around each call):
  * cached configuration: the offload / ubatch slider moved back to a configuration seen before: no run; the
    views come from the PNG cache when this run was already shown with the same view settings ("seen views"),
    else matplotlib draws them from the cached run ("views drawn");
  * token step: the token slider moved by one to a token not shown before (no run; curve and state inspector
    drawn);
  * first result: the offload / ubatch slider or the kernels dropdown moved to a new configuration (a full
    comparison, then a redraw), with the device side under Triton's interpreter on this CPU (on a GPU the run part
    shrinks); offload n_layer after n_layer + 1 shares its run (the head moved: the same bits); the engine dropdown
    on llama.cpp (its CPU build, when llama-cpp-python is installed); the prompt dropdown on a second prompt (its
    reference sides run as well).

Redraw = matplotlib renders each view to PNG, as in a notebook; the browser's own repaint (< 50 ms) is not in it.
Each view reaches the page when it is drawn (status line and text views first, then the figures top to bottom):
`first_view` is when the first picture of the new setting was on the page, `total` when the last one was.
Writes benchmarks/results/dashboard_cpu.json and prints a table: the shipped tiny Mamba-1 (the headline entries),
then under "models" the first results of the shipped tiny Mamba-2 and hybrid (`--also`; their cached and token-step
figures are the same views' and are not repeated).

    python3 benchmarks/dashboard_responsiveness.py [--rounds 3] [--repeats 5] [--n-gen 4] [--also NAME,...]
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# before torch and triton are imported (as engine_cpu.py): triton imported compiled first cannot run the kernels'
# tl.zeros under the interpreter ("Cannot call @triton.jit'd outside of the scope of a kernel")
os.environ.setdefault("TRITON_INTERPRET", "1")

PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, "
          "must be in want of a")
PROMPT2 = ("However little known the feelings or views of such a man may be on his first entering a neighbourhood, "
           "this truth is")       # the prompt dropdown's second entry: a new prompt runs its reference sides too


def _timed(dash, **values) -> dict:
    t = time.perf_counter()
    dash.set(**values)
    wall = (time.perf_counter() - t) * 1e3
    if dash.errors:
        raise RuntimeError(f"dashboard error: {dash.errors[-1]['message']}")
    return dict(dash.timings, wall_ms=wall)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5, help="repeats of each cached measurement")
    ap.add_argument("--n-gen", type=int, default=4)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "dashboard_cpu.json"))
    ap.add_argument("--model", default=None, help="model folder (default: the shipped tiny Mamba-1)")
    ap.add_argument("--also", default="tiny-mamba2,tiny-granite-hybrid",
                    help="shipped models (data/NAME) whose first results are measured too, in their own rounds")
    ap.add_argument("--rounds", type=int, default=3,
                    help="fresh processes, each a whole run; the file keeps each entry's median and every round's "
                         "total (a never-run setting can be timed once per dashboard, and this VM drifts by 20%%)")
    args = ap.parse_args()
    if args.rounds > 1:
        return _rounds(args)

    import torch
    import triton

    import mamba_debug as md
    from mamba_debug.plugins import load_plugin
    from mamba_debug.settings import resolve_device
    from mamba_debug.triton_launch import launch_paths
    from mamba_debug.views import textcache

    model = md.load_model(args.model)
    L = model.config.n_layer
    P = len(model.encode(PROMPT))
    load_before = os.getloadavg()
    t = time.perf_counter()
    dash = md.Dashboard(model, [PROMPT, PROMPT2], kernels="triton", n_gen=args.n_gen, offload=2, ubatch=P)
    first = dict(dash.timings, wall_ms=(time.perf_counter() - t) * 1e3)

    new_runs = {"offload 2, ubatch P (dashboard start)": first}
    new_runs[f"offload {L + 1} (all + head), ubatch P"] = _timed(dash, offload=L + 1)
    # the head moved back to the host: the same bits as offload L + 1 (one run shared, no comparison)
    new_runs[f"offload {L} (all, head on host), ubatch P"] = _timed(dash, offload=L)
    new_runs["offload 6, ubatch P"] = _timed(dash, offload=6)
    new_runs["offload 2, ubatch 8"] = _timed(dash, offload=2, ubatch=8)
    bug = "bug_strided_gate" if model.config.layer_types[0] == "mamba1" else "bug_m2_norm_before_gate"
    new_runs[f"offload 2, ubatch 8, kernels {bug}"] = _timed(dash, kernels=bug)
    if "engine" in dash.controls.value_widgets() and importlib.util.find_spec("llama_cpp") is not None:
        new_runs["offload 2, ubatch 8, engine llama.cpp (CPU)"] = _timed(dash, engine="llama.cpp")
        dash.set(engine="torch")
    dash.set(kernels="triton")
    new_runs["offload 2, ubatch 8, prompt 2 (its reference sides run too)"] = _timed(dash, prompt=1)
    dash.set(prompt=0)                         # back to the runs below (cached)

    cached, drawn, steps = [], [], []
    seen = [dict(offload=L + 1, ubatch=P), dict(offload=6, ubatch=P), dict(offload=2, ubatch=8),
            dict(offload=2, ubatch=P)]
    for i in range(args.repeats * len(seen)):
        r = _timed(dash, **seen[i % len(seen)])
        assert r["source"] == "cache", r
        cached.append(r)
    for i in range(args.repeats * len(seen)):
        dash._pngs.clear()                    # the run is cached, its views must be drawn again
        r = _timed(dash, **seen[i % len(seen)])
        assert r["source"] == "cache", r
        drawn.append(r)
    n_tok = dash.result.tokens.shape[1]
    for i in range(args.repeats * 2):
        dash._pngs.clear()
        r = _timed(dash, token=(dash.w_token.value + 1) % n_tok)
        assert r["source"] == "view", r
        steps.append(r)

    def med(rows, key):
        return round(statistics.median(r[key] for r in rows), 1)

    result = {
        "what": "mamba-debug dashboard responsiveness on the shipped tiny model (ms)",
        "date": datetime.date.today().isoformat(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "text": textcache.status(),
                    "kernel_launches": sorted(set(launch_paths(load_plugin("triton").module).values())),
                    "torch": torch.__version__, "triton": triton.__version__,
                    "device": resolve_device(None), "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
        "model": repr(model), "prompt_tokens": P, "n_gen": args.n_gen, "kernels": "triton",
        "cached_config_seen_views_ms": {"median": med(cached, "update_ms"),
                                        "max": round(max(r["update_ms"] for r in cached), 1),
                                        "wall_median": med(cached, "wall_ms"), "n": len(cached)},
        "cached_config_views_drawn_ms": {"median": med(drawn, "update_ms"),
                                         "max": round(max(r["update_ms"] for r in drawn), 1),
                                         "wall_median": med(drawn, "wall_ms"), "n": len(drawn)},
        "token_step_ms": {"median": med(steps, "update_ms"), "max": round(max(r["update_ms"] for r in steps), 1),
                          "n": len(steps)},
        "first_result_ms": {name: {"total": round(r["wall_ms"], 1), "run": round(r.get("run_ms", 0.0), 1),
                                   "redraw": round(r.get("redraw_ms", 0.0), 1),
                                   "first_view": round(r.get("first_view_ms", r["wall_ms"]), 1)}
                            for name, r in new_runs.items()},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")

    print(f"{repr(model)}, {P} prompt tokens + {args.n_gen} generated, device {result['machine']['device']}, "
          f"{os.cpu_count()} CPUs, load {load_before[0]:.1f}")
    print(f"{'action':52s} {'total ms':>10s} {'run ms':>10s} {'redraw ms':>10s} {'1st view':>10s}")
    for name, r in result["first_result_ms"].items():
        print(f"{'new config: ' + name:52s} {r['total']:10.0f} {r['run']:10.0f} {r['redraw']:10.0f} "
              f"{r['first_view']:10.0f}")
    c, d, s = result["cached_config_seen_views_ms"], result["cached_config_views_drawn_ms"], result["token_step_ms"]
    print(f"{'cached config, seen views (median of %d)' % c['n']:52s} {c['median']:10.1f} {0:10.0f} {c['median']:10.1f}")
    print(f"{'cached config, views drawn (median of %d)' % d['n']:52s} {d['median']:10.0f} {0:10.0f} {d['median']:10.0f}")
    print(f"{'token step (median of %d)' % s['n']:52s} {s['median']:10.0f} {0:10.0f} {s['median']:10.0f}")
    print(f"wrote {out}")
    return 0


def _rounds(args) -> int:
    """Run the whole measurement in `args.rounds` fresh processes; write their medians (and each round's totals)."""
    import subprocess  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    def rounds(model):
        runs = []
        with tempfile.TemporaryDirectory() as tmp:
            for i in range(args.rounds):
                part = Path(tmp) / f"round{i}.json"
                subprocess.run([sys.executable, __file__, "--rounds", "1", "--repeats", str(args.repeats),
                                "--n-gen", str(args.n_gen), "--out", str(part)]
                               + (["--model", model] if model else []), check=True)
                runs.append(json.loads(part.read_text()))
        return merge(runs)

    merged = rounds(args.model)
    merged["models"] = {}
    for name in filter(None, args.also.split(",")):
        other = rounds(str(REPO / "data" / name))
        merged["models"][name] = {"model": other["model"], "first_result_ms": other["first_result_ms"]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=1) + "\n")
    print(f"\nmedians of {args.rounds} rounds (ms):")
    for name, r in merged["first_result_ms"].items():
        print(f"{'new config: ' + name:70s} {r['total']:8.0f}   rounds {r['rounds']}   first view "
              f"{r['first_view']:.0f} {r['first_view_rounds']}")
    for key in ("cached_config_views_drawn_ms", "token_step_ms"):
        print(f"{key:70s} {merged[key]['median']:8.0f}   rounds {merged[key]['rounds']}")
    for name, other in merged["models"].items():
        for what, r in other["first_result_ms"].items():
            print(f"{name + ': ' + what:70s} {r['total']:8.0f}   rounds {r['rounds']}   first view "
                  f"{r['first_view']:.0f} {r['first_view_rounds']}")
    print(f"wrote {out}")
    return 0


def merge(runs: list) -> dict:
    """Rounds' results as one: each entry's median (total, run and redraw each), and every round's value."""
    merged = dict(runs[-1], rounds=len(runs))
    for key in ("cached_config_seen_views_ms", "cached_config_views_drawn_ms", "token_step_ms"):
        merged[key] = dict(runs[-1][key], median=round(statistics.median(r[key]["median"] for r in runs), 1),
                           rounds=[r[key]["median"] for r in runs])
    merged["first_result_ms"] = {
        name: {**{k: round(statistics.median(r["first_result_ms"][name][k] for r in runs), 1)
                  for k in ("total", "run", "redraw", "first_view")},
               "rounds": [r["first_result_ms"][name]["total"] for r in runs],
               "first_view_rounds": [r["first_result_ms"][name]["first_view"] for r in runs]}
        for name in runs[-1]["first_result_ms"]}
    return merged


if __name__ == "__main__":
    sys.exit(main())
