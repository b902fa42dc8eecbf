"""Damage is detected, not absorbed: a plug-in op that writes into the tensors it was handed is caught by comparing
its inputs, bit for bit, before and after the call (`plugins.checked_op`). The op still receives the very tensors
(strided views included: copying them into contiguous ones would hide the #6758 class of bug); only the snapshot
is a copy. `states_out` is an output buffer the op is meant to fill, so it is not checked."""
from __future__ import annotations

import torch

_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
NOT_CHECKED = frozenset({"states_out"})


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (NaN == NaN, -0.0 != 0.0): a view, no copy."""
    if t.is_floating_point() or t.dtype == torch.bool:
        return t.view(_BITS[t.element_size()])
    return t


def snapshot_inputs(args: tuple, kwargs: dict) -> list:
    """(name, the tensor, a copy of it) for every tensor argument."""
    named = [(f"argument {i}", a) for i, a in enumerate(args)]
    named += [(k, v) for k, v in kwargs.items() if k not in NOT_CHECKED]
    return [(name, t, t.detach().clone()) for name, t in named if isinstance(t, torch.Tensor)]


def changed_inputs(snapshot: list, args: tuple = (), kwargs: dict | None = None) -> list:
    """Names of the inputs whose bits differ from their snapshot."""
    return [name for name, t, copy in snapshot if t.shape != copy.shape or not torch.equal(_bits(t), _bits(copy))]
