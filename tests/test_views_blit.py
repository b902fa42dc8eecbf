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


def _stock_png(fig) -> bytes:
    """A full draw by a fresh canvas: matplotlib's own renderer and text (no views.textcache on it)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    live = fig.canvas
    FigureCanvasAgg(fig)
    try:
        return fig_png(fig, fig.dpi)
    finally:
        fig.set_canvas(live)


def _same(shown: bytes, fig) -> bool:
    a, b = _pixels(shown), _pixels(_stock_png(fig))
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


def test_text_drawn_from_the_glyph_cache_has_matplotlibs_pixels():
    """Strings at many fractional positions, rotations, sizes, weights, colours, antialiased or not, mathtext
    (its rules too), drawn three times through views.textcache (the second and third from its caches), equal a
    fresh canvas' draw; on the matplotlib it was written for (3.11) the cache is in use, not silently off."""
    import matplotlib

    from mamba_debug.views import textcache
    if matplotlib.__version__.startswith("3.11."):
        assert textcache.status() == "glyph cache", textcache.status()
    rng = np.random.default_rng(5)
    fig = live_figure((3.1, 2.3), dpi=111)
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1])
    for i in range(40):
        fig.text(rng.uniform(0, 0.9), rng.uniform(0, 0.9), ["−0.25", "state n", "layer 11 on", r"$\frac{a}{b}$",
                                                            "Ag ij", "1e-07"][i % 6],
                 rotation=[0, 90, 33.3, -12][i % 4], fontsize=rng.uniform(5, 13), antialiased=i % 5 != 0,
                 weight=["normal", "bold"][i % 2], color=["k", "#c60", "0.4"][i % 3])
    layer = StaticLayer()
    for _ in range(3):
        shown = layer.png(fig)
        assert _same(shown, fig)
    assert getattr(fig.canvas.get_renderer(), "_mamba_debug_text_cache", False) == (
        textcache.status() == "glyph cache")


def test_encode_png_decodes_to_the_canvas_pixels():
    """Random bytes (every wrap of the 'up' filter's mod-256 difference, any alpha), odd sizes, one row, each zlib
    level: Pillow reads back exactly the canvas' RGBA."""
    from mamba_debug.views.blit import encode_png

    class Canvas:
        def __init__(self, a):
            self.a = a

        def buffer_rgba(self):
            return memoryview(self.a)

    rng = np.random.default_rng(3)
    for (h, w), level in (((7, 13), None), ((1, 5), 0), ((64, 33), 1), ((3, 1), 9)):
        a = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
        a[h // 2:] = a[h // 2, 0]                 # a flat part too
        assert np.array_equal(_pixels(encode_png(Canvas(a), level)), a)
