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
launches two kernels a layer, each a few ms (benchmarks/README.md, sixteenth session). Its second launch with an
argument key is recorded (a key launched once never pays for it), later ones replay the recorded operations
(`triton_replay`: the same numpy operations without triton.language in between, the same bits; a kernel whose
Python reads back what differs between launches is not recorded).
"""
from __future__ import annotations

import contextlib
import functools

import numpy as np
import torch

from . import triton_replay


_MISSING = object()
MAX_KEYS = 4096             # a shape per ubatch size and stride pattern; a process that sees more starts over
MAX_TRACES = 256            # recorded interpreter launches per kernel (each holds its grid point's fixed arrays)


# Host arithmetic of the launchers: triton.cdiv and triton.next_power_of_2 are jit / constexpr functions in recent
# Triton, ~0.8 us per call from the host.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def check(op: str, ok: bool, what: str, **tensors):
    """A plug-in op's argument check: unless ok, a ValueError naming the op, the rule and the shapes it got."""
    if not ok:
        shapes = ", ".join(f"{k}={list(v.shape)}" for k, v in tensors.items())
        raise ValueError(f"{op}: {what} (got {shapes})")


def check_device(op: str, interpret: bool, **tensors):
    """No silent fallback: interpreted kernels take CPU tensors, compiled kernels take CUDA tensors."""
    want = "cpu" if interpret else "cuda"
    for k, v in tensors.items():
        if v.device.type != want:
            mode = "Triton's interpreter (TRITON_INTERPRET=1)" if interpret else "a CUDA GPU"
            raise ValueError(f"{op}: this copy of the triton kernels was loaded for {mode} and takes {want} "
                             f"tensors, but {k} is on {v.device}; load the plug-in for the matching device")


def sm_count(device=None) -> int:
    """Streaming multiprocessors of a CUDA device (a torch.device; index None or no device: the current one)."""
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def check_mode(interpret: bool, what: str):
    """At the top of a Triton file executed by path (`triton_env.exec_file`): its mode is one Triton can give here.
    Interpreted: the first interpreted launch imports triton.experimental.gluon, which asserts that TRITON_INTERPRET
    is still set if triton's library was built interpreted; the loader restores the variable after executing the
    file, so it is imported now. Compiled: a library first imported interpreted cannot compile (ImportError)."""
    import triton  # noqa: PLC0415
    import triton.language  # noqa: F401, PLC0415
    if interpret:
        import triton.experimental.gluon  # noqa: F401, PLC0415
    elif not isinstance(triton.language.standard._sum_combine, triton.runtime.JITFunction):
        raise ImportError(f"triton was first imported with TRITON_INTERPRET=1 in this process, so its library is "
                          f"interpreted and {what} cannot be compiled for cuda; run the GPU comparison in a process "
                          f"started without TRITON_INTERPRET=1")


def on_device(device, interpret: bool):
    """Launches on `device` when it is a GPU other than the current one (Triton launches on the current device)."""
    if interpret or device is None or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


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
            self.patches = [(obj, name, _index if name == "__index__" else getattr(obj, name))
                            for obj, name, _ in scope._changes]
        finally:
            scope.restore()
        self.memo = [(interpreter, "_get_np_dtype", _np_dtype_memo(interpreter))]
        # a jit helper the kernel calls (tl.zeros in Triton 3.6) patches the language again: `_index` goes back on
        index = [p for p in self.patches if p[1] == "__index__"]
        again = triton_replay.reapplying(interpreter._patch_lang, index)
        self.patches += self.memo + [(interpreter, "_patch_lang", again)]
        self.traces: dict = {}          # argument key -> triton_replay.Trace, or REFUSED
        self.once: set = set()          # keys launched once: recorded at their second launch (recording costs
                                        # 1.5-2x a launch; a key launched once never pays it)
        self.refused: dict = {}         # kernel name -> why its launches are not replayed
        self.replays = 0

    def __call__(self, grid: tuple, tensors: tuple, scalars: tuple, meta: dict) -> bool:
        """Run the launch; False (nothing run) when a tensor is not a plain CPU tensor: Triton's own path then."""
        if not all(isinstance(t, torch.Tensor) and t.is_cpu for t in tensors):   # a Parameter is one too
            return False
        key = self._key(grid, tensors, scalars, meta)
        trace = self.traces.get(key)
        replay = isinstance(trace, (triton_replay.Trace, list))
        # a replay calls the builder only: the language patches matter to the interpreter's reductions alone
        patches = self.patches if not replay or triton_replay.needs_language(trace) else self.memo
        with _set(patches):
            grid3 = (*grid, 1, 1)[:3]
            self.I.interpreter_builder.set_grid_dim(*grid3)
            try:
                if replay:
                    self._replay(trace, grid3, tensors)
                    self.replays += 1
                else:
                    self._interpret(grid3, tensors, scalars, meta, key, record=self._second(key, trace))
            except Exception as e:
                import triton  # noqa: PLC0415
                if triton.knobs.compilation.front_end_debugging:
                    raise
                raise self.I.InterpreterError(repr(e)) from e
        return True

    def _second(self, key, trace) -> bool:
        """Whether this launch is to be recorded: the second of a key not recorded yet."""
        if trace is not None or key is None:
            return False
        if key in self.once:
            return True
        if len(self.once) >= MAX_TRACES:
            self.once.clear()
        self.once.add(key)
        return False

    def _interpret(self, grid3, tensors, scalars, meta, key, record: bool):
        """Walk the grid as Triton's GridExecutor does; with `record`, keep what the grid points did (`_record`)."""
        I, constexprs = self.I, self.constexprs
        args = dict(self.defaults)
        args.update(zip(self.names, (*tensors, *scalars)))
        args.update((k, v) for k, v in meta.items() if k in self.arg_set)   # num_warps & co. are no arguments
        args = {k: v if k in constexprs else I._implicit_cvt(v) for k, v in args.items()}
        handles = {k: v.handle for k, v in args.items() if k not in constexprs and isinstance(v, I.tl.tensor)}
        points: list = []
        gx, gy, gz = grid3
        for x in range(gx):
            for y in range(gy):
                for z in range(gz):
                    I.interpreter_builder.set_grid_idx(x, y, z)
                    if record:
                        record = self._record(triton_replay.Recorder(I, handles), args, points)
                    else:
                        self.fn(**args)
        if points:
            self._keep(key, points, gx * gy * gz)

    def _key(self, grid, tensors, scalars, meta):
        """What fixes a launch's sequence of builder calls; None (no replay) when replays are off."""
        if not triton_replay.enabled():
            return None
        try:
            values = (*meta.values(), *scalars)
            key = (tuple(grid), values, tuple(map(type, values)), tuple(t.dtype for t in tensors))
            hash(key)
        except TypeError:
            return None
        return key

    def _record(self, rec, args, points) -> bool:
        """A grid point run as usual while `rec` notes its builder calls (appended to `points`); whether the next
        point is to be recorded too (not once one is refused, nor when one trace serves every point)."""
        hooks = triton_replay.install(rec, self.patches)
        with _set(hooks):
            self.fn(**args)
            triton_replay.still_set(rec, hooks)
        points.append(rec)
        return rec.refused is None and rec.per_point

    def _keep(self, key, points, n_points):
        """Keep the launch's traces: one for every point, one per point, or REFUSED (with the reason)."""
        self.once.discard(key)
        if len(self.traces) >= MAX_TRACES:
            self.traces.clear()
        refused = next((r.refused for r in points if r.refused is not None), None)
        if refused is None and points[0].per_point and n_points > triton_replay.MAX_POINTS:
            refused = f"its program id steers Python over more than {triton_replay.MAX_POINTS} grid points"
        if refused is None and points[0].per_point and len(points) != n_points:
            refused = "a grid point's trace is missing"
        if refused is not None:
            self.traces[key] = triton_replay.REFUSED
            self.refused[self.fn.__name__] = refused
            return
        fixed = triton_replay.POINT if points[0].per_point else triton_replay.KEY
        traces = [triton_replay.Trace(r, fixed) for r in points]
        self.traces[key] = traces[0] if len(traces) == 1 and not points[0].per_point else traces

    def _replay(self, trace, grid, tensors):
        """Run a kept launch: one Trace for every grid point, or a list of them, one per point in grid order."""
        TH = self.I.TensorHandle
        by_name = dict(zip(self.names, tensors))
        first = trace[0] if isinstance(trace, list) else trace
        handles = [TH(np.array([by_name[name].data_ptr()], dtype=np.uint64), ty) for name, ty in first.pointer_args]
        builder = self.I.interpreter_builder
        mem = triton_replay.Memory(self.I, tensors)
        i = 0
        for x in range(grid[0]):
            for y in range(grid[1]):
                for z in range(grid[2]):
                    builder.set_grid_idx(x, y, z)
                    (trace[i] if isinstance(trace, list) else trace).run(mem, *handles)
                    i += 1


@contextlib.contextmanager
def _set(patches: list):
    """(obj, name, value) set for the block, then each attribute put back as it was (absent: removed again)."""
    saved = [(obj, name, getattr(obj, name, _MISSING)) for obj, name, _ in patches]
    try:
        for obj, name, value in patches:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


def _index(self):
    """tl.tensor's `__index__` under the interpreter (a loop bound, an index read into Python): Triton 3.6 reads
    `int(data)` of a one-element array, which numpy 2.5 refuses; Triton 3.9 squeezes it first, as here."""
    data = self.handle.data
    return int(data.reshape(-1)[0]) if data.size == 1 else int(data)


def _np_dtype_memo(interpreter):
    """The interpreter's `_get_np_dtype`, which builds a 19-entry dict of Triton types at each of its calls (two or
    three per operation, ~12 us each), answered from a memo for plain element types (blocks by their element)."""
    tl, orig = interpreter.tl, interpreter._get_np_dtype
    memo: dict = {}

    def _get_np_dtype(tt_dtype):
        t = tt_dtype.element_ty if type(tt_dtype) is tl.block_type else tt_dtype
        if type(t) is not tl.dtype:             # pointers and anything else: as Triton answers
            return orig(tt_dtype)
        np_dtype = memo.get(t.name)
        if np_dtype is None:
            np_dtype = memo[t.name] = orig(t)
        return np_dtype
    return _get_np_dtype


def launch_paths(module) -> dict:
    """Which path each `Launch` of a kernel file takes: "compiled (kept launchers)", "interpreted (lean, replayed)"
    (MAMBA_DEBUG_REPLAY=0: "interpreted (lean)") or "interpreted (Triton's GridExecutor)" (benchmarks record it
    beside their figures)."""
    lean = "interpreted (lean, replayed)" if triton_replay.enabled() else "interpreted (lean)"
    return {name: ("compiled (kept launchers)" if not obj.interpret else
                   lean if obj.interpreted is not None else "interpreted (Triton's GridExecutor)")
            for name, obj in list(vars(module).items()) if isinstance(obj, Launch)}


_NOT_YET = object()      # Launch.interpreted before its first use


class Launch:
    """One jit kernel's launches (see the module docstring): `launch(grid, tensors, scalars, meta)` is
    `kernel[grid](*tensors, *scalars, **meta)`. The kernel's leading parameters are its tensors, then its scalars;
    `meta` names the rest (constexprs, num_warps), in the same order at every call site."""

    def __init__(self, kernel, interpret: bool):
        self.kernel, self.interpret = kernel, interpret
        self.kept: dict = {}
        self._interpreted = _NOT_YET if interpret else None
        if not interpret:
            from triton import knobs
            from triton.runtime.driver import driver
            self.runtime, self.drivers = knobs.runtime, driver    # the active driver is found at the first launch

    @property
    def interpreted(self) -> "Interpreted | None":
        """The interpreted launcher, made at first use: each costs ~20 ms (Triton rewrites the kernel's source), and
        a run launches a few of a plug-in's kernels (a Mamba-1 model none of Mamba-2's)."""
        if self._interpreted is _NOT_YET:
            self._interpreted = Interpreted.make(self.kernel)
        return self._interpreted

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
