"""Every view, in screen order. The dashboard lays out and redraws these; the HTML report draws those `in_report`.

Adding a view: its module (a `View` subclass and `VIEW`), then one line here.
"""
from __future__ import annotations

from .curve import VIEW as CURVE
from .generations import VIEW as GENERATIONS
from .heatmap import VIEW as HEATMAP
from .logits import VIEW as LOGITS
from .states import VIEW as STATES
from .sweep_matrix import VIEW as SWEEP

VIEWS = (
    CURVE,
    HEATMAP,
    STATES,
    GENERATIONS,
    SWEEP,
    LOGITS,
)

BY_NAME = {v.name: v for v in VIEWS}


def get(name: str):
    return BY_NAME[name]


def depending_on(changed) -> list:
    """The views that read one of the changed ViewState fields, in screen order."""
    changed = set(changed)
    return [v for v in VIEWS if v.depends & changed]
