"""`mamba-debug lab`: JupyterLab on the project's notebooks, with the widgets working.

The notebook extras are not dependencies of the library; `pip install -r requirements-lab.txt` brings
jupyterlab, ipywidgets (its JupyterLab extension ships inside the wheel, nothing to build), nbclient,
nbformat, ipykernel and playwright. The kernel finds `mamba_debug` even without `pip install -e .`:
the repository root is put on its PYTHONPATH.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

from .errors import MambaDebugError
from .shipped import IN_CHECKOUT, ROOT as REPO

NOTEBOOKS = REPO / "notebooks"
LAB_PACKAGES = ("jupyterlab", "ipywidgets", "ipykernel")
STOP_TIMEOUT_S = 20     # JupyterLab's own shutdown (kernels included) before it is killed


def missing_lab_packages() -> list[str]:
    return [p for p in LAB_PACKAGES if importlib.util.find_spec(p) is None]


def lab_command(notebook_dir: Path, port: int | None = None, no_browser: bool = False, token: str | None = None,
                extra: list[str] | None = None) -> list[str]:
    """The command line that starts JupyterLab (the browser test uses it too)."""
    cmd = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={notebook_dir}"]
    if port is not None:
        cmd += [f"--ServerApp.port={port}", "--ServerApp.port_retries=0"]
    if no_browser:
        cmd.append("--no-browser")
    if token is not None:
        cmd.append(f"--IdentityProvider.token={token}")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")          # containers and CI run as root; JupyterLab refuses without it
    return cmd + list(extra or [])


def lab_env(base: dict | None = None) -> dict:
    """Environment for the server and its kernels: the repository on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    mine = [str(REPO)] if IN_CHECKOUT else []        # an installed wheel is importable as it is
    parts = mine + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(REPO)]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env


def cmd_lab(args) -> int:
    missing = missing_lab_packages()
    if missing:
        raise MambaDebugError(f"the notebook extras are not installed (missing: {', '.join(missing)}); run "
                              f"`pip install -r {REPO / 'requirements-lab.txt'}` (or `make lab`)")
    folder = Path(args.notebooks).resolve()
    if not folder.is_dir():
        where = "" if IN_CHECKOUT else (" (this mamba_debug was installed from a wheel, which carries no notebooks: "
                                        "open a source checkout's with `pip install -e CHECKOUT`, or pass --notebooks)")
        raise MambaDebugError(f"{folder}: no such folder of notebooks{where}")
    first = args.open or ("01_quickstart.ipynb" if (folder / "01_quickstart.ipynb").is_file() else None)
    extra = list(args.jupyter_args or [])
    if first and not args.no_browser:
        extra.append(f"--LabApp.default_url=/lab/tree/{first}")
    cmd = lab_command(folder, args.port, args.no_browser, args.token, extra)
    print("mamba-debug lab: " + " ".join(cmd), file=sys.stderr)
    return run_lab(cmd, env=lab_env(), cwd=folder)


def run_lab(cmd: list, env: dict, cwd) -> int:
    """Run JupyterLab until it exits; SIGTERM, SIGINT and SIGHUP to this process stop it (its kernels and its
    port with it): the signal is passed on as SIGTERM (JupyterLab's clean shutdown, no "shut down? y/n" prompt);
    what is left after STOP_TIMEOUT_S is killed. JupyterLab runs in its own session, so a Ctrl-C in the terminal
    reaches only this process, which passes it on once."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, start_new_session=True)
    stopping = []

    def stop(signum, _frame):
        stopping.append(signum)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    handled = [s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGHUP", None)) if s is not None]
    previous = {s: signal.signal(s, stop) for s in handled}
    try:
        while True:
            try:
                rc = proc.wait(timeout=STOP_TIMEOUT_S if stopping else None)
                break
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if proc.poll() is None:
            _kill_group(proc.pid)
            proc.wait()
    return 0 if stopping else rc


def _kill_group(pgid: int):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def add_lab_command(sub) -> argparse.ArgumentParser:
    """Register `mamba-debug lab` on the CLI's subparsers."""
    p = sub.add_parser("lab", help="open JupyterLab on the notebooks (dashboard widgets included)",
                       description="Start JupyterLab on notebooks/ with mamba_debug importable by its kernels. "
                                   "Needs `pip install -r requirements-lab.txt`. Arguments after `--` go to "
                                   "JupyterLab unchanged.")
    p.add_argument("--notebooks", default=str(NOTEBOOKS), help="folder to open (default: the repository's notebooks/)")
    p.add_argument("--open", default=None, help="notebook to open first (default 01_quickstart.ipynb)")
    p.add_argument("--port", type=int, default=None, help="server port (default: JupyterLab's, 8888 or the next free)")
    p.add_argument("--no-browser", action="store_true", help="do not open a browser (print the URL only)")
    p.add_argument("--token", default=None,
                   help="access token (default: JupyterLab's random one; '' disables it - local use only)")
    p.add_argument("jupyter_args", nargs=argparse.REMAINDER, help="extra JupyterLab arguments after --")
    p.set_defaults(func=_strip_dashdash(cmd_lab))
    return p


def _strip_dashdash(fn):
    def run(args):
        if args.jupyter_args and args.jupyter_args[0] == "--":
            args.jupyter_args = args.jupyter_args[1:]
        return fn(args)
    return run
