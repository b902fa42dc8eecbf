"""Kernel plug-ins: files in `kernels/` (or any .py path) that override ops of the device layers.

A plug-in is a Python file with a module-level `OPS = {"op_name": callable, ...}` (any subset of
`ops.OP_NAMES`) and optional metadata:

    NAME, DESCRIPTION          what it is
    SUPPORTS_STATES_OUT        False if its ssm_scan cannot fill `states_out` (default True)
    SSD_CHUNK                  Q if its ssd_scan computes Mamba-2's scan in the chunked SSD form (mamba_ssm's order:
                               a cumulative sum of dA per chunk of Q tokens, exponentials of its differences): a
                               second opinion then samples that order's float32 rounding too (second_opinion.py)
    BUG                        for a deliberately buggy variant: a dict with "bug", "incident",
                               "symptom" and "expect" (the settings and first divergence it must show)

The files are loaded by path, never imported as a package: a PyPI package called `kernels` exists
and other libraries import it. Triton kernels are compiled for the GPU (`device="cuda"`) or run by
Triton's interpreter on the CPU (`device="interpret"`); the choice is made when the file is executed,
so each (file, device) pair gets its own module object.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .errors import PluginError
from .ops import OP_NAMES, output_contract
from .isolation import changed_inputs, defer, defer_flag, snapshot_inputs
from .shipped import shipped_dir
from .triton_env import exec_file, set_mode

KERNELS_DIR = Path(os.environ.get("MAMBA_DEBUG_KERNELS_DIR", shipped_dir("kernels")))


@dataclass
class Plugin:
    name: str
    path: Path
    description: str
    ops: dict[str, Callable]
    supports_states_out: bool = True
    ssd_chunk: int | None = None
    bug: dict | None = None
    module: object = field(default=None, repr=False)


def _plugin_files() -> dict[str, Path]:
    if not KERNELS_DIR.is_dir():
        return {}
    return {p.stem: p for p in sorted(KERNELS_DIR.glob("*.py")) if not p.name.startswith("_")}


def list_kernels() -> dict[str, str]:
    """Names of the plug-ins in kernels/ with their one-line descriptions (without executing kernels)."""
    out = {}
    for name, path in _plugin_files().items():
        out[name] = _read_description(path)
    return out


def _read_description(path: Path) -> str:
    # Parse the DESCRIPTION literal without running the file: listing must be cheap and side-effect free.
    text = path.read_text()
    m = re.search(r'^DESCRIPTION\s*=\s*\(?\s*((?:"[^"\n]*"\s*)+)\)?', text, re.M)
    if not m:
        return ""
    return "".join(re.findall(r'"([^"\n]*)"', m.group(1)))


def resolve_kernels(name_or_path: str) -> Path:
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise PluginError(f"kernels {name_or_path!r}: give a plug-in's name (md.list_kernels()) or a .py file's path")
    files = _plugin_files()
    if name_or_path in files:
        return files[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".py" and path.is_file():
        return path.resolve()
    known = ", ".join(files) or "(none found in %s)" % KERNELS_DIR
    raise PluginError(f"kernels {name_or_path!r}: no such plug-in name or .py file. "
                      f"Known plug-ins: {known}; or pass the path of a .py file that defines OPS.")


_CACHE: dict[tuple[Path, str], Plugin] = {}
_LOADING_DEVICE: list[str] = []   # stack of devices of the plug-ins being executed right now


def sibling(name: str) -> Plugin:
    """For use inside a plug-in file: load another plug-in (e.g. the correct `triton` kernels that a buggy
    variant modifies) for the same device as the file being loaded."""
    return load_plugin(name, _LOADING_DEVICE[-1] if _LOADING_DEVICE else "interpret")


def load_plugin(name_or_path: str, device: str = "interpret") -> Plugin:
    """Execute a plug-in file for a device ('cuda' compiles Triton, 'interpret'/'cpu' interprets it)."""
    if device not in ("cuda", "interpret", "cpu"):      # anything else was interpreted as if 'interpret'
        raise PluginError(f"device {device!r}: a plug-in loads for 'cuda', 'interpret' or 'cpu'")
    path = resolve_kernels(name_or_path)
    key = (path, device)
    if key not in _CACHE:
        _CACHE[key] = _exec_plugin(path, device)
    return _CACHE[key]


def load_kernels(name_or_path: str, device: str = "interpret") -> dict[str, Callable]:
    """The plug-in's ops as a mapping op name -> callable (validated wrappers)."""
    return dict(load_plugin(name_or_path, device).ops)


def _exec_plugin(path: Path, device: str) -> Plugin:
    # Triton reads TRITON_INTERPRET when a kernel is defined and again at launch (and fixes its own library's
    # mode at first import), so the variable stays set for the rest of the process rather than being restored.
    set_mode(device)
    mod_name = f"mamba_debug_plugin_{path.stem}_{device}"
    _LOADING_DEVICE.append(device)
    try:
        module = exec_file(path, mod_name)
    except PluginError:
        raise
    except (Exception, SystemExit) as exc:     # a plug-in that calls sys.exit() at load is an error, not an exit
        raise PluginError(f"plug-in {path}: failed to load ({type(exc).__name__}: {exc}); fix the file or choose "
                          f"another --kernels") from exc
    finally:
        _LOADING_DEVICE.pop()
    ops = getattr(module, "OPS", None)
    if not isinstance(ops, dict) or not ops:
        raise PluginError(f"plug-in {path}: defines no OPS dict. Add OPS = {{'ssm_scan': my_scan, ...}} "
                          f"with any of {list(OP_NAMES)}.")
    unknown = [k for k in ops if k not in OP_NAMES]
    if unknown:
        raise PluginError(f"plug-in {path}: unknown op name(s) {unknown}; the op table has {list(OP_NAMES)}.")
    not_callable = [k for k, v in ops.items() if not callable(v)]
    if not_callable:
        raise PluginError(f"plug-in {path}: OPS entries {not_callable} are not callable.")
    name = getattr(module, "NAME", path.stem)
    return Plugin(
        name=name, path=path, description=getattr(module, "DESCRIPTION", ""),
        ops={k: checked_op(name, k, fn, check_states_out=not path.resolve().is_relative_to(KERNELS_DIR.resolve()))
             for k, fn in ops.items()},
        supports_states_out=bool(getattr(module, "SUPPORTS_STATES_OUT", True)),
        ssd_chunk=_ssd_chunk(module, path), bug=getattr(module, "BUG", None), module=module)


def _ssd_chunk(module, path: Path) -> int | None:
    """The plug-in's SSD_CHUNK: None, or a positive int (a bool, a string or a float is refused naming the file)."""
    q = getattr(module, "SSD_CHUNK", None)
    if q is None:
        return None
    if isinstance(q, bool) or not isinstance(q, int) or q < 1:
        raise PluginError(f"plug-in {path}: SSD_CHUNK = {q!r}; it must be the chunk size of its chunked ssd_scan, a "
                          f"positive int (or leave it out for a sequential scan)")
    return q


class _Shapes:
    """The arguments' shapes as text, formatted only when a message needs them."""

    def __init__(self, args):
        self.args = args

    def __str__(self):
        return ", ".join(_shape(a) for a in self.args)


def _shape(t) -> str:
    return "x".join(map(str, t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def checked_op(plugin: str, op: str, fn: Callable, check_states_out: bool = True) -> Callable:
    """Wrap an op so a crash, a wrong output shape/dtype/device or (check_states_out: a plug-in of the user's; the
    shipped kernels' tests hold theirs) an unwritten `states_out` names the plug-in, the op and the shapes."""
    def wrapper(*args, **kwargs):
        # shapes: only formatted for a message (this wrapper runs on every op call of the device side)
        shapes = _Shapes(args)
        before = snapshot_inputs(args, kwargs)
        mark = _mark_states_out(kwargs) if check_states_out else None
        try:
            result = fn(*args, **kwargs)
        except PluginError:
            raise
        except (Exception, SystemExit) as exc:   # sys.exit() inside an op must not end the run as "clean"
            raise PluginError(f"plug-in {plugin}: op {op}({shapes}) raised {type(exc).__name__}: {exc}") from exc
        wrote = lambda names: (f"plug-in {plugin}: op {op}({shapes}) wrote into its input(s) {', '.join(names)}; "  # noqa: E731
                               f"ops must return new tensors and leave their inputs as they were")
        if not defer(before, wrote):            # on a GPU inside a forward pass: checked at its end (isolation.py)
            changed = changed_inputs(before, args, kwargs)
            if changed:
                raise PluginError(wrote(changed))
        outs = list(result) if isinstance(result, (tuple, list)) else [result]
        expected = output_contract(op, args)
        if len(expected) == 1 and isinstance(result, (tuple, list)):
            raise PluginError(f"plug-in {plugin}: op {op}({shapes}) returned a {type(result).__name__}; an op with one "
                              f"output returns the tensor itself")
        if len(outs) != len(expected):
            raise PluginError(f"plug-in {plugin}: op {op}({shapes}) returned {len(outs)} value(s), "
                              f"expected {len(expected)}")
        for i, (out, (shape, dtype, device)) in enumerate(zip(outs, expected)):
            if not isinstance(out, torch.Tensor):
                raise PluginError(f"plug-in {plugin}: op {op}({shapes}) output {i} is {type(out).__name__}, not a tensor")
            if out.shape != shape or out.dtype != dtype or out.device != device:
                raise PluginError(
                    f"plug-in {plugin}: op {op}({shapes}) output {i} is {_shape(out)} {out.dtype} on {out.device}, "
                    f"expected {'x'.join(map(str, shape))} {dtype} on {device}")
        if mark is not None:
            _check_states_out(mark, outs[1], f"plug-in {plugin}: op {op}({shapes}) left `states_out` unwritten (its "
                              f"last token still holds the NaN put there before the call); write every token's state "
                              f"into it, or set SUPPORTS_STATES_OUT = False in the plug-in file")
        return result
    wrapper.__name__ = f"{plugin}.{op}"
    wrapper.__wrapped__ = fn
    return wrapper


def _mark_states_out(kwargs: dict):
    """The last token of a scan's `states_out`, filled with NaN before the call (None: no floating states_out):
    a plug-in that ignores the buffer leaves it so, where `torch.empty`'s leftovers read as a NaN or a wrong
    state born in the kernel."""
    so = kwargs.get("states_out")
    if not isinstance(so, torch.Tensor) or not so.is_floating_point() or so.dim() < 2 or not so.numel():
        return None
    last = so[:, -1]
    last.fill_(float("nan"))
    return last


def _check_states_out(last: torch.Tensor, state: torch.Tensor, message: str):
    """Unwritten: the marked slice is all NaN while the state the op returned (the same token's) is finite. On a GPU
    inside a forward pass the flag is read with the pass's other checks (isolation.deferred), not here."""
    flag = torch.isnan(last).all() & torch.isfinite(state).all()
    if not defer_flag(flag, message) and bool(flag):
        raise PluginError(message)
