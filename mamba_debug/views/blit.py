"""Redraw a live figure without drawing its axes' numbers again: the pixels of a full draw, in less time.

Most of a dashboard redraw is text (FreeType lays out and renders every tick number on every draw), and most of that
text - the channel, state, layer and token numbers along the axes - is the same from one run, token or setting to
the next. `StaticLayer.png` draws a figure in two layers:

* static: the figure's and each Axes' background and x and y axis (ticks and their numbers, offset text; not the
  axis labels), kept as pixels while its key is unchanged: the figure's size, dpi and background, per Axes its
  position, limits, scales, tick positions, numbers and settings, and matplotlib's rcParams;
* dynamic, drawn over it each time in `Axes.draw`'s order: each Axes' images, lines, patches, texts, title, legend
  and spines by zorder, its axis labels, and an axis marked dynamic (`mark_dynamic`: a log axis or a colour bar
  whose numbers follow the data) in its place; figure-level artists (a suptitle) whole.

A figure that cannot be split so (grid lines or ticks inside an Axes, a see-through Axes background, subfigures,
matplotlib before 3.7) is drawn in full. tests/test_views_blit.py checks the pixels against a full draw. With the
numbers kept, the state inspector draws in 63 ms instead of 144 and the heatmap in 49 instead of 79 (dpi 160); a
run's five views in 0.40-0.47 s instead of 0.57-0.68 (medians, benchmarks/README.md). The text both layers still
draw comes from `views.textcache` (kept layouts and glyph bitmaps, the same pixels).
"""
from __future__ import annotations

import struct
import zlib
from operator import attrgetter
from typing import Optional

from mamba_debug.views import textcache


class StaticLayer:
    """One live figure's static layer (see the module docstring); `png` draws the figure and encodes it."""

    def __init__(self):
        self.key = None
        self.background = None
        self.label_positions: list = []   # where the static draw placed each Axes' axis labels
        self.hits = self.misses = 0

    def png(self, fig, compress_level: Optional[int] = None) -> bytes:
        """The figure as PNG at its own dpi: the pixels of `fig.savefig(dpi=fig.dpi)`."""
        canvas = fig.canvas
        textcache.install(canvas.get_renderer())
        order = _draw_order(fig)
        if order is None:
            self.key = self.background = None
            canvas.draw()
        else:
            _place(fig, order)
            key = _key(fig, order)
            if key == self.key and self.background is not None:
                canvas.restore_region(self.background)
                # a cleared Axes puts its labels back at their defaults; the axis moves them off the tick numbers
                # as it draws, and the numbers are the static layer's
                for (ax, whole), pos in zip(order, self.label_positions):
                    for axis, xy in zip(() if whole else (ax.xaxis, ax.yaxis), pos or ()):
                        if not _is_dynamic(axis):
                            axis.label.set_position(xy)
                self.hits += 1
            else:
                self.background = _draw_static(fig, order)
                self.label_positions = [None if whole else (a.xaxis.label.get_position(),
                                                            a.yaxis.label.get_position()) for a, whole in order]
                self.key = key
                self.misses += 1
            _draw_dynamic(fig, order)
        return encode_png(canvas, compress_level)


def encode_png(canvas, compress_level: Optional[int] = None) -> bytes:
    """The canvas' pixels as an RGBA PNG (what savefig writes, without its metadata). Every row is PNG's "up"
    filter (the row minus the one above, mod 256: a figure's flat areas become zeros) and the lot deflated by
    zlib: the same pixels and about the same size as Pillow's, in 40% of its time (Pillow tries five filters on
    every row). compress_level: zlib's 0..9, default 6."""
    import numpy as np  # noqa: PLC0415
    rgba = np.asarray(canvas.buffer_rgba())
    h, w = rgba.shape[:2]
    rows = rgba.reshape(h, w * 4)
    raw = np.empty((h, w * 4 + 1), np.uint8)
    raw[:, 0] = 2                                         # each row's filter byte: "up"
    raw[0, 1:] = rows[0]                                  # the first row's prior row is zeros
    np.subtract(rows[1:], rows[:-1], out=raw[1:, 1:])     # uint8 arithmetic wraps mod 256, as the filter's
    idat = zlib.compress(raw, 6 if compress_level is None else compress_level)
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 6, 0, 0, 0)   # 8 bits, RGBA, deflate, filter method 0, no interlace
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def _chunk(tag: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(data, zlib.crc32(tag)))


def mark_dynamic(axis):
    """An axis whose numbers change from draw to draw (an autoscaled log axis: the curves'): drawn whole with the
    dynamic layer, in its place among the Axes' artists, and left out of the key (so a new range is no new layer)."""
    axis._mamba_debug_dynamic = True


def _is_dynamic(axis) -> bool:
    return getattr(axis, "_mamba_debug_dynamic", False)


def _static_axes(ax) -> tuple:
    return tuple(axis for axis in (ax.xaxis, ax.yaxis) if not _is_dynamic(axis))


def _is_colorbar(ax) -> bool:
    return getattr(ax, "_colorbar", None) is not None or getattr(ax, "_mamba_debug_is_colorbar", False)


def _draw_order(fig) -> Optional[list]:
    """[(artist, whole)] in Figure.draw's order: each Axes (split) and each figure-level artist (a suptitle: whole,
    drawn entirely each time); None when the figure cannot be split into a static and a dynamic layer with the
    pixels of a full draw."""
    if getattr(fig, "subfigs", None):
        return None
    order = []
    kids = [a for a in fig.get_children() if a is not fig.patch and a.get_visible()]
    for a in sorted(kids, key=attrgetter("zorder")):              # a stable sort, as Figure.draw's
        if not hasattr(a, "xaxis"):
            order.append((a, True))
        elif _splittable(a):
            order.append((a, False))
        else:
            return None
    return order


def _splittable(ax) -> bool:
    """The Axes' axis draws nothing inside its background (that the dynamic layer paints over)."""
    face = ax.patch.get_facecolor()
    if not (ax.axison and ax.get_frame_on() and ax.patch.get_visible() and face[3] == 1.0):
        return False
    if not hasattr(ax.xaxis, "get_tick_params") or not hasattr(ax, "_update_title_position"):
        return False                      # matplotlib before 3.7: draw in full
    # a locator places an Axes as it draws: only a colour bar's (placed by its parent, whose position is in the key)
    if ax.child_axes or (ax.get_axes_locator() is not None and not _is_colorbar(ax)):
        return False
    for axis in (ax.xaxis, ax.yaxis):
        for tick in axis.majorTicks + axis.minorTicks:
            if tick.gridline.get_visible() or tick.get_tickdir() != "out":
                return False
    return True


def _place(fig, order):
    """Each Axes where its draw would put it (Axes.draw applies its aspect and its locator first: a new colour bar
    sits where `make_axes` left it until its locator moves it)."""
    renderer = fig.canvas.get_renderer()
    for a, whole in order:
        if not whole:
            locator = a.get_axes_locator()
            a.apply_aspect(locator(a, renderer) if locator else None)


def _axis_key(axis) -> tuple:
    if _is_dynamic(axis):
        return ("dynamic",)
    if not axis.get_visible():
        return (False,)
    lim = axis.get_view_interval()
    major = axis.get_majorticklocs()
    minor = axis.get_minorticklocs()
    fmt = axis.get_major_formatter()
    labels = tuple(fmt.format_ticks(major))       # what the draw would write (the formatter's offset follows)
    minor_labels = tuple(axis.get_minor_formatter().format_ticks(minor))
    params = tuple(sorted((k, repr(v)) for k, v in axis.get_tick_params("major").items()))
    mparams = tuple(sorted((k, repr(v)) for k, v in axis.get_tick_params("minor").items()))
    return (True, tuple(lim), axis.get_scale(), tuple(major), labels, fmt.get_offset(), tuple(minor), minor_labels,
            params, mparams, axis.get_label_position(), axis.get_ticks_position(), axis.label.get_visible())


def _key(fig, order) -> tuple:
    import matplotlib as mpl  # noqa: PLC0415
    parts = [tuple(fig.get_size_inches()), fig.dpi, tuple(fig.patch.get_facecolor()),
             # every rcParam (a style set between two draws reaches new ticks); dict.items skips RcParams'
             # per-key checks: 0.2 ms, not 4
             hash(repr(list(dict.items(mpl.rcParams))))]
    for ax, whole in order:
        if whole:                # not in the static layer: only what comes where
            parts.append(type(ax).__name__)
            continue
        parts.append((ax.get_position().bounds, _axis_key(ax.xaxis), _axis_key(ax.yaxis)))
    return tuple(parts)


def _dynamic(ax) -> list:
    """An Axes' artists drawn each time, in Axes.draw's order (by zorder): all but its background and axes."""
    skip = (*_static_axes(ax), ax.patch)
    return sorted((a for a in ax.get_children() if a not in skip and a.get_visible()), key=attrgetter("zorder"))


def _draw_static(fig, order):
    """Draw the figure's static layer: the backgrounds and the axes' ticks and numbers (the rest is set animated,
    which Figure.draw and Axes.draw skip, and the axis labels hidden); return its pixels."""
    hidden, labels = [], []
    for a, whole in order:
        for b in ([a] if whole else _dynamic(a)):
            if not b.get_animated():
                b.set_animated(True)
                hidden.append(b)
        if not whole:
            for label in (axis.label for axis in _static_axes(a)):
                if label.get_visible():   # the axis still places it (off its tick numbers)
                    label.set_visible(False)
                    labels.append(label)
    try:
        fig.canvas.draw()
    finally:
        for b in hidden:
            b.set_animated(False)
        for label in labels:
            label.set_visible(True)
    return fig.canvas.copy_from_bbox(fig.bbox)


def _draw_dynamic(fig, order):
    """Over the static layer, what a full draw paints after each Axes' background. The ticks came before the
    spines and the Axes' contents here, after them in a full draw: they meet only at the axes' edge, where a tick
    and a spine of one colour blend the same in either order (the tests compare the pixels)."""
    renderer = fig.canvas.get_renderer()
    for a, whole in order:
        if whole:
            a.draw(renderer)
            continue
        a._update_title_position(renderer)       # as Axes.draw does (only auto-placed titles move)
        for b in _dynamic(a):
            b.draw(renderer)
        for axis in _static_axes(a):
            axis.label.draw(renderer)
