"""The dashboard's engine control: torch (the Triton kernels / plug-ins) or llama.cpp (a llama.cpp library traced as
the device side). With llama.cpp the kernels control is disabled (its tooltip says why), the header names the
engine, the library file and the version that ran, and the cache keeps the two engines' runs apart. No library:
a clear message in the dashboard, no traceback, no silent fallback to torch.

The runs need llama-cpp-python's library (skipped without it: tests/llamacpp/build.sh); the missing-library case
does not.
"""
from __future__ import annotations

import re

import pytest

from conftest import random_model

IDS = [(7 * i + 3) % 61 for i in range(10)]


def _text(html: str) -> str:
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html)).strip()


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """The small random model as an f32 GGUF (what llama.cpp reads), loaded back: both engines run the same file."""
    from mamba_debug.io import export_gguf, load_model
    path = export_gguf(random_model(), tmp_path_factory.mktemp("gguf") / "random-f32.gguf", dtype="f32")
    return load_model(path)


@pytest.fixture
def dash(gguf_model):
    pytest.importorskip("ipywidgets", reason="the dashboard needs ipywidgets (requirements-lab.txt)")
    from mamba_debug.dashboard import Dashboard
    return Dashboard(gguf_model, IDS, kernels="triton", device="interpret", n_gen=2, offload=3, ubatch=4)


def test_engine_llama_cpp_runs_and_says_what_ran(dash, monkeypatch):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed; run tests/llamacpp/build.sh")
    from mamba_debug.dashboard import state

    calls = []
    real = state.run_compare
    monkeypatch.setattr(state, "run_compare", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    assert dash.errors == [] and dash.result.sides["device"].engine == "torch"
    assert "engine torch" in _text(dash.w_status.value) and not dash.w_kernels.disabled
    torch_result = dash.result

    dash.set(engine="llama.cpp")                              # what choosing it in the dropdown does
    assert dash.errors == [], dash.errors
    assert len(calls) == 1 and calls[0].engine == "llama.cpp" and dash.timings["source"] == "run"
    res = dash.result
    dev = res.sides["device"]
    assert res.settings.engine == "llama.cpp" and dev.engine == "llama.cpp" and dev.kernels is None
    assert dev.extra["library"].endswith("libllama.so") and dev.extra["version"]
    status = _text(dash.w_status.value)
    assert "engine llama.cpp" in status and "libllama.so" in status and dev.extra["version"] in status
    assert dev.extra["library"] in dash.w_status.value                    # the whole path (the hover title)
    assert "-ngl 0" in status and "on the CPU" in status                  # offload is -ngl; a CPU run: all on the CPU
    assert dash.w_kernels.disabled and "not applicable" in dash.w_kernels.tooltip.lower()
    assert "running" not in status and dash.images["curve"] and dash.images["states"]

    dash.set(engine="torch")                                  # the cache key holds the engine: both runs kept
    assert dash.result is torch_result and dash.timings["source"] == "cache" and len(calls) == 1
    assert not dash.w_kernels.disabled and "not applicable" not in dash.w_kernels.tooltip.lower()
    dash.set(engine="llama.cpp")
    assert dash.result is res and dash.timings["source"] == "cache" and len(calls) == 1
    dash.set(offload=2)                                       # llama.cpp's -ngl: a new run, still llama.cpp
    assert len(calls) == 2 and dash.result.sides["device"].engine == "llama.cpp"
    assert dash.result.placement.offload == 2 and dash.errors == []
    labels = [label for label, value in dash.w_jump.options if value is not None]
    assert any(label.startswith("offload 2, ubatch 4") for label in labels)


def test_engine_llama_cpp_without_a_library_says_so(gguf_model, tmp_path):
    pytest.importorskip("ipywidgets", reason="the dashboard needs ipywidgets (requirements-lab.txt)")
    from mamba_debug.dashboard import Dashboard
    empty = tmp_path / "no-llama"
    empty.mkdir()
    dash = Dashboard(gguf_model, IDS, kernels="triton", device="interpret", n_gen=2, offload=3, ubatch=4,
                     llama_lib=str(empty))
    shown = dash.result
    dash.set(engine="llama.cpp")
    assert dash.w_engine.value == "llama.cpp"                 # no silent fallback to torch
    assert dash.result is shown and dash.state.run.engine == "torch"   # nothing ran: the last run stays, said so
    assert "no llama.cpp library could be loaded" in dash.error_text
    assert "Traceback" not in dash.w_error.value and "traceback" not in dash.w_error.value
    assert dash.w_error.layout.display != "none"
    assert dash.errors[-1]["type"] == "LlamaCppUnavailable" and "libllama.so" in dash.errors[-1]["message"]
    assert "no library loads" in _text(dash.w_status.value)
    dash.set(engine="torch")                                  # back: the torch run on screen, the message gone
    assert dash.error_text == "" and dash.result is shown


def test_a_llama_cpp_result_seeds_the_dashboard(gguf_model):
    """result= a llama.cpp comparison computed elsewhere: shown from the cache with the engine control on llama.cpp
    (no run), and engine torch runs the torch side from there."""
    pytest.importorskip("ipywidgets", reason="the dashboard needs ipywidgets (requirements-lab.txt)")
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed; run tests/llamacpp/build.sh")
    from mamba_debug.compare import run_compare
    from mamba_debug.dashboard import Dashboard
    from mamba_debug.settings import RunSettings
    res = run_compare(gguf_model, IDS, RunSettings(engine="llama.cpp", device="cpu", ubatch=4, n_gen=2, offload=3))
    dash = Dashboard(gguf_model, IDS, kernels="triton", device="interpret", n_gen=2, result=res)
    assert dash.errors == [] and dash.result is res and dash.timings["source"] == "cache"
    assert dash.w_engine.value == "llama.cpp" and dash.w_kernels.disabled
    assert "engine llama.cpp" in _text(dash.w_status.value)
    dash.set(engine="torch")
    assert dash.errors == [] and dash.result.sides["device"].engine == "torch" and dash.timings["source"] == "run"
    assert dash.result.settings.device == "interpret" and not dash.w_kernels.disabled
