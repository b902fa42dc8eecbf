"""`check_params`: loaded tensors against the canonical names and shapes the config implies (`arch.param_shapes`).

Every reader (HF folders, state-spaces, GGUF) translates its file's names into the canonical ones (`embed`,
`norm_f`, `lm_head`, `layers.{i}.<name>` as the layer type declares them) and hands the dict here, which names
any missing tensor, wrong shape or non-finite value and returns float64 masters.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..arch import param_shapes
from ..config import ModelConfig
from ..errors import CheckpointError


def check_params(cfg: ModelConfig, params: dict[str, torch.Tensor], source: str,
                 names: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Validate and return float64 master copies. `names` maps canonical names to the file's names for messages."""
    names = names or {}
    shapes = param_shapes(cfg)
    missing = [k for k in shapes if k not in params]
    if missing:
        shown = ", ".join(names.get(k, k) for k in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise CheckpointError(f"{source}: missing tensor(s) {shown}{more}. The file is incomplete or not a "
                              f"Mamba-1 checkpoint of the shape config describes.")
    out, seen = {}, {}
    for key, shape in shapes.items():
        t = params[key]
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{source}: {names.get(key, key)} is a {type(t).__name__}, not a tensor")
        if t.is_complex() or t.dtype == torch.bool or t.is_meta:
            raise CheckpointError(f"{source}: tensor {names.get(key, key)} is {t.dtype} on {t.device}; weights are "
                                  f"real numbers with values (load or materialize it first)")
        if tuple(t.shape) != shape:
            raise CheckpointError(f"{source}: tensor {names.get(key, key)} has shape {list(t.shape)} but the config "
                                  f"implies {list(shape)}. Check config.json against the weights.")
        if id(t) not in seen:       # tied embeddings: one master for both names, widened and checked once
            seen[id(t)] = t.detach().to(torch.float64)
            _check_values(seen[id(t)], f"{source}: tensor {names.get(key, key)}")
        out[key] = seen[id(t)]
    return out


def in_memory_params(cfg: ModelConfig, params) -> dict:
    """`md.build_model`'s params as tensors: a mapping of canonical names, none unknown (a typo such as
    `layers.0.A_log` was ignored, and only the real name reported missing, or nothing when both were given), numpy
    arrays and lists taken (a list's Python floats as float64; one tensor per object given, so a tied head stays
    tied)."""
    if not isinstance(params, Mapping):
        raise CheckpointError(f"params must be a dict of canonical name -> tensor (md.param_shapes(config) lists "
                              f"them), got a {type(params).__name__}")
    shapes = param_shapes(cfg)
    unknown = [str(k) for k in params if k not in shapes]
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise CheckpointError(f"in-memory model: unknown tensor name(s) {', '.join(unknown[:5])}{more} for this "
                              f"config; md.param_shapes(config) lists the names ({', '.join(list(shapes)[:4])}, ...)")
    made: dict = {}
    for v in params.values():
        if not isinstance(v, torch.Tensor) and id(v) not in made:
            try:
                made[id(v)] = torch.as_tensor(v, dtype=torch.float64 if isinstance(v, (list, tuple)) else None)
            except (TypeError, ValueError, RuntimeError):
                made[id(v)] = v                     # named by check_params
    return {k: made.get(id(v), v) for k, v in params.items()}


def check_config_agrees(cfg: ModelConfig, params: dict, source: str) -> None:
    """Masters that contradict the config (`md.build_model`'s, checked like a checkpoint's read): a tied head that is
    not the embedding, a conv bias where the config has none. Saved or exported, each became the config's (a
    checkpoint ties the head and drops the bias), so the model changed on the way (logits 1.48 rel. L2 apart)."""
    if cfg.tie_embeddings and not torch.equal(params["lm_head"], params["embed"]):
        raise CheckpointError(f"{source}: tie_embeddings is true but lm_head is not the embedding; pass the same "
                              f"tensor for both, or set tie_embeddings=False")
    if not cfg.conv_bias:
        bias = [k for k in params if k.endswith(".conv_b") and bool(params[k].any())]
        if bias:
            raise CheckpointError(f"{source}: conv_bias is false but {bias[0]} is not zero; give zeros, or set "
                                  f"conv_bias=True")


def _check_values(t: torch.Tensor, what: str):
    """NaN/Inf and float32's range, from one min/max pass over the float64 master: NaN propagates into both, an Inf
    into one, and max(-min, max) is the largest magnitude. `isfinite(t).all()` and `abs().max()` made full-size
    temporaries: a 2.8B folder's load took 5.4-5.6 s with them, 1.2 s without (an H100 host, 2026-12-05)."""
    if not t.numel():
        return
    lo, hi = (float(v) for v in torch.aminmax(t))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        bad = (~torch.isfinite(t)).sum().item()
        raise CheckpointError(f"{what} holds {bad} NaN/Inf value(s); the checkpoint is corrupt (re-export or "
                              f"re-download it).")
    if max(-lo, hi) > torch.finfo(torch.float32).max:
        raise CheckpointError(f"{what} holds values beyond float32's range (|x| > 3.4e38, up to {max(-lo, hi):.3g}); "
                              f"the float32 sides run it in float32, where it becomes Inf. The checkpoint is corrupt "
                              f"or scaled wrongly.")
