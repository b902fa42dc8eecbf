"""The `mamba-debug` command line. User errors print one clear line and exit with status 2."""
from __future__ import annotations

import argparse
import sys

import torch

from .errors import MambaDebugError


def _add_model_args(p: argparse.ArgumentParser):
    p.add_argument("--model", default=None, help="HF Mamba folder or .gguf file (default: the shipped tiny model)")
    p.add_argument("--prompt", default=None, help="prompt text (default: a sentence for the shipped model)")


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


def _positive(name):
    return _int_at_least(name, 1)


def _nonneg(name):
    return _int_at_least(name, 0)


DEFAULT_PROMPT = ("It was a fine morning in the country, and Mr. Darcy walked with Elizabeth to the house, "
                  "where her mother said that")


def cmd_generate(args) -> int:
    from .loading import load_model
    from .backends import reference_backend
    from .model import Runner

    model = load_model(args.model)
    ids = model.encode(args.prompt or DEFAULT_PROMPT)
    if not ids:
        raise MambaDebugError("the prompt encodes to no tokens; give a non-empty --prompt")
    runner = Runner(model, reference_backend())
    new = model.generate(torch.tensor([ids]), args.n_gen, ubatch=args.ubatch, runner=runner)[0]
    print(f"# {model!r}, reference back-end (float64 CPU), greedy, ubatch {args.ubatch}", file=sys.stderr)
    print(model.decode(ids) + model.decode(new.tolist()) if model.tokenizer else
          " ".join(map(str, ids + new.tolist())))
    return 0


def cmd_list_kernels(args) -> int:
    from .plugins import list_kernels
    for name, desc in list_kernels().items():
        print(f"{name:24s} {desc}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mamba-debug", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="greedy generation with the float64 reference")
    _add_model_args(p)
    p.add_argument("--n-gen", type=_nonneg("--n-gen"), default=40)
    p.add_argument("--ubatch", type=_positive("--ubatch"), default=512)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("list-kernels", help="the kernel plug-ins in kernels/ with their descriptions")
    p.set_defaults(func=cmd_list_kernels)

    from .engine_cli import add_engine_commands   # noqa: PLC0415
    from .gguf_io import add_gguf_commands        # noqa: PLC0415
    from .lab import add_lab_command              # noqa: PLC0415
    add_engine_commands(sub)
    add_gguf_commands(sub)
    add_lab_command(sub)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except MambaDebugError as exc:
        print(f"mamba-debug: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
