"""The two generations side by side: the reference's continuation and the device's free-running one (HTML)."""
from __future__ import annotations

import html
from typing import Callable, Optional

from ..trace import CompareResult
from .base import View, ViewState

CHIP = "border:1px solid #ccc;border-radius:3px;padding:0 2px;margin:1px;display:inline-block"


def generations_html(res: CompareResult, decode: Callable[[list], str], seq: int = 0) -> str:
    """Reference and device continuations token by token, the first differing token highlighted."""
    g = res.generations
    if not g:
        return "<i>no generations (n_gen = 0)</i>"
    ref_ids, dev_ids = g["reference_ids"][seq], g["device_ids"][seq]
    first = g["first_difference"][seq]

    def row(ids, side):
        out = []
        for i, t in enumerate(ids):
            text = html.escape(decode([t])).replace(" ", "&nbsp;") or "&#9251;"
            style = CHIP
            if first is not None and i == first:
                style += ";background:#ffb3b3;font-weight:bold"
            elif first is not None and i > first and side == "device":
                style += ";color:#888"
            out.append(f"<span title='generated token {i} (id {t})' style='{style}'>{text}</span>")
        return "".join(out) or "<i>(none)</i>"

    prompt = html.escape(g["prompt"][seq][-160:])
    same = ("<span style='color:green'>identical</span>" if first is None else
            f"<span style='color:#c00'>first differing generated token: {first}</span>")
    device = html.escape(res.sides["device"].label)
    return (f"<div style='font-family:sans-serif;font-size:12px;line-height:1.4'>"
            f"<div style='color:#555'>prompt (seq {seq}): &hellip;{prompt}</div>"
            f"<table style='border-collapse:collapse;width:100%;margin-top:4px'><tr>"
            f"<th style='text-align:left;width:50%'>reference ({_ref_where(res)})</th>"
            f"<th style='text-align:left' title='{device}'>device (free-running)</th></tr>"
            f"<tr><td style='vertical-align:top'>{row(ref_ids, 'reference')}</td>"
            f"<td style='vertical-align:top'>{row(dev_ids, 'device')}</td></tr></table>{same}"
            f"<div style='color:#888;font-size:10px'>{device}</div></div>")


def generations_table(res: CompareResult) -> str:
    """Every sequence's prompt and the two continuations as text (the report: no tokenizer at hand)."""
    g = res.generations
    rows = ""
    for s in range(len(g.get("prompt", ()))):
        rows += (f"<tr><td>{s}</td><td>{html.escape(g['prompt'][s])}</td><td>{html.escape(g['reference'][s])}"
                 f"</td><td>{html.escape(g['device'][s])}</td><td>{g['first_difference'][s]}</td></tr>")
    return ("<table><tr><th>seq</th><th>prompt</th><th>reference</th><th>device (free-running)</th>"
            f"<th>first differing token</th></tr>{rows}</table>")


def _ref_where(res: CompareResult) -> str:
    return "CPU" if res.settings.ref_device == "cpu" else f"torch ops on {res.settings.ref_device}"


class GenerationsView(View):
    name = "generations"
    title = "Generations"
    depends = frozenset({"seq"})
    width = "half"
    kind = "html"

    def html(self, res: CompareResult, state: ViewState, decode: Optional[Callable[[list], str]] = None) -> str:
        """Token chips of one sequence when a tokenizer's `decode` is given (the dashboard), else the text table."""
        return generations_html(res, decode, state.seq) if decode is not None else generations_table(res)

    def draw(self, fig, res: CompareResult, state: ViewState):
        raise TypeError("the generations view is HTML: call .html(res, state, decode)")


VIEW = GenerationsView()
