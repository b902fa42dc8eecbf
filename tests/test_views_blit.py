"""views.blit: a live figure redrawn over its kept static layer (the axes' numbers) has the pixels of a full draw."""
from __future__ import annotations

import io

import numpy as np
import pytest

from conftest import random_model
from mamba_debug.views.base import fig_png, live_figure
from mamba_debug.views.blit import StaticLayer, mark_dynamic

IDS = [(7 * i + 3) % 61 for i in range(12)]


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGBA"))


def _same(shown: bytes, fig) -> bool:
    a, b = _pixels(shown), _pixels(fig_png(fig, fig.dpi))
    return a.shape == b.shape and np.array_equal(a, b)


def test_dashboard_views_drawn_over_their_static_layers_have_the_pixels_of_a_full_draw():
    """Runs, tokens, layers, sites, metrics (a threshold's ratio, a metric's own range) and sequences:
    after every action each figure on the page equals a full draw of it, and the static layers were reused."""
    pytest.importorskip("ipywidgets", reason="the dashboard needs ipywidgets (requirements-lab.txt)")
    from mamba_debug.dashboard import Dashboard

    model = random_model()
    dash = Dashboard(model, IDS, kernels="bug_strided_gate", device="interpret", n_gen=2, n_seqs=2, offload=2,
                     ubatch=4)
    actions = [dict(offload=4), dict(token=3), dict(token=4), dict(layer=1), dict(ubatch=1), dict(site="gate"),
               dict(metric="max_abs"), dict(metric="cosine"), dict(seq=1), dict(kernels="triton"), dict(offload=0),
               dict(offload=5), dict(token=0)]
    for values in actions:
        dash.set(**values)
        assert dash.errors == [], (values, dash.errors)
        for name in dash._layers:
            assert _same(dash.images[name], dash._figs[name]), (values, name)
        assert _same(dash.images["sweep"], dash._figs["sweep"]), values
    hits = {name: layer.hits for name, layer in dash._layers.items()}
    assert all(hits[name] > 0 for name in ("curve", "heatmap", "states", "logits")), hits


def _figure(grid=False):
    fig = live_figure((4, 3), dpi=80)
    ax = fig.add_subplot()
    ax.plot([0, 1, 2], [1, 3, 2])
    ax.set_xlabel("x label")
    ax.set_title("first")
    if grid:
        ax.grid(True)
    return fig, ax


def test_a_figure_with_grid_lines_is_drawn_in_full():
    fig, _ = _figure(grid=True)
    layer = StaticLayer()
    assert _same(layer.png(fig), fig) and layer.key is None and layer.hits == layer.misses == 0


def test_new_numbers_make_a_new_static_layer_and_new_labels_and_titles_do_not():
    fig, ax = _figure()
    layer = StaticLayer()
    layer.png(fig)
    ax.set_title("second, a longer title")
    ax.set_xlabel("another x label")
    ax.lines[0].set_ydata([2, 1, 3])
    assert _same(layer.png(fig), fig) and (layer.hits, layer.misses) == (1, 1)
    ax.set_xticks([0, 1, 2], ["a", "b", "c"])                     # other numbers: the static layer is redrawn
    assert _same(layer.png(fig), fig) and (layer.hits, layer.misses) == (1, 2)
    ax.clear()                                                     # labels back at their defaults until placed
    ax.plot([0, 1, 2], [1, 3, 2])
    ax.set_xticks([0, 1, 2], ["a", "b", "c"])
    ax.set_xlabel("x label")
    ax.set_ylim(*fig.axes[0].get_ylim())
    png = layer.png(fig)
    assert _same(png, fig), "a cleared Axes over a kept layer"


def test_a_dynamic_axis_follows_its_data_over_a_kept_layer():
    fig, ax = _figure()
    ax.set_yscale("log")
    mark_dynamic(ax.yaxis)
    layer = StaticLayer()
    layer.png(fig)
    ax.lines[0].set_ydata([1e-3, 1e2, 1e5])
    ax.relim()
    ax.autoscale_view()
    assert _same(layer.png(fig), fig) and (layer.hits, layer.misses) == (1, 1)


def test_a_style_change_makes_a_new_static_layer():
    import matplotlib as mpl
    fig, ax = _figure()
    layer = StaticLayer()
    layer.png(fig)
    with mpl.rc_context({"xtick.labelcolor": "red", "ytick.labelcolor": "red"}):
        ax.clear()                                                 # new ticks take the style
        ax.plot([0, 1, 2], [1, 3, 2])
        ax.set_xlabel("x label")
        assert _same(layer.png(fig), fig) and (layer.hits, layer.misses) == (0, 2)
