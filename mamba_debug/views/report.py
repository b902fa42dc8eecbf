"""A self-contained HTML report: the summary, every view of the registry that is `in_report` (figures embedded as
PNG, HTML views inline) and the first divergence as JSON."""
from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from ..safeio import write_text
from ..trace import CompareResult, require_result
from .base import REPORT_DPI, SCREEN_DPI, fig_png, new_figure
from .local_mode import layer_local_table
from .registry import VIEWS
from .summary import engine_local, summary, to_json

STYLE = ("body{font-family:sans-serif;max-width:1000px;margin:auto} pre{background:#f4f4f4;padding:8px;"
         "white-space:pre-wrap} td{border-top:1px solid #ccc;padding:4px;vertical-align:top} "
         "img{max-width:100%;height:auto}")


def figures(res: CompareResult) -> list[tuple[str, str]]:
    """(caption, base64 PNG) of every figure view the report shows, in screen order."""
    return [(caption, _png(view, res, state)) for view in VIEWS if view.in_report and view.kind == "figure"
            for caption, state in view.report_states(res)]


def _png(view, res: CompareResult, state) -> str:
    fig = new_figure(view.figsize)
    view.draw(fig, res, state)
    return base64.b64encode(fig_png(fig, dpi=REPORT_DPI, tight=True)).decode()


def _img(view, res: CompareResult, state) -> str:
    """An <img> shown at the figure's screen width, its pixels at REPORT_DPI (2x: crisp on HiDPI screens)."""
    width = min(int(view.figsize[0] * SCREEN_DPI), 1000)
    return f"<img width='{width}' src='data:image/png;base64,{_png(view, res, state)}'>"


def sections(res: CompareResult) -> list[str]:
    """The report's body, one HTML fragment per view drawing, in screen order."""
    out = []
    for view in VIEWS:
        if not view.in_report:
            continue
        if view.kind == "html":
            for caption, state in view.report_states(res):
                out.append(f"<h2>{html.escape(caption)}</h2>{view.html(res, state)}")
            continue
        if view.kind == "figure":
            out += [f"<h2>{html.escape(caption)}</h2>{_img(view, res, state)}"
                    for caption, state in view.report_states(res)]
    return out


def write_report(res: CompareResult, path, extra: tuple = ()) -> Path:
    """extra: (title, HTML) sections put before the views (the three-way table)."""
    require_result(res, "write_report")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = to_json(res)
    extra = tuple(extra) + _local_table(res) + layer_local_table(res)
    body = "\n".join([f"<h2>{html.escape(t)}</h2>{h}" for t, h in extra] + sections(res))
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>mamba-debug report</title>
<style>{STYLE}</style></head><body>
<h1>mamba-debug: {'DIVERGED' if res.first_divergence else 'no divergence'}</h1>
<pre>{html.escape(summary(res))}</pre>
{body}
<h2>First divergence (JSON)</h2><pre>{html.escape(json.dumps(data['first_divergence'], indent=1))}</pre>
</body></html>"""
    write_text(path, page)
    return path


def _local_table(res: CompareResult, rows: int = 12) -> tuple:
    """The nodes with the largest local error (an engine's --local: each node's op recomputed in float64 from its own
    inputs), against the FP32 floor: error a node makes, apart from error it inherits."""
    loc = engine_local(res)
    if not loc or not loc.get("max_per_node"):
        return ()
    worst = sorted(loc["max_per_node"].items(), key=lambda kv: -kv[1])[:rows]
    cells = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.3g}</td><td>{v / loc['threshold']:.3g}</td></tr>"
                    for k, v in worst)
    return (("Local error per node (largest first)",
             f"<p>{len(loc['max_per_node'])} nodes recomputed; FP32 floor x k = {loc['threshold']:.2g}, TF32 limit "
             f"{loc['tf32_limit']:.2g}.</p><table><tr><th>layer.site</th><th>local rel. L2</th><th>/ (floor x k)</th></tr>"
             f"{cells}</table>"),)
