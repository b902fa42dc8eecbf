"""The per-layer curve: one site's error across the layers at one token, its threshold on the same axes (points
above it red), the first divergence ringed, the offload boundary (host | device) drawn. A model-level site (final
norm, logits) has one value per token, not per layer: it is drawn over the tokens instead of as a one-point curve."""
from __future__ import annotations

import warnings

import numpy as np

from ..arch import MODEL_SITES
from ..trace import CompareResult
from .blit import mark_dynamic
from .base import (check_args, BOUNDARY, DEVICE_SHADE, EXACT_ZERO, FIRST_DIV, NAN_INF, TITLE_Y, View, ViewState,
                   clear_axes, fresh_axes, hatch_columns, mark_device_boundaries, mark_ubatches, message,
                   not_observed_patch, observed_rows, present_rows, site_errors, token_thresholds)

METRIC_LABELS = {"rel_l2": "relative L2 error  ||dev - ref|| / ||ref||", "max_abs": "max |dev - ref|",
                 "nmse": "NMSE  mse(dev, ref) / mse(ref, 0)", "cosine": "1 - cosine(dev, ref)  (0 = same direction)"}


def _first_div_handle():
    """The legend entry of the first-divergence ring."""
    from matplotlib.lines import Line2D  # noqa: PLC0415
    return Line2D([], [], marker="o", ls="", mfc="none", mec=FIRST_DIV, mew=2, label="first divergence")


def _values(err: np.ndarray, metric: str) -> np.ndarray:
    return np.where(np.isfinite(err), np.abs(1.0 - err), err) if metric == "cosine" else err


def _plot_series(ax, x, y, thr, label):
    """Draw y on a log axis: positive values as a line, points above `thr` red, exact zeros as green squares on
    the bottom edge, NaN/Inf as black triangles on the top edge. Returns the handles for a legend."""
    from matplotlib.lines import Line2D  # noqa: PLC0415
    shown = np.where(np.isfinite(y) & (y > 0), y, np.nan)
    handles = ax.semilogy(x, shown, "o-", color="tab:blue", ms=4, lw=1.4, label=label, zorder=3)
    mark_dynamic(ax.yaxis)          # its decades follow the data (views.blit)
    if thr is not None:
        above = np.isfinite(shown) & (shown > thr)
        if above.any():
            handles += ax.plot(x[above], shown[above], "o", color="tab:red", ms=6, zorder=4,
                               label="above threshold = bug")
        handles += ax.plot(x, thr, "--", color="0.2", lw=1.2, drawstyle="steps-mid" if len(x) > 1 else "default",
                           label="threshold", zorder=2)
    finite = np.concatenate([shown[np.isfinite(shown)], [] if thr is None else np.asarray(thr)[np.isfinite(thr)]])
    finite = finite[finite > 0]
    lo, hi = (finite.min() / 30, finite.max() * 30) if finite.size else (1e-10, 1.0)
    with warnings.catch_warnings():      # matplotlib's "identical limits" note on a log axis of one decade
        warnings.simplefilter("ignore", UserWarning)
        ax.set_ylim(lo, hi)
    zero, bad = y == 0, np.isinf(y)
    if zero.any():
        ax.plot(x[zero], np.full(zero.sum(), lo), "s", color=EXACT_ZERO, mec="0.3", ms=7, clip_on=False, zorder=5)
        handles.append(Line2D([], [], marker="s", ls="", color=EXACT_ZERO, mec="0.3", label="exact zero (identical)"))
    if bad.any():
        ax.plot(x[bad], np.full(bad.sum(), hi), "v", color=NAN_INF, ms=8, clip_on=False, zorder=5)
        handles.append(Line2D([], [], marker="v", ls="", color=NAN_INF, label="NaN / Inf on the device"))
    return handles


def _worst_tokens(err: np.ndarray, thr) -> list:
    """Per row, the token of its largest error / threshold (the largest error without thresholds); None where the
    row has no value. A NaN/Inf on the device (inf) is the worst."""
    with np.errstate(all="ignore"):
        score = err if thr is None else err / thr
    return [None if np.isnan(r).all() else int(np.nanargmax(r)) for r in score]


def curve_values(res: CompareResult, site: str, metric: str, seq: int, token=None) -> tuple:
    """(values, thresholds) the curve draws: per token for a model-level site; else per layer at `token`, or at
    each layer's worst token (its largest error / threshold) when None. Thresholds None for metrics without one."""
    err = _values(site_errors(res, site, metric, seq), metric)
    thr_tok = token_thresholds(res, site, seq) if metric == "rel_l2" else None     # [rows, n_tok]
    if site in MODEL_SITES:
        return err[0], None if thr_tok is None else thr_tok[0]
    if token is not None:
        return err[:, token], None if thr_tok is None else thr_tok[:, token]
    at = _worst_tokens(err, thr_tok)

    def pick(a):
        return np.array([np.nan if j is None else a[i, j] for i, j in enumerate(at)])
    return pick(err), None if thr_tok is None else pick(thr_tok)


def layer_curve(res: CompareResult, ax, token=None, site="resid", metric="rel_l2", seq=0):
    """Error per layer at one token (None: worst token); for a model-level site, error per token instead."""
    _draw_curve(res, ax, token, site, metric, seq)
    return ax


def _draw_curve(res: CompareResult, ax, token, site, metric, seq) -> np.ndarray:
    """layer_curve's drawing; returns the values drawn (`curve_values`)."""
    check_args(res, ax, seq=seq, token=token, site=site, metric=metric)
    from matplotlib.lines import Line2D  # noqa: PLC0415
    clear_axes(ax)
    y, thr = curve_values(res, site, metric, seq, token)
    seen = observed_rows(res, site) | ~present_rows(res, site)     # a layer without the site is not "not observed"
    fd = res.first_divergence
    if site in MODEL_SITES:                      # one value per token: a curve over the tokens
        x = np.arange(len(y))
        handles = _plot_series(ax, x, y, thr, f"{site} (model-level: one value per token)")
        mark_ubatches(ax, res, seq)
        if token is not None:
            ax.axvline(token, color="0.5", lw=1.0, zorder=1)
        if fd and fd["layer"] is None and fd["site"] == site and fd["seq"] == seq:
            ax.plot(fd["token"], y[fd["token"]], "o", ms=14, mfc="none", mec=FIRST_DIV, mew=2, zorder=6)
            handles.append(_first_div_handle())
        ax.set_xlabel("token  (dotted: ubatch boundary, blue: prompt | generated)")
        if not seen.all():
            message(ax, "not observed by the device side")
    else:
        x = np.arange(len(y))
        L0 = res.placement.first_device_layer
        if L0 < res.n_layer:
            ax.axvspan(L0 - 0.5, res.n_layer - 0.5, **DEVICE_SHADE, zorder=0)
            ax.axvline(L0 - 0.5, color=BOUNDARY, ls="--", lw=2, zorder=1)
        split = mark_device_boundaries(ax, res)
        handles = _plot_series(ax, x, y, thr, f"{site} at each layer")
        if split is not None:
            handles.append(split)
        if L0 < res.n_layer:
            handles.append(Line2D([], [], color=BOUNDARY, ls="--", lw=2, label=f"offload boundary (layers {L0}+ on "
                                                                                 "device, shaded)"))
        if fd and fd["layer"] is not None and fd["site"] == site and fd["seq"] == seq and \
                (token is None or fd["token"] == token) and np.isfinite(y[fd["layer"]]) and y[fd["layer"]] > 0:
            ax.plot(fd["layer"], y[fd["layer"]], "o", ms=14, mfc="none", mec=FIRST_DIV, mew=2, zorder=6)
            handles.append(_first_div_handle())
        if not seen.all():
            hatch_columns(ax, x[~seen])
            handles.append(not_observed_patch())
        if not seen.any():
            message(ax, "not observed by the device side")
        ax.set_xlim(-0.5, len(y) - 0.5)
        ax.set_xticks(x if len(x) <= 16 else x[::2])
        ax.set_xlabel("layer")
    ax.set_ylabel(METRIC_LABELS.get(metric, metric), fontsize=8)
    ax.legend(handles=handles, loc="best", fontsize=7, framealpha=0.85)
    return y


class CurveView(View):
    name = "curve"
    title = "Per-layer divergence curve"
    depends = frozenset({"token", "site", "metric", "seq"})
    figsize = (6.4, 3.8)

    def draw(self, fig, res: CompareResult, v: ViewState) -> np.ndarray:
        """Per-layer divergence at the chosen token (per token for a model-level site); returns the values drawn."""
        ax = fresh_axes(fig, left=0.13, bottom=0.14, top=0.9)
        token = None if v.token is None else min(v.token, res.tokens.shape[1] - 1)
        drawn = _draw_curve(res, ax, token, v.site, v.metric, v.seq)
        ax.yaxis.get_label().set_fontsize(8)
        if ax.get_yscale() == "log":     # a few decades labelled, no minor ticks: a third of the drawing time
            from matplotlib.ticker import LogLocator, NullLocator  # noqa: PLC0415
            ax.yaxis.set_major_locator(LogLocator(numticks=6))
            ax.yaxis.set_minor_locator(NullLocator())
        if v.site in MODEL_SITES:
            ax.set_title(f"'{v.site}' {v.metric} per token (a model-level site), seq {v.seq}", fontsize=10,
                         y=TITLE_Y)
        elif token is None:
            ax.set_title(f"'{v.site}' {v.metric} per layer at the worst token, seq {v.seq}", fontsize=10,
                         y=TITLE_Y)
        else:
            info = res.token_infos(v.seq)[token]
            ax.set_title(f"'{v.site}' {v.metric} per layer at token {token} ({info.phase}, ubatch {info.ubatch}), "
                         f"seq {v.seq}", fontsize=10, y=TITLE_Y)
        return drawn

    def report_states(self, res: CompareResult) -> list:
        st = ViewState.at_first_divergence(res)
        return [(self.title, ViewState(token=st.token, site="resid", seq=st.seq))]


VIEW = CurveView()
