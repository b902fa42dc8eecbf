"""The sweep matrix: offload x ubatch, each cell the first divergence (token, layer) of that configuration.

It draws a sweep dict (`sweep.run_sweep`'s, or the dashboard's collection of cells), not one run: kind "sweep".
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from .base import View, add_colorbar, fresh_axes, message


def sweep_matrix(sweep: dict, ax, value="first_token"):
    """offload x ubatch matrix of the first-divergence token (or KLD); blank = no divergence."""
    ax.clear()
    offs, ubs = sweep["offloads"], sweep["ubatches"]
    grid = np.full((len(offs), len(ubs)), np.nan)
    for cell in sweep["cells"]:
        i, j = offs.index(cell["offload"]), ubs.index(cell["ubatch"])
        v = cell.get(value)
        grid[i, j] = np.nan if v is None else (v if isinstance(v, (int, float)) else np.nan)
    im = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis_r", interpolation="nearest")
    for cell in sweep["cells"]:
        i, j = offs.index(cell["offload"]), ubs.index(cell["ubatch"])
        fd = cell.get("first_divergence")
        label = "ok" if fd is None else f"t{fd['token']}\nL{'head' if fd['layer'] is None else fd['layer']}"
        ax.text(j, i, label, ha="center", va="center", fontsize=7, color="black" if fd is None else "white")
    ax.set_xticks(range(len(ubs)), [str(u) for u in ubs])
    ax.set_yticks(range(len(offs)), [str(o) for o in offs])
    ax.set_xlabel("ubatch")
    ax.set_ylabel("offload (-ngl)")
    ax.set_title("first divergence (token, layer) per configuration")
    if np.isfinite(grid).any():          # nothing diverged: no scale to show
        add_colorbar(ax, im, label=value)
    return ax


class SweepMatrixView(View):
    name = "sweep"
    title = "First divergence per configuration"
    figsize = (5.0, 3.4)
    in_report = False
    kind = "sweep"

    def draw(self, fig, sweep: dict, state=None, current: Optional[tuple] = None):
        """The offload x ubatch matrix; the configuration on screen (`current` = (offload, ubatch)) is framed."""
        ax = fresh_axes(fig)
        if not sweep["cells"]:
            message(ax, "no sweep yet: press 'run sweep'")
            ax.set_axis_off()
            return ax
        sweep_matrix(sweep, ax)
        if current and current[0] in sweep["offloads"] and current[1] in sweep["ubatches"]:
            from matplotlib.patches import Rectangle  # noqa: PLC0415
            i, j = sweep["offloads"].index(current[0]), sweep["ubatches"].index(current[1])
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="red", lw=2))
        ax.set_title("first divergence per configuration (framed: on screen)", fontsize=9)
        return ax

    def report_states(self, res) -> list:
        return []


VIEW = SweepMatrixView()
