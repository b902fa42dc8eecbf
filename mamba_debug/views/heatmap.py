"""The heatmap: log10 error of one site, layer x token; ubatch boundaries, the prompt | generated line, the device
boundary and the first divergence marked; rows the device side did not observe hatched."""
from __future__ import annotations

import numpy as np

from ..arch import MODEL_SITES
from ..trace import CompareResult
from .base import View, ViewState, add_colorbar, fresh_axes, hatch_rows, not_observed_patch, observed_rows, site_errors


def heatmap(res: CompareResult, ax, site="resid", metric="rel_l2", seq=0, colorbar=True):
    """log10 error, layer x token, ubatch boundaries marked, the first divergence circled."""
    err = site_errors(res, site, metric, seq)
    with np.errstate(divide="ignore", invalid="ignore"):
        img = np.log10(np.where(err > 0, err, 1e-16))
    img = np.where(np.isfinite(err), img, np.where(np.isnan(err), np.nan, 2.0))   # inf (NaN born) -> top colour
    ax.clear()
    model_level = site in MODEL_SITES
    im = ax.imshow(img, aspect="auto", origin="lower", cmap="magma", vmin=-9, vmax=1, interpolation="nearest")
    seen = observed_rows(res, site)
    if not seen.all():
        hatch_rows(ax, np.nonzero(~seen)[0], img.shape[1])
        ax.legend(handles=[not_observed_patch()], loc="upper left", fontsize=7, framealpha=0.8)
    for t in res.token_info:
        if t.index_in_ubatch == 0 and t.token > 0:
            ax.axvline(t.token - 0.5, color="white", lw=0.6, alpha=0.7)
    if not model_level and res.placement.first_device_layer < res.n_layer:
        ax.axhline(res.placement.first_device_layer - 0.5, color="cyan", lw=1.0, ls="--")
    fd = res.first_divergence
    if fd and fd["seq"] == seq:
        row = 0 if model_level else (fd["layer"] if fd["layer"] is not None else res.n_layer - 1)
        ax.plot(fd["token"], row, "o", ms=14, mfc="none", mec="lime", mew=2)
    ax.axvline(res.n_prompt - 0.5, color="deepskyblue", lw=1.2)
    ax.set_xlabel("token (white: ubatch boundary, blue: prompt | generated)")
    ax.set_ylabel("layer" if not model_level else site)
    ax.set_title(f"log10 {metric} of '{site}', seq {seq}")
    if colorbar:
        add_colorbar(ax, im)
    return ax


class HeatmapView(View):
    name = "heatmap"
    title = "Hidden-state (resid) error, layer x token"
    depends = frozenset({"site", "metric", "seq"})        # not the token: stepping tokens stays cheap
    figsize = (6.4, 3.6)

    def draw(self, fig, res: CompareResult, v: ViewState) -> np.ndarray:
        """Layer x token heatmap; returns the image array."""
        ax = fresh_axes(fig)
        heatmap(res, ax, site=v.site, metric=v.metric, seq=v.seq)
        return np.asarray(ax.images[0].get_array(), dtype=float) if ax.images else np.array([])

    def report_states(self, res: CompareResult) -> list:
        """The hidden state; and the first divergent site when that is another one."""
        st = ViewState.at_first_divergence(res)
        out = [(self.title, ViewState(site="resid", seq=st.seq))]
        if res.first_divergence and st.site != "resid":
            out.append((f"Error of the first divergent site '{st.site}'", ViewState(site=st.site, seq=st.seq)))
        return out


VIEW = HeatmapView()
