"""Layer types by name, and what a whole model's config implies: site order, parameter shapes, site sizes."""
from __future__ import annotations

from ..config import ModelConfig, as_config
from ..errors import MambaDebugError
from .base import MODEL_SITES, LayerContext, LayerType, SiteKey, StateSpec
from .attention import Attention
from .mamba1 import Mamba1
from .mamba2 import Mamba2

LAYER_TYPES: dict = {"mamba1": Mamba1(), "mamba2": Mamba2(), "attention": Attention()}


def layer_type(cfg: ModelConfig, i: int) -> LayerType:
    name = cfg.layer_types[i]
    if name not in LAYER_TYPES:
        raise MambaDebugError(f"layer {i} has type {name!r}, which mamba-debug does not know; "
                              f"known: {', '.join(LAYER_TYPES)}")
    lt = LAYER_TYPES[name]
    return lt.for_config(cfg) if hasattr(lt, "for_config") else lt


def _distinct_types(cfg: ModelConfig) -> list:
    """The layer types of this config, each once, in order of first use."""
    first = {name: i for i, name in reversed(list(enumerate(cfg.layer_types)))}
    return [layer_type(cfg, i) for i in sorted(first.values())]


def layer_sites(cfg: ModelConfig) -> tuple:
    """Every site name a block of this model can report, in graph order (the union over its layer types)."""
    out = []
    for lt in _distinct_types(cfg):
        out += [s for s in lt.sites if s not in out]
    return tuple(out)


def all_sites(cfg: ModelConfig) -> tuple:
    return layer_sites(cfg) + MODEL_SITES


def site_order(cfg: ModelConfig) -> list:
    """(layer, site) keys in graph order: layers ascending, each in its type's order, then the model-level sites."""
    cfg = as_config(cfg, "site_order")
    keys = [(i, s) for i in range(cfg.n_layer) for s in layer_type(cfg, i).sites]
    return keys + [(None, s) for s in MODEL_SITES]


def param_shapes(cfg: ModelConfig) -> dict:
    """Canonical name -> shape of every parameter the config implies (what every loader checks against)."""
    cfg = as_config(cfg, "param_shapes")
    E, V = cfg.d_model, cfg.vocab_size
    shapes = {"embed": (V, E), "norm_f": (E,), "lm_head": (V, E)}
    for i in range(cfg.n_layer):
        shapes.update({f"layers.{i}.{k}": v for k, v in layer_type(cfg, i).param_shapes(cfg).items()})
    return shapes


def site_elements(cfg: ModelConfig) -> dict:
    """Elements per token and sequence of each layer site (the largest over the layer types) and the head's."""
    out: dict = {}
    for lt in _distinct_types(cfg):
        for k, v in lt.site_elements(cfg).items():
            out[k] = max(out.get(k, 0), v)
    return {**out, "final_norm": cfg.d_model, "logits": cfg.vocab_size}


def working_elements(cfg: ModelConfig) -> int:
    """Float64 elements a token that a comparison's reference runs and metrics hold at their peak: the most any
    layer type of the model asks (its `working_copies` of its largest site)."""
    return max(lt.working_copies * max(lt.site_elements(cfg).values()) for lt in _distinct_types(cfg))


def model_ops(cfg: ModelConfig) -> tuple:
    """Every op name a model of this config calls (its layer types' and the head's), in first-use order."""
    out = {}
    for lt in _distinct_types(cfg):
        out.update(dict.fromkeys(lt.ops))
    return tuple(dict.fromkeys([*out, "rms_norm", "linear"]))


def layer_site_elements(cfg: ModelConfig) -> list:
    """Per layer: its site -> elements per token and sequence."""
    return [layer_type(cfg, i).site_elements(cfg) for i in range(cfg.n_layer)]


__all__ = ["LAYER_TYPES", "MODEL_SITES", "LayerContext", "LayerType", "SiteKey", "StateSpec", "all_sites",
           "layer_site_elements", "layer_sites", "layer_type", "model_ops", "param_shapes",
           "site_elements", "site_order", "working_elements"]
