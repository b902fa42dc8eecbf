"""The notebook dashboard: one model and prompt(s), every view of a comparison, driven by widgets.

Three layers stay apart (research/aesthetics-anchors.md §1.7):

* **state** - `RunKey` (what a comparison run depends on) and `ViewState` (what is looked at in a run) are
  small frozen dataclasses; `DashState` is the pair. `RunCache` keeps one `CompareResult` per `RunKey`
  and the reference side shared between runs, so returning to a seen configuration redraws at once.
* **views** - the `draw_*` functions and `generations_html` are pure: (figure, result, view state) in,
  pixels out. They draw through `mamba_debug.plots` and know nothing about widgets.
* **callbacks** - `Dashboard` reads every widget into a new `DashState`, compares it with the current one
  and does the least work: a new `RunKey` runs (or fetches) a comparison, a new `ViewState` redraws the
  views that depend on what changed. Every callback is guarded: an exception goes to the error area at the
  top of the dashboard (and `Dashboard.errors`), never into the void of a widget callback.

Figures are rendered to PNG and shown in `ipywidgets.Output` areas (clear_output + display), which works with
the plain inline backend and in any frontend. ipympl is not required; when it is installed the sweep matrix
is also clickable (a click jumps to that configuration); the "jump to" dropdown does the same everywhere.

    from mamba_debug.dashboard import Dashboard
    dash = Dashboard(model, "It is a truth universally acknowledged", kernels="bug_strided_gate")
    dash.widget                      # show it
    dash.set(offload=6, ubatch=8)    # or move the sliders
    dash.timings                     # {'redraw_ms': ..., 'run_ms': ..., 'source': 'cache' | 'run', ...}
"""
from __future__ import annotations

import contextlib
import functools
import html
import io
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence, Union

import numpy as np

from . import plots
from .compare import CompareResult, CompareSettings, run_compare
from .metrics import METRICS
from .model import MODEL_SITES, SITES, MambaModel
from .result import verdict
from .sweep import sweep_cell

try:  # optional: ipywidgets is a notebook extra (requirements-lab.txt)
    import ipywidgets as W
    from IPython.display import Image as _IPImage
    from IPython.display import display as _display
except ImportError:  # pragma: no cover - reported when a Dashboard is built
    W = None

Prompt = Union[str, Sequence[int], Sequence[str]]


# =====================================================================================================
# State
# =====================================================================================================
@dataclass(frozen=True)
class RunKey:
    """Everything one comparison run depends on: the cache key of the dashboard."""
    prompt: int            # index into the dashboard's prompts
    offload: int
    ubatch: int
    kernels: str
    n_seqs: int
    n_gen: int
    device: Optional[str]
    reference: str = "float32"
    rule: str = "llama2024"

    def settings(self, capture: str = "all") -> CompareSettings:
        return CompareSettings(offload=self.offload, ubatch=self.ubatch, n_seqs=self.n_seqs, n_gen=self.n_gen,
                               kernels=self.kernels, device=self.device, reference=self.reference, rule=self.rule,
                               capture=capture)

    def label(self) -> str:
        return f"offload {self.offload}, ubatch {self.ubatch}, kernels {self.kernels}"


@dataclass(frozen=True)
class ViewState:
    """What is looked at inside one run."""
    token: int = 0
    site: str = "resid"
    metric: str = "rel_l2"
    seq: int = 0
    layer: int = 0          # the state inspector's layer


@dataclass(frozen=True)
class DashState:
    run: RunKey
    view: ViewState


PNG_CACHE_SIZE = 256                         # rendered views kept (about 20-30 kB each)

# Which views depend on which view fields (a run change redraws everything).
VIEW_DEPENDS = {
    "curve": {"token", "site", "metric", "seq"},
    "heatmap": {"site", "metric", "seq"},        # not the token: stepping tokens stays cheap
    "states": {"token", "seq", "layer"},
    "text": {"seq"},
}


class RunCache:
    """CompareResults keyed by RunKey (least recently used dropped past `max_runs`), plus the reference
    side shared by runs that differ only in offload/kernels (run_compare's ref_cache)."""

    def __init__(self, max_runs: int = 32):
        self.max_runs = max_runs
        self.runs: "OrderedDict[RunKey, CompareResult]" = OrderedDict()
        self.ref: dict = {}

    def get(self, key: RunKey) -> Optional[CompareResult]:
        res = self.runs.get(key)
        if res is not None:
            self.runs.move_to_end(key)
        return res

    def put(self, key: RunKey, res: CompareResult):
        self.runs[key] = res
        self.runs.move_to_end(key)
        while len(self.runs) > self.max_runs:
            self.runs.popitem(last=False)

    def compute(self, model: MambaModel, prompt_ids, key: RunKey, progress=None) -> CompareResult:
        res = run_compare(model, prompt_ids, key.settings(), progress=progress, ref_cache=self.ref)
        self.put(key, res)
        return res

    def __contains__(self, key) -> bool:
        return key in self.runs

    def __len__(self) -> int:
        return len(self.runs)


# =====================================================================================================
# Views (pure: figure + result + view state in, drawing out)
# =====================================================================================================
MARGINS = dict(left=0.12, right=0.97, bottom=0.15, top=0.88, wspace=0.35)   # fixed: tight_layout costs ~0.2 s


def _fresh_axes(fig, *grid):
    """Clear the whole figure (plots.* add colorbars, which ax.clear() would leave behind) and add axes."""
    fig.clf()
    fig.subplots_adjust(**MARGINS)
    if not grid:
        return fig.add_subplot()
    return fig.subplots(*grid)


def draw_curve(fig, res: CompareResult, v: ViewState) -> np.ndarray:
    """Per-layer divergence at the chosen token; returns the values drawn (the site's metric per layer)."""
    ax = _fresh_axes(fig)
    token = min(v.token, res.tokens.shape[1] - 1)
    plots.layer_curve(res, ax, token=token, site=v.site, metric=v.metric, seq=v.seq)
    info = res.token_info[token]
    if ax.get_legend() is not None:  # the lower right is mostly the floor band; the data sits higher
        ax.legend(loc="lower right", fontsize=6, framealpha=0.8)
    if ax.get_yscale() == "log":     # a few decades labelled, no minor ticks: a third of the drawing time
        from matplotlib.ticker import LogLocator, NullLocator  # noqa: PLC0415
        ax.yaxis.set_major_locator(LogLocator(numticks=6))
        ax.yaxis.set_minor_locator(NullLocator())
    ax.set_title(f"{v.site} {v.metric} per layer at token {token} ({info.phase}, ubatch {info.ubatch}), "
                 f"seq {v.seq}", fontsize=9)
    keys = [(None, v.site)] if v.site in MODEL_SITES else [(i, v.site) for i in range(res.n_layer)]
    return np.array([float(res.errors[k][v.metric][v.seq, token]) for k in keys])


def draw_heatmap(fig, res: CompareResult, v: ViewState) -> np.ndarray:
    """Layer x token heatmap (ubatch boundaries, first divergence circled); returns the image array."""
    ax = _fresh_axes(fig)
    plots.heatmap(res, ax, site=v.site, metric=v.metric, seq=v.seq)
    return np.asarray(ax.images[0].get_array(), dtype=float) if ax.images else np.array([])


def draw_states(fig, res: CompareResult, v: ViewState) -> np.ndarray:
    """SSM state (channel x state) and conv state differences at the chosen layer and token."""
    ax_ssm, ax_conv = _fresh_axes(fig, 1, 2)
    plots.state_diff(res, ax_ssm, v.layer, v.token, "ssm_state", seq=v.seq)
    plots.state_diff(res, ax_conv, v.layer, v.token, "conv_state", seq=v.seq)
    import textwrap  # noqa: PLC0415
    for ax in (ax_ssm, ax_conv):
        ax.set_title(textwrap.fill(ax.get_title(), 60), fontsize=8)
    return np.asarray(ax_ssm.images[0].get_array(), dtype=float) if ax_ssm.images else np.array([])


def draw_sweep(fig, sweep: dict, current: Optional[tuple] = None):
    """The offload x ubatch matrix; the configuration on screen is framed."""
    ax = _fresh_axes(fig)
    if not sweep["cells"]:
        ax.text(0.5, 0.5, "no sweep yet: press 'run sweep'", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return ax
    plots.sweep_matrix(sweep, ax)
    if current and current[0] in sweep["offloads"] and current[1] in sweep["ubatches"]:
        i, j = sweep["offloads"].index(current[0]), sweep["ubatches"].index(current[1])
        ax.add_patch(_rect((j - 0.5, i - 0.5)))
    ax.set_title("first divergence per configuration (framed: on screen)", fontsize=9)
    return ax


def _rect(xy):
    from matplotlib.patches import Rectangle  # noqa: PLC0415
    return Rectangle(xy, 1, 1, fill=False, ec="red", lw=2)


def generations_html(res: CompareResult, decode: Callable[[list], str], seq: int = 0) -> str:
    """Reference and device continuations side by side, the first differing token highlighted."""
    g = res.generations
    if not g:
        return "<i>no generations (n_gen = 0)</i>"
    ref_ids, dev_ids = g["reference_ids"][seq], g["device_ids"][seq]
    first = g["first_difference"][seq]

    def row(ids, side):
        out = []
        for i, t in enumerate(ids):
            text = html.escape(decode([t])).replace(" ", "&nbsp;") or "&#9251;"
            style = "border:1px solid #ccc;border-radius:3px;padding:0 2px;margin:1px;display:inline-block"
            if first is not None and i == first:
                style += ";background:#ffb3b3;font-weight:bold"
            elif first is not None and i > first and side == "device":
                style += ";color:#888"
            out.append(f"<span title='generated token {i} (id {t})' style='{style}'>{text}</span>")
        return "".join(out) or "<i>(none)</i>"

    prompt = html.escape(g["prompt"][seq][-160:])
    same = ("<span style='color:green'>identical</span>" if first is None else
            f"<span style='color:#c00'>first differing generated token: {first}</span>")
    device = html.escape(res.device_label)
    return (f"<div style='font-family:sans-serif;font-size:12px;line-height:1.4'>"
            f"<div style='color:#555'>prompt (seq {seq}): &hellip;{prompt}</div>"
            f"<table style='border-collapse:collapse;width:100%;margin-top:4px'><tr>"
            f"<th style='text-align:left;width:50%'>reference (CPU)</th>"
            f"<th style='text-align:left' title='{device}'>device (free-running)</th></tr>"
            f"<tr><td style='vertical-align:top'>{row(ref_ids, 'reference')}</td>"
            f"<td style='vertical-align:top'>{row(dev_ids, 'device')}</td></tr></table>{same}"
            f"<div style='color:#888;font-size:10px'>{device}</div></div>")


def fig_png(fig, dpi: int = 72) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _in_kernel() -> bool:
    try:
        from IPython import get_ipython  # noqa: PLC0415
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def _has_ipympl() -> bool:
    try:
        import ipympl  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


# =====================================================================================================
# Callbacks and widgets
# =====================================================================================================
def _guarded(fn):
    """Run a callback; an exception goes to the dashboard's error area instead of vanishing."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - shown to the user, kept in self.errors
            self._report_error(fn.__name__, exc)
            return None
    return wrapper


class Dashboard:
    """Widgets over `run_compare` for one model and prompt(s). See the module docstring.

    model: a MambaModel (`md.load_model()`). prompt: text, token ids, or a list of texts (a prompt dropdown).
    offload: None = everything on the device (n_layer + 1). ubatch: None = the whole prompt in one ubatch.
    sweep_offloads / sweep_ubatches: the grid of `run_sweep_matrix` (defaults: 0, n/2, n, n+1 x 1, 8, P).
    result: CompareResult(s) already computed for this model and prompt: cached, the last one shown first.
    sweep: a `mamba_debug.sweep.run_sweep` result for this prompt: its cells fill the sweep matrix.
    autorun: compute the first configuration now (else at the first change or `refresh()`).
    """

    def __init__(self, model: MambaModel, prompt: Prompt, *, kernels: str = "triton", device: Optional[str] = None,
                 offload: Optional[int] = None, ubatch: Optional[int] = None, n_gen: int = 4, n_seqs: int = 1,
                 reference: str = "float32", rule: str = "llama2024", sweep_offloads: Optional[Sequence[int]] = None,
                 sweep_ubatches: Optional[Sequence[int]] = None,
                 result: Union[CompareResult, Sequence[CompareResult], None] = None, sweep: Optional[dict] = None,
                 autorun: bool = True, max_cached_runs: int = 32, dpi: int = 72):
        if W is None:
            raise ImportError("the dashboard needs ipywidgets: pip install -r requirements-lab.txt")
        self.model = model
        self.n_layer = model.config.n_layer
        self.prompts, self.prompt_ids = self._encode_prompts(prompt)
        self.cache = RunCache(max_cached_runs)
        self._failed: dict = {}          # RunKey -> the exception it raised (shown again, not re-run)
        self.state: Optional[DashState] = None
        self.result: Optional[CompareResult] = None
        self.errors: list[dict] = []
        self.timings: dict = {}
        self.images: dict[str, bytes] = {}
        self.view_data: dict[str, np.ndarray] = {}
        self._pngs: "OrderedDict[tuple, tuple]" = OrderedDict()   # rendered views, by run and view state
        self.dpi = dpi
        self._holding = False
        self._fixed = dict(n_gen=n_gen, n_seqs=n_seqs, device=device, reference=reference, rule=rule)
        P = max(len(ids) for ids in self.prompt_ids)
        self.sweep_offloads = list(sweep_offloads) if sweep_offloads is not None else \
            sorted({0, self.n_layer // 2, self.n_layer, self.n_layer + 1})
        self.sweep_ubatches = list(sweep_ubatches) if sweep_ubatches is not None else sorted({1, min(8, P), P})
        self.sweep: dict = {"offloads": [], "ubatches": [], "cells": [], "kernels": kernels}
        self._sweep_cells: dict[tuple, dict] = {}     # (kernels, prompt, offload, ubatch) -> cell
        self._figs = self._make_figures()
        self._build_widgets(kernels, offload, ubatch or P, n_seqs, n_gen)
        for res in ([result] if isinstance(result, CompareResult) else list(result or [])):
            self._seed(res)             # the last one is shown first
        if sweep is not None:
            self._seed_sweep(sweep)
        if autorun:
            self.refresh()

    # -- setup ---------------------------------------------------------------------------------------
    def _encode_prompts(self, prompt: Prompt):
        if isinstance(prompt, str):
            texts = [prompt]
        elif len(prompt) and all(isinstance(p, str) for p in prompt):
            texts = list(prompt)
        else:
            ids = [int(t) for t in prompt]
            return [self.model.decode(ids)[:60]], [ids]
        ids = [self.model.encode(t) for t in texts]
        for t, i in zip(texts, ids):
            if not i:
                raise ValueError(f"prompt {t!r} encodes to no tokens")
        return texts, ids

    @staticmethod
    def _make_figures() -> dict:
        from matplotlib.figure import Figure  # noqa: PLC0415 (no pyplot: figures never leak into cell output)
        return {"curve": Figure(figsize=(6.4, 3.6)), "heatmap": Figure(figsize=(6.4, 3.6)),
                "states": Figure(figsize=(9.0, 3.4)), "sweep": Figure(figsize=(5.0, 3.4))}

    def _build_widgets(self, kernels, offload, ubatch, n_seqs, n_gen):
        L = self.n_layer
        P = max(len(ids) for ids in self.prompt_ids)
        lay = W.Layout
        knames = list(dict.fromkeys(["triton", *self._kernel_names(), "torch", kernels]))
        style = {"description_width": "70px"}
        self.w_prompt = W.Dropdown(options=[(t[:50], i) for i, t in enumerate(self.prompts)], value=0,
                                   description="prompt", style=style, layout=lay(width="360px",
                                   display="" if len(self.prompts) > 1 else "none"))
        self.w_offload = W.IntSlider(value=L + 1 if offload is None else offload, min=0, max=L + 1,
                                     description="offload", continuous_update=False, style=style,
                                     tooltip="like -ngl: the last N blocks (and the head when N > n_layer) on the device")
        self.w_ubatch = W.IntSlider(value=min(ubatch, P), min=1, max=P, description="ubatch",
                                    continuous_update=False, style=style)
        self.w_kernels = W.Dropdown(options=knames, value=kernels, description="kernels", style=style)
        self.w_token = W.IntSlider(value=0, min=0, max=P + n_gen - 1, description="token", continuous_update=False,
                                   style=style)
        self.w_play = W.Play(value=0, min=0, max=P + n_gen - 1, interval=700, description="play")
        self._play_link = W.link((self.w_play, "value"), (self.w_token, "value"))
        self._play_max = W.link((self.w_token, "max"), (self.w_play, "max"))
        self.w_site = W.Dropdown(options=list(SITES), value="resid", description="site", style=style,
                                 layout=lay(width="200px"))
        self.w_metric = W.Dropdown(options=list(METRICS), value="rel_l2", description="metric", style=style,
                                   layout=lay(width="200px"))
        self.w_seq = W.Dropdown(options=list(range(n_seqs)), value=0, description="sequence", style=style,
                                layout=lay(width="160px"))
        self.w_layer = W.IntSlider(value=L - 1, min=0, max=L - 1, description="state layer",
                                   continuous_update=False, style={"description_width": "80px"})
        self.w_first = W.Button(description="go to first divergence", icon="crosshairs", layout=lay(width="200px"))
        self.w_sweep_btn = W.Button(description="run sweep", icon="th", layout=lay(width="140px"))
        self.w_jump = W.Dropdown(options=[("jump to a configuration...", None)], value=None, description="",
                                 layout=lay(width="300px"))
        self.w_progress = W.IntProgress(value=0, min=0, max=1, description="", bar_style="info",
                                        layout=lay(width="240px", visibility="hidden"))
        self.w_status = W.HTML()
        self.w_timing = W.HTML()
        self.w_error = W.HTML(layout=lay(display="none"))
        self.w_text = W.HTML()
        self.out = {name: W.Output() for name in ("curve", "heatmap", "states", "sweep")}
        # CSS classes: handles for the browser test and for anyone styling the dashboard
        for w, cls in [(self.w_offload, "md-offload"), (self.w_ubatch, "md-ubatch"), (self.w_token, "md-token"),
                       (self.w_kernels, "md-kernels"), (self.w_error, "md-error"), (self.w_status, "md-status"),
                       (self.w_text, "md-generations"), (self.w_progress, "md-progress")]:
            w.add_class(cls)
        for name, o in self.out.items():
            o.add_class(f"md-{name}")
        self._sweep_canvas = None
        if _has_ipympl():
            self._sweep_canvas = self._ipympl_canvas(self._figs["sweep"])

        for w in (self.w_prompt, self.w_offload, self.w_ubatch, self.w_kernels, self.w_token, self.w_site,
                  self.w_metric, self.w_seq, self.w_layer):
            w.observe(self._on_widget, names="value")
        self.w_first.on_click(lambda _b: self.goto_first_divergence())
        self.w_sweep_btn.on_click(lambda _b: self.run_sweep_matrix())
        self.w_jump.observe(self._on_jump, names="value")

        run_row = W.HBox([self.w_prompt, self.w_offload, self.w_ubatch, self.w_kernels])
        view_row = W.HBox([self.w_play, self.w_token, self.w_site, self.w_metric, self.w_seq])
        state_row = W.HBox([self.w_layer, self.w_first])
        header = W.HBox([self.w_status, self.w_progress, self.w_timing],
                        layout=lay(align_items="center", justify_content="space-between"))
        sweep_view = self._sweep_canvas if self._sweep_canvas is not None else self.out["sweep"]
        sweep_box = W.VBox([W.HBox([self.w_sweep_btn, self.w_jump]), sweep_view])
        self.widget = W.VBox([
            header, self.w_error, run_row, view_row,
            W.HBox([self.out["curve"], self.out["heatmap"]]),
            state_row, self.out["states"],
            W.HBox([W.VBox([W.HTML("<b>generations</b>"), self.w_text], layout=lay(width="55%")), sweep_box]),
        ])
        self.widget.add_class("md-dashboard")

    @staticmethod
    def _kernel_names() -> list:
        from .plugins import list_kernels  # noqa: PLC0415
        return list(list_kernels())

    @staticmethod
    def _ipympl_canvas(fig):
        """Give the sweep figure an ipympl canvas (a widget) so that clicks on it reach Python."""
        from ipympl.backend_nbagg import Canvas, FigureManager  # noqa: PLC0415
        canvas = Canvas(fig)
        FigureManager(canvas, 0)
        canvas.header_visible = False
        canvas.toolbar_visible = False
        return canvas

    def _seed(self, res: CompareResult):
        """Put a result computed outside the dashboard into the cache (it must be for one of our prompts)."""
        s = res.settings
        prompt = next((i for i, ids in enumerate(self.prompt_ids)
                       if res.tokens[0, :res.n_prompt].tolist() == ids), None)
        if prompt is None:
            raise ValueError("result= was computed for another prompt than this dashboard's")
        ubatch = min(s.ubatch, res.n_prompt)        # every ubatch >= P is the same schedule: one ubatch
        key = RunKey(prompt, res.placement.offload, ubatch, s.kernels, s.n_seqs, s.n_gen, s.device,
                     s.reference, s.rule)
        self.cache.put(key, res)
        with self._hold():
            self.w_prompt.value, self.w_offload.value, self.w_ubatch.value = prompt, key.offload, key.ubatch
            if key.kernels not in self.w_kernels.options:
                self.w_kernels.options = list(self.w_kernels.options) + [key.kernels]
            self.w_kernels.value = key.kernels
            self.w_seq.options = list(range(key.n_seqs))
        self._fixed.update(n_gen=key.n_gen, n_seqs=key.n_seqs, device=key.device, reference=key.reference,
                           rule=key.rule)
        self._add_cell(key, res)

    def _seed_sweep(self, sweep: dict):
        prompt = self.w_prompt.value
        P = len(self.prompt_ids[prompt])
        for cell in sweep["cells"]:
            if cell.get("n_seqs", self._fixed["n_seqs"]) == self._fixed["n_seqs"]:
                ub = min(cell["ubatch"], P)
                self._sweep_cells[(sweep["kernels"], prompt, cell["offload"], ub)] = dict(cell, ubatch=ub)
        self._rebuild_sweep()

    # -- public API ------------------------------------------------------------------------------------
    def set(self, **values):
        """Set widget values (offload, ubatch, kernels, prompt, token, site, metric, seq, layer) and update
        once: `dash.set(offload=6, ubatch=8)` runs one comparison, not two."""
        widgets = self._value_widgets()
        unknown = set(values) - set(widgets)
        if unknown:
            raise TypeError(f"unknown dashboard control(s) {sorted(unknown)}; known: {sorted(widgets)}")
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

    def jump_to(self, offload: int, ubatch: int):
        """What a click on a sweep cell does: show that configuration (from the cache when it was seen)."""
        return self.set(offload=int(offload), ubatch=int(ubatch))

    def clear_errors(self):
        self.w_error.value = ""
        self.w_error.layout.display = "none"

    @property
    def error_text(self) -> str:
        """The error area as plain text ('' when empty)."""
        import re  # noqa: PLC0415
        return html.unescape(re.sub(r"<[^>]+>", " ", self.w_error.value)).strip()

    def _ipython_display_(self):
        _display(self.widget)

    # -- internals: state ------------------------------------------------------------------------------
    def _value_widgets(self) -> dict:
        return {"prompt": self.w_prompt, "offload": self.w_offload, "ubatch": self.w_ubatch,
                "kernels": self.w_kernels, "token": self.w_token, "site": self.w_site, "metric": self.w_metric,
                "seq": self.w_seq, "layer": self.w_layer}

    @contextlib.contextmanager
    def _hold(self):
        """Change widgets without each change triggering an update."""
        was, self._holding = self._holding, True
        try:
            yield
        finally:
            self._holding = was

    def _read_state(self) -> DashState:
        f = self._fixed
        run = RunKey(prompt=self.w_prompt.value, offload=self.w_offload.value, ubatch=self.w_ubatch.value,
                     kernels=self.w_kernels.value, n_seqs=f["n_seqs"], n_gen=f["n_gen"], device=f["device"],
                     reference=f["reference"], rule=f["rule"])
        view = ViewState(token=self.w_token.value, site=self.w_site.value, metric=self.w_metric.value,
                         seq=self.w_seq.value or 0, layer=self.w_layer.value)
        return DashState(run, view)

    # -- internals: callbacks --------------------------------------------------------------------------
    def _on_widget(self, change):
        if not self._holding:
            self._update()

    @_guarded
    def _update(self, force: bool = False):
        """The one update path: diff the widgets' state with what is on screen and do the least work."""
        new = self._read_state()
        old = self.state
        t0 = time.perf_counter()
        if force or old is None or new.run != old.run or self.result is None:
            res, source, run_ms = self._get_result(new.run)
            if res is None:
                return
            self.result = res
            new = self._fit_view(new, res)
            self.state = new
            self._add_cell(new.run, res)
            self._redraw(set(VIEW_DEPENDS) | {"sweep"}, new)
            self._set_timings(t0, source, run_ms, "all")
        elif new.view != old.view:
            changed = {f for f in ViewState.__dataclass_fields__ if getattr(new.view, f) != getattr(old.view, f)}
            views = {name for name, deps in VIEW_DEPENDS.items() if deps & changed}
            self.state = new
            self._redraw(views, new)
            self._set_timings(t0, "view", 0.0, ",".join(sorted(views)))
        self.clear_errors()       # this action succeeded: the area shows errors of the latest action only

    def _get_result(self, key: RunKey):
        res = self.cache.get(key)
        if res is not None:
            return res, "cache", 0.0
        if key in self._failed:
            raise self._failed[key]
        t = time.perf_counter()
        try:
            res = self.cache.compute(self.model, self.prompt_ids[key.prompt], key, progress=self._progress(key))
        except Exception as exc:
            self._failed[key] = exc
            raise
        return res, "run", (time.perf_counter() - t) * 1e3

    def _progress(self, key: RunKey):
        bar = self.w_progress
        bar.layout.visibility = "visible"
        bar.value, bar.bar_style = 0, "info"
        self.w_status.value = f"<b>running</b> {html.escape(key.label())} ..."

        def update(done, total):
            bar.max = total
            bar.value = done
            bar.description = f"{done}/{total} ub"
            if done >= total:
                bar.layout.visibility = "hidden"
        return update

    def _fit_view(self, st: DashState, res: CompareResult) -> DashState:
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

    @_guarded
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

    @_guarded
    def _run_sweep(self, offloads=None, ubatches=None):
        """Metrics-only runs over the grid, one run_sweep per ubatch (the reference is shared per ubatch)."""
        from .sweep import run_sweep  # noqa: PLC0415
        st = self.state or self._read_state()
        offloads = list(offloads) if offloads is not None else self.sweep_offloads
        ubatches = list(ubatches) if ubatches is not None else self.sweep_ubatches
        P = len(self.prompt_ids[st.run.prompt])
        ubatches = [u for u in ubatches if 1 <= u <= P] or [P]
        base = st.run.settings(capture="metrics")
        bar = self.w_progress
        bar.layout.visibility, bar.max, bar.value, bar.bar_style = "visible", len(ubatches), 0, "warning"
        t0 = time.perf_counter()
        try:
            for n, u in enumerate(ubatches):
                bar.description = f"sweep {n}/{len(ubatches)}"
                self.w_status.value = f"<b>sweep</b> ubatch {u}: offloads {offloads} ..."
                sw = run_sweep(self.model, self.prompt_ids[st.run.prompt], base, offloads=offloads, ubatches=[u],
                               n_seqs_list=[st.run.n_seqs], progress=False)
                for cell in sw["cells"]:
                    self._sweep_cells[(st.run.kernels, st.run.prompt, cell["offload"], cell["ubatch"])] = cell
                bar.value = n + 1
        finally:
            bar.layout.visibility = "hidden"
            self.w_status.value = self._status_html()
        self._rebuild_sweep()
        self._redraw({"sweep"}, self.state or st)
        self.timings["sweep_ms"] = (time.perf_counter() - t0) * 1e3

    def _add_cell(self, key: RunKey, res: CompareResult):
        self._sweep_cells[(key.kernels, key.prompt, key.offload, key.ubatch)] = dict(sweep_cell(res),
                                                                                      ubatch=key.ubatch)
        self._rebuild_sweep(key)

    def _rebuild_sweep(self, key: Optional[RunKey] = None):
        """The matrix for the current kernels and prompt: sweep cells plus every full run seen so far."""
        key = key or (self.state.run if self.state else self._read_state().run)
        cells = [c for (k, p, _o, _u), c in self._sweep_cells.items() if k == key.kernels and p == key.prompt]
        self.sweep = {"offloads": sorted({c["offload"] for c in cells}), "ubatches": sorted({c["ubatch"] for c in cells}),
                      "cells": cells, "kernels": key.kernels}
        opts = [("jump to a configuration...", None)]
        for c in sorted(cells, key=lambda c: (c["offload"], c["ubatch"])):
            fd = c["first_divergence"]
            what = "ok" if fd is None else f"diverges t{fd['token']} L{'head' if fd['layer'] is None else fd['layer']}"
            seen = " (cached)" if self._cached(key, c) else ""
            opts.append((f"offload {c['offload']}, ubatch {c['ubatch']}: {what}{seen}", (c["offload"], c["ubatch"])))
        with self._hold():
            self.w_jump.options = opts
            self.w_jump.value = None

    def _cached(self, key: RunKey, cell: dict) -> bool:
        return replace(key, offload=cell["offload"], ubatch=cell["ubatch"]) in self.cache

    # -- internals: drawing ----------------------------------------------------------------------------
    def _redraw(self, views: set, st: DashState):
        """Draw the views (a PNG already rendered for this run and view state is shown again as it is)."""
        res, v = self.result, st.view
        for name, draw in (("curve", draw_curve), ("heatmap", draw_heatmap), ("states", draw_states)):
            if name in views:
                key = (name, st.run, tuple(getattr(v, f) for f in sorted(VIEW_DEPENDS[name])))
                hit = self._pngs.get(key)
                if hit is None:
                    data = draw(self._figs[name], res, v)
                    hit = (fig_png(self._figs[name], self.dpi), data)
                    self._remember(key, hit)
                png, self.view_data[name] = hit
                self._show(name, png)
        if "text" in views:
            self.w_text.value = generations_html(res, self.model.decode, v.seq)
        if "sweep" in views:
            current = (st.run.offload, st.run.ubatch)
            if self._sweep_canvas is not None:
                draw_sweep(self._figs["sweep"], self.sweep, current)
                self._sweep_canvas.draw_idle()
                if not getattr(self, "_click_cid", None):
                    self._click_cid = self._figs["sweep"].canvas.mpl_connect("button_press_event",
                                                                            self._on_sweep_click)
            else:
                cells = tuple(sorted((c["offload"], c["ubatch"], c["first_token"], c["first_layer"])
                                     for c in self.sweep["cells"]))
                key = ("sweep", self.sweep.get("kernels"), cells, current)
                hit = self._pngs.get(key)
                if hit is None:
                    draw_sweep(self._figs["sweep"], self.sweep, current)
                    hit = (fig_png(self._figs["sweep"], self.dpi), None)
                    self._remember(key, hit)
                self._show("sweep", hit[0])
        self.w_status.value = self._status_html()

    def _remember(self, key, value):
        self._pngs[key] = value
        while len(self._pngs) > PNG_CACHE_SIZE:
            self._pngs.popitem(last=False)

    def _show(self, name: str, png: bytes):
        if self.images.get(name) is png:
            return                    # already on screen
        self.images[name] = png
        out = self.out[name]
        if not _in_kernel():          # plain Python (tests, benchmarks): no frontend to display into
            return
        with out:
            out.clear_output(wait=True)
            _display(_IPImage(data=png, format="png"))

    def _status_html(self) -> str:
        res = self.result
        if res is None:
            return "<i>no run yet</i>"
        colour = "#c00" if res.first_divergence else "#070"
        ub = res.settings.ubatch
        ub_text = f"ubatch {ub}" if ub < res.n_prompt else f"ubatch {res.n_prompt} (the whole prompt)"
        return (f"<div style='font-size:12px;line-height:1.4'><b>{html.escape(res.placement.describe())}</b>, "
                f"{ub_text}<br><span style='color:#666'>{html.escape(res.device_label)}</span><br>"
                f"<span style='color:{colour}'>{html.escape(verdict(res))}</span></div>")

    def _set_timings(self, t0: float, source: str, run_ms: float, views: str):
        total = (time.perf_counter() - t0) * 1e3
        self.timings.update({"update_ms": total, "run_ms": run_ms, "redraw_ms": total - run_ms,
                             "source": source, "views": views})
        if source == "run":
            self.timings["last_run_ms"] = run_ms
        what = {"run": f"new run {run_ms:.0f} ms + redraw", "cache": "cached run, redraw",
                "view": f"redraw ({views})"}[source]
        self.w_timing.value = (f"<span style='font-size:11px;color:#666'>{what} {total - run_ms:.0f} ms "
                               f"&middot; {len(self.cache)} run(s) cached</span>")

    def _report_error(self, where: str, exc: BaseException):
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.errors.append({"where": where, "type": type(exc).__name__, "message": str(exc), "traceback": tb})
        self.w_progress.layout.visibility = "hidden"
        self.w_error.value = (
            "<div style='border:1px solid #c00;background:#fff0f0;padding:6px;font-size:12px'>"
            f"<b style='color:#c00'>error in {html.escape(where)}: {html.escape(type(exc).__name__)}</b>: "
            f"{html.escape(str(exc))}<details><summary>traceback</summary><pre style='font-size:10px'>"
            f"{html.escape(tb)}</pre></details></div>")
        self.w_error.layout.display = ""
        if self.result is not None:
            self.w_status.value = self._status_html() + (
                "<div style='font-size:11px;color:#c00'>the views still show the last good run</div>")
        else:
            self.w_status.value = "<i>no run yet</i>"
