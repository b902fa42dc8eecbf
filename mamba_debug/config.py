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

Mamba-2 (layer type "mamba2", docs/mamba2.md):
    H  n_heads, SSM heads (D = H * P)          P  head_dim, channels per head
    G  n_groups, B/C groups (head h uses group h // (H/G))
    Q  chunk_size of the chunked SSD form (a numerics choice of kernels, not of the model)
Attention (layer type "attention", Granite-4.0-H dense hybrids): Ha query heads, Hk key/value heads, Dh head dim;
F  d_ff, width of the shared SwiGLU feed-forward that follows each mixer (0: none).

States per layer and sequence: conv_state [K-1, D] (the previous K-1 inputs x, oldest first) and
ssm_state [D, N] (h after the last processed token). Mamba-2: conv_state [K-1, D+2GN] (over xBC),
ssm_state [H, P, N]. Attention: k_cache, v_cache [tokens so far, Hk, Dh] (they grow by T per ubatch).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, fields

import numpy as np

from .errors import MambaDebugError


def is_flag(v) -> bool:
    """True or False, Python's or numpy's (np.bool_ is not a bool)."""
    return isinstance(v, (bool, np.bool_))


def is_integer(v) -> bool:
    """A Python or numpy integer that is not a flag (bool is an int)."""
    return isinstance(v, numbers.Integral) and not is_flag(v)


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
    # -- beyond Mamba-1 (to_dict leaves them out at these defaults, so Mamba-1 configs read as before) --
    layer_types: tuple = ()      # per layer, names in arch.LAYER_TYPES; () means all "mamba1"
    head_dim: int = 0            # P (Mamba-2)
    n_heads: int = 0             # H (Mamba-2); 0 means d_inner // head_dim
    n_groups: int = 1            # G (Mamba-2)
    chunk_size: int = 256        # Q (Mamba-2)
    n_attn_heads: int = 0        # Ha (attention)
    n_kv_heads: int = 0          # Hk (attention); 0 means Ha
    attn_head_dim: int = 0       # Dh (attention); 0 means d_model // Ha
    attn_bias: bool = False      # q/k/v/o projections have biases
    d_ff: int = 0                # F: shared SwiGLU feed-forward after each mixer; 0 = none
    mlp_bias: bool = False
    embedding_multiplier: float = 1.0   # Granite: h0 = embed * m
    residual_multiplier: float = 1.0    # Granite: h += m * mixer(...), h += m * ffn(...)
    attention_multiplier: float = 0.0   # Granite: softmax scale; 0 means 1/sqrt(Dh)
    logits_scaling: float = 1.0         # Granite: logits / s

    def __post_init__(self):
        self._plain_values()
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
        self.layer_types = tuple(self.layer_types) or ("mamba1",) * self.n_layer
        if len(self.layer_types) != self.n_layer:
            raise ValueError(f"MambaConfig.layer_types names {len(self.layer_types)} layers but n_layer is "
                             f"{self.n_layer}; give one type per layer")
        if "mamba2" in self.layer_types:
            self._check_mamba2()
        if "attention" in self.layer_types:
            self._check_attention()

    def _plain_values(self):
        """numpy's scalars as the Python int, float or bool a field is declared as; a bool given for a size, a
        non-number for a float, or anything but True or False for a flag (tie_embeddings="no" is truthy: the head
        would be tied) refused naming the field."""
        for f in fields(self):
            v, flag = getattr(self, f.name), is_flag(getattr(self, f.name))
            if f.type == "bool" and not flag:
                raise ValueError(f"MambaConfig.{f.name} must be True or False, got {v!r}")
            if f.type in ("int", "float") and flag:
                raise ValueError(f"MambaConfig.{f.name} must be a number, not {v!r}")
            if f.type == "float" and not isinstance(v, numbers.Real):
                raise ValueError(f"MambaConfig.{f.name} must be a number, got {v!r}")
            kind = {"int": numbers.Integral, "float": numbers.Real, "bool": (bool, np.bool_)}.get(f.type)
            if kind is not None and isinstance(v, kind):
                setattr(self, f.name, {"int": int, "float": float, "bool": bool}[f.type](v))

    def _check_mamba2(self):
        if self.n_heads and not self.head_dim and self.d_inner % self.n_heads == 0:
            self.head_dim = self.d_inner // self.n_heads
        if self.head_dim < 1 or self.d_inner % self.head_dim:
            raise ValueError(f"MambaConfig.head_dim ({self.head_dim}) must divide d_inner ({self.d_inner}) for "
                             f"Mamba-2 layers")
        self.n_heads = self.n_heads or self.d_inner // self.head_dim
        if self.n_heads * self.head_dim != self.d_inner:
            raise ValueError(f"MambaConfig: n_heads * head_dim = {self.n_heads} * {self.head_dim} must equal "
                             f"d_inner = {self.d_inner} (expand * d_model)")
        if self.n_groups < 1 or self.n_heads % self.n_groups:
            raise ValueError(f"MambaConfig.n_groups ({self.n_groups}) must divide n_heads ({self.n_heads})")
        if self.chunk_size < 1:
            raise ValueError(f"MambaConfig.chunk_size must be a positive integer, got {self.chunk_size}")

    def _check_attention(self):
        if self.n_attn_heads < 1:
            raise ValueError("MambaConfig.n_attn_heads must be set (>= 1) for attention layers")
        self.n_kv_heads = self.n_kv_heads or self.n_attn_heads
        if self.n_attn_heads % self.n_kv_heads:
            raise ValueError(f"MambaConfig.n_kv_heads ({self.n_kv_heads}) must divide n_attn_heads "
                             f"({self.n_attn_heads})")
        self.attn_head_dim = self.attn_head_dim or self.d_model // self.n_attn_heads
        if self.attn_head_dim < 1:
            raise ValueError(f"MambaConfig.attn_head_dim must be positive, got {self.attn_head_dim}")

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: D for Mamba-1; D + 2GN (over xBC) when the model has Mamba-2 layers."""
        return self.d_inner + 2 * self.n_groups * self.d_state if "mamba2" in self.layer_types else self.d_inner

    def to_dict(self) -> dict:
        """Every field; the fields beyond Mamba-1 only where they differ from their defaults (so a Mamba-1
        config reads exactly as before they existed)."""
        out = asdict(self)
        out["layer_types"] = list(self.layer_types)
        for f in fields(self)[_FIRST_EXTRA:]:
            if f.name == "layer_types" and set(self.layer_types) == {"mamba1"}:
                del out[f.name]
            elif f.name != "layer_types" and out[f.name] == f.default:
                del out[f.name]
        return out


_FIRST_EXTRA = [f.name for f in fields(MambaConfig)].index("layer_types")


# The name the architecture-agnostic code uses; `MambaConfig` stays for existing callers.
ModelConfig = MambaConfig


def as_config(cfg, fn: str) -> "MambaConfig":
    """A public function's config: a ModelConfig or a dict of its fields; anything else refused naming the function
    (an AttributeError on None before)."""
    if isinstance(cfg, dict):
        return MambaConfig(**cfg)
    if not isinstance(cfg, MambaConfig):
        raise MambaDebugError(f"{fn} takes a md.ModelConfig (or a dict of its fields), got a {type(cfg).__name__}")
    return cfg
