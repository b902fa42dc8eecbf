"""The side seam: a side reports only what it computed. A site it did not observe is NaN in the trace, null in the
JSON, never the first divergence, and never filled from another side (a copy of the reference would read as 0)."""
from __future__ import annotations

import json
import math

import pytest
import torch

import mamba_debug as md
from mamba_debug import compare
from mamba_debug.sides import StepOutput

from conftest import random_model

PROMPT = [(11 * i + 5) % 61 for i in range(20)]

STRIDED_SILU = '''
import torch
def silu(x):
    flat = torch.as_strided(x, x.shape, torch.empty(x.shape).stride(), x.storage_offset())
    return flat * torch.sigmoid(flat)
OPS = {"silu": silu}
'''


class SubsetSide:
    """A device side that observes fewer sites than the reference (as llama.cpp's will): it drops `hidden`."""

    def __init__(self, inner, hidden):
        self.inner, self.hidden, self.info = inner, set(hidden), inner.info

    def __getattr__(self, name):                  # u, has_device, save_state, free_step, ...: the real side's
        return getattr(self.inner, name)

    def reset(self, settings, n_seqs, first_seq=0, n_tokens=0):
        self.inner.reset(settings, n_seqs, first_seq, n_tokens)

    def observed_sites(self):
        return self.inner.observed_sites() - self.hidden

    def step(self, tokens):
        out = self.inner.step(tokens)
        return StepOutput(out.logits, {k: v for k, v in out.sites.items() if k not in self.hidden})


@pytest.fixture
def bug(tmp_path):
    f = tmp_path / "strided_silu.py"
    f.write_text(STRIDED_SILU)
    return str(f)


def _run(monkeypatch, hidden, **kw):
    model = random_model(n_layer=4)
    if hidden:
        real = compare.build_sides

        def build(*args, **kwargs):
            sides = real(*args, **kwargs)
            sides["device"] = SubsetSide(sides["device"], hidden)
            return sides
        monkeypatch.setattr(compare, "build_sides", build)
    s = md.RunSettings(device="cpu", n_gen=3, ubatch=4, **kw)
    return md.run_compare(model, PROMPT, s)


def test_unobserved_sites_are_nan_null_and_never_the_first_divergence(monkeypatch, bug):
    """The strided-silu bug is born at layer 2's gate; a device side that does not observe gate (anywhere) must not
    read 0 there: NaN errors, null in the JSON, and the divergence is found at the next site it does observe."""
    full = _run(monkeypatch, (), kernels=bug, offload=2)
    assert (full.first_divergence["layer"], full.first_divergence["site"]) == (2, "gate")

    hidden = {(i, "gate") for i in range(4)}
    res = _run(monkeypatch, hidden, kernels=bug, offload=2)
    fd = res.first_divergence
    assert (fd["token"], fd["layer"], fd["site"]) == (full.first_divergence["token"], 2, "y_gated")
    for key in hidden:
        assert not res.is_observed(key)
        assert torch.isnan(res.errors[key]["rel_l2"]).all(), key     # not observed: NaN, never 0.0
    assert res.is_observed((2, "y_gated")) and res.observed["ref32"] >= hidden
    row = md.to_json(res)["per_layer"][2]["sites"]["gate"]
    assert row["max_rel_l2"] is None                                  # null in JSON, never "nan" or 0
    json.dumps(md.to_json(res), allow_nan=False)                      # and the JSON stays strict


def test_unobserved_host_sites_are_not_filled_from_the_reference(monkeypatch):
    """Correct kernels, the device not observing layer 1's resid: NaN there, no divergence anywhere."""
    res = _run(monkeypatch, {(1, "resid")}, kernels="torch", offload=5)
    assert res.first_divergence is None
    assert torch.isnan(res.errors[(1, "resid")]["rel_l2"]).all()
    assert not math.isnan(float(res.errors[(1, "out")]["rel_l2"].max()))
