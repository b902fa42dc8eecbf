"""Launch a compiled Triton kernel with Triton's per-call host work done once per argument key.

`kernel[grid](*args, **meta)` binds every argument, computes Triton's specialization key (dtype and 16-byte
alignment of each pointer, value class of each integer), looks the compiled kernel up, then calls its launcher. On
the H200 machine that is 80-150 us of host time for a kernel with ~50 arguments (benchmarks/README.md, eighth
session): a decode step that runs for 2 us on the GPU took 150 us called from Python.

`Launch(kernel, interpret)(grid, tensors, scalars, meta)` does the same launch. Its first call with a given key goes
through Triton's own path (compiling if needed) and keeps the compiled kernel; later calls with that key call the compiled kernel's
launcher directly, as Triton itself does after its lookup. The key is finer than Triton's, so a kept kernel is
always the one Triton would pick:
* every integer argument by value (Triton keys on value classes: 1, multiple of 16, 32 or 64 bits),
* every tensor argument by dtype and by whether its address is a multiple of 16,
* every meta (constexpr and option) value in call order, and the current device.
Triton's global compilation knobs (debug, instrumentation) are not in the key: set them before the first launch.
Under the interpreter, and while a launch hook is set (a profiler such as proton wants every launch's metadata),
every call takes Triton's own path. Otherwise the launcher gets no launch metadata and no hooks (Triton builds the
metadata and calls its empty hook chain on every launch).
"""
from __future__ import annotations

import functools

import torch


MAX_KEYS = 4096             # a shape per ubatch size and stride pattern; a process that sees more starts over


# Host arithmetic of the launchers: triton.cdiv and triton.next_power_of_2 are jit / constexpr functions in recent
# Triton, ~0.8 us per call from the host.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def sm_count(device=None) -> int:
    """Streaming multiprocessors of a CUDA device (a torch.device; index None or no device: the current one)."""
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def helper_jit(interpret: bool):
    """The decorator of a kernel file's helper functions: triton.jit when compiled; under the interpreter the plain
    function, same source. The interpreter re-patches triton.language on every call of a jit function (about 1 ms,
    more than a helper's few operations, paid per token by a per-token helper); the launching kernel has patched it
    already. Applied while the file is executed, so triton.jit sees that moment's TRITON_INTERPRET."""
    if interpret:
        return lambda fn: fn
    import triton  # noqa: PLC0415 (a process that never compiles need not import it here)
    return triton.jit


def _hooked(hook) -> bool:
    """Whether a launch hook is set: Triton 3.4+ keeps an empty HookChain (never None) when none is."""
    return hook is not None and bool(getattr(hook, "calls", True))


class Launch:
    """One jit kernel's launches (see the module docstring): `launch(grid, tensors, scalars, meta)` is
    `kernel[grid](*tensors, *scalars, **meta)`. The kernel's leading parameters are its tensors, then its scalars;
    `meta` names the rest (constexprs, num_warps), in the same order at every call site."""

    def __init__(self, kernel, interpret: bool):
        self.kernel, self.interpret = kernel, interpret
        self.kept: dict = {}
        if not interpret:
            from triton import knobs
            from triton.runtime.driver import driver
            self.runtime, self.drivers = knobs.runtime, driver    # the active driver is found at the first launch

    def __call__(self, grid: tuple, tensors: tuple, scalars: tuple, meta: dict):
        if self.interpret or _hooked(self.runtime.launch_enter_hook) or _hooked(self.runtime.launch_exit_hook):
            self.kernel[grid](*tensors, *scalars, **meta)
            return
        active = self.drivers.active
        device = active.get_current_device()
        values = (*meta.values(), *scalars)
        # types too: 1, True and 1.0 are one dict key, three specializations to Triton
        key = (device, values, tuple(map(type, values)), tuple([(t.dtype, t.data_ptr() % 16 == 0) for t in tensors]))
        kept = self.kept.get(key)
        if kept is None:
            self._first(key, grid, tensors, scalars, meta)
            return
        compiled, tail = kept
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], g1, g2, active.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *tensors, *scalars, *tail)

    def _first(self, key, grid, tensors, scalars, meta):
        """Triton's own launch; keep what it compiled and the parameters after the positional ones in signature
        order (the launcher takes every parameter, constexprs included, as Triton's `run` passes them)."""
        compiled = self.kernel[grid](*tensors, *scalars, **meta)
        if hasattr(compiled, "result"):         # Triton's asynchronous compile mode hands back a future
            compiled = compiled.result()
        if compiled is None:                    # a jit cache hook asked Triton not to compile: nothing to keep
            return
        params = self.kernel.params[len(tensors) + len(scalars):]
        tail = tuple(meta[p.name] if p.name in meta else p.default for p in params)
        if len(self.kept) >= MAX_KEYS:
            self.kept.clear()
        self.kept[key] = (compiled, tail)
