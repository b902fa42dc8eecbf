"""The README's figures, drawn by the current code from the shipped tiny model: `python docs/figures/make_figures.py`.

The #6758 variant (`bug_strided_gate`) at offload 6, ubatch 8 (the README's headline run): the heatmap of error /
threshold, the per-layer curve at the first divergence, the state inspector one layer on, and a small sweep
matrix. About half a minute on a 2-core CPU (Triton interpreted).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))        # this checkout's mamba_debug, installed or not
os.environ.setdefault("TRITON_INTERPRET", "1")

import mamba_debug as md  # noqa: E402
from mamba_debug.views import registry  # noqa: E402
from mamba_debug.views.base import REPORT_DPI, ViewState, fig_png, new_figure  # noqa: E402

PROMPT = "It was a fine morning in the country, and Mr. Darcy walked"


def save(view_name: str, data, state, name: str, **kw):
    view = registry.get(view_name)
    fig = new_figure(view.figsize)
    view.draw(fig, data, state, **kw)
    (HERE / name).write_bytes(fig_png(fig, dpi=REPORT_DPI))
    print("wrote", HERE / name)


def main():
    model = md.load_model()
    ids = model.encode(PROMPT)
    settings = md.RunSettings(kernels="bug_strided_gate", offload=6, ubatch=8, n_gen=8)
    res = md.run_compare(model, ids, settings)
    fd = res.first_divergence
    save("heatmap", res, ViewState(site="resid"), "heatmap.png")
    save("curve", res, ViewState(token=fd["token"], site="gate"), "curve.png")
    save("states", res, ViewState(token=fd["token"], layer=fd["layer"] + 1), "states.png")
    sweep = md.run_sweep(model, ids, settings.replace(capture="metrics"), offloads=[0, 6, 12, 13],
                         ubatches=[1, 8, len(ids)], progress=False)
    save("sweep", sweep, None, "sweep.png", current=(6, 8))


if __name__ == "__main__":
    main()
