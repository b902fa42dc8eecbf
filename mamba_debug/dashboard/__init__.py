"""The notebook dashboard (`Dashboard`): widgets over `run_compare`, every view of `views.registry`.

    import mamba_debug as md
    dash = md.Dashboard(model, "It is a truth universally acknowledged", kernels="bug_strided_gate")
"""
from __future__ import annotations

from .app import Dashboard
from .state import DashState, RunCache

__all__ = ["DashState", "Dashboard", "RunCache"]
