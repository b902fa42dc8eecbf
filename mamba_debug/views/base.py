"""What every view shares: the `View` it is, the `ViewState` it reads, and the drawing helpers.

A view is pure: (figure, result, view state) in, pixels out (`draw` returns the numbers it drew, for tests and
the dashboard's `view_data`). It knows nothing about widgets; the dashboard and the HTML report both walk
`views.registry.VIEWS` and call the same `draw`.

"Not observed": a site the device side did not report has NaN errors (`not res.is_observed(key)`). Views draw it
as hatched grey with a legend entry "not observed", never as 0 and never as a gap that reads as "fine".

Colour means one thing everywhere: error / threshold on a diverging scale centred on 1 (blue: below the site's
threshold, white: at it, red: above it = a bug). Four values get their own legended looks (`SPECIAL_LOOKS`): exact
zero (device and reference identical: green), not observed (hatched grey), NaN/Inf on the device (black) and not run
(light grey with dots).
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..arch import MODEL_SITES
from ..config import is_integer
from ..errors import MambaDebugError
from ..metric_block import METRICS
from ..trace import CompareResult

DEVICE_SHADE = dict(color="tab:orange", alpha=0.12)
NOT_OBSERVED = dict(facecolor="0.85", edgecolor="0.45", hatch="///", lw=0.0)   # the "not observed" look
NOT_OBSERVED_LABEL = "not observed by the device side"
NO_SITE = dict(facecolor="white", edgecolor="0.6", lw=0.8)      # a layer whose type has no such site (a hybrid)
NO_SITE_LABEL = "no such site in this layer's type"
MARGINS = dict(left=0.12, right=0.97, bottom=0.15, top=0.88, wspace=0.35)   # fixed: tight_layout costs ~0.2 s
SCREEN_DPI = 80            # CSS px per figure inch on screen (the <img> width), whatever the PNG's pixel density
DPI = 2 * SCREEN_DPI       # the dashboard's PNGs: 2 px per CSS px, crisp on any modern display
REPORT_DPI = 160           # the report's PNGs: a 6.4-inch figure is 1000 px wide
# Titles at a fixed height: where matplotlib's automatic placement puts them on axes with no ticks on top and no
# offset text (every view's axes), without it measuring the axes' tick labels on each draw (~10% of a redraw)
TITLE_Y = 1.0


def screen_width(figsize) -> int:
    """The width in CSS px a figure of `figsize` inches is shown at."""
    return int(round(figsize[0] * SCREEN_DPI))

# error / threshold: log10 of the ratio on a diverging scale centred on 0 (ratio 1)
RATIO_CMAP = "RdBu_r"
RATIO_DECADES = 4          # the colour scale spans 1e-4 .. 1e4 x the threshold (clipped beyond)
RATIO_LABEL = "error / threshold  (above 1 = bug)"
EXACT_ZERO = "#b8e186"     # pale green: device and reference bit-identical
NAN_INF = "#000000"        # black: NaN or Inf on the device side
NOT_RUN = "#f2f2f2"        # light grey (dotted): this token / layer / configuration was not run
FIRST_DIV = "#000000"      # the first-divergence marker (a black ring)
BOUNDARY = "#7b3294"       # the offload boundary (host | device)
DEVICE_BOUNDARY = "#e66101"  # a boundary between two devices of a split placement (--devices)
SPECIAL_LOOKS = {
    "exact zero (identical)": dict(facecolor=EXACT_ZERO, edgecolor="none"),
    NOT_OBSERVED_LABEL: NOT_OBSERVED,
    "NaN / Inf on the device": dict(facecolor=NAN_INF, edgecolor="none"),
    "not run": dict(facecolor=NOT_RUN, edgecolor="0.6", hatch="..", lw=0.8),
}


@dataclass(frozen=True)
class ViewState:
    """What is looked at inside one run (hashable: rendered views are cached by it)."""
    token: Optional[int] = 0     # None: the worst token (the report's curve without a divergence)
    site: str = "resid"
    metric: str = "rel_l2"
    seq: int = 0
    layer: int = 0               # the state inspector's layer

    @classmethod
    def at_first_divergence(cls, res: CompareResult) -> "ViewState":
        """Where a report looks: the first divergence (else the worst token of the hidden state, layer 0)."""
        fd = res.first_divergence
        if fd is None:
            return cls(token=None, site="resid", seq=0, layer=0)
        return cls(token=fd["token"], site=fd["site"], seq=fd["seq"],
                   layer=fd["layer"] if fd["layer"] is not None else res.n_layer - 1)


FIELDS = tuple(ViewState.__dataclass_fields__)


class View:
    """One view. Subclasses set the class attributes and implement `draw` (or `html` for kind "html").

    name:      the dashboard's handle (`dash.images[name]`, CSS class `md-<name>`)
    title:     the heading in the report
    depends:   the ViewState fields it reads; the dashboard redraws it when one of them changes (and on every run)
    figsize:   inches; `width` "half" or "full" of the dashboard's row
    in_report: drawn into the HTML report (with `report_states(res)`)
    kind:      "figure" (draws a CompareResult), "html" (returns HTML), "sweep" (draws a sweep dict, not a run)
    """
    name: str = ""
    title: str = ""
    depends: frozenset = frozenset()
    figsize: tuple = (6.4, 3.6)
    width: str = "half"
    in_report: bool = True
    kind: str = "figure"

    def draw(self, fig, res: CompareResult, state: ViewState):
        raise NotImplementedError

    def report_states(self, res: CompareResult) -> list:
        """(caption, ViewState) pairs the report draws; default: one, at the first divergence."""
        return [(self.title, ViewState.at_first_divergence(res))]

    def __repr__(self) -> str:
        return f"<view {self.name}: depends on {sorted(self.depends)}>"


# -- drawing helpers -----------------------------------------------------------------------------------
def fresh_axes(fig, *grid, **margins):
    """Empty axes in the fixed margins (updated by `margins`): the figure's own from its last draw when it asked for
    the same grid and margins (cleared, colour bars removed; their tick objects kept, which is most of what a redraw
    costs), else a cleared figure with new ones."""
    key = (grid, tuple(sorted(margins.items())))
    kept = getattr(fig, "_mamba_debug_axes", None)
    if kept is not None and kept[0] == key and _reusable(fig, kept[2]):
        _clear_kept(fig, kept[2])
        _mark_cleared(kept[2])
        return kept[1]
    fig.clf()
    fig.subplots_adjust(**{**MARGINS, **margins})
    axes = fig.add_subplot() if not grid else fig.subplots(*grid)
    fig._mamba_debug_axes = (key, axes, list(np.atleast_1d(axes).ravel()))
    _mark_cleared(fig._mamba_debug_axes[2])
    return axes


def _mark_cleared(axes: list):
    for ax in axes:
        ax._mamba_debug_cleared = len(ax.get_children())


def clear_axes(ax):
    """ax.clear(), unless `fresh_axes` has just given this axes empty (nothing added since): a second clear would
    drop the tick objects that `fresh_axes` kept, and drawing them anew is most of a redraw's time."""
    mark = getattr(ax, "_mamba_debug_cleared", None)
    ax._mamba_debug_cleared = None
    if mark is not None and mark == len(ax.get_children()):
        return
    ax.clear()


def _reusable(fig, main: list) -> bool:
    """Every kept axes still in the figure, and nothing else there but their colour bars."""
    bars = [getattr(a, "_mamba_debug_colorbar", None) for a in main]
    others = [a for a in fig.axes if all(a is not m for m in main)]
    return all(a.figure is fig and a in fig.axes for a in main) and \
        all(any(b is not None and b.ax is a for b in bars) for a in others)


def _clear_kept(fig, main: list):
    """What fig.clf() and new axes would give, on the same axes: colour bars removed (which restores their
    parents' place), each axes cleared without recreating its tick objects, the figure's own texts gone."""
    from matplotlib import rcParams  # noqa: PLC0415
    for ax in main:
        bar = getattr(ax, "_mamba_debug_colorbar", None)
        if bar is not None:
            bar.remove()
            ax._mamba_debug_colorbar = None
    for ax in main:
        axes = list(ax._axis_map.values())
        for axis in axes:       # Axis.clear() drops its ticks; the tick parameters it keeps apply to them alike
            axis.reset_ticks = _keep_ticks
        try:
            ax.clear()
        finally:
            for axis in axes:
                del axis.reset_ticks
        ax.set_axis_on()                    # what clear() leaves as it was and new axes would not have
        ax.set_facecolor(rcParams["axes.facecolor"])
        ax.set_aspect("auto")
    if fig._suptitle is not None:
        fig._suptitle.remove()
        fig._suptitle = None
    for artists in (fig.texts, fig.legends, fig.lines, fig.patches, fig.images, fig.artists):
        for artist in list(artists):
            artist.remove()


def _keep_ticks():
    return None


def new_figure(figsize):
    """A standalone Figure (no pyplot: the report must not switch a notebook's backend)."""
    from matplotlib.figure import Figure  # noqa: PLC0415
    return Figure(figsize=figsize)


def live_figure(figsize, dpi: Optional[int] = None):
    """A figure redrawn again and again (the dashboard's): its own Agg canvas, so that every PNG of it renders with
    one renderer and matplotlib's text-size cache (per renderer) holds across redraws. dpi: the figure's own (its
    PNG drawn straight from the canvas by `views.blit`), else matplotlib's default."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: PLC0415
    fig = new_figure(figsize)
    if dpi is not None:
        fig.set_dpi(dpi)
    FigureCanvasAgg(fig)
    return fig


def fig_png(fig, dpi: int = DPI, tight: bool = False, compress_level: Optional[int] = None) -> bytes:
    """The figure as PNG. compress_level: zlib's 0..9 (None: PIL's default, 6); the dashboard's 1 encodes a large
    figure in a third of the time for about 10% more bytes (the pixels are the same)."""
    buf = io.BytesIO()
    kw = {"bbox_inches": "tight"} if tight else {}
    if compress_level is not None:
        kw["pil_kwargs"] = {"compress_level": compress_level}
    fig.savefig(buf, format="png", dpi=dpi, **kw)
    return buf.getvalue()


def add_colorbar(ax, im, **kw):
    """One colorbar per Axes, replaced on redraw (redrawing into the same Axes must not pile them up)."""
    old = getattr(ax, "_mamba_debug_colorbar", None)
    if old is not None:
        old.remove()
    ax._mamba_debug_colorbar = ax.figure.colorbar(im, ax=ax, fraction=0.04, **kw)
    ax._mamba_debug_colorbar.ax._mamba_debug_is_colorbar = True     # views.blit: placed by its locator
    return ax._mamba_debug_colorbar


def mark_device_boundaries(ax, res: CompareResult, axis: str = "x"):
    """A dash-dot line before each block whose input crossed from another device (--devices), labelled with the
    device it runs on; the legend handle, or None when the placement has no such boundary on the layer axis."""
    from matplotlib.lines import Line2D  # noqa: PLC0415
    p = res.placement
    layers = [b for b in p.device_boundaries if b < res.n_layer]
    for b in layers:
        line = ax.axvline if axis == "x" else ax.axhline
        line(b - 0.5, color=DEVICE_BOUNDARY, ls="-.", lw=1.8, zorder=1)
        name = p.slot_name(p.layer_slot(b))
        if axis == "x":
            ax.text(b - 0.5, 1.0, f" {name}", color=DEVICE_BOUNDARY, fontsize=7, va="top", ha="left",
                    transform=ax.get_xaxis_transform(), zorder=6)
        else:
            ax.text(0.0, b - 0.5, f" {name} above", color=DEVICE_BOUNDARY, fontsize=7, va="bottom", ha="left",
                    transform=ax.get_yaxis_transform(), zorder=6, bbox=dict(fc="white", ec="none", alpha=0.7, pad=1))
    if not layers:
        return None
    return Line2D([], [], color=DEVICE_BOUNDARY, ls="-.", lw=1.8, label="device boundary (hidden state handed over)")


def shade_device_layers(ax, res: CompareResult, label: str = "device layers"):
    L0 = res.placement.first_device_layer
    if L0 < res.n_layer:
        ax.axvspan(L0 - 0.5, res.n_layer - 0.5, **DEVICE_SHADE, label=label)


def check_args(res: Optional[CompareResult], ax, *, seq=0, token=None, layer=None, site=None, metric=None):
    """A notebook's arguments to a view, refused naming them: a sequence, token or metric out of range was an
    IndexError or KeyError from inside the drawing, an unknown site an empty picture saying "not observed"."""
    if not (hasattr(ax, "figure") and hasattr(ax, "imshow")):
        raise MambaDebugError(f"ax must be a matplotlib Axes (fig, ax = plt.subplots()), got a {type(ax).__name__}")
    if res is None:
        return
    S, T = res.tokens.shape
    for name, v, n, what in (("seq", seq, S, "sequence"), ("token", token, T, "token"),
                             ("layer", layer, res.n_layer, "layer")):
        if v is not None and not (is_integer(v) and -n <= v < n):
            raise MambaDebugError(f"{name}={v!r}: this result has {n} {what}(s), 0..{n - 1}")
    sites = MODEL_SITES + tuple(dict.fromkeys(s for layer_sites in res.layer_sites for s in layer_sites))
    if site is not None and site not in sites:
        raise MambaDebugError(f"site={site!r}: this result's sites are {', '.join(sites)}")
    if metric is not None and metric not in METRICS:
        raise MambaDebugError(f"metric={metric!r}: the metrics are {', '.join(METRICS)}")


def site_keys(res: CompareResult, site: str) -> list:
    """The (layer, site) keys a per-layer view plots: one per layer, or the one model-level key."""
    return [(None, site)] if site in MODEL_SITES else [(i, site) for i in range(res.n_layer)]


def site_errors(res: CompareResult, site: str, metric: str = "rel_l2", seq: int = 0) -> np.ndarray:
    """[n_layer (1 for a model-level site), n_tok] of one site's metric for one sequence. NaN: not observed by
    the device side, or a layer without this site."""
    n_tok = res.tokens.shape[1]
    rows = [res.errors[k][metric][seq].numpy() if k in res.errors else np.full(n_tok, np.nan)
            for k in site_keys(res, site)]
    return np.stack(rows).astype(float)


def observed_rows(res: CompareResult, site: str) -> np.ndarray:
    """bool per plotted row: the device side observed this site there."""
    return np.array([k in res.errors and res.is_observed(k) for k in site_keys(res, site)])


def present_rows(res: CompareResult, site: str) -> np.ndarray:
    """bool per plotted row: the layer's type has this site (a hybrid's attention layers have no 'conv', its Mamba
    layers no 'q')."""
    return np.array([k[0] is None or k[0] >= len(res.layer_sites) or k[1] in res.layer_sites[k[0]]
                     for k in site_keys(res, site)])


def token_thresholds(res: CompareResult, site: str, seq: int = 0) -> np.ndarray:
    """[n_layer (1 for a model-level site), n_tok] each token's threshold for one sequence; NaN for a row without
    the site."""
    n_tok = res.tokens.shape[1]
    rows = [res.token_thresholds(k)[seq].numpy() if k in res.thresholds and k in res.floor else np.full(n_tok, np.nan)
            for k in site_keys(res, site)]
    return np.stack(rows).astype(float)


def not_observed_patch():
    """A legend handle for the "not observed" look."""
    from matplotlib.patches import Patch  # noqa: PLC0415
    return Patch(**NOT_OBSERVED, label=NOT_OBSERVED_LABEL)


def hatch_rows(ax, rows, n_cols: int):
    """Cover whole image rows (layers) that were not observed with the "not observed" look."""
    from matplotlib.patches import Rectangle  # noqa: PLC0415
    for r in rows:
        ax.add_patch(Rectangle((-0.5, r - 0.5), n_cols, 1, **NOT_OBSERVED, zorder=3))


def hatch_columns(ax, xs):
    """Mark positions on a curve's x axis (layers) that were not observed: a hatched band each."""
    for x in xs:
        ax.axvspan(x - 0.4, x + 0.4, **NOT_OBSERVED, zorder=0)


def message(ax, text: str):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)


# -- colour that means something -------------------------------------------------------------------------
def ratio_norm():
    """The norm of log10(error / threshold): centred on 0 (= at the threshold)."""
    from matplotlib.colors import Normalize  # noqa: PLC0415
    return Normalize(vmin=-RATIO_DECADES, vmax=RATIO_DECADES)


def special_handles(which=None) -> list:
    """Legend handles for the special looks (all, or the names in `which`); a hybrid's absent site only in `which`."""
    from matplotlib.patches import Patch  # noqa: PLC0415
    looks = {**SPECIAL_LOOKS, **({NO_SITE_LABEL: NO_SITE} if which is not None else {})}
    return [Patch(**look, label=name) for name, look in looks.items() if which is None or name in which]


def ratio_colorbar(ax, im):
    """The error / threshold colour bar: ticks as ratios, 1 marked as the threshold."""
    cb = add_colorbar(ax, im)
    ticks = list(range(-RATIO_DECADES, RATIO_DECADES + 1, 2))
    names = {-4: "1e-4", -3: "0.001", -2: "0.01", -1: "0.1", 0: "1 (threshold)", 1: "10", 2: "100", 3: "1000", 4: "1e4"}
    cb.set_ticks(ticks, labels=[names.get(t, f"1e{t}") for t in ticks])
    cb.ax.axhline(0, color="k", lw=1.5)
    cb.ax.tick_params(labelsize=8)
    cb.set_label(RATIO_LABEL, fontsize=8)
    return cb


def special_overlay(ax, err: np.ndarray, seen_rows: np.ndarray, present: Optional[np.ndarray] = None):
    """Paint the special values of an error image (rows x tokens) on top of its colour image: exact zero green,
    NaN/Inf black, rows not observed hatched, NaN in an observed row (not run) light grey dotted, rows whose layer
    has no such site (`present` false) white. Returns the names of the looks it used."""
    from matplotlib.colors import to_rgba  # noqa: PLC0415
    rgba = np.zeros(err.shape + (4,))
    used = set()
    present = np.ones(len(seen_rows), bool) if present is None else np.asarray(present, bool)
    if not present.all():
        rgba[~present] = to_rgba(NO_SITE["facecolor"])
        used.add(NO_SITE_LABEL)
    seen_rows = np.asarray(seen_rows, bool) | ~present      # an absent site is not "not observed"
    seen = np.broadcast_to((seen_rows & present)[:, None], err.shape)
    for name, mask, colour in [("exact zero (identical)", seen & (err == 0), EXACT_ZERO),
                               ("NaN / Inf on the device", seen & np.isinf(err), NAN_INF),
                               ("not run", seen & np.isnan(err), NOT_RUN)]:
        if mask.any():
            rgba[mask] = to_rgba(colour)
            used.add(name)
    ax.imshow(rgba, aspect="auto", origin="lower", interpolation="nearest", zorder=2)
    if not np.all(seen_rows):
        hatch_rows(ax, np.nonzero(~seen_rows)[0], err.shape[1])
        used.add(NOT_OBSERVED_LABEL)
    return used


def mark_ubatches(ax, res: CompareResult, seq: int = 0, ymin=0.0, ymax=1.0, colour="0.35"):
    """Thin vertical lines at sequence `seq`'s ubatch boundaries on a token axis, the prompt | generated line
    thicker (a smaller last group of sequences runs longer ubatches)."""
    for t in res.token_infos(seq):
        if t.index_in_ubatch == 0 and 0 < t.token < res.n_prompt:
            ax.axvline(t.token - 0.5, ymin=ymin, ymax=ymax, color=colour, lw=0.8, ls=":", zorder=4)
    ax.axvline(res.n_prompt - 0.5, ymin=ymin, ymax=ymax, color="tab:blue", lw=1.4, zorder=4)

