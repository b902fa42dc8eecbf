"""Issue #18's goals against the recorded figures: one bar per goal, measured / goal (1 = at the goal, left of it
met), drawn from benchmarks/results/*.json. Writes docs/figures/speed_goals.png and prints the table the README
shows.   python3 benchmarks/plot_goals.py
"""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RES = ROOT / "benchmarks" / "results"


def _load(name):
    p = RES / name
    return json.loads(p.read_text()) if p.is_file() else None


def goals() -> list:
    """(goal, measured, goal value, unit, where): only what is recorded."""
    out = []
    e2e = _load("gpu_e2e.json")
    if e2e:
        rows = e2e["rows"]
        metric_rows = [r for r in rows if r["part"] == "tracing" and "capture='metrics'" in r["what"]]
        # the engine's path now: measured at birth (the copied level is kept for comparison)
        tr = next((r for r in metric_rows if "measured at birth" in r["what"]), metric_rows[0] if metric_rows else None)
        if tr:
            out.append(("1 metrics-only tracing, 2.8B (H200)", tr["ratio"], 1.1, "x untraced", tr.get("date")))
        runs = [r for r in rows if r["part"] == "e2e" and "reference on cuda" in r["what"]]
        best = min((r for r in runs if r["peak_gpu_bytes"] <= 48e9), key=lambda r: r["seconds"], default=None)
        if best:
            out.append(("2 2.8B x 2048 compare, time (H200, warm)", best["seconds"], 20, "s", best.get("date")))
            out.append(("2 2.8B x 2048 compare, GPU memory", best["peak_gpu_bytes"] / 1e9, 48, "GB", best.get("date")))
        cli = [r for r in rows if r["part"] == "cli" and "first in its process" in r.get("what", "")]
        if cli:         # gpu_e2e.py's cli part: `mamba-debug compare` on a saved folder, the worst of its runs
            worst = max(cli, key=lambda r: r["seconds"])
            out.append(("2 the same, the whole command first in its process", worst["seconds"], 20, "s",
                        worst.get("date")))
    eng = _load("engine_cpu.json")
    if eng:
        for r in eng["rows"]:
            if r["what"].startswith("compare") and "kernels triton" in r["what"]:
                model = r.get("model", "tiny-mamba")
                name = "shipped model" if model == "tiny-mamba" else model
                out.append((f"3 CPU compare ({name})", r["seconds"], 3, "s", eng["date"]))
            if r["what"].startswith("sweep"):
                out.append(("3 CPU full sweep", r["seconds"], 60, "s", eng["date"]))
    dash = _load("dashboard_cpu.json")
    if dash:
        moved = [v for k, v in dash["first_result_ms"].items() if "start" not in k]
        worst = max(v["total"] for v in moved)
        out.append(("3 dashboard control, new setting, all views (worst)", worst / 1e3, 1, "s", dash.get("date")))
        if all("first_view" in v for v in moved):      # each view reaches the page when drawn: the first one
            worst = max(v["first_view"] for v in moved)
            out.append(("3 dashboard control, new setting, its first view (worst)", worst / 1e3, 1, "s",
                        dash.get("date")))
        for name, other in dash.get("models", {}).items():       # the other shipped models' first results
            worst = max(v["total"] for k, v in other["first_result_ms"].items() if "start" not in k)
            out.append((f"3 dashboard control, {name}, all views (worst)", worst / 1e3, 1, "s", dash.get("date")))
    h = _load("h200.json")
    if h:
        def row(op, mode, b):
            return next((r for r in h["rows"] if r["op"] == op and r["mode"] == mode and r["impl"] == "triton"
                         and r["d_inner"] == 5120 and r["batch"] == b and r["L"] in (2048, 1)), None)
        for b, g in ((1, 3), (8, 2)):
            r = row("ssm_scan", "prefill", b)
            if r:
                out.append((f"4 prefill scan / its floor, batch {b}", r["time_us"] / r["floor_us"], g, "x floor",
                            r.get("date", h["meta"]["date"])))
        r = row("ssm_conv", "prefill", 1)
        if r:
            out.append(("4 prefill conv, batch 1", r["time_us"], 27.1, "us", r.get("date", h["meta"]["date"])))
        r = row("ssm_scan", "decode", 64)
        if r and r.get("reference_us"):
            out.append(("4 decode scan / selective_state_update, b 64", r["time_us"] / r["reference_us"], 1, "x",
                        r.get("date", h["meta"]["date"])))
        direct = [r for r in h["rows"] if r["impl"] == "triton, direct Python call: kernels/triton.py"
                  and r["op"] == "ssm_scan" and (r["batch"], r["mode"]) in ((1, "prefill"), (8, "prefill"),
                                                                         (1, "decode"))]
        for r in direct:
            out.append((f"4 direct call / graphed, scan {r['mode']} b {r['batch']}", r["direct_x_graphed"], 1.1,
                        "x", r["date"]))
    lc = _load("llamacpp_cpu.json")
    if lc:
        run = lc["runs"].get("now") or lc["runs"].get("after", {})      # the latest measured run
        rows = run.get("rows", [])
        if rows:
            out.append(("5 llama.cpp tracing, CPU (worst setting)", max(r["ratio"] for r in rows), 2, "x untraced",
                        run.get("date")))
    lh = _load("llamacpp_h200.json")
    if lh:      # the latest session's cells run in a kept context (as the CPU figure: runs after a setting's first),
        # with the default copies (deferred, asynchronous: sides/llamacpp/defer.py), worst of its calls
        big = [r for r in lh["rows"] if r.get("mode") == "big" and r.get("traced_s") and r.get("untraced_s")
               and r["device"] == "cuda" and r.get("offload") == 65 and "session 19" in str(r.get("date"))
               and r.get("context") == "kept from the previous run" and r.get("copies_mode") == "async"]
        if big:
            worst = max(big, key=lambda r: r["traced_s"] / r["untraced_s"])
            out.append((f"5 llama.cpp tracing, CUDA (2.8B, -ngl all, -ub {worst['ubatch']})",
                        worst["traced_s"] / worst["untraced_s"], 2, "x untraced", "2026-12-03"))
    return out


def main():
    g = goals()
    print("| goal | now | target | status (recorded) |\n|---|---|---|---|")
    for name, v, goal, unit, date in g:
        print(f"| {name} | {v:.3g} {unit} | {goal:g} {unit} | {'met' if v <= goal else 'not met'} ({date}) |")
    fig, ax = plt.subplots(figsize=(7.5, 0.36 * len(g) + 1.0), dpi=120)
    ratios = [v / goal for _, v, goal, _, _ in g]
    ys = range(len(g))[::-1]
    ax.barh(list(ys), ratios, color=["#3b7d3b" if r <= 1 else "#b8512e" for r in ratios], height=0.6)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_xscale("log")
    ax.set_yticks(list(ys), [name for name, *_ in g], fontsize=8)
    for y, r, (_, v, goal, unit, _) in zip(ys, ratios, g):
        ax.text(max(r, 1.0) * 1.06, y, f"{v:.3g} {unit} (goal {goal:g})", va="center", fontsize=7)
    ax.set_xlim(0.3, max(ratios + [1.0]) * 12)     # room for the longest bar's label
    ax.set_xlabel("measured / goal (left of the line: met)")
    ax.set_title("issue #18: time to answer, against its goals", fontsize=9)
    fig.subplots_adjust(left=0.42, right=0.98, top=0.92, bottom=0.12)
    out = ROOT / "docs" / "figures" / "speed_goals.png"
    fig.savefig(out)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
