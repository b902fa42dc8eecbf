"""What every view shares: the `View` it is, the `ViewState` it reads, and the drawing helpers.

A view is pure: (figure, result, view state) in, pixels out (`draw` returns the numbers it drew, for tests and
the dashboard's `view_data`). It knows nothing about widgets; the dashboard and the HTML report both walk
`views.registry.VIEWS` and call the same `draw`.

"Not observed": a site the device side did not report has NaN errors (`not res.is_observed(key)`). Views draw it
as hatched grey with a legend entry "not observed", never as 0 and never as a gap that reads as "fine".
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Optional

import numpy as np

from ..arch import MODEL_SITES
from ..trace import CompareResult

DEVICE_SHADE = dict(color="tab:orange", alpha=0.12)
NOT_OBSERVED = dict(facecolor="0.85", edgecolor="0.45", hatch="///", lw=0.0)   # the "not observed" look
NOT_OBSERVED_LABEL = "not observed by the device side"
MARGINS = dict(left=0.12, right=0.97, bottom=0.15, top=0.88, wspace=0.35)   # fixed: tight_layout costs ~0.2 s


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
def fresh_axes(fig, *grid):
    """Clear the whole figure (colorbars are axes of their own, which ax.clear() would leave behind), set the
    fixed margins and add axes."""
    fig.clf()
    fig.subplots_adjust(**MARGINS)
    if not grid:
        return fig.add_subplot()
    return fig.subplots(*grid)


def new_figure(figsize):
    """A standalone Figure (no pyplot: the report must not switch a notebook's backend)."""
    from matplotlib.figure import Figure  # noqa: PLC0415
    return Figure(figsize=figsize)


def fig_png(fig, dpi: int = 72, tight: bool = False) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, **({"bbox_inches": "tight"} if tight else {}))
    return buf.getvalue()


def add_colorbar(ax, im, **kw):
    """One colorbar per Axes, replaced on redraw (redrawing into the same Axes must not pile them up)."""
    old = getattr(ax, "_mamba_debug_colorbar", None)
    if old is not None:
        old.remove()
    ax._mamba_debug_colorbar = ax.figure.colorbar(im, ax=ax, fraction=0.04, **kw)
    return ax._mamba_debug_colorbar


def shade_device_layers(ax, res: CompareResult, label: str = "device layers"):
    L0 = res.placement.first_device_layer
    if L0 < res.n_layer:
        ax.axvspan(L0 - 0.5, res.n_layer - 0.5, **DEVICE_SHADE, label=label)


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


def thresholds(res: CompareResult, site: str) -> np.ndarray:
    return np.array([res.thresholds.get(k, np.nan) for k in site_keys(res, site)])


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
