"""A person's view of the quickstart: JupyterLab in headless Chromium runs notebooks/01_quickstart.ipynb, the
offload slider is moved with the keyboard, and the dashboard's plot must change.

Needs Debian's chromium (`apt-get install -y chromium`) and the notebook extras with Playwright's Python API
(`pip install -r requirements-lab.txt`; no `playwright install`: the system chromium is used). Skipped, with the
reason, when chromium or playwright is missing. Screenshots go to out/browser/.
"""
from __future__ import annotations

import base64
import hashlib
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "01_quickstart.ipynb"
ARTIFACTS = REPO / "out" / "browser"
CHROMIUM = os.environ.get("MAMBA_DEBUG_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
RUN_TIMEOUT_S = 900         # the whole notebook, Triton interpreted on a small shared CPU
REDRAW_TIMEOUT_S = 300      # one new configuration


def _requirements():
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"chromium not installed ({CHROMIUM} missing): apt-get install -y chromium")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("playwright not installed: pip install -r requirements-lab.txt (no `playwright install` needed)")
    for mod in ("jupyterlab", "ipywidgets", "ipykernel"):
        pytest.importorskip(mod, reason="notebook extras: pip install -r requirements-lab.txt")
    if not (REPO / "data" / "tiny-mamba" / "config.json").is_file():
        pytest.skip("the shipped tiny model (data/tiny-mamba) is not there: the quickstart runs on it")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab_server(tmp_path):
    """JupyterLab on a temp copy of the quickstart: localhost only, random port, no token, fresh state."""
    _requirements()
    from mamba_debug.lab import lab_command, lab_env

    root = tmp_path / "nb"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    port = _free_port()
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)       # no "get notified about Jupyter news?" toast over the page
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')
    env = lab_env()
    env.update({"JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
                "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
                "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"),
                "MPLBACKEND": "module://matplotlib_inline.backend_inline"})
    cmd = lab_command(root, port, no_browser=True, token="", extra=[
        "--ServerApp.ip=127.0.0.1", "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
        "--LabApp.expose_app_in_browser=True", "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.extension_manager=readonly"])
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(cmd, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited ({proc.returncode}):\n{(tmp_path / 'lab.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"JupyterLab did not answer in 120 s:\n{(tmp_path / 'lab.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait(page, predicate_js: str, timeout_s: float, what: str, arg=None):
    try:
        page.wait_for_function(predicate_js, arg=arg, timeout=timeout_s * 1000, polling=500)
    except Exception as exc:  # noqa: BLE001
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "quickstart-timeout.png"), full_page=True)
        raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} "
                             f"(screenshot: out/browser/quickstart-timeout.png)") from exc


ALL_CELLS_DONE = """() => {
    const prompts = [...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')];
    if (!prompts.length) return false;
    const done = prompts.every(p => /\\[\\d+\\]/.test(p.textContent));
    const app = window.jupyterapp;
    const widget = app && app.shell.currentWidget;
    const kernel = widget && widget.sessionContext && widget.sessionContext.session
                   && widget.sessionContext.session.kernel;
    return done && kernel && kernel.status === 'idle';
}"""

KERNEL_READY = """() => {
    const app = window.jupyterapp;
    const widget = app && app.shell.currentWidget;
    const ctx = widget && widget.sessionContext;
    return !!(ctx && ctx.session && ctx.session.kernel && ctx.session.kernel.status === 'idle'
              && widget.content && widget.content.widgets && widget.content.widgets.length);
}"""


DASHBOARD_DONE = """(statesBefore) => {
    const status = document.querySelector('.md-dashboard .md-status');
    const states = document.querySelector('.md-states img');
    return status && !/running/.test(status.textContent) && /offload 0/.test(status.textContent)
           && states && states.getAttribute('src') !== statesBefore;
}"""


def _img_src(page, cls: str) -> str:
    return page.evaluate(f"""() => {{
        const img = document.querySelector('.{cls} img');
        return img ? img.getAttribute('src') : '';
    }}""")


def _digest(src: str) -> str:
    data = src.split(",", 1)[-1]
    return hashlib.sha256(base64.b64decode(data) if data else b"").hexdigest()[:16]


def test_quickstart_dashboard_in_a_real_browser(lab_server):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            page.set_default_timeout(60_000)
            console_errors = []
            page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
            page.goto(f"{lab_server}/lab/tree/{NOTEBOOK.name}", wait_until="domcontentloaded", timeout=120_000)
            page.wait_for_selector(".jp-Notebook", timeout=120_000)
            _wait(page, KERNEL_READY, 180, "the notebook's kernel to start")

            # run every cell, as Run > Run All Cells does
            page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
            _wait(page, ALL_CELLS_DONE, RUN_TIMEOUT_S, "all cells to run and the kernel to go idle")
            text = page.inner_text(".jp-Notebook")
            assert "Traceback" not in text and "AssertionError" not in text, text[-3000:]
            page.wait_for_selector(".md-dashboard .md-curve img", timeout=60_000)
            dash = page.locator(".md-dashboard")
            dash.scroll_into_view_if_needed()
            before = _img_src(page, "md-curve")
            states_before = _img_src(page, "md-states")
            assert before.startswith("data:image/png;base64,")
            readout = page.locator(".md-offload .widget-readout")
            start_value = readout.inner_text().strip()
            dash.screenshot(path=str(ARTIFACTS / "quickstart-before.png"))

            # move the offload slider with the keyboard: focus its handle, Home = offload 0
            handle = page.locator(".md-offload .noUi-handle")
            handle.focus()
            handle.press("Home")
            page.wait_for_timeout(500)
            if readout.inner_text().strip() == start_value:     # keyboard not taken: type into the readout
                readout.click()
                page.keyboard.press("Control+A")
                page.keyboard.type("0")
                page.keyboard.press("Enter")
            _wait(page, "() => document.querySelector('.md-offload .widget-readout').textContent.trim() === '0'",
                  30, "the offload readout to show 0")
            _wait(page, """(before) => {
                      const img = document.querySelector('.md-curve img');
                      return img && img.getAttribute('src') !== before;
                  }""", REDRAW_TIMEOUT_S, "the per-layer curve to be redrawn", arg=before)
            _wait(page, DASHBOARD_DONE, REDRAW_TIMEOUT_S, "the dashboard to finish the new configuration",
                  arg=states_before)
            _wait(page, KERNEL_READY, REDRAW_TIMEOUT_S, "the kernel to go idle")
            after = _img_src(page, "md-curve")
            status = page.inner_text(".md-dashboard .md-status")
            error_box = page.inner_text(".md-dashboard .md-error") if page.is_visible(".md-dashboard .md-error") else ""
            dash.screenshot(path=str(ARTIFACTS / "quickstart.png"))
            page.screenshot(path=str(ARTIFACTS / "quickstart-page.png"), full_page=True)
        finally:
            browser.close()

    assert _digest(after) != _digest(before), "the plot image did not change after moving the offload slider"
    assert "offload 0" in status, status
    assert error_box.strip() == "", error_box
    assert not [e for e in console_errors if "widget" in e.lower() and "error" in e.lower()], console_errors
