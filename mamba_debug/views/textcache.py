"""Agg text without FreeType's repeated work: each glyph's bitmap and each string's layout kept, the pixels unchanged.

After `views.blit` keeps the axes' numbers, text is still most of a dashboard redraw: titles, axis labels and colour
bar numbers drawn on every frame (the state inspector: 33 strings, about 80 of its 130 ms). matplotlib 3.11's Agg
renderer lays each string out (`FT2Font._layout`) and renders each glyph (`_render_glyph`) at a transform whose
translation is in 1/64 pixel; a glyph's bitmap depends on that translation only through its fraction (an outline
moved by whole pixels rasterizes the same, moved), so this module keeps

    layout: (font, string, size, dpi, hinting, features, language) -> [(glyph's font, glyph index, x, y)]
    glyph:  (font, size, dpi, glyph index, matrix, translation mod 64, hinting, antialiased)
            -> (alpha bitmap, its left and top relative to the translation's whole pixels)

and hands the kept bitmap to the same `draw_text_image` call. `install(renderer)` puts the two methods on one
renderer (a canvas keeps its renderer while its size and dpi hold) once a self-check has drawn the same strings
with and without them, pixel for pixel, in this process; a matplotlib that differs (no such private methods, or
other pixels) keeps its own text drawing, and `status()` says which ran. tests/test_views_blit.py compares figures.
"""
from __future__ import annotations

import math
import types

MAX_ENTRIES = 20000          # glyph bitmaps are ~0.2 KB each: the caches stay under ~10 MB, then start again

_layouts: dict = {}
_glyphs: dict = {}
_matrices: dict = {}
_state = {"checked": None, "why": ""}   # checked: None (not yet), True (in use), False (matplotlib's own text)


def install(renderer) -> bool:
    """Put the cached text methods on this Agg renderer (once it passed the self-check); whether they are on it."""
    if getattr(renderer, "_mamba_debug_text_cache", False):
        return True
    if not _check():
        return False
    _attach(renderer)
    return True


def status() -> str:
    """Which text drawing the dashboard's figures use, and why (for reports and tests)."""
    _check()
    return "glyph cache" if _state["checked"] else f"matplotlib's own ({_state['why']})"


def _attach(renderer):
    renderer._mamba_debug_text_cache = True
    renderer._mamba_debug_own_glyphs = renderer._draw_text_glyphs_and_boxes
    renderer.draw_text = types.MethodType(_draw_text, renderer)
    renderer._draw_text_glyphs_and_boxes = types.MethodType(_draw_glyphs_and_boxes, renderer)


def _draw_text(self, gc, x, y, s, prop, angle, ismath=False, mtext=None):
    """RendererAgg.draw_text (matplotlib 3.11) with the string's layout kept."""
    from matplotlib.backends.backend_agg import get_hinting_flag  # noqa: PLC0415
    if ismath:
        return self.draw_mathtext(gc, x, y, s, prop, angle)
    font = self._prepare_font(prop)
    flags = get_hinting_flag()
    features = mtext.get_fontfeatures() if mtext is not None else None
    language = mtext.get_language() if mtext is not None else None
    size = prop.get_size_in_points()
    try:
        key = (font, s, size, self.dpi, flags, features, language)
        items = _layouts.get(key)
    except TypeError:                 # an unhashable language (a list of ranges): not kept
        key = items = None
    if items is None:
        items = [(item.ft_object, item.glyph_index, item.x, item.y)
                 for item in font._layout(s, flags=flags, features=features, language=language)]
        if key is not None:
            _put(_layouts, key, items)
    self._draw_text_glyphs_and_boxes(gc, x, y, angle, ((ft, size, g, 0, 1, gx, gy) for ft, g, gx, gy in items), [])


def _draw_glyphs_and_boxes(self, gc, x, y, angle, glyphs, boxes):
    """RendererAgg._draw_text_glyphs_and_boxes (matplotlib 3.11), each glyph's bitmap kept; the boxes (mathtext's
    rules) by matplotlib's own code."""
    from matplotlib.backends.backend_agg import get_hinting_flag  # noqa: PLC0415
    from matplotlib.ft2font import RenderMode  # noqa: PLC0415
    cos, sin = math.cos(math.radians(angle)), math.sin(math.radians(angle))
    flags, aa, height = get_hinting_flag(), gc.get_antialiased(), self.height
    for font, size, glyph_index, slant, extend, dx, dy in glyphs:          # dy is upwards
        matrix = _matrix(cos, sin, slant, extend)
        tx = round(0x40 * (x + dx * cos - dy * sin))
        ty = round(0x40 * (height - y + dx * sin + dy * cos))             # FreeType's y is upwards
        key = (font, size, self.dpi, glyph_index, matrix[0], tx & 63, ty & 63, flags, aa)
        hit = _glyphs.get(key)
        if hit is None:
            font.set_size(size, self.dpi)
            font._set_transform(matrix[1], [tx, ty])
            bitmap = font._render_glyph(glyph_index, flags, RenderMode.NORMAL if aa else RenderMode.MONO)
            buffer = bitmap.buffer.copy()
            if not aa:
                buffer *= 0xff
            hit = (buffer, bitmap.left - (tx >> 6), bitmap.top - (ty >> 6))
            _put(_glyphs, key, hit)
        buffer, left, top = hit
        # draw_text_image's y is downwards & the bitmap's bottom side
        self._renderer.draw_text_image(buffer, left + (tx >> 6), int(height) - (top + (ty >> 6)) + buffer.shape[0],
                                       0, gc)
    if boxes:
        self._mamba_debug_own_glyphs(gc, x, y, angle, (), boxes)


def _matrix(cos, sin, slant, extend) -> tuple:
    """FreeType's 16.16 transform for an angle, slant and extent, as matplotlib computes it: (key, array)."""
    key = (cos, sin, slant, extend)
    hit = _matrices.get(key)
    if hit is None:
        import numpy as np  # noqa: PLC0415
        m = (0x10000 * np.array([[cos, -sin], [sin, cos]]) @ [[extend, extend * slant], [0, 1]]).round().astype(int)
        hit = _matrices[key] = (tuple(m.ravel().tolist()), m)
    return hit


def _put(cache: dict, key, value):
    if len(cache) >= MAX_ENTRIES:
        cache.clear()
    cache[key] = value


def _check() -> bool:
    """Once per process: draw strings (rotated, at fractional positions, antialiased and not, mathtext) on two
    canvases, one with the cached methods (twice, so the second draw reads the caches), one without; in use only if
    the pixels agree."""
    if _state["checked"] is None:
        try:
            _state["checked"] = _self_check()
            if not _state["checked"]:
                _state["why"] = "its pixels differed from matplotlib's in the self-check"
        except (AttributeError, ImportError, TypeError, ValueError) as exc:
            _state["checked"], _state["why"] = False, f"this matplotlib differs: {type(exc).__name__}: {exc}"
    return _state["checked"]


def _self_check() -> bool:
    import numpy as np  # noqa: PLC0415
    from matplotlib.backends.backend_agg import FigureCanvasAgg, RendererAgg  # noqa: PLC0415
    from matplotlib.figure import Figure  # noqa: PLC0415
    for name in ("_draw_text_glyphs_and_boxes", "_prepare_font", "draw_mathtext"):
        getattr(RendererAgg, name)
    pixels = []
    for cached in (False, True, True):
        fig = Figure(figsize=(2.3, 1.7), dpi=97)
        canvas = FigureCanvasAgg(fig)
        if cached:
            _attach(canvas.get_renderer())
        strings = (("state n -0.25", 0, True), ("−3e-07 Ag", 90, True), ("layer 11", 33, False),
                   (r"$\sqrt{x}_1$", 0, True))
        for i, (s, rot, aa) in enumerate(strings):
            fig.text(0.11 + 0.173 * i, 0.21 + 0.137 * i, s, rotation=rot, antialiased=aa, fontsize=7 + 1.3 * i)
        canvas.draw()
        pixels.append(np.asarray(canvas.buffer_rgba()).copy())
    return all(np.array_equal(pixels[0], p) for p in pixels[1:])
