"""The side seam: what compare asks of every engine it runs in lock step (the torch runner today, llama.cpp next).

A side runs the ubatch schedule it is given, one ubatch per `step`, and reports what it computed as a
`StepOutput`: logits and the sites it observed. A site it did not observe is absent: compare records NaN there and
draws it as "not observed"; it is never filled from another side (a copy of the reference reads as error 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol

import torch

from ..settings import RunSettings
from ..trace import SideInfo

__all__ = ["SharedReference", "Side", "SideInfo", "StepOutput"]


@dataclass
class StepOutput:
    logits: torch.Tensor                      # [S, T, V]
    sites: dict                               # (layer, site) -> (value, per_token): [S, T, ...] or [S, ...]
    states_before: Optional[list] = None      # every layer's states at the ubatch's start, when asked to keep them
    states_after: Optional[list] = None       # ... and at its end


class Side(Protocol):
    info: SideInfo

    # first_seq: the slot of sequence 0; n_tokens: the most tokens a sequence will hold (prompt and generated)
    def reset(self, settings: RunSettings, n_seqs: int, first_seq: int = 0, n_tokens: int = 0) -> None: ...

    def observed_sites(self) -> frozenset: ...

    def step(self, tokens: torch.Tensor) -> StepOutput: ...     # one ubatch [S, T], from its current states

    def save_state(self) -> object: ...                         # for the device's free-running generation

    def load_state(self, state: object) -> None: ...


class SharedReference:
    """A sweep's reference runs, shared by cells that differ only in what the reference does not depend on
    (offload, kernels, device): per ubatch, the reference sides' `StepOutput`s and the sites' noise floors.

    Read only once a run has completed it, and written only when a run completes: an interrupted run must not
    leave half a reference behind for the next one."""

    def __init__(self, shared: Optional[dict]):
        self.shared = shared
        complete = shared is not None and shared.get("complete")
        self.data = shared if complete else {"steps": {}, "floors": {}}
        self.reading = bool(complete)

    def cached(self, side: str, u: int) -> Optional[StepOutput]:
        steps = self.data["steps"].get(side, [])
        return steps[u] if self.reading and u < len(steps) else None

    def store(self, side: str, u: int, out: StepOutput):
        if self.shared is not None and not self.reading:   # kept for the sweep's next runs only
            self.data["steps"].setdefault(side, []).append(out)

    def floors(self, u: int) -> dict:
        """This ubatch's floor per site, shared by every run over the same reference (filled by the first)."""
        return self.data["floors"].setdefault(u, {})

    def complete(self):
        if self.shared is not None and not self.reading:
            self.shared.update(self.data, complete=True)
