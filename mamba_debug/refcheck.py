"""Non-finite is never agreement: a reference side whose own values become NaN or Inf is reported, naming the layer
and the site, instead of a comparison against garbage reading "no divergence".

Cheap on the hot path: one pass over every site of the ubatch, whose result is non-finite exactly when a NaN or Inf
lies anywhere; only then are the sites searched in graph order for the first bad one. On a GPU that pass is one
multi-tensor max-magnitude per dtype (`torch._foreach_norm`, ord inf: nothing overflows, NaN and Inf propagate),
a few launches for ~1000 sites: 8.5 ms a ubatch and side against 26.5 ms for a sum per site (2.8B model, ubatch
128 and 256, an H100, 2026-12-05). On a CPU a sum per site is the faster one.

Finite is not enough either: activations past float32's range can leave a float32 reference finite and wrong (x**2
overflowing inside a norm zeroes its output). Then the rounding floor (float32 against float64) is ~1 at every site
after it, every threshold ~10, and nothing could diverge: `check_float32_range` refuses such a run, naming the first
site where float32 left float64 (`FLOAT32_LIMIT`: floors of real models sit at 1e-7..1e-4).
"""
from __future__ import annotations

import math

import torch

from .errors import MambaDebugError


class NonFiniteReference(MambaDebugError):
    """A reference side produced NaN/Inf: the comparison has no valid reference."""


class OutOfFloat32Range(MambaDebugError):
    """The float32 reference is finite but not float64's: the model's activations pass float32's range."""


FLOAT32_LIMIT = 1e-2        # a float32 reference this far from float64 (rel. L2) is not rounding: it cannot carry the model


def check_float32_range(res) -> None:
    """Refuse a comparison whose float32 reference's logits left float64's past FLOAT32_LIMIT (see the module
    docstring), naming the first site in graph order, earliest token first, where it did."""
    logits = res.floor.get((None, "logits"))
    if logits is None or not float(logits.nan_to_num(0).max()) > FLOAT32_LIMIT:
        return
    over = {k: (res.floor[k].nan_to_num(0) > FLOAT32_LIMIT).any(0) for k in res.site_order() if k in res.floor}
    token = min(int(torch.nonzero(o)[0]) for o in over.values() if o.any())     # the earliest token, then
    layer, site = next(k for k, o in over.items() if o[token])                    # the first site in graph order
    where = "the output head" if layer is None else f"layer {layer}"
    value = float(res.floor[(layer, site)][:, token].nan_to_num(0).max())
    raise OutOfFloat32Range(
        f"the float32 reference left the float64 one at {where}, site {site}, token {token} (relative error "
        f"{value:.2g}; float32's rounding gives 1e-7..1e-4), and its logits by up to {float(logits.max()):.2g}: the "
        f"activations pass float32's range (an overflow or underflow), so no threshold made from its rounding can "
        f"tell a bug from it. The weights or inputs are out of scale, or the model is damaged")


def check_reference(name: str, label: str, sites: dict, logits: torch.Tensor, ubatch: int, order: list):
    """sites: (layer, site) -> (value, per_token) of one ubatch of a reference side; order: keys in graph order."""
    if all_finite([v for v, _ in sites.values()] + [logits]):
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


def all_finite(values: list) -> bool:
    """Whether no tensor of `values` (one device) holds a NaN or Inf, with one host sync."""
    if values and values[0].device.type == "cuda":
        groups = {}
        for v in values:
            if v.numel():            # an empty tensor has no max magnitude (and no NaN)
                groups.setdefault(v.dtype, []).append(v)
        peaks = [torch.stack(torch._foreach_norm(g, ord=math.inf)).max().double() for g in groups.values()]
        return not peaks or bool(torch.isfinite(torch.stack(peaks).max()))
    # finite float32 values never overflow a float64 sum; float64 ones near its range could, which reads as non-finite
    # and only sends the search below looking (it finds no bad site and passes)
    return bool(torch.isfinite(torch.stack([v.sum(dtype=torch.float64) for v in values]).sum())) if values else True
