"""The state inspector: device minus reference of a layer's recurrent states (SSM and conv state) at one token."""
from __future__ import annotations

import textwrap

import numpy as np

from ..arch import LAYER_TYPES
from ..trace import CompareResult
from .base import NOT_OBSERVED, View, ViewState, add_colorbar, fresh_axes, message

# Every state a layer type declares, the SSM state first (the left panel); each drawn channel x (state | window)
STATE_NAMES = tuple(sorted({spec.name for lt in LAYER_TYPES.values() for spec in lt.states},
                           key=lambda n: (n != "ssm_state", n)))
_AXES = {"ssm_state": ("state n", False), "conv_state": ("window row (oldest first)", True)}


def state_diff(res: CompareResult, ax, layer: int, token: int, which="ssm_state", seq=0):
    """Device minus reference state at one layer and token: channel x state (ssm) or time x channel (conv)."""
    ax.clear()
    key = (layer, which)
    if ("dev",) + key not in res.trace:
        if key in res.errors and not res.is_observed(key):
            ax.set_facecolor(NOT_OBSERVED["facecolor"])
            message(ax, f"{which} of layer {layer}: not observed by the device side")
        else:
            message(ax, f"{which} of layer {layer} was not captured\n(capture policy {res.settings.capture!r})")
        return ax
    toks = res.trace_tokens[key]
    idx = min(range(len(toks)), key=lambda j: (toks[j] > token, abs(toks[j] - token)))   # at or before `token`
    diff = (res.trace[("dev",) + key][seq, idx].double() - res.trace[("ref",) + key][seq, idx].double()).numpy()
    xlabel, transpose = _AXES.get(which, ("state", False))
    diff = diff.reshape(diff.shape[0], -1) if diff.ndim != 2 else diff
    lim = max(float(np.nanmax(np.abs(diff))) if diff.size else 0.0, 1e-12)
    im = ax.imshow(diff.T if transpose else diff, aspect="auto", cmap="coolwarm", vmin=-lim, vmax=lim,
                   interpolation="nearest")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("channel d")
    where = "" if toks[idx] == token else f" (nearest capture: token {toks[idx]}, ubatch boundary)"
    ax.set_title(f"{which} device - reference, layer {layer}, token {token}{where}", fontsize=9)
    add_colorbar(ax, im)
    return ax


def layer_states(res: CompareResult, layer: int) -> tuple:
    """The state sites of one layer, in the inspector's order (both Mamba-1 states when the layer is unknown)."""
    sites = res.layer_sites[layer] if 0 <= layer < len(res.layer_sites) else STATE_NAMES
    return tuple(n for n in STATE_NAMES if n in sites) or STATE_NAMES


class StatesView(View):
    name = "states"
    title = "State difference at the first divergence"
    depends = frozenset({"token", "seq", "layer"})
    figsize = (9.0, 3.4)
    width = "full"

    def draw(self, fig, res: CompareResult, v: ViewState) -> np.ndarray:
        """Each state's difference (SSM left, conv right) at the chosen layer and token; returns the first image."""
        names = layer_states(res, v.layer)
        axes = fresh_axes(fig, 1, len(names))
        axes = list(np.atleast_1d(axes))
        token = v.token if v.token is not None else res.tokens.shape[1] - 1
        for ax, which in zip(axes, names):
            state_diff(res, ax, v.layer, token, which, seq=v.seq)
            ax.set_title(textwrap.fill(ax.get_title(), 60), fontsize=8)
        first = axes[0]
        return np.asarray(first.images[0].get_array(), dtype=float) if first.images else np.array([])

    def report_states(self, res: CompareResult) -> list:
        """Only where something diverged inside a layer whose states were captured."""
        fd = res.first_divergence
        if not fd or fd["layer"] is None or ("dev", fd["layer"], STATE_NAMES[0]) not in res.trace:
            return []
        return [(self.title, ViewState.at_first_divergence(res))]


VIEW = StatesView()
