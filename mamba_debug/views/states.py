"""The state inspector: at one (layer, token), each recurrent state of the reference, of the device, and their
difference (device - reference).

Rows: the SSM state h [channel d x state n] (Mamba-2's [head, row, n] as channel d = head * head_dim + row, the
channel of x it reads) and the conv state [channel d x window row]. A layer with no such state (attention: its KV
cache's new rows are its `k` and `v` sites) says so. Columns: reference, device
(one colour scale for both) and the difference (its own scale, centred on 0). A difference that is exactly zero is
painted in the "exact zero" look and said in words: the states agree, so whatever diverged at this layer came after
the scan (the gate, say) and reaches the states of the next layer through its input.

The SSM state is captured per token. The conv state is captured at ubatch ends only; at any other token it is the
window of the last K-1 conv inputs x, read from the captured `xz` site of the same side (identical to the captured
state where both exist); the title says which one is shown.
"""
from __future__ import annotations

import numpy as np

from ..arch import LAYER_TYPES
from ..trace import CompareResult
from .blit import mark_dynamic
from .base import (check_args, EXACT_ZERO, NOT_OBSERVED, TITLE_Y, View, ViewState, add_colorbar, clear_axes, fresh_axes,
                   message)

# Every state a layer type declares, the SSM state first (the top row)
STATE_NAMES = tuple(sorted({spec.name for lt in LAYER_TYPES.values() for spec in lt.states},
                           key=lambda n: (n != "ssm_state", n)))
_AXES = {"ssm_state": "state n", "conv_state": "window row (oldest first)"}


def _captured(res: CompareResult, side: str, layer: int, which: str, token: int, seq: int):
    """(array [channel, ...], token it belongs to, how) of one side's state at or before `token`, or None."""
    key = (layer, which)
    if (side,) + key not in res.trace:
        return None
    toks = res.trace_tokens[key]
    if token in toks:
        j = toks.index(token)
        return res.trace[(side,) + key][seq, j].double().numpy(), token, "captured"
    if which == "conv_state":               # rebuild the window from the captured conv inputs x (the xz site)
        xz_key = (side, layer, "xz")
        xtoks = res.trace_tokens.get((layer, "xz"), [])
        state = res.trace[(side,) + key]
        k1, d = state.shape[-2], state.shape[-1]
        want = [t for t in range(token - k1 + 1, token + 1) if t >= 0]
        if xz_key in res.trace and all(t in xtoks for t in want):
            x = res.trace[xz_key][seq].double()[..., :d]
            rows = [x[xtoks.index(t)] if t >= 0 else np.zeros(d) for t in range(token - k1 + 1, token + 1)]
            return np.stack([np.asarray(r) for r in rows]), token, "from the captured x inputs"
    before = [j for j, t in enumerate(toks) if t <= token]
    j = before[-1] if before else int(np.argmin([abs(t - token) for t in toks]))
    return res.trace[(side,) + key][seq, j].double().numpy(), toks[j], "nearest capture (ubatch end)"


def _ubatch_end_before(res: CompareResult, layer: int, which: str, token: int, seq: int):
    """The last token at or before `token` (else the first after it) whose device state was kept (llama.cpp: the
    state is the one it writes at each ubatch end; the trace holds NaN at the other tokens)."""
    toks = res.trace_tokens[(layer, which)]
    kept = res.trace[("dev", layer, which)][seq]
    have = [t for j, t in enumerate(toks) if not bool(kept[j].isnan().all())]
    before = [t for t in have if t <= token]
    return before[-1] if before else (have[0] if have else None)


def state_arrays(res: CompareResult, layer: int, token: int, which="ssm_state", seq=0):
    """(reference, device, token shown, how) of one state, each [channel d, ...]; None when not captured."""
    ref = _captured(res, "ref", layer, which, token, seq)
    dev = _captured(res, "dev", layer, which, token, seq)
    if ref is None or dev is None:
        return None
    if np.isnan(dev[0]).all() and dev[2] == "captured":     # a device with its states at ubatch ends only
        end = _ubatch_end_before(res, layer, which, token, seq)
        if end is None:
            return None
        ref = _captured(res, "ref", layer, which, end, seq)
        dev = _captured(res, "dev", layer, which, end, seq)
        ref = (ref[0], end, "the device keeps its state at ubatch ends only: the last one")
    a, b = ref[0], dev[0]
    if which == "conv_state":               # stored [window, channel]: show channel down, window across
        a, b = a.T, b.T
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])     # Mamba-2: [H, P, N] -> [H * P, N]
    return a, b, ref[1], ref[2]


def _missing(res: CompareResult, ax, layer: int, which: str):
    key = (layer, which)
    if key in res.errors and not res.is_observed(key):
        ax.set_facecolor(NOT_OBSERVED["facecolor"])
        message(ax, f"{which} of layer {layer}:\nnot observed by the device side")
    else:
        message(ax, f"{which} of layer {layer} was not captured\n(capture policy {res.settings.capture!r})")
    ax.set_xticks([])
    ax.set_yticks([])


def state_row(res: CompareResult, axes, layer: int, token: int, which="ssm_state", seq=0, got=False):
    """Reference, device and difference of one state into three axes. Returns the difference (or None).
    got: `state_arrays`' answer when the caller has it."""
    if got is False:
        got = state_arrays(res, layer, token, which, seq)
    for ax in axes:
        clear_axes(ax)
    if got is None:
        for ax in axes:
            _missing(res, ax, layer, which)
        return None
    ref, dev, shown, how = got
    diff = dev - ref
    lim = max(float(np.abs(ref).max()), float(np.abs(dev).max()), 1e-30)
    for ax, arr, name in [(axes[0], ref, "reference"), (axes[1], dev, "device")]:
        im = ax.imshow(arr, aspect="auto", cmap="PuOr_r", vmin=-lim, vmax=lim, interpolation="nearest")
        _bar_ticks(add_colorbar(ax, im))
        ax.set_title(f"{name}", fontsize=9, y=TITLE_Y)
    # the difference panel holds both of its looks (the difference with its colour bar; "identical" in green),
    # one shown: a run whose states start or stop agreeing updates the panel instead of building it again
    ax = axes[2]
    im = ax.imshow(diff, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    bar = add_colorbar(ax, im)
    _bar_ticks(bar)
    green = ax.imshow(np.zeros(diff.shape + (3,)) + np.array([0.72, 0.88, 0.53]), aspect="auto",
                      interpolation="nearest")
    text = ax.text(0.5, 0.5, "identical\n(difference exactly 0)", ha="center", va="center", transform=ax.transAxes,
                   fontsize=10, bbox=dict(fc="white", ec=EXACT_ZERO, alpha=0.9))
    ax._mamba_debug_diff = (im, bar, green, text)
    _show_diff(ax, ref, diff)
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415
    for i, a in enumerate(axes):
        a.set_xlabel(_AXES.get(which, "state"), fontsize=8)
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        # the three panels share one channel axis: its numbers once, on the left (tick labels are most of a draw)
        a.tick_params(labelsize=7, labelleft=i == 0)
    axes[0].set_ylabel(_ylabel(which, shown, how), fontsize=8)
    return diff


def _show_diff(ax, ref: np.ndarray, diff: np.ndarray):
    """The difference panel's look for `diff`: the difference, its colour limits, bar format and title, or
    "identical" when it is exactly zero."""
    from matplotlib.ticker import FormatStrFormatter  # noqa: PLC0415
    im, bar, green, text = ax._mamba_debug_diff
    dmax = float(np.abs(diff).max())
    for artist in (im, bar.ax):
        artist.set_visible(dmax > 0)
    for artist in (green, text):
        artist.set_visible(dmax == 0)
    if dmax == 0:
        ax.set_title("device - reference", fontsize=9, color="black", y=TITLE_Y)
        return
    im.set_data(diff)
    im.set_clim(-dmax, dmax)
    # each tick its own number (no "1e-6" offset above the bar, where it runs into the title)
    bar.formatter = FormatStrFormatter("%.1g" if dmax >= 1e-3 else "%.0e")
    rel = float(np.linalg.norm(diff) / max(np.linalg.norm(ref), 1e-300))
    ax.set_title(f"device - reference  (||diff|| / ||ref|| = {rel:.2g})", fontsize=9,
                 color="tab:red" if rel > 1e-4 else "black", y=TITLE_Y)


def _bar_ticks(bar):
    """A colour bar's ticks: at most 4 numbers, small."""
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415
    bar.locator = MaxNLocator(4)         # the property: the bar re-applies its own locator on every update
    bar.ax.tick_params(labelsize=7)
    mark_dynamic(bar.ax.yaxis if bar.orientation == "vertical" else bar.ax.xaxis)   # its numbers follow the data


def _ylabel(which: str, shown: int, how: str) -> str:
    where = f"token {shown}" + ("" if how == "captured" else f", {how}")
    return f"{which}\n({where})\nchannel d"


def _look(got) -> tuple:
    """What a row's panels hold, apart from their numbers: a redraw with the same looks only updates the data."""
    if got is None:
        return (None,)
    return (got[0].shape, got[1].shape)


def _update_row(axes, got, which: str) -> np.ndarray:
    """The numbers of a row drawn before with the same look: image data, colour limits, the difference panel's
    look and titles. What `state_row` would draw, without recreating axes, ticks and colour bars (most of a
    redraw's time)."""
    ref, dev, shown, how = got
    diff = dev - ref
    lim = max(float(np.abs(ref).max()), float(np.abs(dev).max()), 1e-30)
    for ax, arr in ((axes[0], ref), (axes[1], dev)):
        im = ax.images[0]
        im.set_data(arr)
        im.set_clim(-lim, lim)
    _show_diff(axes[2], ref, diff)
    axes[0].set_ylabel(_ylabel(which, shown, how), fontsize=8)
    return diff


def state_diff(res: CompareResult, ax, layer: int, token: int, which="ssm_state", seq=0):
    """Only the difference panel (device - reference) of one state into one Axes (kept for notebooks)."""
    check_args(res, ax, seq=seq, token=token, layer=layer, site=which)
    fig = ax.figure
    spare = [fig.add_axes([0, 0, 0.01, 0.01]) for _ in range(2)]
    state_row(res, [*spare, ax], layer, token, which, seq)
    for s in spare:
        s.remove()
    ax.set_title(f"{which} device - reference, layer {layer}, token {token}", fontsize=9)
    return ax


def layer_states(res: CompareResult, layer: int) -> tuple:
    """The state sites of one layer, in the inspector's order: none for a layer without them (attention), every
    state when the layer is unknown."""
    sites = res.layer_sites[layer] if 0 <= layer < len(res.layer_sites) else STATE_NAMES
    return tuple(n for n in STATE_NAMES if n in sites)


class StatesView(View):
    name = "states"
    title = "State inspector: reference, device and difference at the first divergence"
    depends = frozenset({"token", "seq", "layer"})
    figsize = (10.0, 5.0)
    width = "full"

    def draw(self, fig, res: CompareResult, v: ViewState) -> np.ndarray:
        """Each state (a row) of reference, device and difference at the chosen layer and token; returns the first
        state's difference (empty when not captured)."""
        names = layer_states(res, v.layer)
        if not names:
            fig._mamba_debug_states = None
            ax = fresh_axes(fig, 1, 1)
            message(ax, f"layer {v.layer} keeps no SSM or conv state\nan attention layer's KV cache grows by its "
                        f"'k' and 'v' sites:\nthe heatmap and the curves show them")
            ax.set_xticks([])
            ax.set_yticks([])
            fig.suptitle(f"layer {v.layer}", fontsize=10)
            return np.array([])
        token = v.token if v.token is not None else res.tokens.shape[1] - 1
        token = min(token, res.tokens.shape[1] - 1)
        got = [state_arrays(res, v.layer, token, which, v.seq) for which in names]
        looks = (names, tuple(_look(g) for g in got))
        drawn = getattr(fig, "_mamba_debug_states", None)
        if drawn is not None and drawn[0] == looks and drawn[1] == [id(a) for a in fig.axes] and \
                all(g is not None for g in got):
            diffs = [_update_row(row, g, which) for row, g, which in zip(drawn[2], got, names)]
        else:       # a new look: every panel drawn afresh
            axes = np.atleast_2d(fresh_axes(fig, len(names), 3, left=0.1, right=0.96, top=0.86, bottom=0.1,
                                            hspace=0.45, wspace=0.3))
            diffs = [state_row(res, list(row), v.layer, token, which, seq=v.seq, got=g)
                     for row, which, g in zip(axes, names, got)]
            fig._mamba_debug_states = (looks, [id(a) for a in fig.axes], [list(row) for row in axes])
        where = "on the device" if res.placement.on_device(v.layer) else \
            "on the host: ref32's run, identical by construction"
        if res.placement.devices and res.placement.on_device(v.layer):     # its states live on its own device
            where = f"on device {res.placement.slot_name(res.placement.layer_slot(v.layer))}"
        agree = [d is not None and not np.abs(d).max() > 0 for d in diffs]
        note = ""
        fd = res.first_divergence
        if fd and fd["layer"] == v.layer and fd["token"] == token and all(agree):
            note = (f"\nthe states agree at the first divergence: '{fd['site']}' goes wrong after the scan; "
                    f"layer {v.layer + 1}'s states carry it on")
        fig.suptitle(f"layer {v.layer} {where}; token {token}, seq {v.seq}{note}", fontsize=10)
        first = diffs[0]
        return np.array([]) if first is None else first

    def report_states(self, res: CompareResult) -> list:
        """At the first divergence, and one layer on when the states there still agree (where the error lands)."""
        fd = res.first_divergence
        if not fd or fd["layer"] is None or ("dev", fd["layer"], STATE_NAMES[0]) not in res.trace:
            return []
        st = ViewState.at_first_divergence(res)
        out = [(self.title, st)]
        got = state_arrays(res, fd["layer"], fd["token"], STATE_NAMES[0], fd["seq"])
        nxt = fd["layer"] + 1
        if got is not None and np.array_equal(got[0], got[1]) and nxt < res.n_layer and \
                ("dev", nxt, STATE_NAMES[0]) in res.trace:
            out.append((f"The same token one layer on (layer {nxt}): the states carry the error",
                        ViewState(token=st.token, site=st.site, seq=st.seq, layer=nxt)))
        return out


VIEW = StatesView()
