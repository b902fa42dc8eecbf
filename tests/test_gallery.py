"""The bug gallery: every kernels/bug_*.py must show the first divergence its BUG["expect"] promises, and the correct
`triton` plug-in must show none (zero false alarms matter as much as catching bugs).

Each expectation entry runs `run_compare` on a small random model (4 layers, d_model 32) under Triton's interpreter:

    {"settings": {... CompareSettings fields: offload, ubatch, n_seqs, ...},
     "first_divergence": None | {"layer_from_boundary": int (0 = first device layer) or "layer": None (head),
                                 "site": str, "token": int, "seq": int (optional)},
     optional: "n_gen" (default 4), "prompt_len" (default 40; the first tokens of PROMPT), "repeat" (default 1),
               "nondeterministic": bool (needs repeat >= 2),
               "model": {"dt_bias": value} (dt_bias set to value on every 16th channel of every layer)
                        {"arch": "mamba2" | "hybrid"} (a random Mamba-2 or Granite-style hybrid model instead)}
"""
from __future__ import annotations

import ast
import functools
import os
import time
from pathlib import Path

import pytest

from mamba_debug.compare import CompareSettings, run_compare
from mamba_debug.plugins import list_kernels, load_plugin

from conftest import random_model

KERNELS = Path(__file__).resolve().parent.parent / "kernels"
BUG_FILES = sorted(KERNELS.glob("bug_*.py"))
N_LAYER, D_MODEL = 4, 32
PROMPT = [(7 * i * i + 3 * i + 1) % 61 for i in range(160)]    # varied ids (vocab 61); 40 unless prompt_len
BUG_KEYS = {"bug", "incident", "symptom", "expect"}
DIVERGENCE_KEYS = {"layer_from_boundary", "layer", "site", "token", "seq"}
ENTRY_KEYS = {"settings", "first_divergence", "n_gen", "prompt_len", "repeat", "nondeterministic", "model"}
TIMINGS: dict[str, float] = {}
# interpret (CI) or cuda (the GPU run in benchmarks/h200.py): Triton fixes its mode once per process
DEVICE = os.environ.get("MAMBA_DEBUG_TEST_DEVICE", "interpret")


def _literal(path: Path, name: str):
    """A module-level literal of a plug-in file, read without executing it (collection stays cheap)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def _cases():
    for path in BUG_FILES:
        bug = _literal(path, "BUG") or {}
        for i, _ in enumerate(bug.get("expect", [])):
            yield pytest.param(path, i, id=f"{path.stem}[{i}]")


@functools.lru_cache(maxsize=None)
def _model(dt_bias: float | None = None, arch: str = "mamba1"):
    if arch != "mamba1":        # Mamba-2 (8 heads of 8, 2 groups) or a Granite-style hybrid (attention at 1 and 3)
        from test_mamba2 import MODELS
        return MODELS[arch](0, d_model=D_MODEL, n_layer=N_LAYER, vocab_size=61, head_dim=8, n_groups=2,
                            **({"layer_types": ("mamba2",) * N_LAYER} if arch == "mamba2" else {}))
    model = random_model(0, n_layer=N_LAYER, d_model=D_MODEL)
    if dt_bias is not None:
        for i in range(N_LAYER):
            model.params[f"layers.{i}.dt_bias"][::16] = dt_bias
    return model


_REF_CACHES: dict = {}   # one shared reference cache per model: the reference side does not depend on the kernels


def _compare(kernels: str, settings: dict, *, n_gen=4, prompt_len=40, repeat=1, dt_bias=None, arch="mamba1"):
    if DEVICE == "cuda" and settings.get("devices"):    # the CPU stand-ins of a split become slots on one GPU
        settings = {**settings, "devices": ["cuda:0"] * len(settings["devices"])}
    s = CompareSettings(**{"n_gen": n_gen, "repeat": repeat, **settings, "kernels": kernels, "device": DEVICE,
                           "capture": "metrics", "free_run": False})
    t0 = time.perf_counter()
    res = run_compare(_model(dt_bias, arch), PROMPT[:prompt_len], s,
                      ref_cache=_REF_CACHES.setdefault((dt_bias, arch), {}))
    TIMINGS[f"{Path(kernels).stem} {settings}"] = time.perf_counter() - t0
    return res


def _where(fd) -> str:
    if fd is None:
        return "no divergence"
    return (f"layer {fd['layer']} site {fd['site']} token {fd['token']} seq {fd['seq']} "
            f"(error {fd['error']}, threshold {fd['threshold']:.3g})")


def test_gallery_has_at_least_ten_variants_with_metadata():
    assert len(BUG_FILES) >= 10, [p.name for p in BUG_FILES]
    for path in BUG_FILES:
        plugin = load_plugin(str(path), DEVICE)
        assert plugin.name == path.stem, f"{path.name}: NAME must be {path.stem!r}"
        module = plugin.module
        assert module.__doc__ and module.__doc__.strip(), f"{path.name}: no module docstring"
        assert isinstance(module.DESCRIPTION, str) and module.DESCRIPTION and "\n" not in module.DESCRIPTION
        assert _literal(path, "DESCRIPTION") == module.DESCRIPTION, f"{path.name}: DESCRIPTION must be a literal"
        bug = plugin.bug
        assert isinstance(bug, dict) and BUG_KEYS <= set(bug), f"{path.name}: BUG lacks {BUG_KEYS - set(bug or {})}"
        assert all(isinstance(bug[k], str) and bug[k] for k in ("bug", "incident", "symptom")), path.name
        assert bug == _literal(path, "BUG"), f"{path.name}: BUG must be a plain literal"
        assert bug["expect"], f"{path.name}: no expectations"
        shows_something = False
        for entry in bug["expect"]:
            assert set(entry) <= ENTRY_KEYS and "settings" in entry and "first_divergence" in entry, (path.name, entry)
            fd = entry["first_divergence"]
            if fd is not None:
                shows_something = True
                assert set(fd) <= DIVERGENCE_KEYS and {"site", "token"} <= set(fd), (path.name, fd)
                assert ("layer_from_boundary" in fd) != ("layer" in fd and fd["layer"] is None), (path.name, fd)
            if "nondeterministic" in entry:
                assert entry.get("repeat", 1) >= 2, (path.name, entry)
        assert shows_something, f"{path.name}: no expectation shows the bug"
        assert list_kernels().get(path.stem) == module.DESCRIPTION, f"{path.name}: not listed with its description"


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")     # A > 0 and dt = inf variants:
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf/NaN is the point there
@pytest.mark.parametrize("path,index", list(_cases()))
def test_variant_shows_its_expected_first_divergence(path, index):
    entry = load_plugin(str(path), DEVICE).bug["expect"][index]
    res = _compare(str(path), entry["settings"], n_gen=entry.get("n_gen", 4), prompt_len=entry.get("prompt_len", 40),
                   repeat=entry.get("repeat", 1), dt_bias=(entry.get("model") or {}).get("dt_bias"),
                   arch=(entry.get("model") or {}).get("arch", "mamba1"))
    fd, want = res.first_divergence, entry["first_divergence"]
    context = f"{path.stem} {entry['settings']} ({res.placement.describe()}): got {_where(fd)}, expected {want}"
    if want is None:
        assert fd is None, context
    else:
        assert fd is not None, context
        layer = None if "layer" in want else res.placement.first_device_layer + want["layer_from_boundary"]
        got = {"layer": fd["layer"], "site": fd["site"], "token": fd["token"], "seq": fd["seq"]}
        expected = {"layer": layer, "site": want["site"], "token": want["token"], "seq": want.get("seq", fd["seq"])}
        assert got == expected, context
        assert fd["on_device"], context
    if "nondeterministic" in entry:
        assert (res.nondeterminism is not None) == entry["nondeterministic"], \
            f"{path.stem}: run-to-run difference {res.nondeterminism}"


# The correct kernels on a grid: every placement (no device layer .. every layer and the head) x ubatch x n_seqs.
# A 13-token prompt keeps the interpreter fast and still gives partial ubatches (8+5, 3+3+3+3+1).
@pytest.mark.parametrize("ubatch", [1, 3, 8])
@pytest.mark.parametrize("n_seqs", [1, 3])
def test_correct_triton_kernels_show_no_divergence(ubatch, n_seqs):
    for offload in range(N_LAYER + 2):
        res = _compare("triton", {"offload": offload, "ubatch": ubatch, "n_seqs": n_seqs}, n_gen=2, prompt_len=13)
        assert res.first_divergence is None, \
            f"false alarm: triton offload {offload} ubatch {ubatch} n_seqs {n_seqs}: {_where(res.first_divergence)}"


def test_correct_triton_kernels_with_large_dt_and_repeat():
    """The model the softplus variant needs (dt = 100 on some channels) is no false alarm for the correct kernels,
    and they are deterministic run to run."""
    res = _compare("triton", {"offload": 2, "ubatch": 8, "n_seqs": 2}, dt_bias=100.0, repeat=2)
    assert res.first_divergence is None, _where(res.first_divergence)
    assert res.nondeterminism is None, res.nondeterminism
