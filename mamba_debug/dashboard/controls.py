"""The dashboard's widgets and their layout, built from the view registry.

Run controls (prompt, offload, ubatch, kernels) make a new `RunSettings`; view controls make a new `ViewState`, one
widget per field (`FIELD_WIDGETS`). A view field read by one view only sits above that view (the state inspector's
layer); the others share the view row. Each view of the registry gets an output area in screen order: figure views
an `ipywidgets.Image` of fixed size (CSS class `md-<name>`), HTML views an `HTML` widget; two "half" views share a
row.
"""
from __future__ import annotations

import html
from typing import Optional

from ..arch import all_sites
from ..metrics import METRICS
from ..plugins import list_kernels
from ..settings import ENGINES, whole_ubatch
from ..views.base import FIELDS, SCREEN_DPI, screen_width
from ..views.registry import VIEWS

try:  # optional: ipywidgets is a notebook extra (requirements-lab.txt)
    import ipywidgets as W
except ImportError:  # pragma: no cover - reported when a Dashboard is built
    W = None

STYLE = {"description_width": "70px"}
VIEW_EXTRAS = {"generations": "<b>generations</b>"}     # a heading above a view's area
HEADER_HEIGHT = "66px"     # the header never changes height (a run in progress must not move the page)
# While the live widgets render, the static snapshot printed under them (for a notebook opened without a kernel or
# on a code-hosting site) is hidden; without widgets this style is absent and the snapshot shows.
HIDE_SNAPSHOT = "<style>.md-static-snapshot{display:none !important}</style>"
KERNELS_NOT_APPLICABLE = ("Not applicable with engine llama.cpp: the device side is the llama.cpp library's own "
                          "ops, not torch kernels (choose engine torch to pick kernels)")
TIPS = {
    "prompt": "Which prompt to run",
    "offload": "Offload (like llama.cpp -ngl): the last N blocks run on the device (N > n_layer: the head too). "
               "Arrow keys move it; the run starts when you stop (about half a second later).",
    "ubatch": "Micro-batch (like llama.cpp -ub): prompt tokens processed together. A new value runs once you "
              "stop moving the slider.",
    "engine": "The device side's engine: torch (the Triton kernels or a plug-in) or llama.cpp (a llama.cpp library "
              "traced through its eval callback; --llama-lib / LLAMA_CPP_LIB_PATH, else llama-cpp-python's)",
    "kernels": "The device side's kernels: a plug-in from kernels/ (bug_* are the bug gallery)",
    "token": "The token the curve and the state inspector look at (no new run: a redraw)",
    "play": "Step through the tokens one by one",
    "site": "The site (tensor inside a block) the curve and heatmap show",
    "metric": "The error metric drawn (thresholds exist for rel_l2 only)",
    "seq": "Which sequence (with several sequences per run)",
    "layer": "The layer whose conv and SSM states the inspector shows",
    "first": "Point token, layer, sequence and site at the first divergence",
    "tok_prev": "Previous token",
    "tok_next": "Next token",
    "off_minus": "One block fewer on the device (offload - 1); runs",
    "off_plus": "One block more on the device (offload + 1); runs",
    "ub_minus": "Smaller micro-batch (ubatch - 1); runs",
    "ub_plus": "Larger micro-batch (ubatch + 1); runs",
    "sweep_btn": "Run every offload x ubatch configuration of the grid (metrics only) to fill the matrix",
    "jump": "Show one configuration of the matrix (from the cache when it ran before)",
    "progress": "Progress of the run: ubatches done",
}


def in_kernel() -> bool:
    """A Jupyter kernel with a frontend to display into (not plain Python: tests, benchmarks)."""
    try:
        from IPython import get_ipython  # noqa: PLC0415
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def status_html(res, verdict: str) -> str:
    """The header: placement, ubatch, the engine and what ran on the device, the verdict."""
    if res is None:
        return "<i>no run yet</i>"
    colour = "#c00" if res.first_divergence else "#070"
    ub, whole = res.settings.ubatch, whole_ubatch(res.n_prompt, res.settings.n_seqs)
    every = " of every sequence" if res.settings.n_seqs > 1 else ""
    ub_text = f"ubatch {ub}" if ub < whole else f"ubatch {whole} (the whole prompt{every})"
    where, device = engine_lines(res)
    return (f"<div style='font-size:12px;line-height:1.4'><b>{where}</b>, "
            f"{ub_text}<br><span style='color:#666'>{device}</span><br>"
            f"<span style='color:{colour}'>{html.escape(verdict)}</span></div>")


def engine_lines(res) -> tuple:
    """(placement, device side) of the header, as HTML: for llama.cpp what really ran (the library file, its
    version, -ngl), read from the result's device side."""
    dev = res.sides["device"]
    if res.settings.engine != "llama.cpp":
        return html.escape(res.placement.describe()), f"engine torch: {html.escape(dev.label)}"
    extra = dev.extra or {}
    lib, version = str(extra.get("library", "?")), str(extra.get("version", "?"))
    ngl = extra.get("n_gpu_layers", 0)
    if ngl == 0:
        where = (f"offload {res.settings.offload} is -ngl: this CPU run used -ngl 0, so every block and the head "
                 f"ran in llama.cpp on the CPU")
    else:
        where = f"offload {res.settings.offload} = -ngl {ngl}: {res.placement.describe()}"
    short = lib if len(lib) <= 60 else "..." + lib[-57:]
    return (html.escape(where), f"engine llama.cpp: <span title='{html.escape(lib)}'>{html.escape(short)}</span> "
                                f"({html.escape(version)})")


def llama_cpp_unavailable_html(problem: str) -> str:
    """The message (no traceback) shown when engine llama.cpp is chosen and no library loads."""
    return ("<div style='border:1px solid #c60;background:#fff8ec;padding:6px;font-size:12px'>"
            "<b style='color:#c60'>engine llama.cpp: no llama.cpp library could be loaded</b>, so nothing ran (the "
            "dashboard does not fall back to torch). Install llama-cpp-python or point LLAMA_CPP_LIB_PATH at a "
            f"llama.cpp build's lib folder, then choose the engine again.<br><span style='color:#666'>"
            f"{html.escape(problem)}</span></div>")


def timing_html(source: str, run_ms: float, total_ms: float, views: str, n_cached: int,
                first_ms: Optional[float] = None) -> str:
    what = {"run": f"new run {run_ms:.0f} ms + redraw", "cache": "cached run, redraw",
            "same": "the same bits as a cached run (only the head moved), redraw",
            "view": f"redraw ({views})"}[source]
    first = f" (first view at {first_ms:.0f} ms)" if first_ms is not None and first_ms < total_ms - 1 else ""
    return (f"<span style='font-size:11px;color:#666'>{what} {total_ms - run_ms:.0f} ms{first} "
            f"&middot; {n_cached} run(s) cached</span>")


def error_html(where: str, exc: BaseException, tb: str) -> str:
    return ("<div style='border:1px solid #c00;background:#fff0f0;padding:6px;font-size:12px'>"
            f"<b style='color:#c00'>error in {html.escape(where)}: {html.escape(type(exc).__name__)}</b>: "
            f"{html.escape(str(exc))}<details><summary>traceback</summary><pre style='font-size:10px'>"
            f"{html.escape(tb)}</pre></details></div>")


def snapshot_html(images: dict, widths: dict, status: str) -> str:
    """The dashboard as static HTML (its header and every view's PNG, in screen order): what a saved notebook shows
    where the widgets were when it is opened without a kernel. Hidden by HIDE_SNAPSHOT while the widgets live."""
    import base64  # noqa: PLC0415
    imgs = "".join(f"<img alt='{html.escape(name)}' width='{widths.get(name, 500)}' style='margin:2px' "
                   f"src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
                   for name, png in ((v.name, images.get(v.name)) for v in VIEWS) if png)
    return (f"<div class='md-static-snapshot'><div style='font-size:11px;color:#666'>mamba-debug dashboard: a static "
            f"picture of the last state (run the notebook for the live widgets)</div>{status}<div>{imgs}</div></div>")


def has_ipympl() -> bool:
    try:
        import ipympl  # noqa: F401, PLC0415
    except ImportError:
        return False
    return True


def ipympl_canvas(fig):
    """Give a figure an ipympl canvas (a widget) so that clicks on it reach Python."""
    from ipympl.backend_nbagg import Canvas, FigureManager  # noqa: PLC0415
    canvas = Canvas(fig)
    FigureManager(canvas, 0)
    canvas.header_visible = False
    canvas.toolbar_visible = False
    return canvas


class Controls:
    """Every widget of one dashboard (`w_*` attributes, `out` / `html` areas per view) and `widget`, the layout."""

    def __init__(self, cfg, prompts: list, n_prompt: int, *, kernels: str, offload, ubatch: int, n_seqs: int,
                 n_gen: int, figures: dict, engine: str = "torch"):
        if W is None:
            raise ImportError("the dashboard needs ipywidgets: pip install -r requirements-lab.txt")
        L, P, lay = cfg.n_layer, n_prompt, W.Layout
        knames = list(dict.fromkeys(["triton", *list_kernels(), "torch", kernels]))
        self.w_prompt = W.Dropdown(options=[(t[:50], i) for i, t in enumerate(prompts)], value=0,
                                   description="prompt", style=STYLE, layout=lay(width="360px",
                                   display="" if len(prompts) > 1 else "none"))
        self.w_offload = W.IntSlider(value=L + 1 if offload is None else offload, min=0, max=L + 1,
                                     description="offload", continuous_update=False, style=STYLE,
                                     tooltip="like -ngl: the last N blocks (and the head when N > n_layer) on the device")
        top = whole_ubatch(P, n_seqs)
        self.w_ubatch = W.IntSlider(value=min(ubatch, top), min=1, max=top, description="ubatch",
                                    continuous_update=False, style=STYLE)
        self.w_kernels = W.Dropdown(options=knames, value=kernels, description="kernels", style=STYLE)
        self.w_engine = W.Dropdown(options=list(ENGINES), value=engine, description="engine", style=STYLE,
                                   layout=lay(width="170px"))
        # one widget per ViewState field
        self.w_token = W.IntSlider(value=0, min=0, max=P + n_gen - 1, description="token", continuous_update=False,
                                   style=STYLE)
        self.w_play = W.Play(value=0, min=0, max=P + n_gen - 1, interval=700, description="play")
        self._play_link = W.link((self.w_play, "value"), (self.w_token, "value"))
        self._play_max = W.link((self.w_token, "max"), (self.w_play, "max"))
        self.w_site = W.Dropdown(options=list(all_sites(cfg)), value="resid", description="site", style=STYLE,
                                 layout=lay(width="200px"))
        self.w_metric = W.Dropdown(options=list(METRICS), value="rel_l2", description="metric", style=STYLE,
                                   layout=lay(width="200px"))
        self.w_seq = W.Dropdown(options=list(range(n_seqs)), value=0, description="sequence", style=STYLE,
                                layout=lay(width="160px"))
        self.w_layer = W.IntSlider(value=L - 1, min=0, max=L - 1, description="state layer",
                                   continuous_update=False, style={"description_width": "80px"})
        self.field_widgets = {"token": self.w_token, "site": self.w_site, "metric": self.w_metric,
                              "seq": self.w_seq, "layer": self.w_layer}
        missing = set(FIELDS) - set(self.field_widgets)
        if missing:
            raise RuntimeError(f"ViewState field(s) without a dashboard control: {sorted(missing)}")
        self.w_first = W.Button(description="go to first divergence", icon="crosshairs", layout=lay(width="200px"))
        self.w_sweep_btn = W.Button(description="run sweep", icon="th", layout=lay(width="140px"))
        self.w_jump = W.Dropdown(options=[("jump to a configuration...", None)], value=None, description="",
                                 layout=lay(width="300px"))
        self.w_progress = W.IntProgress(value=0, min=0, max=1, description="", bar_style="info",
                                        layout=lay(width="240px", visibility="hidden"))
        step = dict(layout=lay(width="34px", padding="0"))
        self.w_tok_prev = W.Button(icon="step-backward", **step)
        self.w_tok_next = W.Button(icon="step-forward", **step)
        self.w_off_minus, self.w_off_plus = W.Button(icon="minus", **step), W.Button(icon="plus", **step)
        self.w_ub_minus, self.w_ub_plus = W.Button(icon="minus", **step), W.Button(icon="plus", **step)
        for name, tip in TIPS.items():
            w = getattr(self, f"w_{name}", None)
            if w is not None:
                w.tooltip = tip
        self.show_engine(engine)
        self.w_status = W.HTML(layout=lay(height=HEADER_HEIGHT, overflow="hidden", width="60%"))
        self.w_timing = W.HTML(layout=lay(height="20px", overflow="hidden", width="360px"))
        self.widths = {v.name: screen_width(v.figsize) for v in VIEWS}
        self.w_error = W.HTML(layout=lay(display="none"))
        # one image widget per figure view, its size fixed: a redraw never moves what is below it
        self.out = {v.name: W.Image(format="png", layout=lay(width=f"{screen_width(v.figsize)}px",
                                                             height=f"{int(v.figsize[1] * SCREEN_DPI)}px"))
                    for v in VIEWS if v.kind in ("figure", "sweep")}
        self.html = {v.name: W.HTML() for v in VIEWS if v.kind == "html"}
        self.w_text = self.html.get("generations")
        # CSS classes: handles for the browser test and for anyone styling the dashboard
        for w, cls in [(self.w_offload, "md-offload"), (self.w_ubatch, "md-ubatch"), (self.w_token, "md-token"),
                       (self.w_kernels, "md-kernels"), (self.w_engine, "md-engine"), (self.w_error, "md-error"),
                       (self.w_status, "md-status"),
                       (self.w_progress, "md-progress"), (self.w_tok_prev, "md-tok-prev"),
                       (self.w_tok_next, "md-tok-next"), (self.w_first, "md-first"), (self.w_layer, "md-layer"),
                       (self.w_off_minus, "md-off-minus"), (self.w_off_plus, "md-off-plus"),
                       (self.w_ub_minus, "md-ub-minus"), (self.w_ub_plus, "md-ub-plus")]:
            w.add_class(cls)
        for name, o in {**self.out, **self.html}.items():
            o.add_class(f"md-{name}")
        self.sweep_canvas = ipympl_canvas(figures["sweep"]) if "sweep" in figures and has_ipympl() else None
        self.widget = self._layout()
        self.widget.add_class("md-dashboard")

    def show_png(self, name: str, png: bytes):
        """Put a rendered view into its image widget (a widget value: it reaches the page from any callback,
        timers included, which a display() into an Output area does not)."""
        self.out[name].value = png

    def run_widgets(self) -> dict:
        return {"prompt": self.w_prompt, "offload": self.w_offload, "ubatch": self.w_ubatch, "engine": self.w_engine,
                "kernels": self.w_kernels}

    def show_engine(self, engine: str):
        """The kernels control applies to engine torch only: disabled, and its tooltip says why, with llama.cpp."""
        llama = engine == "llama.cpp"
        self.w_kernels.disabled = llama
        self.w_kernels.tooltip = KERNELS_NOT_APPLICABLE if llama else TIPS["kernels"]

    def value_widgets(self) -> dict:
        """Every control `Dashboard.set` takes, by name."""
        return {**self.run_widgets(), **self.field_widgets}

    def _field_box(self, field):
        if field == "token":        # the slider and its step buttons side by side
            return W.HBox([self.w_play, self.w_token, self.w_tok_prev, self.w_tok_next, self.w_first])
        return self.field_widgets[field]

    def _view_box(self, view, own_fields):
        lay = W.Layout
        above = [self._field_box(f) for f in own_fields]
        if view.name in VIEW_EXTRAS:
            above.insert(0, W.HTML(VIEW_EXTRAS[view.name]))
        if view.kind == "sweep":
            above.append(W.HBox([self.w_sweep_btn, self.w_jump]))
            area = self.sweep_canvas if self.sweep_canvas is not None else self.out[view.name]
        else:
            area = self.html[view.name] if view.kind == "html" else self.out[view.name]
        box = W.VBox([*above, area]) if above else area
        if view.kind == "html" and view.width == "half":
            box.layout = lay(width="55%")
        return box

    def _layout(self):
        readers = {f: [v for v in VIEWS if f in v.depends] for f in FIELDS}
        own = {v.name: [f for f in FIELDS if [r.name for r in readers[f]] == [v.name]] for v in VIEWS}
        shared = [f for f in FIELDS if len(readers[f]) != 1]
        header = W.HBox([self.w_status, W.VBox([self.w_progress, self.w_timing])],
                        layout=W.Layout(align_items="center", justify_content="space-between",
                                        height=HEADER_HEIGHT, overflow="hidden"))
        run_row = W.HBox([self.w_prompt, self.w_offload, self.w_off_minus, self.w_off_plus, self.w_ubatch,
                          self.w_ub_minus, self.w_ub_plus, self.w_engine, self.w_kernels], layout=W.Layout(flex_flow="row wrap"))
        view_row = W.HBox([self._field_box(f) for f in shared], layout=W.Layout(flex_flow="row wrap"))
        rows, half = [], []
        for view in VIEWS:
            box = self._view_box(view, own[view.name])
            if view.width == "half":
                half.append(box)
                if len(half) == 2:
                    rows.append(W.HBox(half))
                    half = []
                continue
            if half:
                rows.append(W.HBox(half))
                half = []
            rows.append(box)
        if half:
            rows.append(W.HBox(half))
        return W.VBox([W.HTML(HIDE_SNAPSHOT, layout=W.Layout(display="none")), header, self.w_error, run_row,
                       view_row, *rows])
