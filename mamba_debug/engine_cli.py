"""Command-line front of the divergence engine: compare, sweep, bisect, export-case, show."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import MambaDebugError


def _int_list(text: str) -> list[int]:
    try:
        if ".." in text:
            a, b = text.split("..")
            return list(range(int(a), int(b) + 1))
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a list like 1,2,8 or a range like 0..13, got {text!r}") from None


def _add_run_args(p: argparse.ArgumentParser, offload=True):
    from .cli import _nonneg, _positive  # noqa: PLC0415
    p.add_argument("--model", default=None, help="HF Mamba folder or .gguf file (default: the shipped tiny model)")
    p.add_argument("--prompt", default=None, help="prompt text (default: a sentence for the shipped model)")
    if offload:
        p.add_argument("--offload", type=_nonneg("--offload"), default=None,
                       help="like -ngl: the last N blocks run on the device (default: all, head included)")
    p.add_argument("--ubatch", type=_positive("--ubatch"), default=512, help="like -ub (default 512)")
    p.add_argument("--n-seqs", type=_positive("--n-seqs"), default=1, help="sequences processed together")
    p.add_argument("--n-gen", type=_nonneg("--n-gen"), default=16, help="tokens generated after the prompt")
    p.add_argument("--kernels", default="triton", help="plug-in name in kernels/ or a .py path (torch: plain ops)")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "interpret", "cpu"])
    p.add_argument("--reference", default="float32", choices=["float32", "float64"], help="reference side precision")
    p.add_argument("--ref-device", default="cpu", choices=["cpu", "cuda"],
                   help="where the reference sides run their plain torch ops (cuda: for big models; default cpu)")
    p.add_argument("--rule", default="llama2024", choices=["llama2024", "llama2025"], help="-ngl placement rule")
    p.add_argument("--k-floor", type=float, default=10.0, help="flag errors beyond k x the rounding floor")


def _settings(args, **over):
    from .compare import CompareSettings  # noqa: PLC0415
    s = CompareSettings(offload=getattr(args, "offload", None), ubatch=args.ubatch, n_seqs=args.n_seqs,
                        n_gen=args.n_gen, kernels=args.kernels, device=args.device, reference=args.reference,
                        ref_device=args.ref_device, rule=args.rule, k_floor=args.k_floor)
    for k, v in over.items():
        setattr(s, k, v)
    return s


def _model_and_prompt(args):
    from .cli import DEFAULT_PROMPT  # noqa: PLC0415
    from .loading import load_model  # noqa: PLC0415
    model = load_model(args.model)
    if model.tokenizer is not None:
        ids = model.encode(args.prompt or DEFAULT_PROMPT)
    elif args.prompt:
        ids = [int(x) for x in args.prompt.split()] if all(x.isdigit() for x in args.prompt.split()) else None
        if ids is None:
            raise MambaDebugError("this model has no tokenizer.json: give --prompt as space-separated token ids")
    else:
        ids = [(7 * i + 3) % model.config.vocab_size for i in range(24)]
    if not ids:
        raise MambaDebugError("the prompt encodes to no tokens; give a non-empty --prompt")
    return model, ids


def _progress(enabled):
    if not enabled:
        return None
    from tqdm.auto import tqdm  # noqa: PLC0415
    bar = tqdm(desc="ubatches", unit="ub", leave=False)

    def update(done, total):
        bar.total = total
        bar.n = done
        bar.refresh()
        if done == total:
            bar.close()
    return update


def cmd_compare(args) -> int:
    from .compare import run_compare  # noqa: PLC0415
    from .result import save_trace, summary, to_json  # noqa: PLC0415
    model, ids = _model_and_prompt(args)
    s = _settings(args, capture=args.capture, local=args.local, repeat=args.repeat,
                  memory_budget_mb=args.memory_budget_mb,
                  capture_layers=_int_list(args.layers) if args.layers else None,
                  capture_sites=args.sites.split(",") if args.sites else None)
    if s.capture_layers or s.capture_sites:
        s.capture = "sites"
    res = run_compare(model, ids, s, progress=_progress(sys.stderr.isatty()))
    print(summary(res))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(to_json(res), indent=1))
        print(f"json      {args.json}")
    if args.trace:
        print(f"trace     {save_trace(res, args.trace)}")
    if args.report:
        from .report import write_report  # noqa: PLC0415
        print(f"report    {write_report(res, args.report)}")
    return 1 if res.first_divergence else 0


def cmd_sweep(args) -> int:
    from .sweep import run_sweep  # noqa: PLC0415
    model, ids = _model_and_prompt(args)
    offloads = _int_list(args.offloads) if args.offloads else None
    from .sweep import auto_workers  # noqa: PLC0415
    workers = auto_workers(model, args.device) if args.workers is None else args.workers
    sw = run_sweep(model, ids, _settings(args), offloads, _int_list(args.ubatches), _int_list(args.n_seqs_list),
                   workers=workers)
    ubs = sw["ubatches"]
    for s in sw["n_seqs"]:
        print(f"first divergence (token/layer) with {s} sequence(s); rows offload, columns ubatch")
        print("offload " + "".join(f"{'ub ' + str(u):>12s}" for u in ubs))
        for o in sw["offloads"]:
            row = []
            for u in ubs:
                c = next(c for c in sw["cells"] if c["offload"] == o and c["ubatch"] == u and c["n_seqs"] == s)
                fd = c["first_divergence"]
                row.append("ok" if fd is None else f"t{fd['token']}/L{'head' if fd['layer'] is None else fd['layer']}")
            print(f"{o:7d} " + "".join(f"{x:>12s}" for x in row))
    shared = sorted({(c["offload"], c["same_run_as"]) for c in sw["cells"] if "same_run_as" in c})
    runs = len(sw["cells"]) - sum(1 for c in sw["cells"] if "same_run_as" in c)
    print(f"{len(sw['cells'])} cells from {runs} runs in {sw['seconds']:.1f} s ({sw['workers']} process(es))"
          + "".join(f"; offload {o} is the run of offload {r} (the head's placement changes no bit here)"
                    for o, r in shared))
    if args.json:
        Path(args.json).write_text(json.dumps(sw, indent=1))
    return 1 if any(c["first_divergence"] for c in sw["cells"]) else 0


def cmd_bisect(args) -> int:
    from .sweep import bisect_layer  # noqa: PLC0415
    model, ids = _model_and_prompt(args)
    out = bisect_layer(model, ids, _settings(args))
    for r in out["runs"]:
        fd = r["first_divergence"]
        print(f"offload {r['offload']:3d}: " + ("clean" if fd is None else
              f"diverges at token {fd['token']} layer {fd['layer']} site {fd['site']}"))
    print(out["message"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if out["bad_layer"] is not None else 0


def cmd_export_case(args) -> int:
    from .export import export_case  # noqa: PLC0415
    model, ids = _model_and_prompt(args)
    case = export_case(model, ids, _settings(args, capture="metrics", free_run=False), args.out)
    print(f"exported {len(case['calls'])} op call(s) of layer {case['layer']} in ubatch {case['ubatch']} to "
          f"{args.out}; replay with: pytest {Path(args.out) / 'test_case.py'}")
    return 0


def cmd_show(args) -> int:
    from .result import load_trace, summary, to_json  # noqa: PLC0415
    res = load_trace(args.trace)
    print(summary(res))
    if args.json:
        Path(args.json).write_text(json.dumps(to_json(res), indent=1))
    if args.report:
        from .report import write_report  # noqa: PLC0415
        print(f"report    {write_report(res, args.report)}")
    return 1 if res.first_divergence else 0


def add_engine_commands(sub):
    p = sub.add_parser("compare", help="run reference and device side by side, report where drift begins")
    _add_run_args(p)
    p.add_argument("--json", default=None, help="write the result as JSON (DESIGN.md)")
    p.add_argument("--report", default=None, help="write an HTML report with the plots")
    p.add_argument("--trace", default=None, help="save the trace (.safetensors) to reopen with `show`")
    p.add_argument("--capture", default="all", choices=["all", "sites", "metrics"])
    p.add_argument("--layers", default=None, help="capture only these layers (e.g. 0,3 or 2..5)")
    p.add_argument("--sites", default=None, help="capture only these sites (comma-separated names)")
    p.add_argument("--memory-budget-mb", type=float, default=2048.0)
    p.add_argument("--local", action="store_true", help="also measure each device layer's own (local) error")
    p.add_argument("--repeat", type=int, default=1, help=">= 2: run the device twice, report nondeterminism")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("sweep", help="first divergence over offload x ubatch (x sequences)")
    _add_run_args(p, offload=False)
    p.add_argument("--offloads", default=None, help="offload counts (default 0..n_layer+1)")
    p.add_argument("--ubatches", default="1,2,8,32", help="ubatch sizes (default 1,2,8,32)")
    p.add_argument("--n-seqs-list", default="1", help="sequence counts (default 1)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes (default: the cores, up to 4, when the kernels are interpreted on the CPU)")
    p.add_argument("--json", default=None)
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("bisect", help="find the first bad layer by moving the offload boundary")
    _add_run_args(p, offload=False)
    p.add_argument("--json", default=None)
    p.set_defaults(func=cmd_bisect)

    p = sub.add_parser("export-case", help="write a divergent layer's real op inputs and a replay pytest")
    _add_run_args(p)
    p.add_argument("--out", required=True, help="folder for inputs.safetensors, case.json, test_case.py")
    p.set_defaults(func=cmd_export_case)

    p = sub.add_parser("show", help="reopen a saved trace: summary, JSON, report")
    p.add_argument("trace")
    p.add_argument("--json", default=None)
    p.add_argument("--report", default=None)
    p.set_defaults(func=cmd_show)
