"""The views: every view of the registry draws on a small trace; a site the device side did not observe is drawn
as "not observed" (hatched, with a legend entry), never as 0; the report is built from the registry."""
from __future__ import annotations

import json

import numpy as np
import pytest

import mamba_debug as md
from mamba_debug import compare
from mamba_debug.views import registry
from mamba_debug.views.base import NOT_OBSERVED_LABEL, ViewState, fig_png, new_figure

from conftest import random_model
from test_sides import PROMPT, SubsetSide

HIDDEN = {(1, "resid"), (2, "gate")}


@pytest.fixture(scope="module")
def runs():
    """The strided-gate bug from layer 2 on: once with every site observed, once with HIDDEN not observed."""
    mp = pytest.MonkeyPatch()
    model = random_model(n_layer=4)
    s = md.RunSettings(device="cpu", n_gen=3, ubatch=4, kernels="bug_strided_gate", offload=2)
    full = md.run_compare(model, PROMPT, s)
    real = compare.build_sides

    def build(*args, **kwargs):
        sides = real(*args, **kwargs)
        sides["device"] = SubsetSide(sides["device"], HIDDEN)
        return sides
    mp.setattr(compare, "build_sides", build)
    try:
        subset = md.run_compare(model, PROMPT, s)
    finally:
        mp.undo()
    return model, full, subset


def test_every_view_draws(runs, tmp_path):
    model, full, _ = runs
    st = ViewState.at_first_divergence(full)
    for view in registry.VIEWS:
        if view.kind == "html":
            assert "reference" in view.html(full, st, model.decode)
            continue
        fig = new_figure(view.figsize)
        if view.kind == "sweep":
            sweep = md.run_sweep(model, PROMPT, full.settings.replace(capture="metrics"), offloads=[0, 2],
                                 ubatches=[4], progress=False)
            view.draw(fig, sweep, None, (2, 4))
        else:
            view.draw(fig, full, st)
        png = fig_png(fig)
        assert png[:4] == b"\x89PNG" and len(png) > 2000, view.name
    assert [v.name for v in registry.VIEWS][:3] == ["curve", "heatmap", "states"]


def test_not_observed_is_drawn_as_not_observed_never_zero(runs):
    _, _, res = runs
    curve = new_figure(registry.BY_NAME["curve"].figsize)
    y = registry.BY_NAME["curve"].draw(curve, res, ViewState(token=5, site="resid"))
    assert np.isnan(y[1]) and not np.isnan(y[3])                 # layer 1's resid: NaN, not 0
    labels = [t.get_text() for t in curve.axes[0].get_legend().get_texts()]
    assert NOT_OBSERVED_LABEL in labels

    heat = new_figure(registry.BY_NAME["heatmap"].figsize)
    img = registry.BY_NAME["heatmap"].draw(heat, res, ViewState(site="gate"))
    assert np.isnan(img[2]).all() and not np.isnan(img[3]).any()
    ax = heat.axes[0]
    assert any(p.get_hatch() for p in ax.patches)                # the row is hatched
    assert NOT_OBSERVED_LABEL in [t.get_text() for t in ax.get_legend().get_texts()]

    j = md.to_json(res)
    assert j["per_layer"][2]["sites"]["gate"]["max_rel_l2"] is None
    assert j["per_layer"][1]["resid_max_rel_l2"] is None
    assert j["per_layer"][2]["worst_site"] != "gate"
    json.dumps(j, allow_nan=False)
    assert "did not observe 2 site(s)" in md.summary(res)


def test_report_is_built_from_the_registry(runs, tmp_path):
    _, full, subset = runs
    page = md.write_report(full, tmp_path / "r.html").read_text()
    for view in registry.VIEWS:
        if view.in_report:
            for caption, _st in view.report_states(full):
                assert caption.split("'")[0] in page, caption
    assert page.count("<img") == sum(len(v.report_states(full)) for v in registry.VIEWS
                                     if v.in_report and v.kind == "figure")
    assert "did not observe 2 site(s)" in md.write_report(subset, tmp_path / "s.html").read_text()
