"""The torch side: one `Runner` and the capture of its sites. It serves as both reference sides (float32, float64
plain torch ops) and as the device side (the Triton kernels or a user's plug-in, placed like llama.cpp's -ngl).

A device side below its offload boundary runs exactly the float32 host ops that ref32 runs, so it does not compute
those blocks again: built with `prefix_from=ref32`, it steps after ref32, starts at the boundary from ref32's hidden
state and reports ref32's host-block tensors as its own (they *are* its run). Compare never decides that for it.
"""
from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from ..arch import site_order
from ..metric_block import SiteErrors
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
    metrics is ever asked of it. Sites are measured together, whole layers at a time, once the layers waiting hold
    `held_cap` bytes of device sites (and at the ubatch's end): on a GPU one launch of the fused kernel per group of
    16 like sites and one combine launch per call, each site read where it lies (`metrics.site_errors_many`). A
    launch costs the host 20-30 us on the H200's machine, and a traced run there is bound by its host: a 2.8B
    layer's 15 sites took three launches when every layer was measured on its own, and take about 1.5 a layer with
    four layers a call. The layers waiting cost their sites' memory for a while (~0.3 GB a 2.8B layer at ubatch 512;
    `budget` counts every device site of a ubatch anyway).

    `beside` (`MAMBA_DEBUG_SIDE_STREAM=1`, off): on a GPU, the waiting layers' sites are measured on a side stream
    beside the next layer's kernels (`_beside`), the same bits. Timed on an H100 on 2026-12-05
    (benchmarks/gpu_tracing.py, two calls, a layer a measurement): no better than the run's own stream (1.35-1.41x
    against 1.17-1.31x; at CUDA priority -1 1.20-1.41x): the run is host-bound there and the side stream adds host
    work.
    """

    beside = os.environ.get("MAMBA_DEBUG_SIDE_STREAM", "0") == "1"    # measure on a side stream (`_beside`)
    side_priority = 0  # the side stream's CUDA priority: 0 the default streams' (lowest), -1 ahead of the run's
    held_cap = 1 << 30  # bytes of device sites waiting to be measured before the next layer's start measures them

    def __init__(self, to_host: bool = True):
        self.to_host = to_host
        self.values: dict = {}
        self.pending = False       # non-blocking copies issued since the last take()
        self.against: Optional[dict] = None
        self.born: list = []       # sites waiting to be measured: (key, per_token, (dev, ref), at_end)
        self.held = 0              # their device values' bytes
        self.joining = None        # the side stream with this ubatch's measurements in flight

    def site(self, layer, site, value, per_token):
        if value.requires_grad:    # detach() makes a new view: a dispatcher call per site, skipped when not needed
            value = value.detach()
        ref = self.against.get((layer, site)) if self.against is not None else None
        born = birth_pair(value, per_token, *ref) if ref is not None else None
        if born is not None:
            if self.held >= self.held_cap and self.born and self.born[-1][0][0] != layer:
                self._measure_born()
            self.born.append(((layer, site), per_token, *born))
            self.held += value.nbytes
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
        born, self.born, self.held = self.born, [], 0
        if not born:
            return
        pairs = [pair for _, _, pair, _ in born]
        on_gpu = self.beside and all(d.is_cuda and r.is_cuda and d.device == r.device for d, r in pairs)
        errors = _beside(pairs, self) if on_gpu else site_errors_many(pairs)
        for (key, per_token, _, at_end), e in zip(born, errors):
            self.values[key] = (Measured(e, at_end), per_token)

    def take(self) -> dict:
        self._measure_born()
        if self.joining is not None:   # the ubatch's measurements done before anything reads them or writes a state
            torch.cuda.current_stream(self.joining.device).wait_stream(self.joining)
            self.joining = None
        self.against = None        # this ubatch's reference values: not held past it
        if self.pending:           # the one wait of this ubatch: every copy above has landed after it
            torch.cuda.synchronize()
            self.pending = False
        values, self.values = self.values, {}
        return values


def _beside(pairs: list, capture: Capture) -> list:
    """`site_errors_many` of the waiting layers' CUDA pairs on a side stream, beside the next layer's kernels: the
    metrics kernel is bound by memory bandwidth, the next layer's GEMMs by arithmetic and its scan by one dependent
    chain per program, so on the run's own stream the metrics added their whole time to a traced run (~9.5% of a
    2.8B prefill, issue #18 goal 1), and beside it they were meant to hide (measured: they do not, see Capture). The
    side stream starts after everything the run queued so far (the sites are final); each pair's memory is not
    reused before the side stream has read it (`record_stream`), the result blocks not before the run's stream is
    done with them; `take()` joins the side stream to the run's before the ubatch's metrics are read or a state is
    written in place."""
    device = pairs[0][1].device
    main, side = torch.cuda.current_stream(device), _side_stream(device, capture.side_priority)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        errors = site_errors_many(pairs)
    for dev, ref in pairs:
        dev.record_stream(side)
        ref.record_stream(side)
    for block in {id(b): b for b in map(_block_of, errors)}.values():
        block.record_stream(main)
    capture.joining = side
    return errors


@functools.lru_cache(maxsize=None)
def _side_stream(device: torch.device, priority: int) -> "torch.cuda.Stream":
    return torch.cuda.Stream(device, priority=priority)


def _block_of(errors) -> torch.Tensor:
    """The tensor a pair's metrics lie in: a SiteErrors' result block, else (an empty site) its first metric."""
    return errors.block if isinstance(errors, SiteErrors) else next(iter(errors.values()))


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
        self.from_shared = False     # the last step's output came from the shared reference (already checked)
        self.capture = _Local(to_host, self) if local_of is not None else Capture(to_host)
        runner.observer = self.capture
        placement = runner.placement
        self.start = min(placement.first_device_layer, model.config.n_layer) if prefix_from is not None else 0
        self.has_device = placement.n_device_layers > 0 or placement.head_on_device
        self.keep_states_after_from: Optional[int] = None   # ubatch index from which states_after are kept
        self.u = -1
        self.last: Optional[StepOutput] = None

    def reset(self, settings: RunSettings, n_seqs: int, first_seq: int = 0, n_tokens: int = 0):
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
        self.from_shared = cached is not None
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
        """One ubatch with nothing observed (the device's own generation, after the comparison): logits. The
        observer comes back after: the next group of sequences runs on this side too."""
        observer, self.runner.observer = self.runner.observer, None
        try:
            return self.runner.forward(tokens)
        finally:
            self.runner.observer = observer
