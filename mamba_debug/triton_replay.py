"""Replay an interpreted Triton kernel's operations without the language front end in between.

Under TRITON_INTERPRET=1 a kernel is plain Python: every `a + b` goes through triton.language's type checks,
broadcasting and tensor wrappers (~20 us), then one numpy operation of the interpreter's builder (~3-5 us). What
the builder is asked to compute depends only on what the kernel's Python control flow saw, so for one argument
key (constexprs, scalar argument values, tensor dtypes, grid) the sequence of builder calls is the same at every
launch, as long as no branch, loop bound or index was read from something that differs between launches: a
pointer, a loaded value or the program id. A `Recorder` watches the first grid point of a launch (the second of
its key) as it runs normally: each builder call (and each reduction or scan of the interpreter's own), its inputs
as the results of earlier calls or as the kernel's arguments; every value Python reads back (`bool`, `int`,
`range` bounds) is checked to depend on neither (on the program id alone: one trace per grid point). Later
launches with that key run the recorded calls in order (`Trace`): the same numpy operations on the same inputs,
so the same bits, in a fraction of the time, values fixed by the key not computed again. Their loads and stores
are numpy gathers and scatters over the launch's tensors (`Memory`), the same bytes as the interpreter's
element-by-element helpers.

A kernel that reads a pointer or a loaded value into Python, builds a value outside the builder (the
interpreter's `.T`), prints one, or runs past MAX_OPS operations is not recorded: it runs as before (`refused`
says why). `MAMBA_DEBUG_REPLAY=0` turns replays off.
"""
from __future__ import annotations

import os

MAX_OPS = 50_000            # a longer first grid point (a long prompt's scan loop) is not kept
MAX_POINTS = 1024            # a larger grid whose program id steers Python is not kept
REFUSED = object()          # a key whose first grid point could not be recorded
KEY, POINT, DATA = 0, 1, 2  # a value fixed by the argument key, by the key and the grid point, or by the data


def enabled() -> bool:
    return os.environ.get("MAMBA_DEBUG_REPLAY", "1") != "0"


class Refused(Exception):
    """The kernel's Python read back a value a replay could not reproduce."""


class Recorder:
    """The builder calls of one grid point, with each result's dependence on pointers, loads and the program id."""

    def __init__(self, I, arg_handles: dict):
        self.I = I
        self.slot: dict = {}            # id(handle) -> slot index
        self.keep: list = []            # the handles, alive while recording (ids stay unique)
        self.tainted: list = []         # per slot: KEY, POINT or DATA (what its value depends on)
        self.ops: list = []             # (fn, args, kwargs, outs)
        self.args: list = []            # (name, slot, is pointer)
        self.depth = 0
        self.refused: str | None = None
        self.per_point = False          # Python read a value of the program id: one trace per grid point
        for name, h in arg_handles.items():
            pointer = hasattr(h.dtype, "element_ty")
            self.args.append((name, self._new(h, DATA if pointer else KEY), pointer))

    def _new(self, handle, tainted: int) -> int:
        self.slot[id(handle)] = len(self.keep)
        self.keep.append(handle)
        self.tainted.append(tainted)
        return len(self.keep) - 1

    def stop(self, why: str):
        """Keep nothing of this grid point (the first reason stays)."""
        if self.refused is None:
            self.refused = why

    def refuse(self, why: str):
        """`stop`, and leave the call being noted (`call` catches it: nothing reaches the kernel)."""
        self.stop(why)
        raise Refused(why)

    @property
    def on(self) -> bool:
        return self.refused is None and self.depth == 0

    # inputs become ("s", slot) or ("k", constant)
    def _ref(self, v, taint: list):
        TH = self.I.TensorHandle
        if isinstance(v, TH):
            s = self.slot.get(id(v))
            if s is None:
                self.refuse("a value built outside the interpreter's builder")
            taint.append(self.tainted[s])
            return ("s", s)
        if isinstance(v, (list, tuple)) and any(isinstance(x, (TH, list, tuple)) for x in v):
            return ("t", type(v), tuple(self._ref(x, taint) for x in v))
        if isinstance(v, self.I.TensorDescHandle):
            self.refuse("a tensor descriptor")
        return ("k", v)

    def call(self, fn, args, kwargs, out, program_id: bool = False):
        """Note one builder call (already run) and its result; never raises into the kernel."""
        try:
            self._call(fn, args, kwargs, out, program_id)
        except Refused:
            pass

    def _call(self, fn, args, kwargs, out, program_id):
        if len(self.ops) >= MAX_OPS:
            self.refuse(f"more than {MAX_OPS} operations in a grid point")
        taint: list = []
        a = tuple(self._ref(v, taint) for v in args)
        k = {n: self._ref(v, taint) for n, v in kwargs.items()}
        TH = self.I.TensorHandle
        handles = [out] if isinstance(out, TH) else \
            list(out) if isinstance(out, (list, tuple)) and out and all(isinstance(x, TH) for x in out) else None
        if handles is None and out is not None:
            if not taint:
                return                  # a type or a policy: a constant of the calls that take it
            self.refuse(f"{getattr(fn, '__name__', fn)} hands Python a value")
        if handles is None and not taint and getattr(fn, "__name__", "").startswith("get_"):
            return                      # a query answered None (a cache policy): nothing to do again
        t = max(taint, default=KEY)
        t = max(t, POINT) if program_id else t
        if any(word in getattr(fn, "__name__", "") for word in _READS_MEMORY):
            t = DATA                    # memory may change between launches, even at an address fixed by the key
        outs = tuple(self._new(h, t) for h in handles or ())
        self.ops.append((fn, a, k, outs, not isinstance(out, TH) and handles is not None))

    def read(self, handle, what: str):
        """Python reads `handle` (a branch, a loop bound, an index): allowed when no launch of this key differs."""
        if not self.on:
            return
        s = self.slot.get(id(handle))
        if s is None:
            self.stop(f"{what} of a value built outside the builder")
        elif self.tainted[s] == DATA:
            self.stop(f"{what} of a value that depends on a pointer or a loaded value")
        else:
            self.per_point |= self.tainted[s] == POINT


_SKIP = frozenset({"__init__", "set_grid_idx", "set_grid_dim"})
_READS_MEMORY = ("load", "atomic", "gather")    # builder methods whose result is read from memory


def install(rec: Recorder, patches: list) -> list:
    """Hooks that feed `rec` while a grid point runs: (obj, name, value) to set, in the same form as the launch's
    language patches (the caller sets and restores them all)."""
    I = rec.I
    builder = I.interpreter_builder
    out = []
    for name, member in vars(type(builder)).items():
        if name in _SKIP or not callable(member):
            continue
        out.append((builder, name, _builder_hook(rec, getattr(builder, name), name == "create_get_program_id")))
    apply = I.ReduceScanOpInterface.apply
    out.append((I.ReduceScanOpInterface, "apply", _reduce_hook(rec, apply)))
    tensor = I.tl.core.tensor
    current = {(id(o), n): v for o, n, v in patches}
    reads = []
    for name, what in (("__index__", "an index"), ("__bool__", "a branch")):
        orig = current.get((id(tensor), name), getattr(tensor, name, None))
        reads.append((tensor, name, _read_hook(rec, orig, what, lambda t: t.handle)))
    for name in ("__repr__", "__str__"):
        orig = current.get((id(tensor), name), getattr(tensor, name))
        reads.append((tensor, name, _refuse_hook(rec, orig, "a printed value")))
    out += reads
    out.append((I.TensorHandle, "__bool__", _read_hook(rec, I.TensorHandle.__bool__, "a branch", lambda h: h)))
    # a jit helper called by the kernel (tl.cumsum, a user's @triton.jit function) patches the language again,
    # tl.tensor's conversions included: the read hooks go back on after it
    out.append((I, "_patch_lang", reapplying(I._patch_lang, reads)))
    return out


def reapplying(patch_lang, patches: list):
    """The interpreter's `_patch_lang` (run again by every jit helper a kernel calls, and never undone), with
    `patches` (obj, name, value) set again after it."""
    def _patch_lang(fn):
        scope = patch_lang(fn)
        for obj, name, value in patches:
            setattr(obj, name, value)
        return scope
    return _patch_lang


def still_set(rec: Recorder, hooks: list):
    """After the grid point: a hook something else replaced saw nothing after that, so the trace is not kept."""
    if any(getattr(obj, name, None) is not value for obj, name, value in hooks):
        rec.stop("a hook was replaced while the kernel ran")


def _builder_hook(rec, bound, program_id):
    def hook(*args, **kwargs):
        if not rec.on:
            return bound(*args, **kwargs)
        rec.depth += 1
        try:
            out = bound(*args, **kwargs)
        finally:
            rec.depth -= 1
        rec.call(bound, args, kwargs, out, program_id)
        return out
    return hook


def _reduce_hook(rec, apply):
    """The interpreter's reductions and scans compute on the handles' arrays directly: one recorded call each."""
    def hook(self, input):
        if not rec.on or not isinstance(input, tuple):
            return apply(self, input)
        rec.depth += 1
        try:
            out = apply(self, input)
        finally:
            rec.depth -= 1
        rec.call(_Reduce(self, [x.type for x in input], rec.I.tl.core.tensor),
                 [x.handle for x in input], {}, tuple(o.handle for o in out))
        return out
    return hook


# combine functions the interpreter's reductions and scans compute with numpy alone (no Triton function called)
_NUMPY_COMBINES = ("_sum_combine", "_prod_combine", "_elementwise_max", "_elementwise_min",
                   "_argmin_combine_tie_break_left", "_argmin_combine_tie_break_fast",
                   "_argmax_combine_tie_break_left", "_argmax_combine_tie_break_fast")


class _Reduce:
    def __init__(self, op, types, tensor):
        self.op, self.types, self.tensor = op, types, tensor
        self.__name__ = type(op).__name__
        from triton.language import standard  # noqa: PLC0415 (a process that never interprets need not import it)
        self.language = not any(op.combine_fn is getattr(standard, n, None) for n in _NUMPY_COMBINES)

    def __call__(self, *handles):
        out = self.op.apply(tuple(self.tensor(h, t) for h, t in zip(handles, self.types)))
        return tuple(o.handle for o in out)


def _read_hook(rec, orig, what, handle_of):
    def hook(self):
        rec.read(handle_of(self), what)
        return orig(self)
    return hook


def _refuse_hook(rec, orig, what):
    def hook(self):
        if rec.on:
            rec.stop(what)
        return orig(self)
    return hook


class Trace:
    """A recorded grid point as one straight-line Python function of the launch's pointer arguments.

    Values fixed by the key (or, in a per-point trace, by the key and the point: `fixed`), such as index arithmetic
    on scalar arguments, masks and constants, are not computed again: the function reads the recorded arrays, made
    read-only (the builder never writes into an input; were it to, the replay fails loudly instead of drifting)."""

    def __init__(self, rec: Recorder, fixed: int):
        self.pointer_args = [(name, rec.keep[s].dtype) for name, s, p in rec.args if p]
        ns: dict = {}
        src = _Source(rec, fixed, ns)
        lines = ["def run(mem, " + ", ".join(f"v{s}" for _, s, p in rec.args if p) + "):"]
        self.n_ops = 0
        for i, (fn, a, k, outs, many) in enumerate(rec.ops):
            if outs and all(rec.tainted[o] <= fixed for o in outs):
                continue
            self.n_ops += 1
            ns[f"f{i}"] = fn
            memory_op = Memory.takes(fn)
            call = (f"mem.{fn.__name__}(" if memory_op else f"f{i}(") + ", ".join([src(x) for x in a] + [f"{n}={src(x)}" for n, x in k.items()]) + ")"
            if not outs:
                lines.append(f"    {call}")
            elif many:
                lines.append(f"    {', '.join(f'v{o}' for o in outs)}, = {call}")
            else:
                lines.append(f"    v{outs[0]} = {call}")
        lines.append("    return None")
        exec(compile("\n".join(lines), "<mamba_debug.triton_replay>", "exec"), ns)
        self.run = ns["run"]
        self.n_recorded = len(rec.ops)
        self.language = any(isinstance(fn, _Reduce) and fn.language for fn, *_ in rec.ops)


def needs_language(trace) -> bool:
    """Whether a kept launch (a Trace or one per grid point) runs one of the interpreter's reductions, whose combine
    function may be a Triton function run by the interpreter (triton.language patched)."""
    return any(t.language for t in trace) if isinstance(trace, list) else trace.language


class _Source:
    """An input of a recorded call as source text: a slot computed in the replay, a fixed one, or a constant."""

    def __init__(self, rec: Recorder, fixed: int, ns: dict):
        self.rec, self.fixed, self.ns, self.n = rec, fixed, ns, 0

    def __call__(self, x) -> str:
        if x[0] == "s":
            s = x[1]
            if self.rec.tainted[s] > self.fixed:
                return f"v{s}"
            handle = self.rec.keep[s]
            handle.data.flags.writeable = False
            self.ns[f"c{s}"] = handle
            return f"c{s}"
        if x[0] == "t":
            inner = ", ".join(self(y) for y in x[2])
            return f"({inner},)" if x[1] is tuple else f"[{inner}]"
        name = f"k{self.n}"
        self.n += 1
        self.ns[name] = x[1]
        return name


class Memory:
    """A replay's loads and stores as numpy gathers and scatters over the launch's tensors' storages (the
    interpreter's own helpers walk the addresses one by one in C++, ~15 ns an element, 4-5x numpy). An operation
    whose unmasked addresses do not all lie, aligned, in one storage, or whose element type is not a plain number,
    takes the builder's own path, as does one whose shapes differ (the same bytes either way)."""

    # the builder methods it stands in for, with their parameters in the Triton it was written against (3.9); a
    # Triton whose builder takes others keeps its own (3.6 passes more)
    OPS = {"create_masked_load": ("ptrs", "mask", "other", "cache_policy", "is_volatile"),
           "create_load": ("ptr", "cache_policy", "is_volatile"),
           "create_masked_store": ("ptrs", "value", "mask", "cache_policy"),
           "create_store": ("ptr", "val", "cache_policy")}

    @classmethod
    def takes(cls, fn) -> bool:
        """Whether a recorded call is one of the builder's loads or stores, with the parameters written for."""
        name = getattr(fn, "__name__", None)
        if name not in cls.OPS or getattr(fn, "__self__", None) is None:
            return False
        import inspect  # noqa: PLC0415
        try:
            return tuple(inspect.signature(fn).parameters) == cls.OPS[name]
        except (TypeError, ValueError):
            return False

    def __init__(self, I, tensors):
        import ctypes  # noqa: PLC0415
        import numpy as np  # noqa: PLC0415
        self.np, self.ctypes, self.I, self.builder = np, ctypes, I, I.interpreter_builder
        spans = {}
        for t in tensors:
            st = t.untyped_storage()
            spans[st.data_ptr()] = st.nbytes()
        self.spans = sorted(spans.items())
        self.views: dict = {}

    def _view(self, sel, dtype):
        """The storage holding every address of `sel` (uint64, aligned to the element) as an array of `dtype`, and
        the element indices; None when no storage does."""
        np = self.np
        size = dtype.itemsize
        first, last = int(sel.min()), int(sel.max())
        for lo, n in self.spans:
            if lo <= first and last + size <= lo + n:
                off = sel - np.uint64(lo)
                if size & (size - 1) or (off & np.uint64(size - 1)).any():
                    return None
                view = self.views.get((lo, dtype))
                if view is None:
                    raw = np.ctypeslib.as_array((self.ctypes.c_ubyte * (n - n % size)).from_address(lo))
                    view = self.views[(lo, dtype)] = raw.view(dtype)
                return view, (off >> np.uint64(size.bit_length() - 1)).astype(np.intp)
        return None

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        np = self.np
        dtype_tt = ptrs.get_element_ty()
        dtype = self.I._get_np_dtype(dtype_tt)
        p, m = ptrs.data, mask.data
        if dtype.kind not in "fiu" or p.shape != m.shape or (other is not None and (
                other.data.shape != p.shape or other.data.dtype != dtype)):
            return self.builder.create_masked_load(ptrs, mask, other, cache_policy, is_volatile)
        out = np.zeros(p.shape, dtype) if other is None else other.data.copy()
        sel = p[m]
        if sel.size:
            found = self._view(sel, dtype)
            if found is None:
                return self.builder.create_masked_load(ptrs, mask, other, cache_policy, is_volatile)
            view, idx = found
            out[m] = view[idx]
        return self.I.TensorHandle(out, dtype_tt)

    def create_load(self, ptr, cache_policy, is_volatile):
        mask = self.I.TensorHandle(self.np.ones_like(ptr.data, dtype=bool), self.I.tl.int1)
        return self.create_masked_load(ptr, mask, None, cache_policy, is_volatile)

    def create_masked_store(self, ptrs, value, mask, cache_policy):
        p, v, m = ptrs.data, value.data, mask.data
        if v.dtype.kind not in "fiu" or not p.shape == v.shape == m.shape:
            return self.builder.create_masked_store(ptrs, value, mask, cache_policy)
        sel = p[m]
        if sel.size:
            found = self._view(sel, v.dtype)
            if found is None:
                return self.builder.create_masked_store(ptrs, value, mask, cache_policy)
            view, idx = found
            view[idx] = v[m]        # in address order, as the helper writes: the last of repeated addresses wins
        return None

    def create_store(self, ptr, val, cache_policy):
        mask = self.I.TensorHandle(self.np.ones_like(ptr.data, dtype=bool), self.I.tl.int1)
        return self.create_masked_store(ptr, val, mask, cache_policy)
