"""The numeric fields of `RunSettings`, checked once by `RunSettings.validated`: finite, of the right type, in
range (a NaN compares False with every bound, so `k_floor=nan` would otherwise pass `k_floor <= 1` and no site
could ever diverge)."""
from __future__ import annotations

import math

from .errors import MambaDebugError


def _number(name: str, v, low: float, high: float = math.inf, flag: str | None = None):
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and low < v <= high
    if not ok:
        raise MambaDebugError(f"{name} ({flag}) must be a finite number in ({low:g}, {high:g}], got {v!r}")


def _count(name: str, v, low: int, flag: str):
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise MambaDebugError(f"{name} ({flag}) must be an integer >= {low}, got {v!r}")


def check_numbers(s) -> None:
    _number("k_floor", s.k_floor, 1.0, 1e12, "--k-floor")
    _number("memory_budget_mb", s.memory_budget_mb, 0.0, 1e9, "--memory-budget-mb")
    _count("repeat", s.repeat, 1, "--repeat")
    if s.offload is not None:
        _count("offload", s.offload, 0, "--offload")
    for name, flag in (("capture_layers", "--layers"), ("capture_sites", "--sites")):
        value = getattr(s, name)
        if value is not None and len(value) == 0:
            raise MambaDebugError(f"{flag} names nothing; give at least one (e.g. {flag} 0,3) or leave it out")
