"""Matplotlib views of a comparison; the HTML report and the notebook dashboard draw with these.

Each function draws into a given Axes (so a dashboard can redraw in place) and returns it.
"""
from __future__ import annotations


import numpy as np

from .compare import CompareResult
from .model import MODEL_SITES

DEVICE_SHADE = dict(color="tab:orange", alpha=0.12)


def _colorbar(ax, im, **kw):
    """One colorbar per Axes, replaced on redraw (redrawing into the same Axes must not pile them up)."""
    old = getattr(ax, "_mamba_debug_colorbar", None)
    if old is not None:
        old.remove()
    ax._mamba_debug_colorbar = ax.figure.colorbar(im, ax=ax, fraction=0.04, **kw)
    return ax._mamba_debug_colorbar


def _errors(res: CompareResult, site: str, metric: str = "rel_l2", seq: int = 0) -> np.ndarray:
    """[n_layer (+1 for a model-level site), n_tok] of one site's metric for one sequence (NaN = not captured)."""
    if site in MODEL_SITES:
        return res.errors[(None, site)][metric][seq][None].numpy()
    return np.stack([res.errors[(i, site)][metric][seq].numpy() for i in range(res.n_layer)])


def _floor_line(res, site):
    if site in MODEL_SITES:
        return np.array([res.thresholds[(None, site)]])
    return np.array([res.thresholds[(i, site)] for i in range(res.n_layer)])


def layer_curve(res: CompareResult, ax, token=None, site="resid", metric="rel_l2", seq=0):
    """Error per layer at one token (None: worst token), device layers shaded, the threshold band drawn."""
    err = _errors(res, site, metric, seq)
    y = np.nanmax(np.where(np.isnan(err), -np.inf, err), axis=1) if token is None else err[:, token]
    layers = np.arange(len(y))
    ax.clear()
    L0 = res.placement.first_device_layer
    if L0 < res.n_layer:
        ax.axvspan(L0 - 0.5, res.n_layer - 0.5, **DEVICE_SHADE, label="device layers")
    shown = np.where(np.isfinite(y) & (y > 0), y, np.nan)
    ax.semilogy(layers, shown, "o-", color="tab:blue", label=f"{site} {metric} (device vs reference)")
    if metric == "rel_l2":
        thr = _floor_line(res, site)
        ax.fill_between(layers, 1e-12, thr / res.settings.k_floor, color="tab:green", alpha=0.15, label="rounding floor")
        ax.plot(layers, thr, "--", color="tab:green", label=f"threshold ({res.settings.k_floor:g}x floor)")
    if np.all(np.nan_to_num(y, nan=0.0) == 0):
        ax.text(0.5, 0.5, "device and reference identical here (error 0)", ha="center", va="center",
                transform=ax.transAxes)
    bad = ~np.isfinite(y) & ~np.isnan(y)
    for i in np.nonzero(bad)[0]:
        ax.annotate("NaN/Inf", (i, ax.get_ylim()[1]), color="red", ha="center", va="top")
    ax.set_xlabel("layer")
    ax.set_ylabel(metric)
    ax.set_title(f"{site} at {'worst token' if token is None else 'token %d' % token}, seq {seq}")
    ax.legend(loc="upper left", fontsize=7)
    return ax


def heatmap(res: CompareResult, ax, site="resid", metric="rel_l2", seq=0, colorbar=True):
    """log10 error, layer x token, ubatch boundaries marked, the first divergence circled."""
    err = _errors(res, site, metric, seq)
    with np.errstate(divide="ignore", invalid="ignore"):
        img = np.log10(np.where(err > 0, err, 1e-16))
    img = np.where(np.isfinite(err), img, np.where(np.isnan(err), np.nan, 2.0))   # inf (NaN born) -> top colour
    ax.clear()
    im = ax.imshow(img, aspect="auto", origin="lower", cmap="magma", vmin=-9, vmax=1, interpolation="nearest")
    for t in res.token_info:
        if t.index_in_ubatch == 0 and t.token > 0:
            ax.axvline(t.token - 0.5, color="white", lw=0.6, alpha=0.7)
    if site not in MODEL_SITES and res.placement.first_device_layer < res.n_layer:
        ax.axhline(res.placement.first_device_layer - 0.5, color="cyan", lw=1.0, ls="--")
    fd = res.first_divergence
    if fd and fd["seq"] == seq:
        row = 0 if site in MODEL_SITES else (fd["layer"] if fd["layer"] is not None else res.n_layer - 1)
        ax.plot(fd["token"], row, "o", ms=14, mfc="none", mec="lime", mew=2)
    ax.axvline(res.n_prompt - 0.5, color="deepskyblue", lw=1.2)
    ax.set_xlabel("token (white: ubatch boundary, blue: prompt | generated)")
    ax.set_ylabel("layer" if site not in MODEL_SITES else site)
    ax.set_title(f"log10 {metric} of '{site}', seq {seq}")
    if colorbar:
        _colorbar(ax, im)
    return ax


def logits_curve(res: CompareResult, ax, seq=0):
    ax.clear()
    kld = res.logits["kld"][seq].numpy()
    ax.semilogy(np.arange(len(kld)), np.maximum(kld, 1e-16), ".-", label="KL(ref || device)")
    flips = np.nonzero(res.logits["top1"][seq].numpy() < 1)[0]
    if len(flips):
        ax.plot(flips, np.maximum(kld[flips], 1e-16), "rx", label="top-1 differs")
    ax.axvline(res.n_prompt - 0.5, color="deepskyblue", lw=1.2)
    ax.set_xlabel("token")
    ax.set_ylabel("KLD")
    ax.set_title("logits: KL divergence per token")
    ax.legend(fontsize=7)
    return ax


def state_diff(res: CompareResult, ax, layer: int, token: int, which="ssm_state", seq=0):
    """Device minus reference state at one layer and token: channel x state (ssm) or time x channel (conv)."""
    ax.clear()
    key = (layer, which)
    if ("dev",) + key not in res.trace:
        ax.text(0.5, 0.5, f"{which} of layer {layer} was not captured\n(capture policy {res.settings.capture!r})",
                ha="center", va="center", transform=ax.transAxes)
        return ax
    toks = res.trace_tokens[key]
    idx = min(range(len(toks)), key=lambda j: (toks[j] > token, abs(toks[j] - token)))   # at or before `token`
    diff = (res.trace[("dev",) + key][seq, idx].double() - res.trace[("ref",) + key][seq, idx].double()).numpy()
    lim = max(float(np.nanmax(np.abs(diff))) if diff.size else 0.0, 1e-12)
    im = ax.imshow(diff if which == "ssm_state" else diff.T, aspect="auto", cmap="coolwarm", vmin=-lim, vmax=lim,
                   interpolation="nearest")
    ax.set_xlabel("state n" if which == "ssm_state" else "window row (oldest first)")
    ax.set_ylabel("channel d")
    where = "" if toks[idx] == token else f" (nearest capture: token {toks[idx]}, ubatch boundary)"
    ax.set_title(f"{which} device - reference, layer {layer}, token {token}{where}", fontsize=9)
    _colorbar(ax, im)
    return ax


def sweep_matrix(sweep: dict, ax, value="first_token"):
    """offload x ubatch matrix of the first-divergence token (or KLD); blank = no divergence."""
    ax.clear()
    offs, ubs = sweep["offloads"], sweep["ubatches"]
    grid = np.full((len(offs), len(ubs)), np.nan)
    for cell in sweep["cells"]:
        i, j = offs.index(cell["offload"]), ubs.index(cell["ubatch"])
        v = cell.get(value)
        grid[i, j] = np.nan if v is None else (v if isinstance(v, (int, float)) else np.nan)
    im = ax.imshow(grid, aspect="auto", origin="lower", cmap="viridis_r", interpolation="nearest")
    for cell in sweep["cells"]:
        i, j = offs.index(cell["offload"]), ubs.index(cell["ubatch"])
        fd = cell.get("first_divergence")
        label = "ok" if fd is None else f"t{fd['token']}\nL{'head' if fd['layer'] is None else fd['layer']}"
        ax.text(j, i, label, ha="center", va="center", fontsize=7, color="black" if fd is None else "white")
    ax.set_xticks(range(len(ubs)), [str(u) for u in ubs])
    ax.set_yticks(range(len(offs)), [str(o) for o in offs])
    ax.set_xlabel("ubatch")
    ax.set_ylabel("offload (-ngl)")
    ax.set_title("first divergence (token, layer) per configuration")
    if np.isfinite(grid).any():          # nothing diverged: no scale to show
        _colorbar(ax, im, label=value)
    return ax
