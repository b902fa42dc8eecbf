"""The per-layer curve: one site's error across the layers at one token, the threshold band, device layers shaded."""
from __future__ import annotations

import numpy as np

from ..trace import CompareResult
from .base import (View, ViewState, fresh_axes, hatch_columns, message, not_observed_patch, observed_rows,
                   shade_device_layers, site_errors, thresholds)


def layer_curve(res: CompareResult, ax, token=None, site="resid", metric="rel_l2", seq=0):
    """Error per layer at one token (None: worst token), device layers shaded, the threshold band drawn; layers the
    device side did not observe are hatched "not observed" (never drawn as 0)."""
    err = site_errors(res, site, metric, seq)
    if token is None:
        with np.errstate(all="ignore"):
            y = np.array([np.nanmax(row) if (~np.isnan(row)).any() else np.nan for row in err])
    else:
        y = err[:, token]
    seen = observed_rows(res, site)
    layers = np.arange(len(y))
    ax.clear()
    shade_device_layers(ax, res)
    shown = np.where(np.isfinite(y) & (y > 0), y, np.nan)
    ax.semilogy(layers, shown, "o-", color="tab:blue", label=f"{site} {metric} (device vs reference)")
    if metric == "rel_l2":
        thr = thresholds(res, site)
        ax.fill_between(layers, 1e-12, thr / res.settings.k_floor, color="tab:green", alpha=0.15,
                        label="rounding floor")
        ax.plot(layers, thr, "--", color="tab:green", label=f"threshold ({res.settings.k_floor:g}x floor)")
    if not seen.all():
        hatch_columns(ax, layers[~seen])
    obs = y[seen]
    if not seen.any():
        message(ax, "not observed by the device side")
    elif np.all(np.nan_to_num(obs, nan=0.0) == 0):
        message(ax, "device and reference identical here (error 0)")
    bad = seen & ~np.isfinite(y) & ~np.isnan(y)
    for i in np.nonzero(bad)[0]:
        ax.annotate("NaN/Inf", (i, ax.get_ylim()[1]), color="red", ha="center", va="top")
    ax.set_xlabel("layer")
    ax.set_ylabel(metric)
    ax.set_title(f"{site} at {'worst token' if token is None else 'token %d' % token}, seq {seq}")
    handles, _labels = ax.get_legend_handles_labels()
    if not seen.all():
        handles.append(not_observed_patch())
    ax.legend(handles=handles, loc="upper left", fontsize=7)
    return ax


class CurveView(View):
    name = "curve"
    title = "Per-layer divergence curve"
    depends = frozenset({"token", "site", "metric", "seq"})
    figsize = (6.4, 3.6)

    def draw(self, fig, res: CompareResult, v: ViewState) -> np.ndarray:
        """Per-layer divergence at the chosen token; returns the values drawn (the site's metric per layer)."""
        ax = fresh_axes(fig)
        token = None if v.token is None else min(v.token, res.tokens.shape[1] - 1)
        layer_curve(res, ax, token=token, site=v.site, metric=v.metric, seq=v.seq)
        if ax.get_legend() is not None:  # the lower right is mostly the floor band; the data sits higher
            leg = ax.get_legend()
            ax.legend(leg.legend_handles, [t.get_text() for t in leg.get_texts()], loc="lower right", fontsize=6,
                      framealpha=0.8)
        if ax.get_yscale() == "log":     # a few decades labelled, no minor ticks: a third of the drawing time
            from matplotlib.ticker import LogLocator, NullLocator  # noqa: PLC0415
            ax.yaxis.set_major_locator(LogLocator(numticks=6))
            ax.yaxis.set_minor_locator(NullLocator())
        err = site_errors(res, v.site, v.metric, v.seq)
        if token is None:
            ax.set_title(f"{v.site} {v.metric} per layer at the worst token, seq {v.seq}", fontsize=9)
            with np.errstate(all="ignore"):
                return np.array([np.nanmax(r) if (~np.isnan(r)).any() else np.nan for r in err])
        info = res.token_info[token]
        ax.set_title(f"{v.site} {v.metric} per layer at token {token} ({info.phase}, ubatch {info.ubatch}), "
                     f"seq {v.seq}", fontsize=9)
        return err[:, token]

    def report_states(self, res: CompareResult) -> list:
        st = ViewState.at_first_divergence(res)
        return [(self.title, ViewState(token=st.token, site="resid", seq=st.seq))]


VIEW = CurveView()
