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


# -- issue 16: views that never mislead ----------------------------------------------------------------------
def _png_size(png: bytes) -> tuple:
    import struct
    return struct.unpack(">II", png[16:24])


def test_report_figures_are_crisp(runs, tmp_path):
    import base64
    import re
    _, full, _ = runs
    page = md.write_report(full, tmp_path / "r.html").read_text()
    pngs = [base64.b64decode(m) for m in re.findall(r"data:image/png;base64,([A-Za-z0-9+/=]+)", page)]
    assert pngs and all(_png_size(p)[0] >= 900 for p in pngs), [_png_size(p) for p in pngs]


def test_heatmap_is_error_over_threshold_centred_on_one(runs):
    from mamba_debug.views.base import RATIO_LABEL
    _, full, _ = runs
    fig = new_figure(registry.BY_NAME["heatmap"].figsize)
    ratio = registry.BY_NAME["heatmap"].draw(fig, full, ViewState(site="gate"))
    ax = fig.axes[0]
    im = ax.images[0]
    assert im.norm.vmin == -im.norm.vmax                        # log10(ratio): 0 (= threshold) in the middle
    fd = full.first_divergence
    assert ratio[fd["layer"], fd["token"]] > 1                  # the first divergence is above its threshold
    assert (ratio[: full.placement.first_device_layer] == 0).all()   # host layers: exact zero, not "small"
    assert RATIO_LABEL in fig.axes[-1].get_ylabel()             # the colour bar says "above 1 = bug"
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    for look in ("exact zero (identical)", NOT_OBSERVED_LABEL, "NaN / Inf on the device", "not run",
                 "first divergence", "offload boundary"):
        assert look in labels, labels


def test_curve_marks_threshold_and_model_level_sites_are_not_one_point(runs):
    _, full, _ = runs
    view = registry.BY_NAME["curve"]
    fig = new_figure(view.figsize)
    fd = full.first_divergence
    view.draw(fig, full, ViewState(token=fd["token"], site=fd["site"]))
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "threshold" in labels and "first divergence" in labels and any("offload boundary" in t for t in labels)
    fig = new_figure(view.figsize)
    y = view.draw(fig, full, ViewState(token=0, site="logits", metric="cosine"))
    assert len(y) == full.tokens.shape[1]                      # one value per token, drawn over the tokens
    assert "cosine" in fig.axes[0].get_ylabel()


def test_state_inspector_shows_reference_device_and_difference(runs):
    _, full, _ = runs
    view = registry.BY_NAME["states"]
    fd = full.first_divergence
    captions = view.report_states(full)
    assert captions, "the report shows the states at the first divergence"
    for _caption, st in captions:
        fig = new_figure(view.figsize)
        diff = view.draw(fig, full, st)
        assert diff.size                                         # drawn, not "not captured"
        titles = [a.get_title() for a in fig.axes]
        assert "reference" in titles and "device" in titles
        assert any(t.startswith("device - reference") for t in titles)
    # a token that is not at a ubatch end: the conv state is rebuilt from the captured inputs, not "nearest"
    fig = new_figure(view.figsize)
    view.draw(fig, full, ViewState(token=1, layer=fd["layer"]))
    assert any("from the captured x inputs" in a.get_ylabel() for a in fig.axes)


def test_state_inspector_on_a_hybrid_shows_mamba2_channels_and_says_attention_has_no_state():
    """An attention layer drew four "not captured" rows (ssm_state, conv_state, k_cache, v_cache) and blamed the
    capture policy; Mamba-2's [H, P, N] state was drawn as [H, P * N] under "channel d" and "state n"."""
    from test_mamba2 import hybrid_model
    model = hybrid_model()
    res = md.run_compare(model, [3, 1, 4, 1, 5, 9], md.RunSettings(device="cpu", kernels="torch", n_gen=1,
                                                                   capture="all"))
    view, cfg = registry.BY_NAME["states"], model.config
    fig = new_figure(view.figsize)
    view.draw(fig, res, ViewState(token=2, layer=1))                          # attention
    texts = [t.get_text() for a in fig.axes for t in a.texts]
    assert len(fig.axes) == 1 and "keeps no SSM or conv state" in texts[0] and "not captured" not in texts[0]
    fig = new_figure(view.figsize)
    view.draw(fig, res, ViewState(token=2, layer=0))                          # Mamba-2
    assert fig.axes[0].images[0].get_array().shape[:2] == (cfg.d_inner, cfg.d_state)



def test_a_hybrids_site_that_a_layer_type_lacks_is_not_called_unobserved():
    """'q' in a hybrid's Mamba-2 layers was hatched "not observed by the device side"; it is no site of theirs."""
    from mamba_debug.views.base import NO_SITE_LABEL, NOT_OBSERVED_LABEL
    from mamba_debug.views.curve import layer_curve
    from mamba_debug.views.heatmap import heatmap
    from test_mamba2 import hybrid_model
    res = md.run_compare(hybrid_model(), [3, 1, 4, 1, 5, 9], md.RunSettings(device="cpu", kernels="torch", n_gen=1))
    fig = new_figure((6.4, 4.2))
    ax = fig.add_subplot()
    heatmap(res, ax, site="q")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert NO_SITE_LABEL in labels and not ax.patches, "no row hatched as not observed"
    fig = new_figure((6.4, 4.2))
    ax = fig.add_subplot()
    layer_curve(res, ax, token=2, site="q")
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert NOT_OBSERVED_LABEL not in labels


def test_sweep_matrix_tells_clean_diverged_and_not_run_apart(runs):
    model, full, _ = runs
    sweep = md.run_sweep(model, PROMPT, full.settings.replace(capture="metrics"), offloads=[0, 2],
                         ubatches=[1, 4], progress=False)
    sweep["cells"] = [c for c in sweep["cells"] if (c["offload"], c["ubatch"]) != (2, 1)]   # one not run
    fig = new_figure(registry.BY_NAME["sweep"].figsize)
    registry.BY_NAME["sweep"].draw(fig, sweep, None, (2, 4))
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "clean" in texts and "not run" in texts
    assert any(t.startswith("L2 t") and "KLD" in t for t in texts)
    assert "KLD" in fig.axes[-1].get_ylabel()                  # the colour bar is the KLD
    # one panel per number of sequences, one colour bar
    multi = dict(sweep, n_seqs=[1, 2], cells=sweep["cells"] + [dict(c, n_seqs=2) for c in sweep["cells"]])
    fig = new_figure(registry.BY_NAME["sweep"].figsize)
    registry.BY_NAME["sweep"].draw(fig, multi, None, (2, 4))
    titles = [a.get_title() for a in fig.axes]
    assert "1 sequence(s)" in titles and "2 sequence(s)" in titles
    assert sum("KLD" in a.get_ylabel() for a in fig.axes) == 1


def test_a_redraw_into_the_same_figure_is_a_fresh_draw(runs):
    """The dashboard redraws into the figure it drew before (its axes, ticks and the state inspector's panels
    kept): every view's PNG must be byte for byte the one a new figure gives, whatever was drawn there before."""
    from mamba_debug.views.base import live_figure
    model, full, subset = runs
    n_tok = full.tokens.shape[1]
    states = [ViewState(token=t, site=site, layer=layer, metric=metric)
              for t, site, layer, metric in [(1, "resid", 3, "rel_l2"), (2, "resid", 3, "rel_l2"),
                                             (n_tok - 1, "gate", 0, "max_abs"), (3, "y_scan", 2, "rel_l2"),
                                             (0, "logits", 1, "rel_l2"), (4, "gate", 2, "cosine")]]
    sweep = md.run_sweep(model, PROMPT, full.settings.replace(capture="metrics"), offloads=[0, 2], ubatches=[2, 4],
                         progress=False)
    empty = {"offloads": [], "ubatches": [], "cells": [], "kernels": sweep["kernels"]}
    for view in registry.VIEWS:
        if view.kind == "html":
            continue
        live = live_figure(view.figsize)
        if view.kind == "sweep":
            calls = [(sw, None, cur) for sw in (sweep, empty, sweep) for cur in ((2, 4), (0, 2))]
        else:
            calls = [(res, st) for res in (full, subset, full) for st in states]
        for args in calls:
            view.draw(live, *args)
            fresh = new_figure(view.figsize)
            view.draw(fresh, *args)
            assert fig_png(live, compress_level=1) == fig_png(fresh, compress_level=1), (view.name, args[1:])


def test_public_views_refuse_arguments_out_of_range_naming_them():
    """From a notebook, md.views.heatmap(res, ax, seq=5) was an IndexError from inside the drawing, a metric typo a
    KeyError, ax=None an AttributeError, and site="nope" an empty picture saying "not observed"."""
    import re
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mamba_debug import MambaDebugError
    res = md.run_compare(random_model(n_layer=2), [1, 2, 3, 4], md.RunSettings(kernels="torch", n_gen=1, ubatch=2))
    fig, ax = plt.subplots()
    for call, said in ((lambda: md.views.heatmap(res, ax, seq=1), "seq=1: this result has 1 sequence(s), 0..0"),
                       (lambda: md.views.heatmap(res, ax, metric="rel"), "metric='rel': the metrics are rel_l2"),
                       (lambda: md.views.heatmap(res, ax, site="nope"), "site='nope': this result's sites are"),
                       (lambda: md.views.layer_curve(res, ax, token=5), "token=5: this result has 5 token(s), 0..4"),
                       (lambda: md.views.state_diff(res, ax, 2, 0), "layer=2: this result has 2 layer(s), 0..1"),
                       (lambda: md.views.logits_curve(res, None), "ax must be a matplotlib Axes"),
                       (lambda: md.views.sweep_matrix({}, ax), "sweep must be a run_sweep result")):
        with pytest.raises(MambaDebugError, match=re.escape(said)):
            call()
    md.views.layer_curve(res, ax, token=np.int64(-1))           # numpy and negative indices as in Python
    plt.close(fig)
