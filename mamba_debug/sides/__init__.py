"""Sides: the engines a comparison runs in lock step (see base.py for the seam)."""
from .base import SharedReference, Side, SideInfo, StepOutput
from .torch_side import Capture, TorchSide

__all__ = ["Capture", "SharedReference", "Side", "SideInfo", "StepOutput", "TorchSide"]
