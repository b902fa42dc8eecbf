"""Canonical parameter names and shapes, shared by every loader (HF folders, state-spaces, GGUF).

Loaders translate their file's names into these and hand a dict name -> tensor to `check_params`,
which names any missing tensor, wrong shape or non-finite value. `A` is stored already as
-exp(A_log) (llama.cpp's `ssm_a`). `conv_w` is [D, K] (the conv1d weight squeezed).
"""
from __future__ import annotations

import torch

from .config import MambaConfig
from .errors import CheckpointError

LAYER_PARAMS = ("norm", "in_proj", "in_proj_bias", "conv_w", "conv_b", "x_proj", "dt_proj", "dt_bias",
                "A", "D", "out_proj", "out_proj_bias")


def expected_shapes(cfg: MambaConfig) -> dict[str, tuple[int, ...]]:
    E, D, N, K, R, V = cfg.d_model, cfg.d_inner, cfg.d_state, cfg.d_conv, cfg.dt_rank, cfg.vocab_size
    shapes = {"embed": (V, E), "norm_f": (E,), "lm_head": (V, E)}
    for i in range(cfg.n_layer):
        p = f"layers.{i}."
        shapes.update({p + "norm": (E,), p + "in_proj": (2 * D, E), p + "conv_w": (D, K), p + "conv_b": (D,),
                       p + "x_proj": (R + 2 * N, D), p + "dt_proj": (D, R), p + "dt_bias": (D,),
                       p + "A": (D, N), p + "D": (D,), p + "out_proj": (E, D)})
        if cfg.proj_bias:
            shapes[p + "in_proj_bias"] = (2 * D,)
            shapes[p + "out_proj_bias"] = (E,)
    return shapes


def check_params(cfg: MambaConfig, params: dict[str, torch.Tensor], source: str,
                 names: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Validate and return float64 master copies. `names` maps canonical names to the file's names for messages."""
    names = names or {}
    shapes = expected_shapes(cfg)
    missing = [k for k in shapes if k not in params]
    if missing:
        shown = ", ".join(names.get(k, k) for k in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{source}: missing tensor(s) {shown}{more}. The file is incomplete or not a "
                              f"Mamba-1 checkpoint of the shape config describes.")
    out = {}
    for key, shape in shapes.items():
        t = params[key]
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{source}: tensor {names.get(key, key)} has shape {list(t.shape)} but the config "
                                  f"implies {list(shape)}. Check config.json against the weights.")
        t = t.detach().to(torch.float64)
        if not torch.isfinite(t).all():
            bad = (~torch.isfinite(t)).sum().item()
            raise CheckpointError(f"{source}: tensor {names.get(key, key)} holds {bad} NaN/Inf value(s); "
                                  f"the checkpoint is corrupt (re-export or re-download it).")
        out[key] = t
    return out
