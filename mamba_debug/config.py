"""Model configuration and the dimension glossary used everywhere in mamba_debug.

Glossary (shapes in docstrings and comments use these letters):

    S  sequences processed together (n_seqs); each owns one state slot
    T  tokens in the current ubatch (1 during generation)
    P  prompt length in tokens
    E  d_model, width of the residual stream (llama.cpp: n_embd)
    D  d_inner, width of the SSM channels (= expand * E)
    N  d_state, SSM state size per channel
    K  d_conv, width of the causal depthwise convolution
    R  dt_rank, rank of the dt projection
    V  vocabulary size (as stored, possibly padded)
    L  n_layer, number of blocks (layers)

States per layer and sequence: conv_state [K-1, D] (the previous K-1 inputs x, oldest first) and
ssm_state [D, N] (h after the last processed token).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass
class MambaConfig:
    d_model: int                 # E
    n_layer: int                 # L
    vocab_size: int              # V, rows of the embedding as stored (padded vocab included)
    d_state: int = 16            # N
    d_conv: int = 4              # K
    expand: int = 2
    d_inner: int = 0             # D; 0 means expand * d_model
    dt_rank: int = 0             # R; 0 means "auto" = ceil(d_model / 16)
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    conv_bias: bool = True       # conv1d has a bias (always true in released checkpoints)
    proj_bias: bool = False      # in_proj / out_proj have biases (HF use_bias)

    def __post_init__(self):
        if self.d_inner == 0:
            self.d_inner = self.expand * self.d_model
        if self.dt_rank in (0, "auto", None):
            self.dt_rank = math.ceil(self.d_model / 16)
        for name in ("d_model", "n_layer", "vocab_size", "d_state", "d_conv", "d_inner", "dt_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MambaConfig.{name} must be a positive integer, got {value!r}")
        if self.d_conv < 2:
            raise ValueError(f"MambaConfig.d_conv must be at least 2, got {self.d_conv}")

    @property
    def layer_types(self) -> tuple[str, ...]:
        """The layer type of each block, by name in `arch.LAYER_TYPES` (a hybrid mixes several)."""
        return ("mamba1",) * self.n_layer

    def to_dict(self) -> dict:
        return asdict(self)


# The name the architecture-agnostic code uses; `MambaConfig` stays for existing callers.
ModelConfig = MambaConfig
