"""Which layers run on the device: llama.cpp's `-ngl N` rules.

`llama2024` (llama.cpp until Dec 2025): the last N repeating blocks go to the device,
i_gpu_start = max(n_layer - N, 0); the output head (final norm + lm_head) too when N > n_layer.
`llama2025` (PR #18148): the output layer counts as the first offloaded slot,
i_gpu_start = max(n_layer + 1 - N, 0), and the head is on the device for any N >= 1.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import MambaDebugError

RULES = ("llama2024", "llama2025")


@dataclass(frozen=True)
class Placement:
    n_layer: int
    offload: int              # as given (llama.cpp clamps big values, e.g. -ngl 99)
    rule: str = "llama2024"

    def __post_init__(self):
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

    def describe(self) -> str:
        head = "head on device" if self.head_on_device else "head on host"
        if self.n_device_layers == 0:
            return f"offload {self.offload}: all {self.n_layer} blocks on host, {head}"
        return (f"offload {self.offload}: blocks {self.first_device_layer}..{self.n_layer - 1} on device, "
                f"{head} ({self.rule})")
