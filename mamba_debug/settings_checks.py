"""The numeric fields of `RunSettings`, checked once by `RunSettings.validated`: finite, of the right type, in
range (a NaN compares False with every bound, so `k_floor=nan` would otherwise pass `k_floor <= 1` and no site
could ever diverge)."""
from __future__ import annotations

import math

from .errors import MambaDebugError

# Generated tokens of one run (compare's --n-gen, generate's --n-gen): each is a step of its own through every side,
# so a debugging run needs tens; far more is a typo that would run for hours.
N_GEN_MAX = 1 << 14


def _number(name: str, v, low: float, high: float = math.inf, flag: str | None = None):
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and low < v <= high
    if not ok:
        raise MambaDebugError(f"{name} ({flag}) must be a finite number in ({low:g}, {high:g}], got {v!r}")


def _count(name: str, v, low: int, flag: str):
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise MambaDebugError(f"{name} ({flag}) must be an integer >= {low}, got {v!r}")


def n_gen_problem(v, flag: str = "--n-gen"):
    """What is wrong with a number of generated tokens (None: nothing); the one wording for the flag and the API."""
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        return f"{flag} must be an integer >= 0, got {v!r}"
    if v > N_GEN_MAX:
        return (f"{flag} {v} is over the limit of {N_GEN_MAX} generated tokens (each one is a step of its own; a "
                f"debugging run needs tens): give at most {N_GEN_MAX}")
    return None


def check_n_gen(v, flag: str = "--n-gen") -> None:
    problem = n_gen_problem(v, flag)
    if problem:
        raise MambaDebugError(problem)


def check_numbers(s) -> None:
    check_n_gen(s.n_gen, "n_gen (--n-gen)")
    _number("k_floor", s.k_floor, 1.0, 1e12, "--k-floor")
    _number("memory_budget_mb", s.memory_budget_mb, 0.0, 1e9, "--memory-budget-mb")
    _count("repeat", s.repeat, 1, "--repeat")
    if s.offload is not None:
        _count("offload", s.offload, 0, "--offload")
    for name, flag in (("capture_layers", "--layers"), ("capture_sites", "--sites")):
        value = getattr(s, name)
        if value is not None and len(value) == 0:
            raise MambaDebugError(f"{flag} names nothing; give at least one (e.g. {flag} 0,3) or leave it out")
