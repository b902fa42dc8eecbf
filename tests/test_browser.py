"""A person's view of the quickstart: JupyterLab in headless Chromium runs notebooks/01_quickstart.ipynb; the
offload and ubatch sliders are moved with the keyboard, tokens stepped with the buttons; the pictures must change,
no error may show, and the controls must not move.

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
    const states = document.querySelector('.md-states img, img.md-states');
    return status && !/running/.test(status.textContent) && /offload 0/.test(status.textContent)
           && states && states.getAttribute('src') !== statesBefore;
}"""


def _img_src(page, cls: str) -> str:
    return page.evaluate(f"""() => {{
        const img = document.querySelector('.{cls} img, img.{cls}');
        return img ? img.getAttribute('src') : '';
    }}""")


def _digest(src: str) -> str:
    """A short name for what an image shows: its bytes for a data: URL, else (a blob: URL) the URL itself."""
    data = src.split(",", 1)[-1] if src.startswith("data:") else ""
    return hashlib.sha256(base64.b64decode(data) if data else src.encode()).hexdigest()[:16]


def _readout(page, cls: str) -> str:
    return page.inner_text(f".md-dashboard .{cls} .widget-readout").strip()


def _settle(page, what: str):
    """Wait until the dashboard has no run pending or going, then for the kernel to be idle."""
    _wait(page, """() => {
        const s = document.querySelector('.md-dashboard .md-status');
        const pending = /runs when the slider rests/.test(document.querySelector('.md-dashboard').textContent);
        return s && !/running/.test(s.textContent) && !pending;
    }""", REDRAW_TIMEOUT_S, what)
    _wait(page, KERNEL_READY, REDRAW_TIMEOUT_S, "the kernel to go idle")


def _shot(page, dash, path: str):
    """A screenshot of the browser window with the dashboard's top at the top (what a person sees)."""
    dash.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.wait_for_timeout(300)
    page.screenshot(path=path)


def _controls_offset(page) -> float:
    """Where the offload slider sits below the dashboard's top edge (px): a steady layout keeps it."""
    return page.evaluate("""() => document.querySelector('.md-dashboard .md-offload').getBoundingClientRect().top
                                  - document.querySelector('.md-dashboard').getBoundingClientRect().top""")


def _errors(page) -> str:
    return page.inner_text(".md-dashboard .md-error") if page.is_visible(".md-dashboard .md-error") else ""


def _move_slider(page, cls: str, keys: list, want: str):
    """Move a slider with the keyboard (focus its handle, press keys); type into the readout if keys are not
    taken. Returns when the readout shows `want`."""
    handle = page.locator(f".md-dashboard .{cls} .noUi-handle")
    handle.focus()
    for key in keys:
        handle.press(key)
    page.wait_for_timeout(300)
    if _readout(page, cls) != want:
        page.locator(f".md-dashboard .{cls} .widget-readout").click()
        page.keyboard.press("Control+A")
        page.keyboard.type(want)
        page.keyboard.press("Enter")
    _wait(page, f"() => document.querySelector('.md-dashboard .{cls} .widget-readout').textContent.trim() === '{want}'",
          30, f"the {cls} readout to show {want}")


def test_quickstart_dashboard_in_a_real_browser(lab_server):
    """Run the quickstart, then use the dashboard as a person would: the offload slider (Home), the ubatch slider
    (arrow keys, several presses: one run), the token step buttons, the first-divergence button. Every picture that
    should change does, no error shows, and screenshots of each step are left in out/browser/."""
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1100}, device_scale_factor=2)
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
            page.wait_for_selector(".md-dashboard img.md-curve", timeout=60_000)
            dash = page.locator(".md-dashboard")
            dash.scroll_into_view_if_needed()
            # the static snapshot under the widgets exists (for a kernel-less reader) and is hidden while they live
            snap = page.evaluate("""() => [...document.querySelectorAll('.md-static-snapshot')].map(
                e => getComputedStyle(e).display)""")
            assert snap and all(d == "none" for d in snap), snap
            seen = {"start": {c: _img_src(page, c) for c in ("md-curve", "md-heatmap", "md-states")}}
            assert seen["start"]["md-curve"], "the curve shows no picture"
            header_y = _controls_offset(page)
            _shot(page, dash, str(ARTIFACTS / "1-start.png"))

            # 1. offload to 0 with the keyboard (Home): one new run, the curve and heatmap change
            _move_slider(page, "md-offload", ["Home"], "0")
            page.wait_for_timeout(900)                 # the run has started: the layout must not move meanwhile
            header_y_running = _controls_offset(page)
            _wait(page, """(before) => {
                      const img = document.querySelector('.md-curve img, img.md-curve');
                      return img && img.getAttribute('src') !== before;
                  }""", REDRAW_TIMEOUT_S, "the per-layer curve to be redrawn", arg=seen["start"]["md-curve"])
            _wait(page, DASHBOARD_DONE, REDRAW_TIMEOUT_S, "the dashboard to finish the new configuration",
                  arg=seen["start"]["md-states"])
            _settle(page, "the offload run to finish")
            seen["offload"] = {c: _img_src(page, c) for c in ("md-curve", "md-heatmap", "md-states")}
            status_offload = page.inner_text(".md-dashboard .md-status")
            err_offload = _errors(page)
            _shot(page, dash, str(ARTIFACTS / "2-offload-0.png"))

            # 2. ubatch down by three arrow presses in a row: the run starts once, when the slider rests
            start_ub = int(_readout(page, "md-ubatch"))
            want_ub = str(max(1, start_ub - 3))
            _move_slider(page, "md-ubatch", ["ArrowLeft"] * 3, want_ub)
            _settle(page, "the ubatch run to finish")
            _wait(page, f"() => /ubatch {want_ub}(?!\\d)/.test("
                        "document.querySelector('.md-dashboard .md-status').innerText)",
                  REDRAW_TIMEOUT_S, f"the status to show ubatch {want_ub}")
            seen["ubatch"] = {c: _img_src(page, c) for c in ("md-curve", "md-heatmap", "md-states")}
            err_ubatch = _errors(page)
            _shot(page, dash, str(ARTIFACTS / "3-ubatch.png"))

            # 3. step the token back twice and forward once with the buttons: the curve follows, no run
            tok0 = int(_readout(page, "md-token"))
            for cls in ("md-tok-prev", "md-tok-prev", "md-tok-next"):
                before = _img_src(page, "md-curve")
                page.locator(f".md-dashboard .{cls}").click()
                _wait(page, """(before) => {
                          const img = document.querySelector('.md-curve img, img.md-curve');
                          return img && img.getAttribute('src') !== before;
                      }""", 60, f"the curve to follow {cls}", arg=before)
            _settle(page, "the token steps")
            tok1 = int(_readout(page, "md-token"))
            timing = page.inner_text(".md-dashboard").lower()
            seen["token"] = {c: _img_src(page, c) for c in ("md-curve", "md-heatmap", "md-states")}
            err_token = _errors(page)
            _shot(page, dash, str(ARTIFACTS / "4-token-steps.png"))

            # 4. the first-divergence button (nothing diverged in the quickstart: says so, no error)
            page.locator(".md-dashboard .md-first").click()
            _settle(page, "the first-divergence button")
            err_first = _errors(page)
            header_y_after = _controls_offset(page)
            _shot(page, dash, str(ARTIFACTS / "5-first-divergence.png"))
            page.screenshot(path=str(ARTIFACTS / "quickstart-page.png"), full_page=True)

            # 5. saved and reopened without the live widgets: the static picture shows where the dashboard was
            page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
            page.wait_for_timeout(1500)
            page.evaluate("() => window.jupyterapp.commands.execute('kernelmenu:shutdown')")
            page.wait_for_timeout(1500)
            page.close()
            page2 = browser.new_page(viewport={"width": 1500, "height": 1100}, device_scale_factor=2)
            page2.goto(f"{lab_server}/lab/tree/{NOTEBOOK.name}", wait_until="domcontentloaded", timeout=120_000)
            page2.wait_for_selector(".md-static-snapshot img", state="visible", timeout=120_000)
            snapshot = page2.locator(".md-static-snapshot").first
            snapshot.evaluate("e => e.scrollIntoView({block: 'start'})")
            page2.wait_for_timeout(500)
            n_snapshot_imgs = page2.locator(".md-static-snapshot img").count()
            page2.screenshot(path=str(ARTIFACTS / "6-saved-notebook-without-widgets.png"))
        finally:
            browser.close()

    d = {step: {c: _digest(src) for c, src in imgs.items()} for step, imgs in seen.items()}
    assert d["offload"]["md-curve"] != d["start"]["md-curve"], "the curve did not change with the offload"
    assert d["offload"]["md-heatmap"] != d["start"]["md-heatmap"], "the heatmap did not change with the offload"
    assert d["ubatch"]["md-heatmap"] != d["offload"]["md-heatmap"], "the heatmap did not change with the ubatch"
    assert tok1 == max(tok0 - 1, 0) or tok1 == tok0 - 1, (tok0, tok1)
    assert d["token"]["md-heatmap"] == d["ubatch"]["md-heatmap"], "stepping tokens must not redraw the heatmap"
    assert "offload 0" in status_offload, status_offload
    for err in (err_offload, err_ubatch, err_token, err_first):
        assert err.strip() == "", err
    for y in (header_y_running, header_y_after):
        assert abs(y - header_y) < 2, f"the controls moved by {y - header_y:.0f} px"
    assert "redraw" in timing
    assert n_snapshot_imgs >= 4, "the saved notebook shows no static picture of the dashboard"
    assert not [e for e in console_errors if "widget" in e.lower() and "error" in e.lower()], console_errors
