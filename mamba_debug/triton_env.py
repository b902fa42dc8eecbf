"""Execute a Triton file by path, compiled for a GPU or under Triton's interpreter: `TRITON_INTERPRET` in one place.

Triton kernel files (the plug-ins in kernels/, the fused metrics kernel) are executed, never imported, so that each
mode gets its own module object: triton.jit reads TRITON_INTERPRET when a kernel is defined and again at launch, and
Triton fixes its own library's mode at its first import.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from pathlib import Path


def exec_file(path: Path, module_name: str):
    """Execute the Python file at `path` as module `module_name`, registered in sys.modules (dataclasses and triton
    need the module to be findable) and removed again if it fails. The caller sets TRITON_INTERPRET first."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def set_mode(device: str):
    """For the rest of the process: Triton files executed from now on compile for the GPU (device "cuda") or are
    interpreted (anything else). Plug-ins keep the variable set, since Triton reads it again at launch."""
    os.environ["TRITON_INTERPRET"] = "0" if device == "cuda" else "1"


@contextlib.contextmanager
def mode(interpret: bool):
    """TRITON_INTERPRET set for the duration of one file's execution, then restored."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
