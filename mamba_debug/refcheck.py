"""Non-finite is never agreement: a reference side whose own values become NaN or Inf is reported, naming the layer
and the site, instead of a comparison against garbage reading "no divergence".

Cheap on the hot path: one float64 sum over every site of the ubatch (finite float32 values never overflow it, a
NaN or Inf anywhere makes it non-finite); only then are the sites searched in graph order for the first bad one.
"""
from __future__ import annotations

import torch

from .errors import MambaDebugError


class NonFiniteReference(MambaDebugError):
    """A reference side produced NaN/Inf: the comparison has no valid reference."""


def check_reference(name: str, label: str, sites: dict, logits: torch.Tensor, ubatch: int, order: list):
    """sites: (layer, site) -> (value, per_token) of one ubatch of a reference side; order: keys in graph order."""
    values = [v for v, _ in sites.values()] + [logits]
    total = torch.stack([v.sum(dtype=torch.float64) for v in values]).sum()
    if torch.isfinite(total):
        return
    for key in order + [k for k in sites if k not in order]:
        if key in sites and not torch.isfinite(sites[key][0]).all():
            layer, site = key
            where = "the output head" if layer is None else f"layer {layer}"
            raise NonFiniteReference(
                f"the reference side {name} ({label}) itself produced NaN/Inf at {where}, site {site}, in ubatch "
                f"{ubatch}: there is no valid reference to compare the device with. The weights or activations "
                f"overflow this precision (try --reference float64) or the model is damaged")
    if not torch.isfinite(logits).all():
        raise NonFiniteReference(f"the reference side {name} ({label}) produced NaN/Inf logits in ubatch {ubatch}")
