"""The sweep matrix: offload x ubatch (one panel per number of sequences); each cell one configuration.

A diverged cell is coloured by its mean KLD (log scale, its own colour bar) and says where it first diverged
(layer and token); a clean cell (no site beyond its threshold) is pale green and says "clean"; a configuration not
run is light grey, dotted, "not run"; NaN/Inf logits are black. It draws a sweep dict (`sweep.run_sweep`'s, or the
dashboard's collection of cells), not one run: kind "sweep".
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..errors import MambaDebugError
from .base import (check_args, EXACT_ZERO, NAN_INF, SPECIAL_LOOKS, TITLE_Y, View, add_colorbar, clear_axes, fresh_axes,
                   message)

KLD_RANGE = (1e-6, 10.0)            # the colour bar's fixed range (mean KLD); beyond it the end colours
KLD_CMAP = "YlOrRd"


def _num(v) -> float:
    if v is None:
        return math.nan
    if isinstance(v, str):
        return math.inf if v in ("inf", "-inf") else math.nan
    return float(v)


def _label(fd) -> str:
    if fd is None:
        return "clean"
    return f"L{'head' if fd['layer'] is None else fd['layer']} t{fd['token']}"


def sweep_matrix(sweep: dict, ax, value="kld_mean", n_seqs: Optional[int] = None, colorbar=True, legend=True,
                 title: Optional[str] = None):
    """offload x ubatch of one number of sequences: colour = mean KLD of diverged cells, text = first-divergence
    layer and token; clean, not-run and NaN/Inf cells in their own looks."""
    from matplotlib.colors import LogNorm, to_rgba  # noqa: PLC0415
    from matplotlib.patches import Patch, Rectangle  # noqa: PLC0415
    check_args(None, ax)
    if not isinstance(sweep, dict) or not {"offloads", "ubatches", "cells"} <= set(sweep):
        raise MambaDebugError("sweep must be a run_sweep result (a dict with offloads, ubatches and cells)")
    clear_axes(ax)
    offs, ubs = list(sweep["offloads"]), list(sweep["ubatches"])
    seqs = sweep.get("n_seqs") or [None]
    n_seqs = seqs[0] if n_seqs is None else n_seqs
    cells = {}
    for c in sweep["cells"]:
        if n_seqs is None or c.get("n_seqs", n_seqs) == n_seqs:
            if c["offload"] in offs and c["ubatch"] in ubs:
                cells[(offs.index(c["offload"]), ubs.index(c["ubatch"]))] = c
    grid = np.full((len(offs), len(ubs)), np.nan)
    for (i, j), c in cells.items():
        if c.get("first_divergence") is not None:
            grid[i, j] = min(max(_num(c.get(value)), KLD_RANGE[0]), 1e30)
    norm = LogNorm(*KLD_RANGE)
    im = ax.imshow(np.where(np.isfinite(grid), grid, np.nan), aspect="auto", origin="lower", cmap=KLD_CMAP,
                   norm=norm, interpolation="nearest")
    for i in range(len(offs)):
        for j in range(len(ubs)):
            c = cells.get((i, j))
            if c is None:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, **SPECIAL_LOOKS["not run"], zorder=2))
                ax.text(j, i, "not run", ha="center", va="center", fontsize=7, color="0.45", zorder=3)
                continue
            fd = c.get("first_divergence")
            kld = _num(c.get(value))
            if fd is None:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=EXACT_ZERO, edgecolor="none", zorder=2))
                ax.text(j, i, "clean", ha="center", va="center", fontsize=8, color="#1b5e20", zorder=3)
                continue
            if not math.isfinite(kld):
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=NAN_INF, edgecolor="none", zorder=2))
            dark = not math.isfinite(kld) or norm(max(kld, KLD_RANGE[0])) > 0.55
            star = "*" if c.get("second_opinion") == "confirmed" else ""
            ax.text(j, i, f"{_label(fd)}{star}\nKLD {kld:.2g}", ha="center", va="center", fontsize=7.5, zorder=3,
                    color="white" if dark else "black", fontweight="bold")
    for k in range(len(ubs) + 1):
        ax.axvline(k - 0.5, color="white", lw=1.5, zorder=4)
    for k in range(len(offs) + 1):
        ax.axhline(k - 0.5, color="white", lw=1.5, zorder=4)
    ax.set_xlim(-0.5, len(ubs) - 0.5)
    ax.set_ylim(-0.5, len(offs) - 0.5)
    ax.set_xticks(range(len(ubs)), [str(u) for u in ubs])
    ax.set_yticks(range(len(offs)), [str(o) for o in offs])
    ax.set_xlabel("ubatch (-ub)")
    ax.set_ylabel("offload (-ngl)")
    starred = any(c.get("second_opinion") == "confirmed" for c in cells.values())
    ax.set_title(title if title is not None else "first divergence (layer, token) and mean KLD per configuration"
                 + ("" if n_seqs is None else f", {n_seqs} sequence(s)")
                 + ("\n(*: past a second opinion's float32 samples)" if starred else ""), fontsize=9, y=TITLE_Y)
    if colorbar:
        cb = add_colorbar(ax, im)
        cb.set_label("mean KLD of a diverged cell (log)", fontsize=8)
        cb.ax.tick_params(labelsize=7)
        cb.minorticks_off()     # a number at every decade is enough; 72 minor ticks were half of a redraw
    if not legend:
        return ax
    ax.legend(handles=[Patch(facecolor=EXACT_ZERO, label="clean: no divergence"),
                       Patch(**SPECIAL_LOOKS["not run"], label="not run"),
                       Patch(facecolor=NAN_INF, label="NaN / Inf logits")],
              loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=7, frameon=False)
    return ax


class SweepMatrixView(View):
    name = "sweep"
    title = "First divergence per configuration"
    figsize = (6.4, 4.2)
    in_report = False
    kind = "sweep"

    def draw(self, fig, sweep: dict, state=None, current: Optional[tuple] = None):
        """The offload x ubatch matrix (one panel per number of sequences); the configuration on screen
        (`current` = (offload, ubatch)) is framed."""
        seqs = sweep.get("n_seqs") or [None]
        top = 0.86 if len(seqs) > 1 else 0.9
        axes = list(np.atleast_1d(fresh_axes(fig, 1, len(seqs), left=0.12, right=0.92, bottom=0.24, top=top,
                                             wspace=0.15)))
        if not sweep["cells"]:
            message(axes[0], "no sweep yet: press 'run sweep'")
            axes[0].set_axis_off()
            return axes[0]
        many = len(seqs) > 1               # one panel per number of sequences: one colour bar, one legend
        if many:
            fig.suptitle("first divergence (layer, token) and mean KLD per configuration", fontsize=9, y=0.99)
        for k, (ax, n) in enumerate(zip(axes, seqs)):
            sweep_matrix(sweep, ax, n_seqs=n, colorbar=k == len(seqs) - 1, legend=k == 0,
                         title=f"{n} sequence(s)" if many else None)
            if many and k:
                ax.set_ylabel("")
            if current and current[0] in sweep["offloads"] and current[1] in sweep["ubatches"]:
                from matplotlib.patches import Rectangle  # noqa: PLC0415
                i, j = sweep["offloads"].index(current[0]), sweep["ubatches"].index(current[1])
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="tab:blue", lw=3, zorder=5))
        if current:
            fig.text(0.5, 0.93 if many else 0.96, "framed blue: the configuration on screen", ha="center", fontsize=7,
                     color="tab:blue")
        if many:
            axes[0].get_legend().set_bbox_to_anchor((0.5 * len(seqs) + 0.1, -0.2))
        return axes[0]

    def report_states(self, res) -> list:
        return []


VIEW = SweepMatrixView()
