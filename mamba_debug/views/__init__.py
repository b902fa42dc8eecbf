"""Views of a comparison: one module per view, a registry in screen order, the JSON summary and the HTML report.

The plotting functions draw into a given matplotlib Axes (notebooks call them; `md.views.heatmap(res, ax)`); the
`View` objects in `registry.VIEWS` wrap them for the dashboard and the report. Nothing here runs a model.
"""
from __future__ import annotations

from .base import View, ViewState, fig_png
from .registry import BY_NAME, VIEWS
from .report import write_report
from .summary import per_layer, summary, to_json, verdict
# last: these function names shadow their modules' names as attributes of the package (md.views.heatmap(res, ax))
from .curve import layer_curve  # noqa: E402, I001
from .generations import generations_html  # noqa: E402
from .heatmap import heatmap  # noqa: E402
from .logits import logits_curve  # noqa: E402
from .states import state_diff  # noqa: E402
from .sweep_matrix import sweep_matrix  # noqa: E402

__all__ = ["BY_NAME", "VIEWS", "View", "ViewState", "fig_png", "generations_html", "heatmap", "layer_curve",
           "logits_curve", "per_layer", "state_diff", "summary", "sweep_matrix", "to_json", "verdict", "write_report"]
