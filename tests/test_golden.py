"""The engine's answers are held exactly: the golden outputs in tests/golden/ (recorded by tests/golden/record.py).

Every number must be identical on the CPU kind the goldens were recorded on (their `machine`). On a CPU whose torch
kernels differ (another vector ISA: AVX2 against AVX-512), every float32 op of both sides rounds differently, and
the errors the engine measures are that rounding (rel. L2 ~1e-7, KLD ~1e-12): they move by tens of percent, and with
them the verdict's "0.38x its threshold" and which site of a layer is worst. There each float must stay within a
factor of 4 of its golden value, or both below 1e-9 (second-order errors such as a token's KLD, ~1e-12, move by
10x; a fault or a lost site moves errors by orders of magnitude, past 1e-6 in KLD), the verdict's words
before its figures must be the same, a layer's worst site is not compared, and everything else is exact; the test
says which comparison ran.

Two CPUs of one ISA can round differently too (an Intel CPU with AMX against the recording one: a layer's worst
error ratio moved 4.5x, past the cross-ISA factor; MKL, for one, picks its code by processor). Such a CPU kind
has its own exact set in golden/kinds/<digest>/ (record.py): a machine is held to the set whose canary case
(record.CANARY) it reproduces bit for bit, else to the main set. A change that moves any answer matches no set's
canary or fails that set's other cases, so it is caught on every kind.
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


CROSS_ISA_FACTOR = 4.0     # another ISA's float32 rounding: errors within this factor of the golden ones
CROSS_ISA_NOISE = 1e-9     # second-order errors (KLD, NMSE ~1e-12 there) below it: rounding, not compared


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
        same = (a == b or (math.isnan(a) and math.isnan(b)) or (a * b > 0 and max(a / b, b / a) <= rel)
                or max(abs(a), abs(b)) <= CROSS_ISA_NOISE)
    elif rel and isinstance(a, str) and isinstance(b, str) and path.endswith(".verdict"):
        same = a.split("(")[0] == b.split("(")[0]
    elif rel and path.endswith(".worst_site"):
        same = True
    else:
        same = a == b
    return None if same else f"{path}: {a!r} != {b!r}"


def golden_set_matches(fresh: dict, folder: Path) -> bool:
    """This machine has the set's machine key and reproduces its canary answer bit for bit."""
    want = json.loads((folder / f"{record.CANARY}.json").read_text())
    return want.pop("machine") == record.machine() and _diff(want, json.loads(json.dumps(fresh[record.CANARY])),
                                                             record.CANARY) is None


def golden_set(fresh: dict) -> Path:
    """The folder of goldens this machine is held to: the kind whose canary answer it reproduces exactly, else the
    main set."""
    for folder in sorted((GOLDEN / "kinds").glob("*")):
        if golden_set_matches(fresh, folder):
            return folder
    return GOLDEN


@pytest.fixture(scope="module")
def held_to(fresh):
    return golden_set(fresh)


def _canary_note(fresh, held_to) -> str:
    """What to suspect when this machine reproduces no set's canary exactly (its set is then the main one)."""
    if held_to != GOLDEN or golden_set_matches(fresh, GOLDEN):
        return ""
    return (f"; this machine reproduces no recorded set's {record.CANARY} bit for bit: either the code moved an "
            f"answer, or this is a CPU kind without a set of its own (record one with `tests/golden/record.py "
            f"--kind` from a commit whose answers the main set holds, see record.py)")


@pytest.mark.parametrize("name", list(record.CASES))
def test_golden(name, fresh, held_to):
    want = json.loads((held_to / f"{name}.json").read_text())
    recorded_on = want.pop("machine")
    got = json.loads(json.dumps(fresh[name]))          # same JSON round trip as the recorded file
    exact = recorded_on == record.machine()
    if not exact:                                      # digests of float tensors cannot match across ISAs
        for key in ("trace_tensors", "inputs"):
            want.pop(key, None), got.pop(key, None)
    d = _diff(want, got, name, rel=0.0 if exact else CROSS_ISA_FACTOR)
    how = "exact" if exact else f"within a factor of {CROSS_ISA_FACTOR}: recorded on {recorded_on}"
    how += f", {held_to.relative_to(GOLDEN.parent)}"
    assert d is None, f"golden output moved ({how}): {d}" + (_canary_note(fresh, held_to) if exact else "")


def test_a_machine_is_held_to_the_set_whose_canary_it_reproduces(monkeypatch, tmp_path):
    """golden_set picks a CPU kind's set only for a machine that reproduces its canary bit for bit (and has its
    machine key); any other answer, a moved one included, is held to the main set."""
    main = json.loads((GOLDEN / f"{record.CANARY}.json").read_text())
    kind_dir = tmp_path / "golden" / "kinds" / "k1"
    kind_dir.mkdir(parents=True)
    other = json.loads(json.dumps(main))
    other["json"]["logits"]["kld_max"] *= 2                     # the other kind's rounding
    (kind_dir / f"{record.CANARY}.json").write_text(json.dumps(other))
    monkeypatch.setattr(sys.modules[__name__], "GOLDEN", tmp_path / "golden")
    machine = other.pop("machine")
    main.pop("machine")
    monkeypatch.setattr(record, "machine", lambda: machine)
    assert golden_set({record.CANARY: other}) == kind_dir
    assert golden_set({record.CANARY: main}) == tmp_path / "golden"
    moved = json.loads(json.dumps(other))
    moved["json"]["logits"]["kld_max"] *= 3                     # a change of code: no set's canary
    assert golden_set({record.CANARY: moved}) == tmp_path / "golden"
    (tmp_path / "golden" / f"{record.CANARY}.json").write_text(json.dumps(dict(main, machine=machine)))
    assert _canary_note({record.CANARY: moved}, tmp_path / "golden").startswith("; this machine reproduces no")
    assert _canary_note({record.CANARY: main}, tmp_path / "golden") == ""       # the main set's own kind
    assert _canary_note({record.CANARY: other}, kind_dir) == ""
    monkeypatch.setattr(record, "machine", lambda: dict(machine, cpu_capability="AVX2"))
    assert golden_set({record.CANARY: other}) == tmp_path / "golden"
