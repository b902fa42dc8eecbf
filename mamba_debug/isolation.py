"""Damage is detected, not absorbed: a plug-in op that writes into the tensors it was handed is caught by comparing
its inputs, bit for bit, before and after the call (`plugins.checked_op`). The op still receives the very tensors
(strided views included: copying them into contiguous ones would hide the #6758 class of bug); only the snapshot
is a copy. `states_out` is an output buffer the op is meant to fill, so it is not checked.

On a GPU, a call's inputs are copied by one launch of `_isolation_kernel.py` before it and compared by one after it
(per dtype and alignment), not by a copy, `ne` and `any` per input: a 2.8B prefill's ~7000 launches of the check
became ~1500 (benchmarks/README.md, twenty-eighth session). Waiting for the result after every call would leave the
device idle twice per layer and ubatch while the host queues the next kernels, so inside `deferred()` (a Runner's
forward pass) the flags (one per input, on the device) are queued, the snapshot freed at once, and all of them are
settled with one wait when the block ends: the same check and message, once per forward pass. A call outside it (a
kernel called from a notebook) waits once for its own flags."""
from __future__ import annotations

import contextlib
import functools
import threading
from pathlib import Path

import torch

from .errors import PluginError
from .triton_env import exec_file, mode

_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
NOT_CHECKED = frozenset({"states_out"})


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (NaN == NaN, -0.0 != 0.0): a view, no copy."""
    if t.is_floating_point() or t.dtype == torch.bool:
        return t.view(_BITS[t.element_size()])
    return t


def _named(args: tuple, kwargs: dict) -> list:
    """(name, tensor) of every checked tensor argument, detached (a view of the same memory)."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)]
    named += [(k, v) for k, v in kwargs.items() if k not in NOT_CHECKED]
    return [(name, t.detach() if t.requires_grad else t) for name, t in named if isinstance(t, torch.Tensor)]


def snapshot_inputs(args: tuple, kwargs: dict):
    """The inputs' state before an op call. GPU inputs: a `Fused` snapshot (the kernel's copy is queued; outside
    `deferred()` its check then waits once, not once per input). Otherwise (name, the tensor, its bits, a copy of its
    bits) per tensor argument; the bits view is kept for the comparison (on a host-bound GPU run every dispatcher
    call per input and op call counts)."""
    named = _named(args, kwargs)
    deferring = DEFER_ON_CPU and getattr(_LOCAL, "pending", None) is not None
    if named and (named[0][1].is_cuda or deferring):
        fused = Fused.take(named)
        if fused is not None:
            return fused
    return [(name, t, bits, bits.clone()) for name, t in named for bits in (_bits(t),)]


def changed_inputs(snapshot, args: tuple = (), kwargs: dict | None = None) -> list:
    """Names of the inputs whose bits differ from their snapshot (or whose shape changed: resized in place)."""
    if isinstance(snapshot, Fused):
        q = snapshot.queue(str)
        flags, rest = _fetch([q])
        return q.names_hit(flags[0], rest[0])
    return [name for name, t, bits, copy in snapshot if t.shape != copy.shape or not torch.equal(bits, copy)]


class Fused:
    """An op call's inputs checked by `_isolation_kernel.py`: one launch per group of like inputs copies them all
    before the call, one compares them after it. Inputs the kernel does not read (on another device, transposed
    views) are checked the torch way beside them. A resize or a new storage is seen on the host."""

    def __init__(self, names: list, held: list, views: list, plan, snaps: list, rest: list):
        self.names, self.held, self.views, self.plan, self.snaps, self.rest = names, held, views, plan, snaps, rest
        self.queued = None

    @classmethod
    def take(cls, named: list) -> "Fused | None":
        device = named[0][1].device
        sig = tuple((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for _, t in named)
        kept = _PLANS.get(sig)
        if kept is None:
            kept = _PLANS[sig] = _plan(named, device)
        kernel, plan = kept
        if plan is None:
            return None
        views = [_bits(named[i][1]) for i in kernel]
        rest = [(i, bits, bits.clone()) for i, (_, t) in enumerate(named) if i not in kernel and t.numel()
                for bits in (_bits(t),)]
        held = [(t, t.shape, t.stride(), t.data_ptr()) for _, t in named]
        return cls([n for n, _ in named], held, views, plan, plan.copy(views), rest)

    def queue(self, message) -> "Queued":
        """Queue the comparison (once): the flags stay on the device until the forward pass settles them."""
        if self.queued is not None:
            return self.queued
        flags = torch.zeros(len(self.names), dtype=torch.int32, device=self.plan.device)
        self.plan.check(self.views, self.snaps, flags)
        hits = [i for i, (t, shape, stride, ptr) in enumerate(self.held)
                if t.shape != shape or t.stride() != stride or t.data_ptr() != ptr]
        rest = [(i, torch.ne(bits, copy).any()) for i, bits, copy in self.rest]
        self.queued = Queued(message, self.names, flags, rest, hits)
        self.views = self.held = self.rest = self.snaps = None            # the copies are freed here
        return self.queued


class Queued:
    """One op call's queued check: its device flags (int per input, or None), torch-way flags [(input, 0-d bool)]
    and the inputs found changed on the host."""

    def __init__(self, message, names: list, flags, rest: list, hits: list):
        self.message, self.names, self.flags, self.rest, self.hits = message, names, flags, rest, hits

    def names_hit(self, flags: list, rest: list) -> list:
        hit = set(self.hits) | {i for i, f in enumerate(flags) if f} | {i for (i, _), f in zip(self.rest, rest) if f}
        return [self.names[i] for i in sorted(hit)]


_PLANS: dict = {}                    # the inputs' signature -> (kernel inputs' indices, their Plan or None)
MAX_PLANS = 1024


def _plan(named: list, device) -> tuple:
    """Which inputs the kernel reads (on `device`, not empty, rows of unit-stride elements) and their Plan; no Plan
    when the kernel file cannot be loaded for this device (a process whose Triton was first imported interpreted
    cannot compile it: the torch way, the same check)."""
    module = _kernel_module(device.type == "cpu")
    if module is None:
        return (), None
    lays = [module.layout(t) if t.device == device and t.numel() else None for _, t in named]
    kernel = [i for i, lay in enumerate(lays) if lay is not None]
    if not kernel:
        return (), None
    if len(_PLANS) >= MAX_PLANS:
        _PLANS.clear()
    views = [_bits(named[i][1]) for i in kernel]
    return tuple(kernel), module.Plan(views, [lays[i] for i in kernel], kernel)


@functools.lru_cache(maxsize=None)
def _kernel_module(interpret: bool):
    """_isolation_kernel.py executed for one mode, once per process (as metrics._fused_copy does with the metrics
    kernel), or None if Triton cannot give that mode here."""
    try:
        if interpret:
            import triton  # noqa: F401, PLC0415
        path = Path(__file__).with_name("_isolation_kernel.py")
        with mode(interpret):
            return exec_file(path, f"mamba_debug._isolation_kernel_{'interpret' if interpret else 'cuda'}")
    except ImportError:
        return None


# inside deferred(), per thread: the Queued checks of its GPU calls
_LOCAL = threading.local()
DEFER_ON_CPU = False              # tests: the deferred path without a GPU


def defer(snapshot, message) -> bool:
    """Queue the check of one call's inputs (inside `deferred()`, GPU inputs): True if queued. message(names) is the
    error for the inputs found changed."""
    pending = getattr(_LOCAL, "pending", None)
    if pending is None or not snapshot:
        return False
    if isinstance(snapshot, Fused):
        pending.append(snapshot.queue(message))
        return True
    if not (snapshot[0][1].is_cuda or DEFER_ON_CPU):
        return False
    hits = [i for i, (_, t, _, copy) in enumerate(snapshot) if t.shape != copy.shape]
    rest = [(i, torch.ne(bits, copy).any()) for i, (_, t, bits, copy) in enumerate(snapshot) if i not in hits]
    pending.append(Queued(message, [name for name, *_ in snapshot], None, rest, hits))
    return True


def defer_flag(flag: torch.Tensor, message: str) -> bool:
    """Queue a 0-d bool tensor that is true for an error (inside `deferred()`, a GPU tensor): True if queued."""
    pending = getattr(_LOCAL, "pending", None)
    if pending is None or not (flag.is_cuda or DEFER_ON_CPU):
        return False
    pending.append(Queued(lambda _names: message, ["flag"], None, [(0, flag)], []))
    return True


@contextlib.contextmanager
def deferred():
    """Checks queued by `defer` inside this block (in this thread) are settled at its end with one wait; nested
    blocks settle in the outermost. An op that wrote into its inputs is reported even when the block ends in an
    error (the write is then the likelier cause)."""
    if getattr(_LOCAL, "pending", None) is not None:
        yield
        return
    _LOCAL.pending = pending = []
    try:
        yield
    except BaseException as exc:
        _LOCAL.pending = None
        _settle(pending, cause=exc)
        raise
    _LOCAL.pending = None
    _settle(pending)


def _settle(pending: list, cause=None):
    """One wait for every queued flag; the first call found to have written into its inputs raises."""
    for q, (flags, rest) in zip(pending, zip(*_fetch(pending))):
        names = q.names_hit(flags, rest)
        if names:
            raise PluginError(q.message(names)) from cause


def _fetch(pending: list) -> tuple:
    """Every queued call's device flags and torch-way flags, read with one wait: ([flags per call], [rest per
    call]), each a list of ints."""
    ints = [q.flags for q in pending if q.flags is not None]
    bools = [f for q in pending for _, f in q.rest]
    device = (ints or bools or [None])[0]
    if device is None:
        return [[] for _ in pending], [[] for _ in pending]
    device = device.device
    # a placement over GPUs: the flags onto one device first
    one = [f if f.device == device else f.to(device) for f in ints + bools]
    ints, bools = one[:len(ints)], one[len(ints):]
    flat = torch.cat(ints + ([torch.stack(bools).to(torch.int32)] if bools else [])).cpu().tolist()   # one wait
    out_flags, out_rest, i = [], [], 0
    for q in pending:
        n = len(q.flags) if q.flags is not None else 0
        out_flags.append(flat[i:i + n])
        i += n
    for q in pending:
        out_rest.append(flat[i:i + len(q.rest)])
        i += len(q.rest)
    return out_flags, out_rest
