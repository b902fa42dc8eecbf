"""The heatmap: one site's error / threshold, layer x token, on a diverging scale centred on the threshold (blue
below, red above = a bug); exact zero, not observed, NaN/Inf and not run in their own legended looks; the ubatch
boundaries, the prompt | generated line, the offload boundary (host | device) and the first divergence marked."""
from __future__ import annotations

import numpy as np

from ..arch import MODEL_SITES
from ..trace import CompareResult
from .blit import mark_dynamic
from .base import (check_args, BOUNDARY, FIRST_DIV, NO_SITE_LABEL, SPECIAL_LOOKS, TITLE_Y, View, ViewState,
                   add_colorbar, clear_axes, fresh_axes, mark_device_boundaries, mark_ubatches, observed_rows,
                   present_rows, ratio_colorbar, ratio_norm, site_errors, special_handles, special_overlay,
                   token_thresholds)


def error_image(res: CompareResult, site: str, metric: str, seq: int):
    """(image, raw error, has_threshold): log10(error / threshold) for rel_l2, else log10 of the metric (1 - cos
    for the cosine); the raw error keeps 0, NaN (not run / not observed) and inf (NaN/Inf on the device)."""
    err = site_errors(res, site, metric, seq)
    if metric == "cosine":
        err = np.where(np.isfinite(err), np.abs(1.0 - err), err)
    with np.errstate(divide="ignore", invalid="ignore"):
        if metric == "rel_l2":
            ratio = err / token_thresholds(res, site, seq)
            img = np.log10(ratio)
        else:
            img = np.log10(err)
    img = np.where(np.isfinite(img) & (err > 0), img, np.nan)
    return img, err, metric == "rel_l2"


def heatmap(res: CompareResult, ax, site="resid", metric="rel_l2", seq=0, colorbar=True, legend=True):
    """Error / threshold (rel_l2) per layer x token; other metrics on their own log scale (no threshold)."""
    check_args(res, ax, seq=seq, site=site, metric=metric)
    img, err, ratio = error_image(res, site, metric, seq)
    clear_axes(ax)
    model_level = site in MODEL_SITES
    if ratio:
        im = ax.imshow(img, aspect="auto", origin="lower", cmap="RdBu_r", norm=ratio_norm(),
                       interpolation="nearest")
    else:
        finite = img[np.isfinite(img)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (-9.0, 0.0)
        im = ax.imshow(img, aspect="auto", origin="lower", cmap="viridis", vmin=lo, vmax=max(hi, lo + 1),
                       interpolation="nearest")
    used = special_overlay(ax, err, observed_rows(res, site), present_rows(res, site))
    mark_ubatches(ax, res, seq)
    n_tok = img.shape[1]
    L0 = res.placement.first_device_layer
    if not model_level and 0 < L0 < res.n_layer:
        ax.axhline(L0 - 0.5, color=BOUNDARY, lw=2.0, ls="--", zorder=5)
        ax.text(n_tok - 0.5, L0 - 0.5, " host below | device above", color=BOUNDARY, fontsize=7, va="bottom",
                ha="right", zorder=6, bbox=dict(fc="white", ec="none", alpha=0.7, pad=1))
    split = None if model_level else mark_device_boundaries(ax, res, axis="y")
    fd = res.first_divergence
    if fd and fd["seq"] == seq:
        row = 0 if model_level else (fd["layer"] if fd["layer"] is not None else None)
        if row is not None:
            ax.plot(fd["token"], row, "o", ms=13, mfc="none", mec="white", mew=4.0, zorder=7)
            ax.plot(fd["token"], row, "o", ms=13, mfc="none", mec=FIRST_DIV, mew=2.0, zorder=7)
    ax.set_xlim(-0.5, n_tok - 0.5)
    ax.set_xlabel("token  (dotted: ubatch boundary, blue: prompt | generated)", fontsize=8)
    if model_level:
        ax.set_yticks([0], [site])
    else:
        ax.set_ylabel("layer")
    what = "error / threshold" if ratio else ("1 - cosine" if metric == "cosine" else metric) + " (no threshold)"
    ax.set_title(f"'{site}' {what}, layer x token, seq {seq}", fontsize=10, y=TITLE_Y)
    if colorbar:
        if ratio:
            ratio_colorbar(ax, im)
        else:
            cb = add_colorbar(ax, im)
            mark_dynamic(cb.ax.yaxis)       # the metric's own range: its numbers follow the data (views.blit)
            cb.set_label(f"log10 {'1 - cosine' if metric == 'cosine' else metric}", fontsize=8)
    if legend:
        from matplotlib.lines import Line2D  # noqa: PLC0415
        marks = [Line2D([], [], marker="o", ls="", mfc="none", mec=FIRST_DIV, mew=2, ms=8, label="first divergence"),
                 Line2D([], [], color=BOUNDARY, ls="--", lw=2, label="offload boundary")] + ([split] if split else [])
        absent = special_handles({NO_SITE_LABEL} & used)
        ax.legend(handles=special_handles() + absent + marks, loc="upper center", ncol=3, fontsize=7, frameon=False,
                  bbox_to_anchor=(0.5, -0.17))
    return ax


class HeatmapView(View):
    name = "heatmap"
    title = "Hidden-state (resid) error / threshold, layer x token"
    depends = frozenset({"site", "metric", "seq"})        # not the token: stepping tokens stays cheap
    figsize = (6.4, 4.2)

    def draw(self, fig, res: CompareResult, v: ViewState) -> np.ndarray:
        """Layer x token heatmap; returns what it coloured: error / threshold for rel_l2 (the metric itself for
        the others): 0 exact zero, NaN not observed / not run, inf NaN/Inf on the device."""
        ax = fresh_axes(fig, bottom=0.25, top=0.91, left=0.1, right=0.82)
        heatmap(res, ax, site=v.site, metric=v.metric, seq=v.seq)
        _img, err, ratio = error_image(res, v.site, v.metric, v.seq)
        if not ratio:
            return err
        with np.errstate(all="ignore"):
            return err / token_thresholds(res, v.site, v.seq)

    def report_states(self, res: CompareResult) -> list:
        """The hidden state; and the first divergent site when that is another one."""
        st = ViewState.at_first_divergence(res)
        out = [(self.title, ViewState(site="resid", seq=st.seq))]
        if res.first_divergence and st.site != "resid":
            out.append((f"Error / threshold of the first divergent site '{st.site}'",
                        ViewState(site=st.site, seq=st.seq)))
        return out


VIEW = HeatmapView()
assert len(SPECIAL_LOOKS) == 4
