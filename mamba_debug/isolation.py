"""Damage is detected, not absorbed: a plug-in op that writes into the tensors it was handed is caught by comparing
its inputs, bit for bit, before and after the call (`plugins.checked_op`). The op still receives the very tensors
(strided views included: copying them into contiguous ones would hide the #6758 class of bug); only the snapshot
is a copy. `states_out` is an output buffer the op is meant to fill, so it is not checked.

On a GPU, comparing after every call (`torch.equal`) waits for the GPU each time: about two waits per layer and
ubatch, each leaving the device idle while the host queues the next kernels. Inside `deferred()` (a Runner's forward
pass) the comparison of GPU inputs is queued instead (a flag on the device per input, the snapshot freed at once)
and settled with one wait when the block ends: the same check and message, once per forward pass."""
from __future__ import annotations

import contextlib
import threading

import torch

from .errors import PluginError

_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
NOT_CHECKED = frozenset({"states_out"})


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (NaN == NaN, -0.0 != 0.0): a view, no copy."""
    if t.is_floating_point() or t.dtype == torch.bool:
        return t.view(_BITS[t.element_size()])
    return t


def snapshot_inputs(args: tuple, kwargs: dict) -> list:
    """(name, the tensor, its bits, a copy of its bits) for every tensor argument. The bits view is kept for the
    comparison: on a host-bound GPU run every dispatcher call per input and op call counts."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)]
    named += [(k, v) for k, v in kwargs.items() if k not in NOT_CHECKED]
    return [(name, t, bits, bits.clone()) for name, t in named if isinstance(t, torch.Tensor)
            for bits in (_bits(t.detach() if t.requires_grad else t),)]


def changed_inputs(snapshot: list, args: tuple = (), kwargs: dict | None = None) -> list:
    """Names of the inputs whose bits differ from their snapshot (or whose shape changed: resized in place)."""
    return [name for name, t, bits, copy in snapshot if t.shape != copy.shape or not torch.equal(bits, copy)]


# inside deferred(), per thread: (message, [(input name, device flag)]) per checked GPU call
_LOCAL = threading.local()
DEFER_ON_CPU = False              # tests: the deferred path without a GPU


def defer(snapshot: list, message) -> bool:
    """Queue the check of one call's inputs (inside `deferred()`, GPU inputs): True if queued. message(names) is the
    error for the inputs found changed."""
    pending = getattr(_LOCAL, "pending", None)
    if pending is None or not snapshot or not (snapshot[0][1].is_cuda or DEFER_ON_CPU):
        return False
    flags = [(name, torch.tensor(True, device=t.device) if t.shape != copy.shape else torch.ne(bits, copy).any())
             for name, t, bits, copy in snapshot]
    pending.append((message, flags))
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
    flat = [f for _, flags in pending for _, f in flags]
    if not flat:
        return
    device = flat[0].get_device()
    if any(f.get_device() != device for f in flat):    # a placement over GPUs: the flags onto one device first
        flat = [f.to(flat[0].device) for f in flat]
    found = torch.stack(flat).cpu().tolist()           # one stack, one wait (no dispatcher call per flag)
    i = 0
    for message, flags in pending:
        names = [name for (name, _), hit in zip(flags, found[i:i + len(flags)]) if hit]
        i += len(flags)
        if names:
            raise PluginError(message(names)) from cause
