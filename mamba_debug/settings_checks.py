"""The fields of `RunSettings`: `plain` makes numpy scalars and comma strings the Python values they stand for
when the settings are made; `check_numbers` checks them once in `RunSettings.validated`: finite, of the right type,
in range (a NaN compares False with every bound, so `k_floor=nan` would otherwise pass `k_floor <= 1` and no site
could ever diverge), flags True or False (`local="no"` is truthy)."""
from __future__ import annotations

import math
import numbers
import os

from .config import is_flag, is_integer
from .errors import MambaDebugError

INT_FIELDS = ("offload", "ubatch", "n_seqs", "n_gen", "repeat")
FLOAT_FIELDS = ("k_floor", "memory_budget_mb")
BOOL_FIELDS = ("local", "op_offload", "fp32_everywhere", "free_run")

# Generated tokens of one run (compare's --n-gen, generate's --n-gen): each is a step of its own through every side,
# so a debugging run needs tens; far more is a typo that would run for hours.
N_GEN_MAX = 1 << 14


def _number(name: str, v, low: float, high: float = math.inf, flag: str | None = None):
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and low < v <= high
    if not ok:
        raise MambaDebugError(f"{name} ({flag}) must be a finite number in ({low:g}, {high:g}], got {v!r}")


def check_count(name: str, v, low: int, flag: str | None = None):
    if not is_integer(v) or v < low:
        named = f"{name} ({flag})" if flag else name
        raise MambaDebugError(f"{named} must be an integer >= {low}, got {v!r}")


def n_gen_problem(v, flag: str = "--n-gen"):
    """What is wrong with a number of generated tokens (None: nothing); the one wording for the flag and the API."""
    if not is_integer(v) or v < 0:
        return f"{flag} must be an integer >= 0, got {v!r}"
    if v > N_GEN_MAX:
        return (f"{flag} {v} is over the limit of {N_GEN_MAX} generated tokens (each one is a step of its own; a "
                f"debugging run needs tens): give at most {N_GEN_MAX}")
    return None


def check_n_gen(v, flag: str = "--n-gen") -> None:
    problem = n_gen_problem(v, flag)
    if problem:
        raise MambaDebugError(problem)


def plain(name: str, v):
    """A field's value as the Python type it stands for: numpy's scalars (a slider's or np.arange's values) as int,
    float or bool, so the settings equal and hash like the same settings typed by hand; a comma string for a list
    (`devices="cuda:0,cuda:1"`) as its items, not its characters. Anything else is left for the checks to name."""
    if name in ("devices", "tensor_split", "capture_sites", "capture_layers") and isinstance(v, str):
        v = tuple(int(x) if name == "capture_layers" and x.strip().isdigit() else x.strip() for x in v.split(","))
    if name in ("devices", "tensor_split", "capture_sites", "capture_layers") and v is not None:
        try:
            v = tuple(v)                            # an array, a list
        except TypeError:
            raise MambaDebugError(f"{name} must be a list (or a comma string), got {v!r}") from None
    if name == "tensor_split" and v is not None:
        return tuple(_share(x) for x in v)
    if name == "capture_layers" and v is not None:
        return tuple(plain("offload", x) for x in v)
    if name in ("kernels", "llama_lib") and isinstance(v, os.PathLike):
        return os.fspath(v)                         # a Path: the trace's JSON and the cache keys hold text
    if name in INT_FIELDS and is_integer(v):
        return int(v)
    if name in FLOAT_FIELDS and isinstance(v, numbers.Real) and not is_flag(v):
        return float(v)
    if name in BOOL_FIELDS and is_flag(v):
        return bool(v)
    return v


def _share(x):
    try:
        return x if is_flag(x) else float(x)
    except (TypeError, ValueError):
        return x                                    # named by placement.check_split


def check_layers(layers, n_layer: int) -> None:
    for layer in layers or ():
        if not is_integer(layer):
            raise MambaDebugError(f"capture layer {layer!r} is not a layer number: give integers 0..{n_layer - 1}")
        if not 0 <= layer < n_layer:
            raise MambaDebugError(f"capture layer {layer} out of range: the model's layers are 0..{n_layer - 1}")


def check_numbers(s) -> None:
    for name in BOOL_FIELDS:
        if not isinstance(getattr(s, name), bool):
            raise MambaDebugError(f"{name} must be True or False, got {getattr(s, name)!r}")
    if not is_integer(s.ubatch) or s.ubatch < 1:
        raise MambaDebugError(f"ubatch must be an integer >= 1 (like -ub), got {s.ubatch!r}")
    if not is_integer(s.n_seqs) or s.n_seqs < 1:
        raise MambaDebugError(f"n_seqs must be an integer >= 1, got {s.n_seqs!r}")
    check_n_gen(s.n_gen, "n_gen (--n-gen)")
    _number("k_floor", s.k_floor, 1.0, 1e12, "--k-floor")
    _number("memory_budget_mb", s.memory_budget_mb, 0.0, 1e9, "--memory-budget-mb")
    check_count("repeat", s.repeat, 1, "--repeat")
    if s.offload is not None:
        check_count("offload", s.offload, 0, "--offload")
    for name, flag in (("capture_layers", "--layers"), ("capture_sites", "--sites")):
        value = getattr(s, name)
        if value is not None and len(value) == 0:
            raise MambaDebugError(f"{flag} names nothing; give at least one (e.g. {flag} 0,3) or leave it out")
