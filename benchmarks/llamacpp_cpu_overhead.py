"""What tracing costs on llama.cpp's CPU build (issue #18 goal 5, CPU half: observing every node at most 2x the run
that observes nothing).

The llama.cpp side alone (no reference side), on the shipped tiny model exported to an f32 GGUF, over compare's
default prompt and n_gen, at a few -ub / sequence settings. Per setting and run: the side's own figures
(`observer_effect`: `traced_s`, the traced decodes, every node mapped; `untraced_s`, the same schedule with the
eval callback answering no to every ask), the traced steps in full (the decodes plus the site arrays handed to
compare), and from a first, counted run: the nodes asked about (every node of every graph), the observe calls,
all Python callbacks. Ratios are medians of each run's traced / untraced (the two are timed back to back, so a
busy machine slows both); seconds are medians over --runs runs.

Run: python benchmarks/llamacpp_cpu_overhead.py [--runs 7] [--label after] [--commit HASH] [--profile ub512x1]
Writes (merges by label) benchmarks/results/llamacpp_cpu.json, or --out FILE. --profile SETTING prints a cProfile
of the traced steps of one run of that setting instead. Runs on the side before the trie too (it counts the side's
own callback then).
"""
from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import mamba_debug as md  # noqa: E402
from mamba_debug.cli import DEFAULT_PROMPT  # noqa: E402
from mamba_debug.compare import sequence_prompts  # noqa: E402
from mamba_debug.settings import RunSettings  # noqa: E402
from mamba_debug.sides.llamacpp import contexts, recall  # noqa: E402
from mamba_debug.sides.llamacpp import side as lside  # noqa: E402

PLAIN = getattr(lside, "Tracer", None)

SETTINGS = {"ub512x1": (512, 1), "ub8x1": (8, 1), "ub3x2": (3, 2)}
OUT = ROOT / "benchmarks" / "results" / "llamacpp_cpu.json"
DATE = datetime.date.today().isoformat()


class Counts:
    asks = observes = 0


def _counted(eval_fn):
    def counted(self, t, ask, user_data):
        if ask:
            Counts.asks += 1
        else:
            Counts.observes += 1
        return eval_fn(self, t, ask, user_data)
    return counted


def make_side(model, s, count: bool):
    """The side, its eval callback counted when asked: the Tracer's callback (made with each context, so the class
    is swapped until the run ends: see one_run), or before the trie, the side's own `_eval` (the script runs on
    both)."""
    if PLAIN is None:
        cls = type("Counting", (lside.LlamaCppSide,), {"_eval": _counted(lside.LlamaCppSide._eval)})
        return (cls if count else lside.LlamaCppSide)(model, s)
    lside.Tracer = type("Counting", (PLAIN,), {"eval": _counted(PLAIN.eval)}) if count else PLAIN
    return lside.LlamaCppSide(model, s)


def one_run(model, ids, ubatch: int, n_seqs: int, profile=None, count=False) -> dict:
    """One schedule traced (timed step by step), then the side's own untraced run of it. count: wrap the Python
    callback to count its calls (a first run: the count costs time of its own); the C fast path counts its own."""
    s = RunSettings(engine="llama.cpp", device="cpu", ubatch=ubatch, n_seqs=n_seqs).validated(model.config)
    side = make_side(model, s, count)
    try:
        tokens = sequence_prompts(ids, n_seqs, model.config.vocab_size)
        B = s.ubatch_per_seq(n_seqs)
        side.reset(s, n_seqs)
        side._c0 = side.tracer.fast.counts() if getattr(side.tracer, "fast", None) is not None else None
        Counts.asks = Counts.observes = 0
        step_s, nxt = 0.0, None
        n_prompt = len(range(0, tokens.shape[1], B))
        for u in range(n_prompt + s.n_gen):
            chunk = tokens[:, u * B:(u + 1) * B] if u < n_prompt else nxt[:, None]
            if profile is not None:
                profile.enable()
            t0 = time.perf_counter()
            out = side.step(chunk)
            step_s += time.perf_counter() - t0
            if profile is not None:
                profile.disable()
            nxt = out.logits[:, -1].argmax(-1)
        asks, observes = Counts.asks, Counts.observes
        fast = getattr(side.tracer, "fast", None)
        c = fast.counts() if fast is not None else {"c_asks": 0, "c_observes": 0, "python_calls": 0}
        c0 = getattr(side, "_c0", None) or {k: 0 for k in c}
        oe = side.observer_effect()
        assert oe["logits_bitwise_identical"], oe
        return {"traced_s": oe["traced_s"], "untraced_s": oe["untraced_s"], "steps_s": round(step_s, 4),
                "ratio": oe["traced_s"] / oe["untraced_s"], "steps_ratio": step_s / oe["untraced_s"],
                "ubatches": n_prompt + s.n_gen, "python_asks": asks, "python_observes": observes,
                "c_asks": c["c_asks"] - c0["c_asks"], "c_observes": c["c_observes"] - c0["c_observes"],
                "python_calls": c["python_calls"] - c0["python_calls"],
                "context": side.info.extra.get("context"), "callback": side.info.extra.get("callback"),
                "nodes_listed": len(side.info.extra["nodes"])}
    finally:
        side.close()
        if PLAIN is not None:
            lside.Tracer = PLAIN


GRAPHS = {"S1xT1": (512, 1, 1), "S2xT1": (3, 2, 1), "S1xT24": (512, 1, 24)}
FLOOR_MODES = ("untraced", "python_no", "python_yes_noop", "second", "repeat", "first", "cold")


def forget():
    """Drop what the Tracer remembers across contexts (recall.py; nothing before it was there)."""
    try:
        from mamba_debug.sides.llamacpp import recall  # noqa: PLC0415
    except ImportError:
        return
    recall._MEMORY.clear()


def floors(model, ids, reps: int = 25) -> list:
    """Per graph kind (sequences x tokens), ms per llama_decode, medians over interleaved repeats:
    untraced (the callback answers no), python_no (a Python callback that answers no: the same in Python),
    python_yes_noop (a Python callback that says yes to every node and does nothing: what llama.cpp's per-node
    synchronisation and the callback's transitions cost), second (traced, the second graph of its kind: the trie
    knows it, its path is mirrored into the C fast path), repeat (traced, a graph the trie and the fast path know),
    first (traced, the trie emptied before, as the first graph of each kind in a new context: recalled where
    recall.py remembers it), cold (also nothing remembered: mapped node by node, as the first graph of its kind in
    a process). Contexts are not kept between sides here (each side's Tracer is this function's)."""
    os.environ["MAMBA_DEBUG_LLAMA_KEEP"] = "0"
    contexts.release()
    mode = {"m": "repeat"}

    calls = {"python_no": lambda self, t, ask, user_data: False,
             "python_yes_noop": lambda self, t, ask, user_data: True}

    class Floor(PLAIN):         # every mode through one more call, so that the ratios compare like with like
        def eval(self, t, ask, user_data):
            return calls.get(mode["m"], PLAIN.eval)(self, t, ask, user_data)
    lside.Tracer, rows = Floor, []
    try:
        for name, (ub, S, T) in GRAPHS.items():
            s = RunSettings(engine="llama.cpp", device="cpu", ubatch=ub, n_seqs=S).validated(model.config)
            side = lside.LlamaCppSide(model, s)
            toks = sequence_prompts(ids, S, model.config.vocab_size)[:, :T]
            side.reset(s, S)
            for _ in range(3):
                side._decode(toks, trace=True)
            got = {m: [] for m in FLOOR_MODES}
            for _ in range(reps):
                for m in FLOOR_MODES:
                    mode["m"] = m
                    if m in ("first", "cold"):
                        if m == "cold":
                            forget()
                        side.tracer._reset_trie()
                    t0 = time.perf_counter()
                    side._decode(toks, trace=m != "untraced")
                    got[m].append(time.perf_counter() - t0)
            n_nodes = len(observe_nodes(side))      # before close: release() drops the graphs
            side.close()
            med = {m: statistics.median(v) * 1e3 for m, v in got.items()}
            rows.append({"graph": name, "n_seqs": S, "tokens": T, "nodes": n_nodes,
                         **{f"{m}_ms": round(v, 3) for m, v in med.items()},
                         **{f"{m}_x": round(v / med["untraced"], 2) for m, v in med.items() if m != "untraced"}})
    finally:
        lside.Tracer = PLAIN
    return rows


def observe_nodes(side) -> list:
    from mamba_debug.sides.llamacpp.observe import graph_nodes  # noqa: PLC0415
    return graph_nodes(side.tracer.graphs[0])


def bench(model, ids, runs: int) -> list:
    """Per setting, in one process with an empty cache folder: its first run as a new process's with nothing
    remembered (recall.py's memory emptied: every first graph mapped node by node), its first run as a new process's
    that finds the trie an earlier process wrote (recall_disk.py), `runs` runs each in a new context (a fresh side
    with MAMBA_DEBUG_LLAMA_KEEP=0, recall.py's memory filled: what the figures before kept contexts measured), then
    `runs` runs of new sides that take over the context the one before kept (contexts.py; a sweep's cells and the
    dashboard's runs of one setting): the headline `ratio`. The counts are of the cold first run (Python's
    callbacks; the C fast path's asks and observes)."""
    rows = []
    for name, (ub, S) in SETTINGS.items():
        os.environ["MAMBA_DEBUG_LLAMA_KEEP"] = "0"
        recall._MEMORY.clear()
        first = one_run(model, ids, ub, S, count=True)
        os.environ["MAMBA_DEBUG_LLAMA_KEEP"] = "1"
        one_run(model, ids, ub, S)                              # writes the trie to disk
        contexts.release()
        recall._MEMORY.clear()
        from_disk = one_run(model, ids, ub, S)
        os.environ["MAMBA_DEBUG_LLAMA_KEEP"] = "0"
        fresh = [one_run(model, ids, ub, S) for _ in range(runs)]
        os.environ["MAMBA_DEBUG_LLAMA_KEEP"] = "1"
        one_run(model, ids, ub, S)                              # its context is kept for the next run
        got = [one_run(model, ids, ub, S) for _ in range(runs)]
        assert all(r["context"] == "kept from the previous run" for r in got), [r["context"] for r in got]
        med = {k: round(statistics.median(r[k] for r in got), 4) for k in ("traced_s", "untraced_s", "steps_s")}
        ratios = {k: round(statistics.median(r[k] for r in got), 2) for k in ("ratio", "steps_ratio")}
        rows.append({"setting": name, "ubatch": ub, "n_seqs": S, **med, **ratios,
                     "fresh_context_ratio": round(statistics.median(r["ratio"] for r in fresh), 2),
                     "first_run_ratio": round(first["ratio"], 2), "first_run_from_disk_ratio": round(from_disk["ratio"], 2),
                     "kept_context_c_asks": got[0]["c_asks"], "kept_context_python_calls": got[0]["python_calls"],
                     **{k: first[k] for k in ("ubatches", "python_asks", "python_observes", "c_asks", "c_observes",
                                              "nodes_listed", "callback")}, "runs": runs})
        contexts.release()
    return rows


def new_processes(reps: int = 3) -> list:
    """Per setting, its run as a new process's (what each `mamba-debug compare --engine llama.cpp` is): a process of
    its own with nothing remembered (MAMBA_DEBUG_LLAMA_KEEP=0: no trie read from disk), and one that reads the trie
    an earlier process wrote (recall_disk.py). Medians of `reps` processes each."""
    rows = []
    for name, (ub, S) in SETTINGS.items():
        def spawn(keep: str) -> dict:
            env = dict(os.environ, MAMBA_DEBUG_LLAMA_KEEP=keep)
            out = subprocess.run([sys.executable, __file__, "--one-run", name], env=env, capture_output=True,
                                 text=True, check=True).stdout
            return json.loads(out.strip().splitlines()[-1])
        spawn("1")                                  # writes the trie of this setting's graphs
        got = {k: [spawn(k) for _ in range(reps)] for k in ("0", "1")}
        med = {k: {m: round(statistics.median(r[m] for r in v), 4) for m in ("traced_s", "untraced_s", "ratio")}
               for k, v in got.items()}
        rows.append({"setting": name, "nothing_remembered": med["0"], "trie_from_disk": med["1"], "processes": reps})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--one-run", choices=sorted(SETTINGS), help=argparse.SUPPRESS)     # new_processes' child
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--label", default="current", help="key of these rows in the result file (before / after)")
    ap.add_argument("--commit", default=None, help="the commit measured, recorded with the rows")
    ap.add_argument("--profile", choices=sorted(SETTINGS), help="print a cProfile of one run's traced steps")
    ap.add_argument("--floors", action="store_true", help="also the per-graph floors (needs the Tracer)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if not args.one_run:
        os.environ["MAMBA_DEBUG_CACHE"] = tempfile.mkdtemp(prefix="llamacpp-bench-")     # no trie of earlier runs
    torch.set_num_threads(1)
    model = md.load_model(None)
    ids = model.encode(DEFAULT_PROMPT)
    if args.one_run:
        r = one_run(model, ids, *SETTINGS[args.one_run])
        print(json.dumps({k: r[k] for k in ("traced_s", "untraced_s", "ratio")}))
        return
    if args.profile:
        ub, S = SETTINGS[args.profile]
        one_run(model, ids, ub, S)
        prof = cProfile.Profile()
        print(one_run(model, ids, ub, S, profile=prof))
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(30)
        return
    rows = bench(model, ids, args.runs)
    print(f"{'setting':<9} {'ubatches':>8} {'traced s':>9} {'untraced s':>10} {'ratio':>6} {'steps s':>8} "
          f"{'steps/unt':>9} {'fresh ctx':>9} {'1st run':>7} {'1st/disk':>8} {'py asks':>7} {'C asks':>7} {'C obs':>6}")
    for r in rows:
        print(f"{r['setting']:<9} {r['ubatches']:>8} {r['traced_s']:>9.4f} {r['untraced_s']:>10.4f} "
              f"{r['ratio']:>6.2f} {r['steps_s']:>8.4f} {r['steps_ratio']:>9.2f} {r['fresh_context_ratio']:>9.2f} "
              f"{r['first_run_ratio']:>7.2f} {r['first_run_from_disk_ratio']:>8.2f} {r['python_asks']:>7} "
              f"{r['c_asks']:>7} {r['c_observes']:>6}")
    proc_rows = new_processes()
    print("\nnew process (x untraced): setting   nothing remembered   trie from disk")
    for r in proc_rows:
        print(f"{'':26}{r['setting']:<9} {r['nothing_remembered']['ratio']:>18.2f} {r['trie_from_disk']['ratio']:>16.2f}")
    floor_rows = floors(model, ids) if args.floors else None
    if floor_rows:
        print(f"\nms per decode (x untraced): {'graph':<7}" + "".join(f"{m:>17}" for m in FLOOR_MODES))
        for r in floor_rows:
            print(f"{'':27}{r['graph']:<7}" + "".join(
                f"{r[m + '_ms']:>9.3f}" + (f" ({r[m + '_x']:.2f}x)" if m != "untraced" else " " * 8)
                for m in FLOOR_MODES))
    if args.no_write:
        return
    out = args.out
    old = json.loads(out.read_text()) if out.is_file() else {}
    old.update({"date": DATE, "machine": f"{platform.machine()}, 2 shared cores, 1 llama.cpp thread",
                "model": str(model), "prompt_tokens": len(ids), "n_gen": RunSettings().n_gen,
                "library": "llama-cpp-python 0.3.36 (llama.cpp 0c1e570), CPU build"})
    old.setdefault("runs", {})[args.label] = {"date": DATE, "commit": args.commit, "rows": rows,
                                              "new_process": proc_rows,
                                              **({"floors": floor_rows} if floor_rows else {})}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(old, indent=1) + "\n")
    print(f"wrote {out} ({args.label})")


if __name__ == "__main__":
    main()
