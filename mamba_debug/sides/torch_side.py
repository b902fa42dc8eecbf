"""The torch side: one `Runner` and the capture of its sites. It serves as both reference sides (float32, float64
plain torch ops) and as the device side (the Triton kernels or a user's plug-in, placed like llama.cpp's -ngl).

A device side below its offload boundary runs exactly the float32 host ops that ref32 runs, so it does not compute
those blocks again: built with `prefix_from=ref32`, it steps after ref32, starts at the boundary from ref32's hidden
state and reports ref32's host-block tensors as its own (they *are* its run). Compare never decides that for it.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..arch import site_order
from ..metrics import Measured, birth_pair, site_errors_many
from ..model import Model, Runner
from ..settings import RunSettings
from ..trace import SideInfo
from .base import SharedReference, StepOutput


class Capture:
    """The observer of one runner: keeps this ubatch's site values, keyed (layer, site).

    to_host=True (reference on the CPU): every value is copied to the CPU. A CUDA value goes into pinned host
    memory with a non-blocking copy, so the GPU is not stalled at each of the ~15 sites per layer, and `take()`
    waits once per ubatch for all of them (a pageable `.to("cpu")` syncs and stages every tensor). The pinned
    blocks come from torch's caching host allocator: from the second ubatch on the same sizes are reused.
    to_host=False (reference on the GPU): values stay on their device; only metrics go to the host later.
    Either way the value is a copy, as an op may later write into a tensor it was handed (a state) in place.

    `against` (set by compare for one ubatch, capture='metrics'): the reference's site values of this ubatch. A site
    found there is measured where it is born and kept as its `Measured` errors, never copied: nothing but its
    metrics is ever asked of it. A layer's sites are measured together when the next layer starts (on a GPU one or
    two launches of the fused kernel, each site read where it lies: `metrics.site_errors_many`).
    """

    def __init__(self, to_host: bool = True):
        self.to_host = to_host
        self.values: dict = {}
        self.pending = False       # non-blocking copies issued since the last take()
        self.against: Optional[dict] = None
        self.born: list = []       # this layer's sites to measure: (key, per_token, (dev, ref), at_end)

    def site(self, layer, site, value, per_token):
        value = value.detach()
        ref = self.against.get((layer, site)) if self.against is not None else None
        born = birth_pair(value, per_token, *ref) if ref is not None else None
        if born is not None:
            if self.born and self.born[-1][0][0] != layer:
                self._measure_born()
            self.born.append(((layer, site), per_token, *born))
            return
        if self.to_host and value.is_cuda:
            copy = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            copy.copy_(value, non_blocking=True)
            self.pending = True
        elif self.to_host:
            copy = value.to("cpu", copy=True)
        else:
            copy = value.clone()
        self.values[(layer, site)] = (copy, per_token)

    def _measure_born(self):
        born, self.born = self.born, []
        for (key, per_token, _, at_end), e in zip(born, site_errors_many([pair for _, _, pair, _ in born])):
            self.values[key] = (Measured(e, at_end), per_token)

    def take(self) -> dict:
        self._measure_born()
        self.against = None        # this ubatch's reference values: not held past it
        if self.pending:           # the one wait of this ubatch: every copy above has landed after it
            torch.cuda.synchronize()
            self.pending = False
        values, self.values = self.values, {}
        return values


class _Local(Capture):
    """Capture plus local mode: every device block gets the reference's input and states of this ubatch, so its
    error is its own, nothing inherited."""

    def __init__(self, to_host: bool, side: "TorchSide"):
        super().__init__(to_host)
        self.side = side

    def before_layer(self, i, h, states):
        runner, ref = self.side.runner, self.side.local_of.last
        if not runner.placement.on_device(i):
            return h, states
        b = runner.layer_backends[i]
        h_in = ref.sites[(i - 1, "resid")][0] if i > 0 else self.side.embedded
        cast = lambda t: t.to(device=b.device, dtype=b.dtype, copy=True)  # noqa: E731 (never the reference's own)
        return cast(h_in), {k: cast(v) for k, v in ref.states_before[i].items()}


class TorchSide:
    """A `Side` over one Runner. prefix_from: the side whose host blocks this one shares (see the module docstring);
    report_prefix: report those blocks' sites as its own (the device side does; a repeat run compares only what it
    computed); local_of: run in local mode against that (reference) side; shared: a sweep's shared reference."""

    def __init__(self, info: SideInfo, model: Model, runner: Runner, *, to_host: bool = True,
                 prefix_from: Optional["TorchSide"] = None, report_prefix: bool = True,
                 local_of: Optional["TorchSide"] = None, shared: Optional[SharedReference] = None,
                 keep_states_before: bool = False):
        self.info, self.model, self.runner = info, model, runner
        self.prefix_from, self.report_prefix, self.local_of = prefix_from, report_prefix, local_of
        self.shared, self.keep_states_before = shared, keep_states_before
        self.capture = _Local(to_host, self) if local_of is not None else Capture(to_host)
        runner.observer = self.capture
        placement = runner.placement
        self.start = min(placement.first_device_layer, model.config.n_layer) if prefix_from is not None else 0
        self.has_device = placement.n_device_layers > 0 or placement.head_on_device
        self.keep_states_after_from: Optional[int] = None   # ubatch index from which states_after are kept
        self.u = -1
        self.last: Optional[StepOutput] = None

    def reset(self, settings: RunSettings, n_seqs: int, first_seq: int = 0):
        self.runner.reset(n_seqs)
        self.u, self.last = -1, None

    def observed_sites(self) -> frozenset:
        return frozenset(site_order(self.model.config))

    def measure_against(self, sites: Optional[dict]):
        """The next step's sites found in `sites` (the reference's of the same ubatch) are measured at birth (see
        Capture); the logits always come as a value (the Accumulator's logit statistics need it)."""
        self.capture.against = None if sites is None else {k: v for k, v in sites.items() if k[0] is not None
                                                           or k[1] != "logits"}

    def step(self, tokens: torch.Tensor) -> StepOutput:
        self.u += 1
        cached = self.shared.cached(self.info.name, self.u) if self.shared is not None else None
        if cached is not None:
            self.last = cached
            return cached
        out = self._prefixed(tokens) if self.prefix_from is not None else self._run(tokens)
        if self.shared is not None:
            self.shared.store(self.info.name, self.u, out)
        self.last = out
        return out

    def _run(self, tokens) -> StepOutput:
        before = self.runner.save_states() if self.keep_states_before else None
        if self.local_of is not None:
            self.embedded = self.runner.embed(tokens)
        logits = self.runner.forward(tokens)
        after = (self.runner.save_states() if self.keep_states_after_from is not None
                 and self.u >= self.keep_states_after_from else None)
        return StepOutput(logits, self.capture.take(), states_before=before, states_after=after)

    def _prefixed(self, tokens) -> StepOutput:
        prefix = self.prefix_from.last                      # this ubatch's run of the shared host blocks
        if not self.has_device:
            return StepOutput(prefix.logits, dict(prefix.sites))
        h0 = prefix.sites[(self.start - 1, "resid")][0].clone() if self.start > 0 else None   # not ref32's own
        logits = self.runner.forward(tokens, resume=(self.start, h0))
        sites = self.capture.take()
        if self.report_prefix:
            for key, val in prefix.sites.items():          # the host blocks (and a host head) ran in the prefix
                sites.setdefault(key, val)
        return StepOutput(logits, sites)

    def save_state(self) -> list:
        """Every layer's states now: the shared host blocks' from the prefix side's run, the rest its own."""
        own = self.runner.save_states()
        if self.prefix_from is None:
            return own
        host = self.prefix_from.last.states_after
        return [host[i] if i < self.start else own[i] for i in range(len(own))]

    def load_state(self, state: list):
        self.runner.load_states(state)

    def free_step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One ubatch with nothing observed (the device's own generation, after the comparison): logits."""
        self.runner.observer = None
        return self.runner.forward(tokens)
