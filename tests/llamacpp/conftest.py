"""Fixtures of the llama.cpp side's tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def read_node_calls(monkeypatch):
    """observe.read_node's calls counted: the node-by-node mapping's cost (a recalled or known node reads none)."""
    from mamba_debug.sides.llamacpp import observe  # noqa: PLC0415
    calls = {"read_node": 0}
    real = observe.read_node

    def counted(*a, **kw):
        calls["read_node"] += 1
        return real(*a, **kw)
    monkeypatch.setattr(observe, "read_node", counted)
    return calls
