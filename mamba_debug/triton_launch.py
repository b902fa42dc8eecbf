"""Launch a compiled Triton kernel with Triton's per-call host work done once per argument key.

`kernel[grid](*args, **meta)` binds every argument, computes Triton's specialization key (dtype and 16-byte
alignment of each pointer, value class of each integer), looks the compiled kernel up, then calls its launcher. On
the H200 machine that is 80-150 us of host time for a kernel with ~50 arguments (benchmarks/README.md, eighth
session): a decode step that runs for 2 us on the GPU took 150 us called from Python.

`Launch(kernel, interpret)(grid, tensors, scalars, meta)` does the same launch. Its first call with a given key goes
through Triton's own path (compiling if needed) and keeps the compiled kernel; later calls with that key call the
compiled kernel's launcher directly, as Triton itself does after its lookup. The key is finer than Triton's, so a
kept kernel is always the one Triton would pick:
* every integer argument by value (Triton keys on value classes: 1, multiple of 16, 32 or 64 bits),
* every tensor argument by dtype and by whether its address is a multiple of 16,
* every meta (constexpr and option) value in call order, and the current device.
Triton's global compilation knobs (debug, instrumentation) are not in the key: set them before the first launch.
While a launch hook is set (a profiler such as proton wants every launch's metadata), every call takes Triton's own
path. Otherwise the launcher gets no launch metadata and no hooks (Triton builds the metadata and calls its empty
hook chain on every launch).

Under the interpreter (`Interpreted`), a launch with CPU tensors only runs the kernel's grid as Triton's
`GridExecutor` does, without the per-call work that is moot there: the kernel's signature read again
(`inspect.getfullargspec`, `getcallargs`), each tensor's storage "copied to the host" (an alias, for a CPU tensor)
and back onto itself after the grid ran, and triton.language scanned for its builtins to patch (the patches are
kept and set again). A launch of a 31-argument kernel that does nothing took 0.84 ms, now 0.27 ms; a decode step
launches two kernels a layer, each a few ms (benchmarks/README.md, sixteenth session).
"""
from __future__ import annotations

import functools

import torch


_MISSING = object()
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


class Interpreted:
    """One kernel's launches under Triton's interpreter, as `GridExecutor.__call__` runs them (the language patched
    for the launch, every non-constexpr argument made a Triton value, the grid walked in order, errors raised as
    Triton's InterpreterError), with the signature read once and CPU tensors handed over as they are. `make(kernel)`
    is None for a kernel that is not a plain interpreted function (or a Triton whose interpreter differs): Triton's
    own path then."""

    @classmethod
    def make(cls, kernel) -> "Interpreted | None":
        try:
            from triton.runtime import interpreter  # noqa: PLC0415
            if not isinstance(kernel, interpreter.InterpretedFunction) or kernel.pre_run_hooks:
                return None
            return cls(kernel, interpreter)
        except (ImportError, AttributeError, TypeError):
            return None

    def __init__(self, kernel, interpreter):
        import inspect  # noqa: PLC0415
        self.fn = kernel.rewrite()
        self.names = list(kernel.arg_names)
        self.arg_set = frozenset(self.names)
        self.constexprs = frozenset(interpreter.GridExecutor(self.fn, self.names, None).constexprs)
        params = inspect.signature(kernel.fn).parameters.values()
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.I = interpreter
        # AttributeError (make: None) on an interpreter without them. Triton 3.2's _patch_lang patched for good (no
        # scope to restore): it is not called at all there
        for name in ("_implicit_cvt", "interpreter_builder", "InterpreterError", "_LangPatchScope"):
            getattr(interpreter, name)
        # What Triton's _patch_lang(fn) sets, kept: it scans triton.language's modules for builtins and wraps each in
        # a new lambda on every launch (~0.3 ms); the wrappers hold no state of their own launch.
        scope = interpreter._patch_lang(self.fn)
        try:
            self.patches = [(obj, name, getattr(obj, name)) for obj, name, _ in scope._changes]
        finally:
            scope.restore()
        slots = {(id(obj), name): (obj, name) for obj, name, _ in self.patches}   # a class patched twice: once
        self.slots = list(slots.values())

    def __call__(self, grid: tuple, tensors: tuple, scalars: tuple, meta: dict) -> bool:
        """Run the launch; False (nothing run) when a tensor is not a plain CPU tensor: Triton's own path then."""
        if not all(isinstance(t, torch.Tensor) and t.is_cpu for t in tensors):   # a Parameter is one too
            return False
        I, constexprs = self.I, self.constexprs
        args = dict(self.defaults)
        args.update(zip(self.names, (*tensors, *scalars)))
        args.update((k, v) for k, v in meta.items() if k in self.arg_set)   # num_warps & co. are no arguments
        saved = [(obj, name, getattr(obj, name, _MISSING)) for obj, name in self.slots]
        try:
            for obj, name, value in self.patches:
                setattr(obj, name, value)
            args = {k: v if k in constexprs else I._implicit_cvt(v) for k, v in args.items()}
            gx, gy, gz = (*grid, 1, 1)[:3]
            I.interpreter_builder.set_grid_dim(gx, gy, gz)
            try:
                for x in range(gx):
                    for y in range(gy):
                        for z in range(gz):
                            I.interpreter_builder.set_grid_idx(x, y, z)
                            self.fn(**args)
            except Exception as e:
                import triton  # noqa: PLC0415
                if triton.knobs.compilation.front_end_debugging:
                    raise
                raise I.InterpreterError(repr(e)) from e
        finally:
            for obj, name, value in saved:
                if value is _MISSING:
                    delattr(obj, name)
                else:
                    setattr(obj, name, value)
        return True


def launch_paths(module) -> dict:
    """Which path each `Launch` of a kernel file takes: "compiled (kept launchers)", "interpreted (lean)" or
    "interpreted (Triton's GridExecutor)" (benchmarks record it beside their figures)."""
    return {name: ("compiled (kept launchers)" if not obj.interpret else
                   "interpreted (lean)" if obj.interpreted is not None else "interpreted (Triton's GridExecutor)")
            for name, obj in vars(module).items() if isinstance(obj, Launch)}


class Launch:
    """One jit kernel's launches (see the module docstring): `launch(grid, tensors, scalars, meta)` is
    `kernel[grid](*tensors, *scalars, **meta)`. The kernel's leading parameters are its tensors, then its scalars;
    `meta` names the rest (constexprs, num_warps), in the same order at every call site."""

    def __init__(self, kernel, interpret: bool):
        self.kernel, self.interpret = kernel, interpret
        self.kept: dict = {}
        self.interpreted = Interpreted.make(kernel) if interpret else None
        if not interpret:
            from triton import knobs
            from triton.runtime.driver import driver
            self.runtime, self.drivers = knobs.runtime, driver    # the active driver is found at the first launch

    def __call__(self, grid: tuple, tensors: tuple, scalars: tuple, meta: dict):
        if self.interpret:
            if self.interpreted is None or not self.interpreted(grid, tensors, scalars, meta):
                self.kernel[grid](*tensors, *scalars, **meta)
            return
        if _hooked(self.runtime.launch_enter_hook) or _hooked(self.runtime.launch_exit_hook):
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
