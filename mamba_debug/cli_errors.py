"""How the command line ends: every failure one line naming the thing and the fix, never a traceback (unless
`--debug`). Exit 2 for anything that is not a verdict (a user error, a file the system refuses, a plug-in that
exits), 130 on Ctrl-C / SIGTERM; exit 1 is left to "diverged" alone."""
from __future__ import annotations

import signal
import sys
import traceback

from .errors import MambaDebugError


def split_debug(argv: list) -> tuple[list, bool]:
    """`--debug` is global: accepted anywhere before a `--` (and not passed on to `lab`'s JupyterLab)."""
    if "--debug" not in argv:
        return argv, False
    stop = argv.index("--") if "--" in argv else len(argv)
    if "--debug" not in argv[:stop]:
        return argv, False
    i = argv.index("--debug")
    return argv[:i] + argv[i + 1:], True


def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _signal_name(exc: KeyboardInterrupt) -> str:
    return "SIGTERM" if exc.args and str(exc.args[0]) == f"signal {int(signal.SIGTERM)}" else "Ctrl-C"


def _say(message: str, debug: bool):
    if debug:
        traceback.print_exc()
    print(f"mamba-debug: error: {message}", file=sys.stderr)


def run_guarded(func, args, debug: bool = False) -> int:
    old = None
    try:
        old = signal.signal(signal.SIGTERM, _sigterm)       # SIGTERM stops like Ctrl-C (exit 130)
    except ValueError:                                      # not the main thread: leave signals alone
        pass
    try:
        return func(args)
    except MambaDebugError as exc:
        _say(str(exc), debug)
    except KeyboardInterrupt as exc:
        if debug:
            traceback.print_exc()
        print(f"mamba-debug: interrupted ({_signal_name(exc)}); no output is half-written: each one is written "
              f"whole or left as it was", file=sys.stderr)
        return 130
    except SystemExit as exc:
        _say(f"something called sys.exit({exc.code!r}) in the middle of the run; the run did not finish "
             f"(a plug-in or a library it loads?)", debug)
    except MemoryError:
        _say("out of memory; lower --n-seqs, --ubatch or --n-gen", debug)
    except OSError as exc:
        name = exc.filename or ""
        _say(f"{name}{': ' if name else ''}{exc.strerror or exc}; check the path, its permissions and the free "
             f"disk space", debug)
    except RecursionError as exc:
        _say(f"recursion too deep ({exc}); the input nests too deeply", debug)
    except Exception as exc:  # noqa: BLE001 (no traceback reaches a user)
        where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        at = f" at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}" if where else ""
        _say(f"unexpected {type(exc).__name__}: {exc}{at}. This is a bug in mamba-debug or an input it does not "
             f"check yet; rerun with --debug for the traceback and report it", debug)
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    return 2
