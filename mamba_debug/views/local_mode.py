"""The torch engine's local mode (`--local`) in words and in a table: each device layer also ran on the reference's
inputs and states, so its own error (`res.local`) stands apart from the error it inherited (the previous layer's
`resid`) and how much it grew it. The JSON's `per_layer` rows carry the same numbers."""
from __future__ import annotations

import math

from ..trace import CompareResult, nanmax


def layer_rows(res: CompareResult) -> list:
    """Per device layer with a local error: (layer, own, inherited, total, threshold), the resid site's rel. L2."""
    rows = []
    for i in (i for i in sorted(res.local) if res.placement.on_device(i)):      # host layers are the reference
        own, thr = nanmax(res.local[i]), res.thresholds.get((i, "resid"), math.nan)
        inherited = nanmax(res.errors[(i - 1, "resid")]["rel_l2"]) if i > 0 and (i - 1, "resid") in res.errors else 0.0
        total = nanmax(res.errors[(i, "resid")]["rel_l2"]) if (i, "resid") in res.errors else math.nan
        rows.append((i, own, inherited, total, thr))
    return rows


def layer_local_line(res: CompareResult):
    """One summary line: the first device layer whose own error passes its threshold (the error is born there), or
    that none does (what passed is inherited and grown); None without --local."""
    rows = layer_rows(res)
    if not rows:
        return None
    head = f"local     each device layer on the reference's inputs and states ({len(rows)} layers): "
    born = next((r for r in rows if r[1] > r[4]), None)
    if born is not None:
        i, own, inherited, _, thr = born
        return head + (f"the error is born at layer {i} (its own resid error {own:.3g}, {own / thr:.3g}x its "
                       f"threshold; it inherited {inherited:.3g})")
    worst = max(rows, key=lambda r: r[1] / r[4] if r[4] > 0 else 0.0)
    grown = [(r[3] / r[2], r[0]) for r in rows if r[2] > 0 and math.isfinite(r[3])]
    tail = f"; it grows inherited error up to {max(grown)[0]:.3g}x (layer {max(grown)[1]})" if grown else ""
    return head + (f"every one's own error within its threshold (worst layer {worst[0]}, {worst[1]:.3g}, "
                   f"{worst[1] / worst[4]:.3g}x){tail}")


def layer_local_table(res: CompareResult) -> tuple:
    """The report's section: own, inherited and total error of each device layer, and the growth."""
    rows = layer_rows(res)
    if not rows:
        return ()
    cells = "".join(f"<tr><td>{i}</td><td>{own:.3g}</td><td>{own / thr:.3g}</td><td>{inh:.3g}</td><td>{tot:.3g}</td>"
                    f"<td>{f'{tot / inh:.3g}' if inh > 0 else ''}</td></tr>" for i, own, inh, tot, thr in rows)
    return (("Local mode: each device layer's own error and what it inherited",
             "<p>Each device layer also ran on the reference's inputs and states (<code>--local</code>): its own "
             "error is what it makes itself. Rel. L2 of the layer's output (<code>resid</code>), the worst token.</p>"
             "<table><tr><th>layer</th><th>own error</th><th>own / threshold</th><th>inherited</th><th>total</th>"
             f"<th>total / inherited</th></tr>{cells}</table>"),)
