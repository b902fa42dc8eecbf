"""The notebooks run top to bottom, and the dashboard behind them caches, redraws and reports errors.

Notebook runs need the notebook extras (`pip install -r requirements-lab.txt`) and the shipped tiny model
(data/tiny-mamba); each executed notebook is written to out/notebooks/ for inspection.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from conftest import random_model

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / "notebooks").glob("[0-9][0-9]_*.ipynb"))
ARTIFACTS = REPO / "out" / "notebooks"
HAS_TINY = (REPO / "data" / "tiny-mamba" / "config.json").is_file()


def test_the_four_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    for want in ("01_quickstart.ipynb", "02_hunting_the_6758_drift.ipynb", "03_bring_your_own_kernel.ipynb",
                 "04_real_checkpoints.ipynb"):
        assert want in names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat", reason="notebook extras: pip install -r requirements-lab.txt")
    nbclient = pytest.importorskip("nbclient", reason="notebook extras: pip install -r requirements-lab.txt")
    pytest.importorskip("ipykernel", reason="notebook extras: pip install -r requirements-lab.txt")
    pytest.importorskip("ipywidgets", reason="notebook extras: pip install -r requirements-lab.txt")
    if not HAS_TINY:
        pytest.skip("the shipped tiny model (data/tiny-mamba) is not there: the notebooks run on it")
    if "llamacpp" in path.stem:
        pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed; run tests/llamacpp/build.sh")
    # the kernel imports mamba_debug from this checkout whether or not it was pip-installed
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "what you will learn" in first.source.lower()
    assert any(c.cell_type == "code" and c.source.lstrip().startswith("assert") for c in nb.cells[-3:]), \
        "a notebook ends with assert cells about what it showed"
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, ARTIFACTS / path.name)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors, errors


# -- the dashboard itself (no notebook, no frontend) ---------------------------------------------------------
@pytest.fixture(scope="module")
def dash():
    pytest.importorskip("ipywidgets", reason="the dashboard needs ipywidgets (requirements-lab.txt)")
    from mamba_debug.dashboard import Dashboard
    model = random_model()
    ids = [(7 * i + 3) % model.config.vocab_size for i in range(10)]
    # Triton kernels under the interpreter: real (rounding-level) errors, so every plot has data
    return Dashboard(model, ids, kernels="triton", device="interpret", n_gen=2, offload=5, ubatch=4)


def test_dashboard_reuses_cached_runs_and_redraws(dash, monkeypatch):
    from mamba_debug.dashboard import state

    calls = []
    real = state.run_compare
    monkeypatch.setattr(state, "run_compare", lambda *a, **k: calls.append(k) or real(*a, **k))
    assert dash.errors == [] and dash.result is not None
    first = dash.result
    curve_all, png_all = dash.view_data["curve"].copy(), dash.images["curve"]
    assert dash.widget is not None and dash.w_offload.max == dash.n_layer + 1

    dash.w_offload.value = 2                                    # what moving the slider does
    assert len(calls) == 1 and dash.timings["source"] == "run" and dash.timings["run_ms"] > 0
    assert dash.result.placement.offload == 2
    assert dash.images["curve"] != png_all
    assert not (dash.view_data["curve"] == curve_all).all()     # layers 0..1 are host now: zero error there
    assert (dash.view_data["curve"][:2] == 0).all()

    dash.w_offload.value = 5                                    # back to a seen configuration
    assert len(calls) == 1, "a seen configuration must come from the cache"
    assert dash.result is first and dash.timings["source"] == "cache" and dash.timings["run_ms"] == 0
    assert dash.timings["redraw_ms"] > 0
    assert (dash.view_data["curve"] == curve_all).all()

    token = dash.w_token.value
    dash.set(token=(token + 1) % (dash.w_token.max + 1))        # view change: no run, partial redraw
    assert len(calls) == 1 and dash.timings["source"] == "view" and "curve" in dash.timings["views"]
    assert "heatmap" not in dash.timings["views"]


def test_dashboard_shows_callback_errors(dash, monkeypatch):
    shown = dash.result
    dash.w_kernels.options = list(dash.w_kernels.options) + ["no_such_kernels"]
    dash.w_kernels.value = "no_such_kernels"                     # a callback that raises
    assert "PluginError" in dash.error_text and "no_such_kernels" in dash.error_text
    assert dash.w_error.layout.display != "none"
    assert dash.errors[-1]["type"] == "PluginError"
    assert dash.result is shown                                  # the last good run stays on screen
    dash.w_kernels.value = "triton"
    assert dash.error_text == ""                                 # next successful action clears the area

    def broken(*a, **k):
        raise RuntimeError("plot exploded")
    monkeypatch.setattr(dash.views["curve"], "draw", broken)
    dash.set(site="gate")
    assert "RuntimeError" in dash.error_text and "plot exploded" in dash.error_text
    assert "Traceback" in dash.errors[-1]["traceback"]


def test_dashboard_sweep_matrix_jumps(dash):
    n_before = len(dash.cache)
    sweep = dash.run_sweep_matrix(offloads=[0, 5], ubatches=[4])
    assert {(c["offload"], c["ubatch"]) for c in sweep["cells"]} >= {(0, 4), (5, 4)}
    assert dash.images["sweep"]
    labels = [value for _label, value in dash.w_jump.options if value is not None]
    assert (0, 4) in labels
    dash.w_jump.value = (0, 4)                                   # what clicking a cell does
    assert dash.state.run.offload == 0 and dash.state.run.ubatch == 4
    assert len(dash.cache) == n_before + 1
    assert dash.result.first_divergence is None


def test_lab_command_registers():
    from mamba_debug.lab import add_lab_command, lab_command, lab_env

    parser = argparse.ArgumentParser()
    add_lab_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["lab", "--no-browser", "--port", "8123"])
    assert args.command == "lab" and args.port == 8123 and callable(args.func)
    cmd = lab_command(REPO / "notebooks", 8123, True, "")
    assert "jupyterlab" in cmd and "--no-browser" in cmd
    assert lab_env({"PYTHONPATH": "/x"})["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/x"]


def _marked_processes(marker: str) -> list:
    """Pids of live processes whose environment holds `marker` (Linux /proc)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if marker.encode() in (d / "environ").read_bytes():
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(int(d.name))
        except OSError:
            continue
    return pids


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_lab_stops_cleanly_on_a_signal(signame, tmp_path):
    """`mamba-debug lab` stopped by SIGTERM or SIGINT takes JupyterLab, its kernels and its port with it."""
    import json
    import signal
    import socket
    import subprocess
    import sys
    import time
    import urllib.request
    import uuid

    for mod in ("jupyterlab", "ipykernel"):
        pytest.importorskip(mod, reason="notebook extras: pip install -r requirements-lab.txt")
    if not Path("/proc/self/environ").exists():
        pytest.skip("needs /proc to find leftover processes")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    marker = f"MAMBA_DEBUG_LAB_TEST={uuid.uuid4().hex}"
    env = dict(os.environ, **dict([marker.split("=")]), JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"),
               JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"), JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    (tmp_path / "nb").mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "mamba_debug", "lab", "--notebooks", str(tmp_path / "nb"),
                             "--no-browser", "--port", str(port), "--token", "", "--",
                             "--ServerApp.ip=127.0.0.1", "--ServerApp.disable_check_xsrf=True"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"mamba-debug lab exited early ({proc.returncode})"
            try:
                urllib.request.urlopen(f"{url}/api/status", timeout=5).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "JupyterLab did not answer in 120 s"
                time.sleep(0.5)
        req = urllib.request.Request(f"{url}/api/kernels", data=json.dumps({"name": "python3"}).encode(),
                                     method="POST", headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=60).close()          # a kernel too: it must go as well
        deadline = time.monotonic() + 60
        while len(_marked_processes(marker)) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)                                       # mamba-debug, JupyterLab, the kernel
        assert len(_marked_processes(marker)) >= 3, _marked_processes(marker)

        proc.send_signal(getattr(signal, signame))
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _marked_processes(marker) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _marked_processes(marker) == [], "processes left behind"
        with socket.socket() as s:                                # nobody listens on the port any more
            assert s.connect_ex(("127.0.0.1", port)) != 0
        with socket.socket() as s:                                # and a new server can take it (as servers
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # do: TIME_WAIT connections allowed)
            s.bind(("127.0.0.1", port))
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _marked_processes(marker):
            os.kill(pid, signal.SIGKILL)


def test_dashboard_controls_have_tooltips_and_step_buttons(dash):
    import ipywidgets as W
    controls = [w for name, w in vars(dash.controls).items() if name.startswith("w_")
                and isinstance(w, (W.Button, W.IntSlider, W.Dropdown, W.Play))]
    assert len(controls) >= 15
    assert all(w.tooltip for w in controls), [w for w in controls if not w.tooltip]
    assert dash.w_offload.description == "offload" and dash.w_ubatch.description == "ubatch"
    assert not dash.w_offload.continuous_update and not dash.w_ubatch.continuous_update
    t = dash.w_token.value
    dash.w_tok_prev.click()
    assert dash.w_token.value == max(t - 1, 0) and dash.timings["source"] in ("view", "cache", "run")
    dash.w_tok_next.click()
    assert dash.w_token.value == min(max(t - 1, 0) + 1, dash.w_token.max)
    dash.step("token", -10_000)
    assert dash.w_token.value == 0                                  # clamped to the slider's range
    assert "md-static-snapshot" in dash._snapshot_html() and "data:image/png;base64" in dash._snapshot_html()
