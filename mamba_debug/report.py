"""A self-contained HTML report: the summary, the JSON verdict and the plots embedded as PNG."""
from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from matplotlib.figure import Figure   # no pyplot: the report must not switch a notebook's backend

from . import plots
from .compare import CompareResult
from .result import summary, to_json


class _Plt:
    """Just enough of pyplot.subplots, on standalone Figures."""

    @staticmethod
    def subplots(figsize):
        fig = Figure(figsize=figsize)
        return fig, fig.add_subplot()


plt = _Plt()


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def figures(res: CompareResult) -> list[tuple[str, str]]:
    fd = res.first_divergence
    out = []
    fig, ax = plt.subplots(figsize=(8, 3.5))
    plots.heatmap(res, ax, "resid")
    out.append(("Hidden-state (resid) error, layer x token", _png(fig)))
    if fd and fd["site"] != "resid":
        fig, ax = plt.subplots(figsize=(8, 3.5))
        plots.heatmap(res, ax, fd["site"])
        out.append((f"Error of the first divergent site '{fd['site']}'", _png(fig)))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    plots.layer_curve(res, ax, token=fd["token"] if fd else None, site="resid")
    out.append(("Per-layer divergence curve", _png(fig)))
    fig, ax = plt.subplots(figsize=(8, 3))
    plots.logits_curve(res, ax)
    out.append(("Logits", _png(fig)))
    if fd and fd["layer"] is not None and (("dev", fd["layer"], "ssm_state") in res.trace):
        fig, ax = plt.subplots(figsize=(6, 4))
        plots.state_diff(res, ax, fd["layer"], fd["token"], seq=fd["seq"])
        out.append(("SSM state difference at the first divergence", _png(fig)))
    return out


def write_report(res: CompareResult, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = to_json(res)
    imgs = "\n".join(f"<h2>{html.escape(t)}</h2><img src='data:image/png;base64,{b}'>" for t, b in figures(res))
    gen = res.generations
    texts = ""
    if gen:
        for s in range(len(gen["prompt"])):
            texts += (f"<tr><td>{s}</td><td>{html.escape(gen['prompt'][s])}</td><td>{html.escape(gen['reference'][s])}"
                      f"</td><td>{html.escape(gen['device'][s])}</td><td>{gen['first_difference'][s]}</td></tr>")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>mamba-debug report</title>
<style>body{{font-family:sans-serif;max-width:1000px;margin:auto}} pre{{background:#f4f4f4;padding:8px;
white-space:pre-wrap}} td{{border-top:1px solid #ccc;padding:4px;vertical-align:top}}</style></head><body>
<h1>mamba-debug: {'DIVERGED' if res.first_divergence else 'no divergence'}</h1>
<pre>{html.escape(summary(res))}</pre>
<h2>Generations</h2><table><tr><th>seq</th><th>prompt</th><th>reference</th><th>device (free-running)</th>
<th>first differing token</th></tr>{texts}</table>
{imgs}
<h2>First divergence (JSON)</h2><pre>{html.escape(json.dumps(data['first_divergence'], indent=1))}</pre>
</body></html>"""
    path.write_text(page)
    return path
