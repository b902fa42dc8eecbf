"""What every layer type declares, and what one block sees while it runs (the layer-type seam).

A `LayerType` (Mamba-1, Mamba-2, attention) names its sites in graph order, its states, the ops it
calls and the parameter shapes a config implies, and runs one block in `layer(ctx, h)`. The Runner (model.py)
knows none of this: it allocates each block's states from the `StateSpec`s, hands the block a `LayerContext`, and
carries the hidden state from block to block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Protocol

import torch

from ..config import ModelConfig
from ..ops import OpTable

SiteKey = tuple  # (layer | None, site): layer None is model level ("final_norm", "logits")
MODEL_SITES = ("final_norm", "logits")


@dataclass(frozen=True)
class StateSpec:
    """One recurrent state of a block, per sequence: `shape(cfg)` without the leading S.

    per_token: the op can also hand out this state after every token (ssm_scan's `states_out`), so the tracer can
    compare it token by token instead of at ubatch ends only.
    grows: the first dim of `shape` is tokens (0 at the start): the state is allocated empty and the layer
    appends T rows per ubatch (an attention KV cache); the Runner treats it like any other state."""
    name: str
    shape: Callable[[ModelConfig], tuple]
    per_token: bool = False
    grows: bool = False


@dataclass
class LayerContext:
    """What one block sees in one ubatch."""
    index: int                                  # the layer's number
    cfg: ModelConfig
    ops: OpTable                                # the host or device table the placement chose
    w: Mapping[str, torch.Tensor]               # this layer's parameters, names without "layers.{i}."
    states: dict                                # name -> tensor, read at the start; the layer assigns the new ones
    site: Callable[..., None]                   # site(name, value, per_token=True)
    want_states_out: bool                       # someone observes per-token states and the ops can write them
    dtype: torch.dtype = torch.float32
    device: Optional[torch.device] = None


class LayerType(Protocol):
    name: str                                   # "mamba1"
    sites: tuple                                # graph order: the public vocabulary of traces and reports
    states: tuple                               # StateSpecs
    ops: tuple                                  # op names it calls; each has its contract in ops.py
    working_copies: int                         # float64 copies of its largest site a token that a comparison's
                                                # reference runs and metrics hold at their peak (measured on a GPU:
                                                # budget.comparison_gpu_bytes)

    # optional: for_config(cfg) -> the variant a config needs (Mamba-2 with or without the shared feed-forward);
    # `arch.layer_type` calls it, so sites may depend on the config

    def param_shapes(self, cfg: ModelConfig) -> dict: ...      # names without "layers.{i}."

    def site_elements(self, cfg: ModelConfig) -> dict: ...     # elements per token and sequence (0: ubatch-end only)

    def layer(self, ctx: LayerContext, h: torch.Tensor) -> torch.Tensor: ...
