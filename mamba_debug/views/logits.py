"""The logits view: KL(reference || device) per token, tokens whose top-1 differs marked, ubatch boundaries and the
prompt | generated line drawn, the first divergence's token marked."""
from __future__ import annotations

import numpy as np

from ..trace import CompareResult
from .blit import mark_dynamic
from .base import (check_args, EXACT_ZERO, FIRST_DIV, NAN_INF, TITLE_Y, View, ViewState, clear_axes, fresh_axes,
                   mark_ubatches)


def logits_curve(res: CompareResult, ax, seq=0):
    check_args(res, ax, seq=seq)
    from matplotlib.lines import Line2D  # noqa: PLC0415
    clear_axes(ax)
    kld = res.logits["kld"][seq].numpy().astype(float)
    x = np.arange(len(kld))
    pos = np.isfinite(kld) & (kld > 0)
    floor = float(kld[pos].min()) / 10 if pos.any() else 1e-12
    top = float(kld[pos].max()) * 10 if pos.any() else 1.0
    handles = ax.semilogy(x, np.where(pos, kld, np.nan), ".-", color="tab:blue", label="KL(ref || device)")
    mark_dynamic(ax.yaxis)          # its decades follow the data (views.blit)
    flips = np.nonzero(res.logits["top1"][seq].numpy() < 1)[0]
    if len(flips):
        handles += ax.plot(flips, np.where(pos[flips], kld[flips], floor), "x", color="tab:red", ms=7, mew=2,
                           label="top-1 token differs")
    zero = kld == 0
    if zero.any():
        ax.plot(x[zero], np.full(zero.sum(), floor), "s", color=EXACT_ZERO, mec="0.3", ms=6, clip_on=False)
        handles.append(Line2D([], [], marker="s", ls="", color=EXACT_ZERO, mec="0.3", label="exact zero"))
    bad = ~np.isfinite(kld)
    if bad.any():
        ax.plot(x[bad], np.full(bad.sum(), top), "v", color=NAN_INF, ms=8, clip_on=False)
        handles.append(Line2D([], [], marker="v", ls="", color=NAN_INF, label="NaN / Inf"))
    ax.set_ylim(floor, top)
    mark_ubatches(ax, res, seq)
    fd = res.first_divergence
    if fd and fd["seq"] == seq:
        ax.axvline(fd["token"], color=FIRST_DIV, lw=1.5, ls="-.")
        handles.append(Line2D([], [], color=FIRST_DIV, ls="-.", label=f"first divergence (token {fd['token']})"))
    ax.set_xlim(-0.5, len(kld) - 0.5)
    ax.set_xlabel("token  (dotted: ubatch boundary, blue: prompt | generated)", fontsize=8)
    ax.set_ylabel("KLD (nats)")
    ax.set_title("logits: KL divergence per token", y=TITLE_Y)
    ax.legend(handles=handles, fontsize=7, loc="best", framealpha=0.85)
    return ax


class LogitsView(View):
    name = "logits"
    title = "Logits"
    depends = frozenset({"seq"})
    figsize = (10.0, 2.8)
    width = "full"

    def draw(self, fig, res: CompareResult, v: ViewState) -> np.ndarray:
        """KLD per token of the chosen sequence; returns it."""
        ax = fresh_axes(fig, left=0.08, right=0.98, bottom=0.2, top=0.88)
        logits_curve(res, ax, seq=v.seq)
        ax.set_title(f"logits: KL divergence per token, seq {v.seq}", fontsize=10, y=TITLE_Y)
        return res.logits["kld"][v.seq].numpy()

    def report_states(self, res: CompareResult) -> list:
        return [(self.title, ViewState(seq=ViewState.at_first_divergence(res).seq))]


VIEW = LogitsView()
