"""Back-ends: an op table plus the dtype and torch device its tensors live in.

- `reference`: float64 torch ops on the CPU with the sequential scan: the ground truth.
- `cpu`: float32 torch ops on the CPU: what a CPU port (llama.cpp's CPU back-end) computes.
  Both can run their (plain torch) ops on a GPU instead (`settings.resolve_ref_device`, the setting
  `ref_device="cuda"`): the same ops and dtypes, only faster for big models; no Triton kernel is involved.
- `device`: float32 on the device, torch ops overridden by a kernel plug-in (default `triton`).
  device="cuda" compiles Triton for the GPU; device="interpret" runs the same Triton kernels under
  Triton's interpreter on CPU tensors; device="cpu" runs them on CPU tensors too (no GPU involved),
  which with kernels="torch" is a pure float32 torch control. There is no silent fallback:
  asking for cuda without a GPU is an error, and `Backend.label` says what really ran.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from .errors import MambaDebugError
from .ops import OpTable, TORCH_OPS, ssd_scan_chunked
from .plugins import load_plugin
from .settings import DEVICES, REF_DEVICES, resolve_device, resolve_ref_device  # noqa: F401 (re-exported)


@dataclass
class Backend:
    name: str
    ops: OpTable
    dtype: torch.dtype
    device: torch.device
    label: str

    @property
    def key(self) -> tuple:
        # the back-end's name too: a device back-end never shares a weight tensor with a reference one (isolation)
        return (self.name, str(self.device), self.dtype)


def _torch_device(device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise MambaDebugError(f"device {device!r}: not a torch device (give cpu, cuda or cuda:N)") from exc


def reference_backend(device: str | torch.device = "cpu") -> Backend:
    device = _torch_device(device)
    return Backend("reference", OpTable("reference", TORCH_OPS), torch.float64, device,
                   f"reference: float64 torch ops on the {_where(device)}, sequential scan")


def cpu_backend(device: str | torch.device = "cpu", ssd_chunk: int | None = None) -> Backend:
    """float32 torch ops; on device="cuda" the same plain ops on the GPU (a reference side there, not a kernel).
    ssd_chunk: Mamba-2's scan in the chunked SSD form with chunks of this many tokens (a second opinion's sample of
    the order a plug-in declares, `second_opinion.ssd_chunk`), else the sequential one."""
    device = _torch_device(device)
    ops, how = dict(TORCH_OPS), ""
    if ssd_chunk is not None:
        ops["ssd_scan"] = functools.partial(ssd_scan_chunked, chunk_size=ssd_chunk)
        how = f", chunked SSD (Q={ssd_chunk})"
    return Backend("cpu", OpTable("cpu", ops), torch.float32, device,
                   f"cpu: float32 torch ops on the {_where(device)}{how}")


def _where(device: torch.device) -> str:
    return "CPU" if device.type == "cpu" else f"GPU ({device})"


def device_backend(kernels: str | None = "triton", device: str | None = None, uses=None,
                   slot: str | None = None) -> Backend:
    """uses: the op names the model calls (`arch.model_ops`); the label then names only the plug-in's ops among
    them (the default plug-in also carries Mamba-2's ops, which a Mamba-1 run never calls). slot: one device of a
    split placement (`cuda:1`, or `cpu` for a CPU stand-in), its tensors on that torch device."""
    device = resolve_device(device)
    torch_device = torch.device(slot if slot is not None else "cuda" if device == "cuda" else "cpu")
    ops = dict(TORCH_OPS)
    supports_states_out = True
    if kernels in (None, "torch"):
        name, overridden = "torch", []
    else:
        plugin = load_plugin(kernels, device)
        ops.update(plugin.ops)
        supports_states_out = plugin.supports_states_out
        name, overridden = plugin.name, sorted(op for op in plugin.ops if uses is None or op in uses)
    where = {"cuda": f"compiled for {torch.cuda.get_device_name(torch_device) if device == 'cuda' else ''}",
             "interpret": "under Triton's interpreter on the CPU", "cpu": "on the CPU"}[device]
    what = f"kernels '{name}' ({', '.join(overridden)}; other ops torch)" if overridden else "torch ops"
    if name != "torch" and not overridden:      # the plug-in ran nothing: say so where the verdict is read
        where += f" (plug-in '{name}' replaces none of the ops this model calls: {', '.join(sorted(plugin.ops))})"
    return Backend(f"device:{name}", OpTable(name, ops, supports_states_out), torch.float32, torch_device,
                   f"device {device}: float32 {what} {where}".replace("  ", " "))


def declared_ssd_chunk(kernels: str | None, device: str | None) -> int | None:
    """The chunk size a plug-in declares for its chunked ssd_scan (its SSD_CHUNK), None for torch or none declared."""
    return None if kernels in (None, "torch") else load_plugin(kernels, resolve_device(device)).ssd_chunk


def device_backends(kernels: str | None, device: str | None, devices=None, uses=None) -> list:
    """One device back-end per device slot of the placement (one unless --devices lists several); the same plug-in
    for each. With several slots the label names them, and `transfer` counts among the ops the model calls."""
    if not devices:
        return [device_backend(kernels, device, uses)]
    uses = None if uses is None else tuple(uses) + ("transfer",) * (len(devices) > 1)
    out = [device_backend(kernels, device, uses, slot=name) for name in devices]
    if len(devices) > 1:
        for b in out:
            b.label = f"{b.label}, split over {len(devices)} devices ({', '.join(devices)})"
    return out


@contextlib.contextmanager
def cpu_threads_for(config):
    """One CPU thread for small models while running them, then restore.

    Each op of a small model (d_inner up to 1024) is too little work to split across threads, and OpenMP's
    spin-waiting makes two threads on two busy cores far slower: a tiny-model compare took 51 s with 2 threads
    and 2 s with 1 while one other process ran (2026-11-30, this project's CI-sized machine)."""
    if config.d_inner > 1024 or torch.get_num_threads() == 1:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
