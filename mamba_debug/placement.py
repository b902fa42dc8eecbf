"""Which layers run on the device: llama.cpp's `-ngl N` rules.

`llama2024` (llama.cpp until Dec 2025): the last N repeating blocks go to the device,
i_gpu_start = max(n_layer - N, 0); the output head (final norm + lm_head) too when N > n_layer.
`llama2025` (PR #18148): the output layer counts as the first offloaded slot,
i_gpu_start = max(n_layer + 1 - N, 0), and the head is on the device for any N >= 1.

Several devices (`--devices cuda:0,cuda:1 --tensor-split 3,1`, llama.cpp's `--split-mode layer`): the offloaded
slots (the blocks from i_gpu_start on, then the head) are spread over the devices in order, as llama.cpp's
`llama_model::load_tensors` does: the shares' cumulative sums, normalised, are split points, and slot `il` goes to
the first device whose split point is strictly above (il - i_gpu_start) / act_gpu_layers (std::upper_bound), with
act_gpu_layers = min(N, n_layer + 1), all in float32 as there. A device's slot is its position in the list, so the
same name may appear twice (CPU stand-ins `cpu,cpu`, or two slots on one GPU): each is a device of its own here.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .errors import MambaDebugError

RULES = ("llama2024", "llama2025")
MAX_DEVICES = 16            # llama.cpp's LLAMA_MAX_DEVICES: the length of its tensor_split array


def check_split(devices: tuple, tensor_split: tuple) -> None:
    """--devices and --tensor-split against each other: counts, signs, finiteness, not all zero."""
    if tensor_split and not devices:
        raise MambaDebugError("--tensor-split needs --devices: name the devices the shares are for "
                              "(e.g. --devices cuda:0,cuda:1 --tensor-split 3,1)")
    if not devices:
        return
    if len(devices) > MAX_DEVICES:
        raise MambaDebugError(f"--devices lists {len(devices)} devices; llama.cpp splits over at most {MAX_DEVICES}")
    if any(not isinstance(d, str) or not d.strip() for d in devices):
        raise MambaDebugError(f"--devices has an empty name in {list(devices)}; give e.g. --devices cuda:0,cuda:1")
    if not tensor_split:
        return
    if len(tensor_split) != len(devices):
        raise MambaDebugError(f"--tensor-split has {len(tensor_split)} value(s) for {len(devices)} device(s) "
                              f"(--devices {','.join(devices)}): give one share per device, e.g. "
                              f"{','.join(['1'] * len(devices))}")
    for x in tensor_split:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
            raise MambaDebugError(f"--tensor-split shares must be finite numbers >= 0, got {list(tensor_split)}")
    with np.errstate(over="ignore"):        # llama.cpp takes the shares and their sum in float32
        shares = [np.float32(x) for x in tensor_split]
        total = np.float32(sum(shares))
    if not any(shares):
        raise MambaDebugError(f"--tensor-split {','.join(map(_num, tensor_split))} gives every device a share of "
                              f"0 in float32 (llama.cpp would then split by free memory, which mamba-debug cannot "
                              f"know): give at least one share > 0")
    if not np.isfinite(total):
        raise MambaDebugError(f"--tensor-split {','.join(map(_num, tensor_split))}: the shares add up past float32's "
                              f"range, where llama.cpp sums them; give smaller shares (only their ratios count)")


def _num(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def split_points(shares: tuple) -> list:
    """llama.cpp's split points: cumulative sums of the shares divided by their total, in float32."""
    acc, cum = np.float32(0.0), []
    for x in shares:
        acc = np.float32(acc + np.float32(x))
        cum.append(acc)
    return [np.float32(c / acc) for c in cum]


@dataclass(frozen=True)
class Placement:
    n_layer: int
    offload: int              # as given (llama.cpp clamps big values, e.g. -ngl 99)
    rule: str = "llama2024"
    devices: tuple = ()        # the device slots in order (--devices); () = one device
    tensor_split: tuple = ()   # each slot's share (--tensor-split); () = equal shares

    def __post_init__(self):
        for name in ("n_layer", "offload"):     # numpy's integers as Python's (the checks below want an int)
            v = getattr(self, name)
            if isinstance(v, np.integer):
                object.__setattr__(self, name, int(v))
        object.__setattr__(self, "devices", tuple(self.devices or ()))
        object.__setattr__(self, "tensor_split", tuple(self.tensor_split or ()))
        check_split(self.devices, self.tensor_split)
        if self.rule not in RULES:
            raise MambaDebugError(f"unknown placement rule {self.rule!r}; choose one of {RULES}")
        if not isinstance(self.offload, int) or self.offload < 0:
            raise MambaDebugError(f"offload must be an integer >= 0 (like -ngl), got {self.offload!r}")

    @property
    def first_device_layer(self) -> int:
        """L0: the first block on the device (== n_layer when no block is offloaded)."""
        slots = self.n_layer if self.rule == "llama2024" else self.n_layer + 1
        return max(slots - self.offload, 0) if self.offload else self.n_layer

    @property
    def head_on_device(self) -> bool:
        if self.rule == "llama2024":
            return self.offload > self.n_layer
        return self.offload >= 1

    def on_device(self, layer: int) -> bool:
        return layer >= self.first_device_layer

    @property
    def n_device_layers(self) -> int:
        return self.n_layer - self.first_device_layer

    # -- several devices --------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return max(1, len(self.devices))

    @property
    def shares(self) -> tuple:
        """Each slot's share: --tensor-split, or equal shares (llama.cpp's default splits by free memory, which for
        identical GPUs is about equal)."""
        return self.tensor_split or (1.0,) * self.n_slots

    def _slot(self, il: int) -> Optional[int]:
        """llama.cpp's get_layer_buft_list: the device slot of block il (il == n_layer: the output head), None on
        the host."""
        slots = self.n_layer if self.rule == "llama2024" else self.n_layer + 1
        i_gpu_start = max(slots - self.offload, 0)
        act = min(self.offload, self.n_layer + 1)
        if il < i_gpu_start or il - i_gpu_start >= act:
            return None
        if self.n_slots == 1:
            return 0
        frac = np.float32(il - i_gpu_start) / np.float32(act)
        return bisect.bisect_right(split_points(self.shares), frac)

    def layer_slot(self, layer: int) -> Optional[int]:
        return self._slot(layer)

    @property
    def layer_slots(self) -> tuple:
        return tuple(self._slot(i) for i in range(self.n_layer))

    @property
    def head_slot(self) -> Optional[int]:
        return self._slot(self.n_layer)

    def slot_name(self, slot: Optional[int]) -> str:
        """'host', the device's name, or name#slot where a name is listed twice (stand-ins)."""
        if slot is None:
            return "host"
        if not self.devices:
            return "device"
        name = self.devices[slot]
        return name if self.devices.count(name) == 1 else f"{name}#{slot}"

    @property
    def device_boundaries(self) -> list:
        """Where the hidden state goes from one device to another: the blocks (n_layer: the head) whose input
        comes from a block on another device slot (the host | device boundary is not one of them)."""
        slots = list(self.layer_slots) + [self.head_slot]
        return [i for i in range(1, len(slots))
                if slots[i] is not None and slots[i - 1] is not None and slots[i] != slots[i - 1]]

    def describe(self) -> str:
        head = "head on device" if self.head_on_device else "head on host"
        if self.n_device_layers == 0:
            text = f"offload {self.offload}: all {self.n_layer} blocks on host, {head}"
        else:
            text = (f"offload {self.offload}: blocks {self.first_device_layer}..{self.n_layer - 1} on device, "
                    f"{head} ({self.rule})")
        return text + ("; " + self.describe_split() if self.devices else "")

    def describe_split(self) -> str:
        """'split 3:1 over cuda:0 (blocks 0..2), cuda:1 (block 3, head)'."""
        parts = []
        slots = self.layer_slots
        for k in range(self.n_slots):
            blocks = [i for i, s in enumerate(slots) if s == k]
            what = ([f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}..{blocks[-1]}"]
                    if blocks else []) + (["head"] if self.head_slot == k else [])
            parts.append(f"{self.slot_name(k)} ({', '.join(what) or 'nothing'})")
        return f"split {':'.join(_num(x) for x in self.shares)} over " + ", ".join(parts)
