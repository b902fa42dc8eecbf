"""The logits view: KL(reference || device) per token, tokens whose top-1 differs marked."""
from __future__ import annotations

import numpy as np

from ..trace import CompareResult
from .base import View, ViewState, fresh_axes


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


class LogitsView(View):
    name = "logits"
    title = "Logits"
    depends = frozenset({"seq"})
    figsize = (9.0, 2.6)
    width = "full"

    def draw(self, fig, res: CompareResult, v: ViewState) -> np.ndarray:
        """KLD per token of the chosen sequence; returns it."""
        ax = fresh_axes(fig)
        logits_curve(res, ax, seq=v.seq)
        ax.set_title(f"logits: KL divergence per token, seq {v.seq} (x: top-1 differs)", fontsize=9)
        return res.logits["kld"][v.seq].numpy()

    def report_states(self, res: CompareResult) -> list:
        return [(self.title, ViewState(seq=ViewState.at_first_divergence(res).seq))]


VIEW = LogitsView()
