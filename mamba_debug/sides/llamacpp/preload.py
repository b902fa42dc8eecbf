"""A CUDA build of llama.cpp in a Python process that imported numpy first: libstdc++ preloaded.

Such a process can die inside llama_model_load_from_file with no message at all (the research note
llamacpp-tracing.md section 3.4; on an H100, 2026-12-06: `compare` of this project's CUDA build with the restart
switched off ended in a segmentation fault, exit 139, twice; restarted with the preload it ran, exit 0). Preloading
the libstdc++ the process already uses prevents it; the CPU build is unaffected. The binding that fails is not established (numpy's
extension and libggml-cuda.so both carry std:: template symbols the loader unifies), so the rule is measured, not
derived: a CUDA build with numpy loaded first and no libstdc++ preloaded is the hazard.

The command line restarts itself once with the preload (`restart`, before it loads anything of llama.cpp's), and
says so; a library user (a notebook) gets a warning naming the fix (`warn`). MAMBA_DEBUG_NO_PRELOAD=1 turns both off.
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Optional

GUARD = "MAMBA_DEBUG_PRELOADED"         # set in the restarted process: it never restarts again
OPT_OUT = "MAMBA_DEBUG_NO_PRELOAD"
# where a distribution keeps its libstdc++ (the one a system g++ build of llama.cpp was linked against)
SYSTEM = ("/usr/lib/x86_64-linux-gnu/libstdc++.so.6", "/usr/lib/aarch64-linux-gnu/libstdc++.so.6",
          "/usr/lib64/libstdc++.so.6", "/usr/lib/libstdc++.so.6")


def cuda_build(folder: Path) -> bool:
    """Does the llama.cpp library folder hold ggml's CUDA backend (read from the file names: nothing loaded)?"""
    try:
        return any(folder.glob("libggml-cuda*.so*"))
    except OSError:
        return False


def preloaded(env=None) -> bool:
    return "libstdc++" in (os.environ if env is None else env).get("LD_PRELOAD", "")


def libstdcxx() -> Optional[str]:
    """The libstdc++ to preload: the one this process has mapped (numpy's and torch's), else the system's."""
    mapped = None
    try:
        with open("/proc/self/maps") as maps:
            mapped = next((line.split()[-1] for line in maps if "/libstdc++.so" in line), None)
    except OSError:
        pass
    return next((p for p in (mapped, *SYSTEM) if p and os.path.isfile(p)), None)


def hazard(folder: Path, env=None) -> bool:
    """A CUDA build about to load into this process after numpy, with no libstdc++ preloaded and no opt-out."""
    env = os.environ if env is None else env
    return ("numpy" in sys.modules and cuda_build(folder) and not preloaded(env)
            and env.get(OPT_OUT) != "1" and env.get(GUARD) != "1")


def restart_plan(folder: Path, env=None) -> Optional[tuple]:
    """(executable, argv, env) that runs this command line again with libstdc++ preloaded, or None (no hazard, no
    libstdc++ found, or a Python that cannot say how it was started)."""
    env = dict(os.environ if env is None else env)
    lib, argv = libstdcxx(), getattr(sys, "orig_argv", None)
    if not hazard(folder, env) or lib is None or not argv:
        return None
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env[GUARD] = "1"
    return sys.executable, list(argv), env


def restart(folder: Path):
    """The command line, before loading llama.cpp: run again with libstdc++ preloaded where the hazard stands (the
    process is replaced; it has written nothing yet)."""
    plan = restart_plan(folder)
    if plan is None:
        return
    exe, argv, env = plan
    print(f"mamba-debug: note: {folder} is a CUDA build of llama.cpp, which can crash at model load in a process "
          f"that loaded numpy first; restarting with LD_PRELOAD={env['LD_PRELOAD']} (set {OPT_OUT}=1 to skip)",
          file=sys.stderr, flush=True)
    sys.stdout.flush()
    os.execve(exe, argv, env)


def warn(folder: Path):
    """Library use (a notebook, a script): the hazard named with its fix; the load goes on."""
    if hazard(folder):
        warnings.warn(f"{folder} is a CUDA build of llama.cpp loaded after numpy without a preloaded libstdc++: such "
                      f"a process can die silently at model load. Start Python or Jupyter with "
                      f"LD_PRELOAD={libstdcxx() or '<the system libstdc++.so.6>'} (or load llama.cpp before numpy); "
                      f"{OPT_OUT}=1 silences this", stacklevel=3)
