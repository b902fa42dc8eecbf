"""The `mamba-debug` command line. User errors print one clear line and exit with status 2; exit 1 means diverged.

The run flags (offload, ubatch, kernels, device, ...) are generated from `RunSettings`' field metadata, so a default
or a help text is written once, in settings.py.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import torch

from .errors import MambaDebugError
from .settings import RunSettings

DEFAULT_PROMPT = ("It was a fine morning in the country, and Mr. Darcy walked with Elizabeth to the house, "
                  "where her mother said that")


# -- argument types ----------------------------------------------------------------------------------
def _int_at_least(name, low):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{name} must be >= {low}, got {value}")
        return value
    return parse


def _n_gen(text: str) -> int:
    """--n-gen: an integer in 0..settings_checks.N_GEN_MAX, refused before the model loads."""
    from .settings_checks import n_gen_problem  # noqa: PLC0415
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--n-gen must be an integer, got {text!r}") from None
    problem = n_gen_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value


def _items(text: str, example: str) -> list:
    """A comma list's items; an empty one refused, as the Python API refuses it (`--devices cpu,,cpu` ran two)."""
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty item; give e.g. {example}")
    return items


def _int_list(text: str) -> list:
    try:
        if ".." in text:
            a, b = text.split("..")
            out = list(range(int(a), int(b) + 1))
        else:
            out = [int(x) for x in _items(text, "1,2,8")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a list like 1,2,8 or a range like 0..13, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r} is an empty list or a reversed range; give e.g. 1,2,8 or 0..13")
    return out


def _str_list(text: str) -> list:
    return _items(text, "a,b")


def _float_list(text: str) -> list:
    try:
        out = [float(x) for x in _items(text, "3,1")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 3,1, got {text!r}") from None
    if not out:
        raise argparse.ArgumentTypeError(f"{text!r} is an empty list; give e.g. 3,1")
    return out


def _parser_for(kind: str, flag: str):
    return {"nonneg": _int_at_least(flag, 0), "positive": _int_at_least(flag, 1), "float": float, "int": int,
            "n_gen": _n_gen, "int_list": _int_list, "str_list": _str_list, "float_list": _float_list}[kind]


# -- flags from RunSettings ------------------------------------------------------------------------
def add_model_flags(p: argparse.ArgumentParser, prompt: bool = True):
    p.add_argument("--model", default=None, help="HF Mamba folder or .gguf file (default: the shipped tiny model)")
    if prompt:
        p.add_argument("--prompt", default=None, help="prompt text (default: a sentence for the shipped model)")


def add_settings_flags(p: argparse.ArgumentParser, command: str):
    """One flag per RunSettings field that `command` takes (its metadata says which: run, point, compare)."""
    takes = {"compare": {"run", "point", "schedule", "compare"}, "export-case": {"run", "point", "schedule"},
             "sweep": {"run"}}.get(command, {"run", "schedule"})
    for f in dataclasses.fields(RunSettings):
        meta = f.metadata
        if not meta or meta["commands"] not in takes:
            continue
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        kw = {"dest": f.name, "help": meta["help"], "default": meta.get("cli_default", f.default)}
        if meta.get("parse") in ("store_true", "store_false"):
            kw["action"] = meta["parse"]
        elif "parse" in meta:
            kw["type"] = _parser_for(meta["parse"], flag)
        if "choices" in meta:
            kw["choices"] = list(meta["choices"])
        p.add_argument(flag, **kw)


def settings_from(args, **over) -> RunSettings:
    """The RunSettings of the parsed flags (fields a command has no flag for keep their defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(RunSettings) if hasattr(args, f.name)}
    values.update(over)
    if values.get("capture_layers") or values.get("capture_sites"):
        values["capture"] = "sites"
    return RunSettings(**values)


def model_and_prompt(args):
    from .io import load_model  # noqa: PLC0415 (loading pulls in the readers: only for commands that load)
    if args.prompt is not None and not args.prompt.strip():
        raise MambaDebugError("--prompt is empty; give some text (or token ids), or leave --prompt out")
    model = load_model(args.model)
    for note in model.notes:
        print(f"mamba-debug: note: {note}", file=sys.stderr)
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


STDOUT = "-"           # `--json -`: the JSON alone on stdout, the lines meant for a person on stderr


def _write_json(path, obj):
    from .safeio import write_text  # noqa: PLC0415
    if path == STDOUT:
        _json_out[0].write(json.dumps(obj, indent=1) + "\n")
        _json_out[0].flush()
        return
    write_text(path, json.dumps(obj, indent=1))


_json_out = [sys.stdout]        # where `--json -` writes: stdout as main() found it


def guard_outputs(args, **outputs):
    """Refuse (exit 2) an output path that is a file this run reads: the model's, the plug-in's, the trace shown."""
    from .safeio import model_inputs, refuse_inputs  # noqa: PLC0415
    inputs = []
    if hasattr(args, "model"):
        from .io.load import DEFAULT_MODEL  # noqa: PLC0415
        inputs += model_inputs(args.model or DEFAULT_MODEL)
    if getattr(args, "kernels", None) not in (None, "torch"):
        from .plugins import resolve_kernels  # noqa: PLC0415
        inputs.append(("the plug-in file", resolve_kernels(args.kernels)))
    if getattr(args, "trace", None) and args.command == "show":
        inputs.append(("the trace file", Path(args.trace)))
    refuse_inputs(outputs, inputs)


# -- commands ----------------------------------------------------------------------------------------
def cmd_compare(args) -> int:
    from .compare import run_compare  # noqa: PLC0415
    from .trace import save_trace  # noqa: PLC0415
    from .views.summary import summary, to_json  # noqa: PLC0415
    guard_outputs(args, **{"--json": args.json, "--trace": args.trace, "--report": args.report})
    if args.three_way:
        return _three_way(args)
    model, ids = model_and_prompt(args)
    res = run_compare(model, ids, settings_from(args), progress=_progress(sys.stderr.isatty()))
    print(summary(res))
    if args.json:
        _write_json(args.json, to_json(res))
        print(f"json      {args.json}")
    if args.trace:
        print(f"trace     {save_trace(res, args.trace)}")
    if args.report:
        from .views.report import write_report  # noqa: PLC0415
        print(f"report    {write_report(res, args.report)}")
    return 1 if res.first_divergence else 0


def _three_way(args) -> int:
    """compare --three-way: float64 reference vs llama.cpp CPU vs llama.cpp CUDA (three_way.py)."""
    from .three_way import html_three_way, run_three_way, summary_three_way, to_json_three_way  # noqa: PLC0415
    from .views.summary import summary  # noqa: PLC0415
    if args.device not in (None, "auto"):
        raise MambaDebugError("--three-way runs both --device cpu and --device cuda: leave --device out")
    if args.trace:
        raise MambaDebugError("--three-way keeps no trace file: save each backend's trace with its own --device run")
    model, ids = model_and_prompt(args)
    tw = run_three_way(model, ids, settings_from(args).replace(device=None), progress=_progress(sys.stderr.isatty()),
                       on_run=lambda label: print(f"running   {label}", file=sys.stderr))
    for label, res in tw.runs.items():
        print(f"== {label}\n{summary(res)}")
    print(summary_three_way(tw))
    if args.json:
        _write_json(args.json, to_json_three_way(tw))
        print(f"json      {args.json}")
    if args.report:
        from .views.report import write_report  # noqa: PLC0415
        print(f"report    {write_report(tw.primary, args.report, extra=(('Three-way', html_three_way(tw)),))}")
    return 1 if tw.diverged else 0


def _keep_partial(args, command: str, stop) -> int:
    """An interrupted sweep or bisect: its finished work goes to `<--json stem>.incomplete.json` (atomically; the
    --json file itself keeps its old content, so a partial result is never taken for a whole one); exit 130."""
    path = _incomplete_path(args.json if args.json not in (None, STDOUT) else f"{command}.json")
    _write_json(path, stop.partial)
    print(f"mamba-debug: interrupted: {stop.done}, written to {path} (marked incomplete, with what was not run); "
          f"{args.json or 'no --json output'} left as it was", file=sys.stderr)
    return 130


def _interrupted_json(json_path):
    return _incomplete_path(json_path) if json_path not in (None, STDOUT) else None


def _incomplete_path(json_path) -> Path:
    path = Path(json_path)
    return path.with_name(path.stem + ".incomplete.json")


def cmd_sweep(args) -> int:
    from .sweep import Interrupted, auto_workers, run_sweep  # noqa: PLC0415
    guard_outputs(args, **{"--json": args.json, "--json (interrupted)": _interrupted_json(args.json)})
    model, ids = model_and_prompt(args)
    base = settings_from(args)
    largest = base.replace(ubatch=max(args.ubatches), n_seqs=max(args.n_seqs_list), capture="metrics")
    workers = auto_workers(model, args.device, largest, len(ids) + base.n_gen) if args.workers is None \
        else args.workers
    try:
        sw = run_sweep(model, ids, base, args.offloads, args.ubatches, args.n_seqs_list,
                       workers=workers, ray=args.ray)
    except Interrupted as stop:                # keep the finished cells, in a file of their own
        return _keep_partial(args, "sweep", stop)
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
    how = f"Ray at {sw['ray']}" if sw.get("ray") else f"{sw['workers']} process(es)"
    by_run: dict = {}
    for o, r in shared:
        by_run.setdefault(r, []).append(o)
    print(f"{len(sw['cells'])} cells from {runs} runs in {sw['seconds']:.1f} s ({how})"
          + "".join(f"; offload{'s' * (len(os_) > 1)} {_ranges(os_)} {'are' if len(os_) > 1 else 'is'} the run of "
                    f"offload {r} (the head's placement changes no bit here)" for r, os_ in by_run.items()))
    if args.json:
        _write_json(args.json, sw)
    return 1 if any(c["first_divergence"] for c in sw["cells"]) else 0


def cmd_bisect(args) -> int:
    from .sweep import Interrupted, bisect_layer  # noqa: PLC0415
    guard_outputs(args, **{"--json": args.json, "--json (interrupted)": _interrupted_json(args.json)})
    model, ids = model_and_prompt(args)
    try:
        out = bisect_layer(model, ids, settings_from(args))
    except Interrupted as stop:                # keep the finished runs and the bracket they give
        print(stop.partial["message"])
        return _keep_partial(args, "bisect", stop)
    for r in out["runs"]:
        fd = r["first_divergence"]
        print(f"offload {r['offload']:3d}: " + ("clean" if fd is None else
              f"diverges at token {fd['token']} layer {fd['layer']} site {fd['site']}"))
    print(out["message"])
    if args.json:
        _write_json(args.json, out)
    return 1 if out["bad_layer"] is not None or out["offload"] == 0 else 0


def _ranges(xs: list) -> str:
    """Sorted integers as runs: [12, 14, 15, 16] -> "12, 14..16"."""
    out: list = []
    for x in xs:
        if out and x == out[-1][1] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in out)


def cmd_export_case(args) -> int:
    from .export import export_case  # noqa: PLC0415
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise MambaDebugError(f"--out {args.out} is a file; export-case writes three files into a folder: name one")
    guard_outputs(args, **{f"--out {args.out}/{n}": Path(args.out) / n
                           for n in ("inputs.safetensors", "case.json", "test_case.py")})
    model, ids = model_and_prompt(args)
    case = export_case(model, ids, settings_from(args, capture="metrics", free_run=False), args.out)
    where = "the output head" if case["layer"] is None else f"layer {case['layer']}"
    print(f"exported {len(case['calls'])} op call(s) of {where} in ubatch {case['ubatch']} to "
          f"{args.out}; replay with: pytest {Path(args.out) / 'test_case.py'}")
    return 0


def cmd_show(args) -> int:
    from .trace import load_trace  # noqa: PLC0415
    from .views.summary import summary, to_json  # noqa: PLC0415
    guard_outputs(args, **{"--json": args.json, "--report": args.report})
    res = load_trace(args.trace)
    print(summary(res))
    if args.json:
        _write_json(args.json, to_json(res))
    if args.report:
        from .views.report import write_report  # noqa: PLC0415
        print(f"report    {write_report(res, args.report)}")
    return 1 if res.first_divergence else 0


def cmd_generate(args) -> int:
    from .backends import reference_backend  # noqa: PLC0415
    from .model import Runner  # noqa: PLC0415
    model, ids = model_and_prompt(args)
    runner = Runner(model, reference_backend())
    new = model.generate(torch.tensor([ids]), args.n_gen, ubatch=args.ubatch, runner=runner)[0]
    print(f"# {model!r}, reference back-end (float64 CPU), greedy, ubatch {args.ubatch}", file=sys.stderr)
    print(model.decode(ids) + model.decode(new.tolist()) if model.tokenizer else
          " ".join(map(str, ids + new.tolist())))
    return 0


def cmd_list_kernels(args) -> int:
    from .plugins import list_kernels  # noqa: PLC0415
    for name, desc in list_kernels().items():
        print(f"{name:24s} {desc}")
    return 0


def cmd_export_gguf(args) -> int:
    from .io import describe_gguf, export_gguf, load_model  # noqa: PLC0415
    guard_outputs(args, **{"--out": args.out})
    if Path(args.out).exists() and not Path(args.out).is_file():
        raise MambaDebugError(f"--out {args.out} is a device or a pipe; export-gguf reads the GGUF back to describe "
                              f"it: give a file name")
    model = load_model(args.model)
    out = export_gguf(model, args.out, dtype=args.dtype)
    print(f"# {model!r} -> GGUF {args.dtype}")
    print(f"wrote     {out}")
    print(describe_gguf(out, notes=model.notes))
    return 0


# -- the parser --------------------------------------------------------------------------------------
def _run_command(sub, name, func, help, out_flags=("json",)):
    p = sub.add_parser(name, help=help)
    add_model_flags(p)
    add_settings_flags(p, name)
    for flag in out_flags:
        p.add_argument(f"--{flag}", default=None, help=OUT_HELP.get(flag))
    p.set_defaults(func=func)
    return p


OUT_HELP = {"json": "write the result as JSON (DESIGN.md); '-': to stdout, the summary to stderr",
            "report": "write an HTML report with the plots",
            "trace": "save the trace (.safetensors) to reopen with `show`"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mamba-debug", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = _run_command(sub, "compare", cmd_compare, "run reference and device side by side, report where drift begins",
                     ("json", "report", "trace"))
    p.add_argument("--three-way", action="store_true", help="with --engine llama.cpp: the float64 reference vs "
                   "llama.cpp on its CPU backend vs on CUDA (one CUDA build), in one run and one report")
    p = _run_command(sub, "sweep", cmd_sweep, "first divergence over offload x ubatch (x sequences)")
    p.add_argument("--offloads", type=_int_list, default=None, help="offload counts (default 0..n_layer+1)")
    p.add_argument("--ubatches", type=_int_list, default="1,2,8,32", help="ubatch sizes (default 1,2,8,32)")
    p.add_argument("--n-seqs-list", type=_int_list, default="1", help="sequence counts (default 1)")
    p.add_argument("--workers", type=_int_at_least("--workers", 1), default=None,
                   help="processes (default: the cores, up to 4, when the kernels are interpreted on the CPU, and no "
                        "more than the memory holds: each worker loads its own copy of the model)")
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="each cell a Ray task: on the cluster at ADDRESS (auto: the running one), or on a Ray "
                        "started here when no ADDRESS is given (pip install ray)")
    _run_command(sub, "bisect", cmd_bisect, "find the first bad layer by moving the offload boundary")
    p = _run_command(sub, "export-case", cmd_export_case,
                     "write a divergent layer's real op inputs and a replay pytest", ())
    p.add_argument("--out", required=True, help="folder for inputs.safetensors, case.json, test_case.py")

    p = sub.add_parser("show", help="reopen a saved trace: summary, JSON, report")
    p.add_argument("trace")
    p.add_argument("--json", default=None, help=OUT_HELP["json"])
    p.add_argument("--report", default=None, help=OUT_HELP["report"])
    p.set_defaults(func=cmd_show)

    p = sub.add_parser("generate", help="greedy generation with the float64 reference")
    add_model_flags(p)
    p.add_argument("--n-gen", type=_n_gen, default=40, help="tokens to generate (default 40)")
    p.add_argument("--ubatch", type=_int_at_least("--ubatch", 1), default=RunSettings.ubatch)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("list-kernels", help="the kernel plug-ins in kernels/ with their descriptions")
    p.set_defaults(func=cmd_list_kernels)

    from .io.gguf import DTYPES  # noqa: PLC0415
    p = sub.add_parser("export-gguf", help="write the model as a llama.cpp GGUF (architecture mamba, mamba2 or "
                                           "granitehybrid)",
                       description="Write a Mamba-1, Mamba-2 or hybrid (Granite-4.0-H-shaped) model as a GGUF file "
                                   "that llama.cpp loads (same keys, tensor names and shapes as llama.cpp's "
                                   "convert_hf_to_gguf.py). Norms, conv, A and D stay F32 (Mamba-1's x and dt "
                                   "projections too); --dtype sets the embedding and the other matrices (in_proj, "
                                   "out_proj, attention and feed-forward weights).")
    p.add_argument("--out", required=True, help="the .gguf file to write")
    add_model_flags(p, prompt=False)
    p.add_argument("--dtype", default="f32", choices=list(DTYPES),
                   help="type of the big matrices (default f32; q8_0 falls back to f16 for rows not a multiple of 32)")
    p.set_defaults(func=cmd_export_gguf)

    from .lab import add_lab_command  # noqa: PLC0415
    add_lab_command(sub)
    return parser


def _preload_for_cuda(llama_lib):
    """A CUDA build of llama.cpp: this command restarts itself with libstdc++ preloaded before it loads anything
    (sides/llamacpp/preload.py: else the process can die silently at model load)."""
    from .sides.llamacpp.lib import library_dir  # noqa: PLC0415
    from .sides.llamacpp.preload import restart  # noqa: PLC0415
    try:
        folder = library_dir(llama_lib)
    except MambaDebugError:
        return                  # no library to be found: the run itself says so, in its own words
    restart(folder)


def main(argv=None) -> int:
    """Exit 0 clean, 1 diverged, 2 a usage or input error (one line; `--debug` adds the traceback), 130 interrupted."""
    from .cli_errors import run_guarded, split_debug  # noqa: PLC0415
    argv_given = argv
    argv, debug = split_debug(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    args = parser.parse_args(argv)
    for flag in ("trace", "report", "out"):             # '-' is stdout to a user, never a file named '-'
        if getattr(args, flag, None) == STDOUT and args.command != "show":
            parser.error(f"--{flag} -: only --json can go to stdout; give --{flag} a "
                         f"{'folder' if args.command == 'export-case' else 'file'} name")
    if argv_given is None and getattr(args, "engine", None) == "llama.cpp":
        _preload_for_cuda(args.llama_lib)
    if getattr(args, "json", None) != STDOUT:
        return run_guarded(args.func, args, debug)
    _json_out[0] = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):    # `mamba-debug compare --json - | jq .verdict`
        return run_guarded(args.func, args, debug)


if __name__ == "__main__":
    sys.exit(main())
