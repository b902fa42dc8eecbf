"""export-case: the real op inputs of a divergent layer, and a self-contained pytest that replays them.

This is the cure for "op tests pass on random inputs": the exported case holds exactly what the device
ops received in the ubatch where the first divergence was born, views included (each tensor argument is
saved as its underlying storage plus size, stride and offset, so a kernel that ignores strides fails the
replay just as it failed in the model).
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from . import ops as ops_module
from .arch import model_ops
from .backends import cpu_backend, device_backends
from .compare import run_compare
from .errors import MambaDebugError
from .model import Model, Runner
from .plugins import resolve_kernels
from .settings import RunSettings, resolve_ref_device


class _Recorder:
    """A Runner observer that records the op calls of one layer in one ubatch (the caller sets `ubatch`)."""

    def __init__(self, layer, ubatch, names):
        self.layer, self.target, self.names = layer, ubatch, names
        self.ubatch = -1
        self.calls = []

    def op(self, layer, name, args, kwargs):
        if name in self.names and layer == self.layer and self.ubatch == self.target:
            self.calls.append((name, args, kwargs))


def _save_arg(arg, store: dict, prefix: str):
    if isinstance(arg, torch.Tensor):
        # keep the view geometry: the bytes of the underlying storage this view can reach
        base_len = arg.storage_offset() + 1 + sum((s - 1) * st for s, st in zip(arg.shape, arg.stride()) if s > 0)
        flat = torch.as_strided(arg, (base_len,), (1,), 0).detach().cpu().clone()
        store[prefix] = flat
        return {"tensor": prefix, "size": list(arg.shape), "stride": list(arg.stride()),
                "offset": arg.storage_offset(), "dtype": str(arg.dtype)}
    if arg is None or isinstance(arg, (int, float, bool)):
        return {"value": arg}
    raise TypeError(f"cannot export argument of type {type(arg).__name__}")


def export_case(model: Model, prompt_ids, settings: RunSettings, out_dir, result=None) -> dict:
    """Find the first divergence (or use `result`), re-run the device side recording that layer's op calls
    in that ubatch, and write inputs.safetensors + case.json + test_case.py into out_dir."""
    from safetensors.torch import save_file  # noqa: PLC0415

    from .safeio import atomic_path, write_text  # noqa: PLC0415

    res = result or run_compare(model, prompt_ids, settings)
    fd = res.first_divergence
    if fd is None:
        raise MambaDebugError("nothing diverged in this configuration, so there is no failing case to export")
    layer = fd["layer"]                                     # None: the output head (its norm and the logits)
    if layer is None and not res.placement.head_on_device:
        raise MambaDebugError(f"the first divergence is the output head's '{fd['site']}', which ran on the host: "
                              f"the device blocks' errors, each under its threshold, added up there, and no device "
                              f"op diverged to export; see them with `mamba-debug compare --capture all`")
    s = res.settings                                        # validated: the device that really ran
    device = s.device
    devs = device_backends(s.kernels, device, s.devices, uses=model_ops(model.config))
    dev = devs[0]
    overridden = sorted(k for k, f in dev.ops.ops.items() if hasattr(f, "__wrapped__")) or list(dev.ops.ops)
    rec = _Recorder(layer, fd["ubatch"], set(overridden))
    host = cpu_backend(resolve_ref_device(s.ref_device))    # the host blocks where the comparison ran them
    runner = Runner(model, host, devs, res.placement, observer=rec)
    seq = fd["seq"]                                         # its group of sequences ran alone (-ub + 1 < n_seqs)
    a, b = next((a, b) for a, b in s.seq_groups(res.tokens.shape[0]) if a <= seq < b)
    tokens = res.tokens[a:b]
    runner.reset(b - a)
    pos = 0
    for t in res.token_infos(seq):                          # replay the same ubatch schedule
        if t.index_in_ubatch == 0:
            rec.ubatch = t.ubatch
            runner.forward(tokens[:, pos:pos + t.ubatch_len])
            pos += t.ubatch_len
            if t.ubatch == fd["ubatch"]:
                break
    store, calls = {}, []
    for n, (name, args, kwargs) in enumerate(rec.calls):
        calls.append({"op": name, "args": [_save_arg(a, store, f"call{n}.arg{i}") for i, a in enumerate(args)],
                      "kwargs": {k: _save_arg(v, store, f"call{n}.{k}") for k, v in kwargs.items()
                                 if k != "states_out"}})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "inputs.safetensors") as tmp:
        save_file(store, str(tmp))
    kpath = None if s.kernels in (None, "torch") else str(resolve_kernels(s.kernels))
    case = {"layer": layer, "seqs": [a, b], "ubatch": fd["ubatch"], "first_divergence": fd, "kernels": s.kernels,
            "kernels_path": kpath, "device": device, "calls": calls, "nmse_limit": 1e-7}
    write_text(out / "case.json", json.dumps(case, indent=1, default=str))
    write_text(out / "test_case.py", _test_source())
    return case


def replay_case(case_dir, kernels=None):
    """Run an exported case's pytest in a fresh process (optionally against another plug-in file, e.g. your fix):
    the subprocess.CompletedProcess, returncode 0 when every recorded call matches the float64 reference."""
    case_dir = Path(case_dir).resolve()           # the run's cwd is the folder: a relative path would apply twice
    missing = [f for f in ("case.json", "test_case.py") if not (case_dir / f).is_file()]
    if missing:
        raise MambaDebugError(f"{case_dir}: not an export-case folder (no {' or '.join(missing)}); give the folder "
                              f"`mamba-debug export-case --out DIR` wrote")
    if kernels is not None and not Path(kernels).is_file():
        raise MambaDebugError(f"kernels={kernels}: no such plug-in file; give the path of a .py file that defines OPS")
    env = dict(os.environ, **({"MAMBA_DEBUG_KERNELS": str(Path(kernels).resolve())} if kernels else {}))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(case_dir / "test_case.py")], capture_output=True, text=True, cwd=case_dir, env=env)


# the float64 reference ops copied into a replay, with what they call; every op of TORCH_OPS has its reference there
REFERENCE_SOURCES = ("rms_norm", "linear", "silu", "softplus", "ssm_conv", "_scan_block", "_recurrence_loop",
                     "_recurrence", "_recurrence_heads", "ssm_scan", "_per_head", "ssd_scan", "rms_norm_gated",
                     "attention", "transfer")


def _test_source() -> str:
    ref = "\n\n".join(inspect.getsource(getattr(ops_module, f)) for f in REFERENCE_SOURCES)
    return f'''"""Replay of real op inputs exported by `mamba-debug export-case`: each recorded call of the kernel
plug-in is run again on exactly those inputs (views rebuilt with their strides) and compared with a float64
reference. Self-contained: needs torch, safetensors, pytest and the plug-in file named in case.json
(override with MAMBA_DEBUG_KERNELS=path). Run: pytest test_case.py
"""
import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

HERE = Path(__file__).parent
CASE = json.loads((HERE / "case.json").read_text())
SOFTPLUS_THRESHOLD = 20.0

# ---- float64 reference ops (copied from mamba_debug.ops) ----
def _kernel_for(t):
    """Always torch's per-token loop here (mamba_debug runs it as a Triton kernel on GPUs: the same bits)."""
    return None


{ref}

REFERENCE = {{{", ".join(f'"{op}": {op}' for op in ops_module.TORCH_OPS)}}}
WHERE = "the output head" if CASE["layer"] is None else f"layer {{CASE['layer']}}"
# each call's NMSE against float64: at most nmse_limit, and at most the square of the run's threshold (a rel. L2) at
# the first divergence: a 1e-4 relative bug (NMSE 1e-8) passed the fixed 1e-7
LIMIT = min(CASE["nmse_limit"], float(CASE["first_divergence"]["threshold"]) ** 2)


def _plugin_ops():
    path = os.environ.get("MAMBA_DEBUG_KERNELS", CASE["kernels_path"])
    if path is None:
        return {{}}
    cuda = torch.cuda.is_available()
    os.environ["TRITON_INTERPRET"] = "0" if cuda else "1"
    spec = importlib.util.spec_from_file_location("replayed_plugin", path)
    module = importlib.util.module_from_spec(spec)
    import sys
    sys.modules["replayed_plugin"] = module
    spec.loader.exec_module(module)
    return module.OPS


STORE = load_file(str(HERE / "inputs.safetensors"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _arg(spec, device, dtype=None):
    if "tensor" not in spec:
        return spec["value"]
    base = STORE[spec["tensor"]].to(device)
    if dtype is not None:
        base = base.to(dtype)
    return torch.as_strided(base, spec["size"], spec["stride"], spec["offset"])


def _nmse(a, b):
    a, b = a.double().cpu(), b.double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return float(((a - b) ** 2).sum() / (b ** 2).sum().clamp_min(1e-300))


@pytest.mark.parametrize("n", range(len(CASE["calls"])))
def test_recorded_call_matches_float64_reference(n):
    call = CASE["calls"][n]
    ops = _plugin_ops()
    fn = ops.get(call["op"], REFERENCE[call["op"]])
    args = [_arg(a, DEVICE) for a in call["args"]]
    kwargs = {{k: _arg(v, DEVICE) for k, v in call["kwargs"].items()}}
    got = fn(*args, **kwargs)
    want = REFERENCE[call["op"]](*[_arg(a, "cpu", torch.float64) if "tensor" in a else a["value"]
                                  for a in call["args"]],
                                **{{k: _arg(v, "cpu", torch.float64) for k, v in call["kwargs"].items()}})
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for i, (g, w) in enumerate(zip(got, want)):
        err = _nmse(g, w)
        assert err <= LIMIT, (f"{{call['op']}} output {{i}} ({{WHERE}}, ubatch {{CASE['ubatch']}}): "
                              f"NMSE {{err:.3g}} > {{LIMIT:.3g}}")
'''
