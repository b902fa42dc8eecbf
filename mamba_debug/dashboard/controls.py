"""The dashboard's widgets and their layout, built from the view registry.

Run controls (prompt, offload, ubatch, kernels) make a new `RunSettings`; view controls make a new `ViewState`, one
widget per field (`FIELD_WIDGETS`). A view field read by one view only sits above that view (the state inspector's
layer); the others share the view row. Each view of the registry gets an output area in screen order: figure views
an `ipywidgets.Output` (CSS class `md-<name>`), HTML views an `HTML` widget; two "half" views share a row.
"""
from __future__ import annotations

import html

from ..arch import all_sites
from ..metrics import METRICS
from ..plugins import list_kernels
from ..views.base import FIELDS
from ..views.registry import VIEWS

try:  # optional: ipywidgets is a notebook extra (requirements-lab.txt)
    import ipywidgets as W
except ImportError:  # pragma: no cover - reported when a Dashboard is built
    W = None

STYLE = {"description_width": "70px"}
VIEW_EXTRAS = {"generations": "<b>generations</b>"}     # a heading above a view's area


def in_kernel() -> bool:
    """A Jupyter kernel with a frontend to display into (not plain Python: tests, benchmarks)."""
    try:
        from IPython import get_ipython  # noqa: PLC0415
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def status_html(res, verdict: str) -> str:
    """The header: placement, ubatch, what ran on the device, the verdict."""
    if res is None:
        return "<i>no run yet</i>"
    colour = "#c00" if res.first_divergence else "#070"
    ub = res.settings.ubatch
    ub_text = f"ubatch {ub}" if ub < res.n_prompt else f"ubatch {res.n_prompt} (the whole prompt)"
    return (f"<div style='font-size:12px;line-height:1.4'><b>{html.escape(res.placement.describe())}</b>, "
            f"{ub_text}<br><span style='color:#666'>{html.escape(res.sides['device'].label)}</span><br>"
            f"<span style='color:{colour}'>{html.escape(verdict)}</span></div>")


def timing_html(source: str, run_ms: float, total_ms: float, views: str, n_cached: int) -> str:
    what = {"run": f"new run {run_ms:.0f} ms + redraw", "cache": "cached run, redraw",
            "view": f"redraw ({views})"}[source]
    return (f"<span style='font-size:11px;color:#666'>{what} {total_ms - run_ms:.0f} ms "
            f"&middot; {n_cached} run(s) cached</span>")


def error_html(where: str, exc: BaseException, tb: str) -> str:
    return ("<div style='border:1px solid #c00;background:#fff0f0;padding:6px;font-size:12px'>"
            f"<b style='color:#c00'>error in {html.escape(where)}: {html.escape(type(exc).__name__)}</b>: "
            f"{html.escape(str(exc))}<details><summary>traceback</summary><pre style='font-size:10px'>"
            f"{html.escape(tb)}</pre></details></div>")


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
                 n_gen: int, figures: dict):
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
        self.w_ubatch = W.IntSlider(value=min(ubatch, P), min=1, max=P, description="ubatch",
                                    continuous_update=False, style=STYLE)
        self.w_kernels = W.Dropdown(options=knames, value=kernels, description="kernels", style=STYLE)
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
        self.w_status = W.HTML()
        self.w_timing = W.HTML()
        self.w_error = W.HTML(layout=lay(display="none"))
        self.out = {v.name: W.Output() for v in VIEWS if v.kind in ("figure", "sweep")}
        self.html = {v.name: W.HTML() for v in VIEWS if v.kind == "html"}
        self.w_text = self.html.get("generations")
        # CSS classes: handles for the browser test and for anyone styling the dashboard
        for w, cls in [(self.w_offload, "md-offload"), (self.w_ubatch, "md-ubatch"), (self.w_token, "md-token"),
                       (self.w_kernels, "md-kernels"), (self.w_error, "md-error"), (self.w_status, "md-status"),
                       (self.w_progress, "md-progress")]:
            w.add_class(cls)
        for name, o in {**self.out, **self.html}.items():
            o.add_class(f"md-{name}")
        self.sweep_canvas = ipympl_canvas(figures["sweep"]) if "sweep" in figures and has_ipympl() else None
        self.widget = self._layout()
        self.widget.add_class("md-dashboard")

    def show_png(self, name: str, png: bytes):
        """Put a rendered view into its output area (only inside a kernel: elsewhere nothing displays)."""
        if not in_kernel():
            return
        from IPython.display import Image, display  # noqa: PLC0415
        out = self.out[name]
        with out:
            out.clear_output(wait=True)
            display(Image(data=png, format="png"))

    def run_widgets(self) -> dict:
        return {"prompt": self.w_prompt, "offload": self.w_offload, "ubatch": self.w_ubatch, "kernels": self.w_kernels}

    def value_widgets(self) -> dict:
        """Every control `Dashboard.set` takes, by name."""
        return {**self.run_widgets(), **self.field_widgets}

    def _field_box(self, field):
        return W.HBox([self.w_play, self.w_token]) if field == "token" else self.field_widgets[field]

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
        header = W.HBox([self.w_status, self.w_progress, self.w_timing],
                        layout=W.Layout(align_items="center", justify_content="space-between"))
        run_row = W.HBox(list(self.run_widgets().values()))
        view_row = W.HBox([self._field_box(f) for f in shared] + [self.w_first])
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
        return W.VBox([header, self.w_error, run_row, view_row, *rows])
