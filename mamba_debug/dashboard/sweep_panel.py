"""The dashboard's sweep matrix: cells from sweeps and from every full run seen, the "jump to" dropdown, clicks on
the matrix (with ipympl). A mixin of `Dashboard` (dashboard.app), which owns the state these methods read.

Cells are kept per device side (`cell_key`: the kernels of engine torch, or "llama.cpp"), prompt, offload and ubatch.
"""
from __future__ import annotations

import functools
import time
from typing import Optional

from ..gc_scope import young_only
from ..settings import RunSettings, whole_ubatch
from ..sweep import run_sweep, sweep_cell
from ..trace import CompareResult


def cell_key(run: RunSettings) -> str:
    """Which matrix a run's cell belongs to: its kernels (engine torch) or llama.cpp."""
    return "llama.cpp" if run.engine == "llama.cpp" else run.kernels


def sweep_key(sweep: dict) -> str:
    return "llama.cpp" if sweep.get("engine") == "llama.cpp" else sweep["kernels"]


def guarded(fn):
    """Run a callback; an exception goes to the dashboard's error area instead of vanishing. While it runs, no full
    garbage collection walks the old heap (gc_scope: ~150 ms each, one in most updates otherwise)."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            with young_only():
                return fn(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - shown to the user, kept in self.errors
            self._report_error(fn.__name__, exc)
            return None
    return wrapper


class SweepPanel:
    """The sweep matrix's part of `Dashboard`."""

    def _seed_sweep(self, sweep: dict):
        prompt = self.w_prompt.value
        top = whole_ubatch(len(self.prompt_ids[prompt]), self._base.n_seqs)
        for cell in sweep["cells"]:
            if cell.get("n_seqs", self._base.n_seqs) == self._base.n_seqs:
                ub = min(cell["ubatch"], top)
                self._sweep_cells[(sweep_key(sweep), prompt, cell["offload"], ub)] = dict(cell, ubatch=ub)
        self._rebuild_sweep()

    @guarded
    def _on_jump(self, change):
        if change["new"] is None or self._holding:
            return
        offload, ubatch = change["new"]
        with self._hold():
            self.w_jump.value = None
        self.jump_to(offload, ubatch)

    def _on_sweep_click(self, event):
        try:
            if event.inaxes is None or not self.sweep["cells"]:
                return
            j, i = int(round(event.xdata)), int(round(event.ydata))
            if 0 <= i < len(self.sweep["offloads"]) and 0 <= j < len(self.sweep["ubatches"]):
                self.jump_to(self.sweep["offloads"][i], self.sweep["ubatches"][j])
        except Exception as exc:  # noqa: BLE001
            self._report_error("sweep click", exc)

    @guarded
    def _run_sweep(self, offloads=None, ubatches=None):
        """Metrics-only runs over the grid, one run_sweep per ubatch (the reference is shared per ubatch)."""
        st = self.state or self._read_state()
        offloads = list(offloads) if offloads is not None else self.sweep_offloads
        ubatches = list(ubatches) if ubatches is not None else self.sweep_ubatches
        ids = self._ids(st)
        top = whole_ubatch(len(ids), st.run.n_seqs)
        ubatches = [u for u in ubatches if 1 <= u <= top] or [top]
        base = st.run.replace(capture="metrics")
        bar = self.w_progress
        bar.layout.visibility, bar.max, bar.value, bar.bar_style = "visible", len(ubatches), 0, "warning"
        t0 = time.perf_counter()
        try:
            for n, u in enumerate(ubatches):
                bar.description = f"sweep {n}/{len(ubatches)}"
                self.w_status.value = f"<b>sweep</b> ubatch {u}: offloads {offloads} ..."
                sw = run_sweep(self.model, ids, base, offloads=offloads, ubatches=[u], n_seqs_list=[st.run.n_seqs],
                               progress=False)
                for cell in sw["cells"]:
                    self._sweep_cells[(cell_key(st.run), st.prompt, cell["offload"], cell["ubatch"])] = cell
                bar.value = n + 1
        finally:
            bar.layout.visibility = "hidden"
            self.w_status.value = self._status_html()
        self._rebuild_sweep()
        self._redraw({"sweep"}, self.state or st)
        self.timings["sweep_ms"] = (time.perf_counter() - t0) * 1e3

    def _add_cell(self, prompt: int, run: RunSettings, res: CompareResult):
        self._sweep_cells[(cell_key(run), prompt, run.offload, run.ubatch)] = dict(sweep_cell(res), ubatch=run.ubatch)
        self._rebuild_sweep(prompt, run)

    def _rebuild_sweep(self, prompt: Optional[int] = None, run: Optional[RunSettings] = None):
        """The matrix for the current engine / kernels and prompt: sweep cells plus every full run seen so far."""
        if run is None:
            st = self.state or self._read_state()
            prompt, run = st.prompt, st.run
        cells = [c for (k, p, _o, _u), c in self._sweep_cells.items() if k == cell_key(run) and p == prompt]
        self.sweep = {"offloads": sorted({c["offload"] for c in cells}), "ubatches": sorted({c["ubatch"] for c in cells}),
                      "cells": cells, "kernels": cell_key(run)}
        opts = [("jump to a configuration...", None)]
        for c in sorted(cells, key=lambda c: (c["offload"], c["ubatch"])):
            fd = c["first_divergence"]
            what = "ok" if fd is None else f"diverges t{fd['token']} L{'head' if fd['layer'] is None else fd['layer']}"
            seen = " (cached)" if self.cache.has(self.prompt_ids[prompt], run.replace(
                offload=c["offload"], ubatch=c["ubatch"])) else ""
            opts.append((f"offload {c['offload']}, ubatch {c['ubatch']}: {what}{seen}", (c["offload"], c["ubatch"])))
        with self._hold():
            self.w_jump.options = opts
            self.w_jump.value = None

    def _redraw_sweep(self, view, current: tuple):
        fig = self._figs[view.name]
        if self._sweep_canvas is not None:
            self.views[view.name].draw(fig, self.sweep, None, current)
            self._sweep_canvas.draw_idle()
            if not getattr(self, "_click_cid", None):
                self._click_cid = fig.canvas.mpl_connect("button_press_event", self._on_sweep_click)
            return
        cells = tuple(sorted((c["offload"], c["ubatch"], c["first_token"], c["first_layer"])
                             for c in self.sweep["cells"]))
        key = (view.name, self.sweep.get("kernels"), cells, current)
        hit = self._pngs.get(key)
        if hit is None:
            if fig.dpi != self.dpi:           # a PNG (no interactive canvas): drawn at its own dpi (views.blit)
                fig.set_dpi(self.dpi)
            self.views[view.name].draw(fig, self.sweep, None, current)
            hit = (self._sweep_layer.png(fig, compress_level=1), None)
            self._remember(key, hit)
        self._show(view.name, hit[0])
