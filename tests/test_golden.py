"""The engine's answers are held exactly: the golden outputs in tests/golden/ (recorded by tests/golden/record.py).

Every number must be identical on the CPU kind the goldens were recorded on (their `machine`). On a CPU whose torch
kernels differ (another vector ISA), floats are compared to 1e-9 relative instead, and the test says so.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

GOLDEN = Path(__file__).resolve().parent / "golden"
sys.path.insert(0, str(GOLDEN))
import record  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="the goldens are the CPU/interpreter answers; a GPU machine picks cuda")


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    return record.run_cases(list(record.CASES), str(tmp_path_factory.mktemp("golden")))


def _diff(a, b, path="", rel=0.0):
    """First difference between two JSON values, or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return f"{path}: keys differ: {sorted(set(a) ^ set(b))}"
        for k in a:
            d = _diff(a[k], b[k], f"{path}.{k}", rel)
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _diff(x, y, f"{path}[{i}]", rel)
            if d:
                return d
        return None
    if isinstance(a, float) and isinstance(b, float) and rel:
        same = a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= rel * max(abs(a), abs(b))
    else:
        same = a == b
    return None if same else f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize("name", list(record.CASES))
def test_golden(name, fresh):
    want = json.loads((GOLDEN / f"{name}.json").read_text())
    recorded_on = want.pop("machine")
    got = json.loads(json.dumps(fresh[name]))          # same JSON round trip as the recorded file
    exact = recorded_on == record.machine()
    if not exact:                                      # digests of float tensors cannot match across ISAs
        for key in ("trace_tensors", "inputs"):
            want.pop(key, None), got.pop(key, None)
    d = _diff(want, got, name, rel=0.0 if exact else 1e-9)
    assert d is None, (f"golden output moved ({'exact' if exact else 'within 1e-9: recorded on ' + str(recorded_on)}):"
                       f" {d}")
