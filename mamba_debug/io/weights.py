"""`check_params`: loaded tensors against the canonical names and shapes the config implies (`arch.param_shapes`).

Every reader (HF folders, state-spaces, GGUF) translates its file's names into the canonical ones (`embed`,
`norm_f`, `lm_head`, `layers.{i}.<name>` as the layer type declares them) and hands the dict here, which names
any missing tensor, wrong shape or non-finite value and returns float64 masters.
"""
from __future__ import annotations

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
        if t.abs().max() > torch.finfo(torch.float32).max if t.numel() else False:
            raise CheckpointError(f"{source}: tensor {names.get(key, key)} holds values beyond float32's range "
                                  f"(|x| > 3.4e38, up to {t.abs().max().item():.3g}); the float32 sides run it in "
                                  f"float32, where it becomes Inf. The checkpoint is corrupt or scaled wrongly.")
        out[key] = t
    return out
