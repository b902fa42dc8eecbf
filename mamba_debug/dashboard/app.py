"""The notebook dashboard: one model and prompt(s), every view of the registry, driven by widgets.

Three layers stay apart:

* **state** (`dashboard.state`) - a `DashState` is (prompt, `RunSettings`, `ViewState`); `RunCache` keeps one
  `CompareResult` per (prompt ids, settings) and the reference side shared between runs, so returning to a seen
  configuration redraws at once.
* **views** (`mamba_debug.views`) - pure: (figure, result, view state) in, pixels out; the registry says which
  `ViewState` fields each view reads.
* **callbacks** (here) - `Dashboard` reads every widget into a new `DashState`, compares it with the current one and
  does the least work: new run settings run (or fetch) a comparison and redraw everything, a new view state redraws
  the views that depend on what changed. Every callback is guarded: an exception goes to the error area at the top
  of the dashboard (and `Dashboard.errors`), never into the void of a widget callback.

Figures are rendered to PNG and shown in image widgets, which works with the plain inline backend and in any
frontend; each is redrawn over a kept layer of its axes' numbers (`views.blit`: the pixels of a full draw). ipympl is
not required; when it is installed the sweep matrix is also clickable (a click jumps to that configuration); the
"jump to" dropdown does the same everywhere.

    import mamba_debug as md
    dash = md.Dashboard(model, "It is a truth universally acknowledged", kernels="bug_strided_gate")
    dash.widget                      # show it
    dash.set(offload=6, ubatch=8)    # or move the sliders
    dash.set(engine="llama.cpp")     # the device side: a llama.cpp library, traced (default torch)
    dash.timings                     # {'first_view_ms': ..., 'redraw_ms': ..., 'run_ms': ..., 'source': 'run', ...}
"""
from __future__ import annotations

import contextlib
import html
import re
import time
import traceback
from collections import OrderedDict
from typing import Optional, Sequence, Union

from ..settings import RunSettings, whole_ubatch
from ..errors import MambaDebugError
from ..trace import CompareResult, require_result
from ..views import registry
from ..views.base import DPI, FIELDS, ViewState, live_figure
from ..views.blit import StaticLayer
from ..views.summary import verdict
from .controls import (Controls, error_html, in_kernel, llama_cpp_unavailable_html, snapshot_html, status_html,
                       timing_html)
from .state import (DashState, Prompt, RunCache, check_args, check_value, dashboard_settings, encode_prompts,
                    engine_settings, llama_cpp_problem)
from .sweep_panel import SweepPanel, guarded

PNG_CACHE_SIZE = 256                         # rendered views kept (about 50-200 kB each)
PNG_COMPRESS = 1        # zlib level of the views' PNGs: a third of the encoding time of the default, ~10% larger
RUN_DELAY_S = 0.6       # in a notebook, a run starts this long after the offload / ubatch slider last moved


_guarded = guarded


class Dashboard(SweepPanel):
    """Widgets over `run_compare` for one model and prompt(s). See the module docstring.

    model: a Model (`md.load_model()`). prompt: text, token ids, or a list of texts (a prompt dropdown).
    offload: None = everything on the device (n_layer + 1). ubatch: None = the whole prompt in one ubatch.
    sweep_offloads / sweep_ubatches: the grid of `run_sweep_matrix` (defaults: 0, n/2, n, n+1 x 1, 8, P).
    result: CompareResult(s) already computed for this model and prompt: cached, the last one shown first.
    sweep: a `run_sweep` result for this prompt: its cells fill the sweep matrix.
    autorun: compute the first configuration now (else at the first change or `refresh()`).
    engine: the device side: "torch" (the kernels control's Triton kernels or plug-in) or "llama.cpp" (a llama.cpp
    library traced: `llama_lib`, else LLAMA_CPP_LIB_PATH, else llama-cpp-python's; on `llama_device`, cpu: -ngl 0).
    """

    def __init__(self, model, prompt: Prompt, *, kernels: str = "triton", device: Optional[str] = None,
                 offload: Optional[int] = None, ubatch: Optional[int] = None, n_gen: int = 4, n_seqs: int = 1,
                 reference: str = "float32", rule: str = "llama2024", sweep_offloads: Optional[Sequence[int]] = None,
                 sweep_ubatches: Optional[Sequence[int]] = None,
                 result: Union[CompareResult, Sequence[CompareResult], None] = None, sweep: Optional[dict] = None,
                 autorun: bool = True, max_cached_runs: int = 32, dpi: int = DPI, engine: str = "torch",
                 llama_lib: Optional[str] = None, llama_device: str = "cpu"):
        check_args(offload, ubatch, n_seqs, dpi, max_cached_runs, engine)
        self.model = model
        self.n_layer = model.config.n_layer
        self.prompts, self.prompt_ids = encode_prompts(model, prompt)
        self.cache = RunCache(max_cached_runs)
        self._failed: dict = {}          # (prompt ids, settings) -> the exception it raised (shown again, not re-run)
        self.state: Optional[DashState] = None
        self.result: Optional[CompareResult] = None
        self.errors: list[dict] = []
        self.timings: dict = {}
        self.images: dict[str, bytes] = {}
        self.view_data: dict = {}
        self._pngs: OrderedDict = OrderedDict()   # rendered views, by view, run and the view fields it reads
        self.dpi = dpi
        self._holding = False
        # what every run of this dashboard shares; the widgets set offload, ubatch and kernels
        self._base = RunSettings(n_gen=n_gen, n_seqs=n_seqs, device=device, reference=reference, rule=rule,
                                 llama_lib=llama_lib)
        self._llama_device = llama_device
        P = self._n_prompt = max(len(ids) for ids in self.prompt_ids)
        self.sweep_offloads = list(sweep_offloads) if sweep_offloads is not None else \
            sorted({0, self.n_layer // 2, self.n_layer, self.n_layer + 1})
        top = whole_ubatch(P, n_seqs)
        self.sweep_ubatches = list(sweep_ubatches) if sweep_ubatches is not None else sorted({1, min(8, top), top})
        self.sweep: dict = {"offloads": [], "ubatches": [], "cells": [], "kernels": kernels}
        self._sweep_cells: dict[tuple, dict] = {}     # (kernels or llama.cpp, prompt, offload, ubatch) -> cell
        self.views = {v.name: v for v in registry.VIEWS}
        # no pyplot: figures never leak into cell output; each keeps its Agg canvas (one renderer across redraws)
        self._figs = {v.name: live_figure(v.figsize, dpi if v.kind == "figure" else None)
                      for v in registry.VIEWS if v.kind in ("figure", "sweep")}
        # each figure view's axes numbers, drawn once and reused while they stay the same (views.blit)
        self._layers = {v.name: StaticLayer() for v in registry.VIEWS if v.kind == "figure"}
        self._sweep_layer = StaticLayer()         # the sweep matrix as a PNG (without ipympl)
        self.controls = Controls(model.config, self.prompts, P, kernels=kernels, offload=offload, ubatch=ubatch or top,
                                 n_seqs=n_seqs, n_gen=n_gen, figures=self._figs, engine=engine)
        for name, w in vars(self.controls).items():     # the widgets are the dashboard's: dash.w_offload, ...
            if name.startswith("w_"):
                setattr(self, name, w)
        self.out, self.widget = self.controls.out, self.controls.widget
        self._sweep_canvas = self.controls.sweep_canvas
        for w in self.controls.value_widgets().values():
            w.observe(self._on_widget, names="value")
        self.w_first.on_click(lambda _b: self.goto_first_divergence())
        self.w_tok_prev.on_click(lambda _b: self.step("token", -1))
        self.w_tok_next.on_click(lambda _b: self.step("token", +1))
        self.w_off_minus.on_click(lambda _b: self.step("offload", -1))
        self.w_off_plus.on_click(lambda _b: self.step("offload", +1))
        self.w_ub_minus.on_click(lambda _b: self.step("ubatch", -1))
        self.w_ub_plus.on_click(lambda _b: self.step("ubatch", +1))
        self._pending = None            # a run scheduled by a slider move (RUN_DELAY_S)
        self._snapshot = None           # the static picture under the widgets (a DisplayHandle), once displayed
        self.w_sweep_btn.on_click(lambda _b: self.run_sweep_matrix())
        self.w_jump.observe(self._on_jump, names="value")
        for res in ([result] if isinstance(result, CompareResult) else list(result or [])):
            self._seed(res)             # the last one is shown first
        if sweep is not None:
            self._seed_sweep(sweep)
        if autorun:
            self.refresh()

    # -- setup ---------------------------------------------------------------------------------------
    def _seed(self, res: CompareResult):
        """Put a result computed outside the dashboard into the cache (it must be for one of our prompts)."""
        require_result(res, "Dashboard(result=...)")
        prompt = next((i for i, ids in enumerate(self.prompt_ids)
                       if res.tokens[0, :res.n_prompt].tolist() == ids), None)
        if prompt is None:
            raise MambaDebugError("result= was computed for another prompt than this dashboard's")
        mine = self.model.config.to_dict()          # the shipped models share a tokenizer: the prompt can match
        other = sorted(k for k in mine if k in res.model_info and res.model_info[k] != mine[k])
        if other:
            k = other[0]
            raise MambaDebugError(f"result= was computed with another model ({k} {res.model_info[k]!r} against this "
                                  f"dashboard's {mine[k]!r}); give a result of the dashboard's model")
        key = dashboard_settings(res.settings, res.n_prompt)
        self.cache.put(self.prompt_ids[prompt], key, res)
        llama = key.engine == "llama.cpp"
        self._base = key.replace(offload=None, ubatch=self._base.ubatch, kernels=self._base.kernels, engine="torch",
                                 device=self._base.device if llama else key.device,
                                 llama_lib=key.llama_lib if llama else self._base.llama_lib)
        if llama:
            self._llama_device = key.device
        with self._hold():
            self.w_ubatch.max = whole_ubatch(self._n_prompt, key.n_seqs)     # before its value: a slider clamps
            self.w_prompt.value, self.w_offload.value, self.w_ubatch.value = prompt, key.offload, key.ubatch
            self.w_engine.value = key.engine
            if not llama:
                if key.kernels not in self.w_kernels.options:
                    self.w_kernels.options = list(self.w_kernels.options) + [key.kernels]
                self.w_kernels.value = key.kernels
            self.w_seq.options = list(range(key.n_seqs))
        self.controls.show_engine(key.engine)
        self._add_cell(prompt, key, res)

    # -- public API ------------------------------------------------------------------------------------
    def set(self, **values):
        """Set widget values (offload, ubatch, engine, kernels, prompt, token, site, metric, seq, layer) and update
        once: `dash.set(offload=6, ubatch=8)` runs one comparison, not two."""
        widgets = self.controls.value_widgets()
        unknown = set(values) - set(widgets)
        if unknown:
            raise MambaDebugError(f"unknown dashboard control(s) {sorted(unknown)}; known: {sorted(widgets)}")
        for name, value in values.items():          # all checked before any is set: a slider clamps silently
            check_value(name, widgets[name], value)
        with self._hold():
            for name, value in values.items():
                w = widgets[name]
                if name == "kernels" and value not in w.options:
                    w.options = list(w.options) + [value]
                w.value = value
        self._update()
        return self

    def refresh(self):
        """Apply the current widget values (runs the comparison if it is not cached; a configuration that
        failed before is tried again)."""
        self._failed.clear()
        self._update(force=self.state is None)
        return self

    def goto_first_divergence(self):
        """Point token, layer, sequence and site at the current run's first divergence."""
        self._goto_first()

    def run_sweep_matrix(self, offloads: Optional[Sequence[int]] = None, ubatches: Optional[Sequence[int]] = None):
        """Fill the offload x ubatch matrix for the current kernels and prompt (metrics only, shared reference)."""
        self._run_sweep(offloads, ubatches)
        return self.sweep

    def step(self, name: str, delta: int):
        """What the step buttons do: move a slider (token, offload, ubatch, layer) by `delta`, within its range."""
        w = self.controls.value_widgets()[name]
        value = min(max(w.value + delta, w.min), w.max)
        if value != w.value:
            self.set(**{name: value})
        return self

    def jump_to(self, offload: int, ubatch: int):
        """What a click on a sweep cell does: show that configuration (from the cache when it was seen)."""
        return self.set(offload=int(offload), ubatch=int(ubatch))

    def clear_errors(self):
        self.w_error.value = ""
        self.w_error.layout.display = "none"

    @property
    def error_text(self) -> str:
        """The error area as plain text ('' when empty)."""
        return html.unescape(re.sub(r"<[^>]+>", " ", self.w_error.value)).strip()

    def _ipython_display_(self):
        """The widgets, and under them a static picture of the views (hidden while the widgets live; what a saved
        notebook shows without a kernel), kept up to date as the views change."""
        from IPython.display import HTML, display  # noqa: PLC0415
        display(self.widget)
        self._snapshot = display(HTML(self._snapshot_html()), display_id=True)

    def _snapshot_html(self) -> str:
        return snapshot_html(self.images, self.controls.widths, self._status_html())

    # -- internals: state ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _hold(self):
        """Change widgets without each change triggering an update."""
        was, self._holding = self._holding, True
        try:
            yield
        finally:
            self._holding = was

    def _read_state(self) -> DashState:
        run = engine_settings(self._base.replace(offload=self.w_offload.value, ubatch=self.w_ubatch.value),
                              self.w_engine.value, self.w_kernels.value, self._llama_device)
        fields = {f: w.value for f, w in self.controls.field_widgets.items()}
        fields["seq"] = fields["seq"] or 0
        return DashState(self.w_prompt.value, run, ViewState(**fields))

    def _ids(self, st: DashState) -> list:
        return self.prompt_ids[st.prompt]

    # -- internals: callbacks --------------------------------------------------------------------------
    def _on_widget(self, change):
        if self._holding:
            return
        if change["owner"] in (self.w_offload, self.w_ubatch) and in_kernel():
            self._schedule_update()       # arrow keys held on a slider: one run, when they stop
        else:
            self._update()

    def _schedule_update(self):
        import asyncio  # noqa: PLC0415
        if self._pending is not None:
            self._pending.cancel()
        self.w_timing.value = (f"<span style='font-size:11px;color:#a60'>offload {self.w_offload.value}, ubatch "
                               f"{self.w_ubatch.value}: runs when the slider rests</span>")
        self._pending = asyncio.get_event_loop().call_later(RUN_DELAY_S, self._run_pending)

    def _run_pending(self):
        self._pending = None
        self._update()

    @_guarded
    def _update(self, force: bool = False):
        """The one update path: diff the widgets' state with what is on screen and do the least work."""
        self.controls.show_engine(self.w_engine.value)
        if self.cache.follow(self.model):       # weights edited since the cached runs: none of them holds
            self._pngs.clear()
            self._failed.clear()
            self._sweep_cells.clear()
            self._rebuild_sweep()
            force = True
        new = self._read_state()
        old = self.state
        t0 = time.perf_counter()
        if force or old is None or (new.prompt, new.run) != (old.prompt, old.run) or self.result is None:
            res, source, run_ms = self._get_result(new)
            if res is None:
                return
            self.result = res
            new = self._fit_view(res)
            self.state = new
            self._add_cell(new.prompt, new.run, res)
            self._redraw(set(self.views), new, t0)
            self._set_timings(t0, source, run_ms, "all")
        elif new.view != old.view:
            changed = {f for f in FIELDS if getattr(new.view, f) != getattr(old.view, f)}
            views = {v.name for v in registry.depending_on(changed)}
            self.state = new
            self._redraw(views, new, t0)
            self._set_timings(t0, "view", 0.0, ",".join(sorted(views)))
        self.clear_errors()       # this action succeeded: the area shows errors of the latest action only

    def _get_result(self, st: DashState):
        ids = self._ids(st)
        res = self.cache.get(ids, st.run)
        if res is not None:
            return res, "cache", 0.0
        key = self.cache.key(ids, st.run)
        if key in self._failed:
            raise self._failed[key]
        if st.run.engine == "llama.cpp":
            problem = llama_cpp_problem(st.run.llama_lib, st.run.device)
            if problem is not None:
                self._llama_unavailable(problem)
                return None, "run", 0.0
        t = time.perf_counter()
        try:
            res = self.cache.compute(self.model, ids, st.run, progress=self._progress(st))
        except Exception as exc:
            self._failed[key] = exc
            raise
        ms = (time.perf_counter() - t) * 1e3
        return res, "same" if "same_run_as" in res.timings else "run", ms

    def _progress(self, st: DashState):
        bar = self.w_progress
        bar.layout.visibility = "visible"
        bar.value, bar.bar_style = 0, "info"
        self.w_status.value = f"<b>running</b> {html.escape(st.label())} ..."

        def update(done, total):
            bar.max = total
            bar.value = done
            bar.description = f"{done}/{total} ub"
            if done >= total:
                bar.layout.visibility = "hidden"
        return update

    def _fit_view(self, res: CompareResult) -> DashState:
        """Fit the view controls to a (new) result: token range, sequences; first time: the first divergence."""
        n_tok = res.tokens.shape[1]
        first_time = self.state is None
        with self._hold():
            self.w_token.max = n_tok - 1
            if self.w_token.value > n_tok - 1:
                self.w_token.value = n_tok - 1
            if list(self.w_seq.options) != list(range(res.settings.n_seqs)):
                self.w_seq.options = list(range(res.settings.n_seqs))
                self.w_seq.value = 0
            fd = res.first_divergence
            if first_time:
                self.w_token.value = fd["token"] if fd else n_tok - 1
                if fd and fd["layer"] is not None:
                    self.w_layer.value = fd["layer"]
        return self._read_state()

    @_guarded
    def _goto_first(self):
        fd = self.result.first_divergence if self.result is not None else None
        if fd is None:
            self.w_status.value += " <i>(nothing diverged: no first divergence to go to)</i>"
            return
        values = {"token": fd["token"], "seq": fd["seq"], "site": fd["site"]}
        if fd["layer"] is not None:
            values["layer"] = fd["layer"]
        self.set(**values)

    # -- internals: drawing ----------------------------------------------------------------------------
    def _redraw(self, names: set, st: DashState, t0: Optional[float] = None):
        """Draw the views (a PNG already rendered for this run and view state is shown again as it is).

        Each view reaches the page as soon as it is drawn (a widget value), so the order is what the user waits
        for: the status line and the text views first (a few ms), then the figures in screen order. t0: when the
        action began; `first_view_ms` is when its first picture was on the page."""
        res, v = self.result, st.view
        if t0 is not None:
            self.timings.pop("first_view_ms", None)
        self.w_status.value = self._status_html()
        for view in sorted(registry.VIEWS, key=lambda view: view.kind != "html"):
            if view.name not in names:
                continue
            if view.kind == "figure":
                key = (view.name, st.prompt, st.run, tuple(getattr(v, f) for f in sorted(view.depends)))
                hit = self._pngs.get(key)
                if hit is None:
                    fig = self._figs[view.name]
                    data = self.views[view.name].draw(fig, res, v)
                    hit = (self._layers[view.name].png(fig, compress_level=PNG_COMPRESS), data)
                    self._remember(key, hit)
                png, self.view_data[view.name] = hit
                self._show(view.name, png)
                if t0 is not None and "first_view_ms" not in self.timings:
                    self.timings["first_view_ms"] = (time.perf_counter() - t0) * 1e3
            elif view.kind == "html":
                self.controls.html[view.name].value = self.views[view.name].html(res, v, self.model.decode)
            elif view.kind == "sweep":
                self._redraw_sweep(view, (st.run.offload, st.run.ubatch))
        if self._snapshot is not None:
            from IPython.display import HTML  # noqa: PLC0415
            self._snapshot.update(HTML(self._snapshot_html()))

    def _remember(self, key, value):
        self._pngs[key] = value
        while len(self._pngs) > PNG_CACHE_SIZE:
            self._pngs.popitem(last=False)

    def _show(self, name: str, png: bytes):
        if self.images.get(name) is png:
            return                    # already on screen
        self.images[name] = png
        self.controls.show_png(name, png)

    def _status_html(self) -> str:
        return status_html(self.result, verdict(self.result) if self.result is not None else "")

    def _set_timings(self, t0: float, source: str, run_ms: float, views: str):
        total = (time.perf_counter() - t0) * 1e3
        first = self.timings.setdefault("first_view_ms", total)     # no figure among the views: all at the end
        self.timings.update({"update_ms": total, "run_ms": run_ms, "redraw_ms": total - run_ms,
                             "source": source, "views": views})
        if source == "run":
            self.timings["last_run_ms"] = run_ms
        self.w_timing.value = timing_html(source, run_ms, total, views, len(self.cache), first)

    def _llama_unavailable(self, problem: str):
        """Engine llama.cpp chosen, no library loads: say so (no traceback), run nothing, fall back to nothing."""
        self.errors.append({"where": "engine llama.cpp", "type": "LlamaCppUnavailable", "message": problem,
                            "traceback": ""})
        self.w_progress.layout.visibility = "hidden"
        self.w_error.value = llama_cpp_unavailable_html(problem)
        self.w_error.layout.display = ""
        note = ("<div style='font-size:11px;color:#c60'>engine llama.cpp: no library loads; the views still show "
                "the last run above</div>")
        self.w_status.value = (self._status_html() if self.result is not None else "<i>no run yet</i>") + note

    def _report_error(self, where: str, exc: BaseException):
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.errors.append({"where": where, "type": type(exc).__name__, "message": str(exc), "traceback": tb})
        self.w_progress.layout.visibility = "hidden"
        self.w_error.value = error_html(where, exc, tb)
        self.w_error.layout.display = ""
        if self.result is not None:
            self.w_status.value = self._status_html() + (
                "<div style='font-size:11px;color:#c00'>the views still show the last good run</div>")
        else:
            self.w_status.value = "<i>no run yet</i>"
