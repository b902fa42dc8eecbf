"""Golden outputs of the engine: what a set of command lines answers, every number kept exactly.

Recorded once before the restructure (issue 13) and held by tests/test_golden.py: a move of code must not move a
float. Each case runs `mamba-debug ...` in-process and keeps its JSON (timings stripped, the checkout's path
replaced by <repo>, temporary folders by <tmp>) and, for files a case writes (a trace, an export-case), a digest
of their tensors and the text they hold.

    python tests/golden/record.py            # re-record every case (only when an answer is meant to change)
    python tests/golden/record.py CASE ...   # re-record some
    python tests/golden/record.py --kind     # this CPU kind's own set (below)

A re-record is a decision, not a fix: say in the commit which case changed and why.

CPU kinds: two machines that `machine()` cannot tell apart (both AVX-512, the same torch) may still round float32
differently (an Intel CPU with AMX against the one these were recorded on; MKL, for one, picks its code by
processor, and forcing its code path moves these bits), and there the errors the engine measures, which are that
rounding, move. Such a kind keeps its own exact set in kinds/<digest>/ (digest: of its answer to CANARY), recorded
with `--kind` from code whose answers the main set still holds on its own kind; tests/test_golden.py holds a
machine to the set whose CANARY answer it reproduces bit for bit, else to the main set.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

BUG = ["--kernels", "bug_strided_gate", "--offload", "6", "--ubatch", "8"]
# name -> (command line, files the case writes: "json" is --json's file)
CASES = {
    "compare_default": ["compare"],
    "compare_bug_strided_gate": ["compare", *BUG],
    "compare_n_seqs_3": ["compare", "--n-seqs", "3"],
    "compare_local": ["compare", "--local", *BUG],
    "compare_reference_float64": ["compare", "--reference", "float64", "--offload", "6", "--ubatch", "8"],
    "compare_repeat_2": ["compare", "--repeat", "2", "--ubatch", "8"],
    "compare_capture_sites": ["compare", "--capture", "sites", "--layers", "5..7", "--sites", "gate,y_gated,resid",
                              *BUG, "--trace", "{tmp}/trace.safetensors"],
    "sweep_small": ["sweep", "--kernels", "bug_strided_gate", "--offloads", "0,6,13", "--ubatches", "1,8",
                    "--workers", "1", "--n-gen", "4"],
    "bisect": ["bisect", "--kernels", "bug_strided_gate", "--ubatch", "8", "--n-gen", "4"],
    "export_case": ["export-case", *BUG, "--n-gen", "4", "--out", "{tmp}/case"],
    "show_trace": ["show", "{tmp}/trace.safetensors"],
}
CANARY = "compare_default"      # the case that picks a CPU kind's set (see the module docstring)
# show_trace reopens the trace that compare_capture_sites saved
NEEDS = {"show_trace": "compare_capture_sites"}
TIMING_KEYS = {"timings", "seconds", "compare_s"}


def _clean(obj, tmp: str):
    """Strip timings, make paths machine-independent."""
    if isinstance(obj, dict):
        return {k: _clean(v, tmp) for k, v in obj.items() if k not in TIMING_KEYS}
    if isinstance(obj, list):
        return [_clean(v, tmp) for v in obj]
    if isinstance(obj, str):
        return obj.replace(tmp, "<tmp>").replace(str(REPO), "<repo>")
    return obj


def _tensor_digest(path: Path) -> dict:
    from safetensors import safe_open
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for k in sorted(f.keys()):
            t = f.get_tensor(k).contiguous()
            out[k] = [str(t.dtype), list(t.shape), hashlib.sha256(t.numpy().tobytes()).hexdigest()[:32]]
    return out


def run_case(name: str, tmp: str) -> dict:
    """Run one case in-process; return what is compared exactly."""
    from mamba_debug.cli import main
    argv = [a.format(tmp=tmp) for a in CASES[name]]
    js = Path(tmp) / f"{name}.json"
    if argv[0] != "export-case":
        argv += ["--json", str(js)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        code = main(argv)
    out = {"argv": CASES[name], "exit": code}
    if js.is_file():
        out["json"] = _clean(json.loads(js.read_text()), tmp)
    if name == "compare_capture_sites":
        out["trace_tensors"] = _tensor_digest(Path(tmp) / "trace.safetensors")
    if name == "export_case":
        case = Path(tmp) / "case"
        out["case"] = _clean(json.loads((case / "case.json").read_text()), tmp)
        out["inputs"] = _tensor_digest(case / "inputs.safetensors")
        out["test_case_sha256"] = hashlib.sha256((case / "test_case.py").read_bytes()).hexdigest()
    return out


def run_cases(names, tmp: str) -> dict:
    results = {}
    for name in names:
        if name in NEEDS and NEEDS[name] not in results:
            results[NEEDS[name]] = run_case(NEEDS[name], tmp)
        results[name] = run_case(name, tmp)
    return results


def machine() -> dict:
    import torch
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__}


def kind_digest(canary: dict) -> str:
    """The name of a CPU kind's set: a digest of its answer to CANARY (as recorded: machine key left out)."""
    body = {k: v for k, v in canary.items() if k != "machine"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]


def main(args=None):
    args = list(args or [])
    kind = "--kind" in args
    names = [a for a in args if a != "--kind"] or list(CASES)
    if kind and CANARY not in names:
        names.append(CANARY)
    with tempfile.TemporaryDirectory() as tmp:
        results = run_cases(names, tmp)
    results = {n: json.loads(json.dumps(dict(results[n], machine=machine()), sort_keys=True)) for n in names}
    out = HERE / "kinds" / kind_digest(results[CANARY]) if kind else HERE
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        (out / f"{name}.json").write_text(json.dumps(results[name], indent=1, sort_keys=True) + "\n")
        print(f"recorded {out.relative_to(HERE)}/{name}: exit {results[name]['exit']}")


if __name__ == "__main__":
    main(sys.argv[1:])
