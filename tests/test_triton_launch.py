"""mamba_debug.triton_launch: Triton's launch with its per-call host work done once per argument key.

On the CPU machine a stand-in kernel records what reaches Triton's own path and the compiled launcher, so the
argument order (every parameter, constexprs and defaults included, in signature order) and the key (a new key for
every change Triton could specialize on) are checked without a GPU. The compiled path itself runs in
tests/test_triton_kernels.py with MAMBA_DEBUG_TEST_DEVICE=cuda (`test_kept_launch_same_bits`).
"""
import inspect
from types import SimpleNamespace

import pytest
import torch

from mamba_debug.triton_launch import Launch


class FakeCompiled:
    function, packed_metadata = "fn", "pm"

    def __init__(self, calls):
        self.calls = calls

    def run(self, *args):
        self.calls.append(("kept", args))


class FakeKernel:
    """kernel(a_ptr, b_ptr, n, stride, BLOCK: constexpr, FLAG: constexpr = 7)"""

    def __init__(self):
        self.calls = []
        self.params = [SimpleNamespace(name=n, default=d) for n, d in
                       (("a_ptr", inspect.Parameter.empty), ("b_ptr", inspect.Parameter.empty),
                        ("n", inspect.Parameter.empty), ("stride", inspect.Parameter.empty),
                        ("BLOCK", inspect.Parameter.empty), ("FLAG", 7))]

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.calls.append(("triton", grid, args, meta))
            return FakeCompiled(self.calls)
        return launch


class FakeActive:
    def get_current_device(self):
        return 0

    def get_current_stream(self, device):
        return 1234


@pytest.fixture
def compiled_launch():
    kernel = FakeKernel()
    launch = Launch(kernel, interpret=False)
    launch.runtime = SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    launch.drivers = SimpleNamespace(active=FakeActive())
    return kernel, launch


@pytest.mark.parametrize("no_hook", [None, SimpleNamespace(calls=[])], ids=["none", "empty chain"])
def test_first_call_is_tritons_then_the_kept_launcher_gets_every_parameter(compiled_launch, no_hook):
    kernel, launch = compiled_launch
    launch.runtime.launch_enter_hook = no_hook      # Triton 3.4+: an empty HookChain, never None
    a, b = torch.zeros(8), torch.zeros(8)
    launch((3,), (a, b), (8, 1), {"num_warps": 2, "BLOCK": 16})
    launch((5, 2), (a, b), (8, 1), {"num_warps": 2, "BLOCK": 16})
    assert kernel.calls[0] == ("triton", (3,), (a, b, 8, 1), {"num_warps": 2, "BLOCK": 16})
    kind, args = kernel.calls[1]
    # grid padded to three, the stream, the compiled function and metadata, no launch metadata or hooks, then the
    # parameters in signature order: BLOCK from meta, FLAG's default; num_warps is an option, not a parameter
    assert kind == "kept" and args == (5, 2, 1, 1234, "fn", "pm", None, None, None, a, b, 8, 1, 16, 7)


@pytest.mark.parametrize("change", ["scalar", "meta", "dtype", "alignment", "bool for int"])
def test_anything_triton_specializes_on_is_a_new_key(compiled_launch, change):
    kernel, launch = compiled_launch
    buf = torch.zeros(16)
    a, b = buf[:8], torch.zeros(8)
    tensors, scalars, meta = (a, b), (8, 1), {"BLOCK": 16}
    launch((1,), tensors, scalars, meta)
    if change == "scalar":
        scalars = (8, 16)                       # 1 and multiples of 16 are specialized
    elif change == "meta":
        meta = {"BLOCK": 32}
    elif change == "bool for int":
        scalars = (8, True)                     # == 1 as a dict key; a u1 argument to Triton
    elif change == "dtype":
        tensors = (a, b.double())
    else:
        tensors = (buf[1:9], b)                 # 4 bytes past a 16-byte boundary
    launch((1,), tensors, scalars, meta)
    assert [c[0] for c in kernel.calls] == ["triton", "triton"]
    launch((1,), tensors, scalars, meta)
    assert kernel.calls[-1][0] == "kept"


@pytest.mark.parametrize("hook", [print, SimpleNamespace(calls=[print]), "exit"], ids=["function", "chain", "exit"])
def test_a_launch_hook_or_the_interpreter_always_takes_tritons_path(compiled_launch, hook):
    kernel, launch = compiled_launch
    if hook == "exit":
        launch.runtime.launch_exit_hook = print
    else:
        launch.runtime.launch_enter_hook = hook     # a profiler wants every launch's metadata
    for _ in range(2):
        launch((1,), (torch.zeros(2),), (2,), {"BLOCK": 2})
    assert [c[0] for c in kernel.calls] == ["triton", "triton"] and not launch.kept
    interpreted = Launch(kernel, interpret=True)
    for _ in range(2):
        interpreted((1,), (torch.zeros(2),), (2,), {"BLOCK": 2})
    assert [c[0] for c in kernel.calls] == ["triton"] * 4 and not interpreted.kept


def test_tritons_default_hook_is_no_hook():
    """Triton 3.4+ keeps an empty HookChain when no hook is set: the kept path must still be taken then."""
    from triton import knobs

    from mamba_debug.triton_launch import _hooked
    assert not _hooked(knobs.runtime.launch_enter_hook) and not _hooked(knobs.runtime.launch_exit_hook)


def test_host_arithmetic_matches_tritons():
    import triton

    from mamba_debug.triton_launch import cdiv, next_pow2
    for n in range(1, 70):
        assert next_pow2(n) == triton.next_power_of_2(n)
        for d in (1, 3, 16, 64):
            assert cdiv(n, d) == triton.cdiv(n, d)


def _interpreted_kernel():
    """A small kernel under the interpreter (TRITON_INTERPRET=1, conftest): two programs, a runtime scalar, a
    constexpr with a default, a loop and a mask."""
    import triton
    import triton.language as tl

    @triton.jit
    def scaled_cumsum(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr, REPEAT: tl.constexpr = 2):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(x_ptr + offs, mask=mask, other=0.0)
        for _ in tl.static_range(REPEAT):
            v = tl.cumsum(v, 0) * scale
        tl.store(y_ptr + offs, v, mask=mask)
    return scaled_cumsum


def test_the_interpreter_launch_runs_the_grid_as_triton_does():
    """Launch under the interpreter skips Triton's per-call host copies and signature reads, not the kernel: the
    same outputs as `kernel[grid]` (defaults, num_warps dropped, a Parameter as a tensor), the lean path really
    taken, and an error inside the kernel raised as Triton's InterpreterError."""
    from triton.runtime.errors import InterpreterError

    from mamba_debug.triton_launch import Interpreted
    kernel = _interpreted_kernel()
    launch = Launch(kernel, interpret=True)
    assert isinstance(launch.interpreted, Interpreted)
    x = torch.nn.Parameter(torch.randn(13), requires_grad=False)
    for meta in ({"BLOCK": 8}, {"BLOCK": 8, "REPEAT": 3, "num_warps": 4}):
        want, got = torch.full((13,), float("nan")), torch.full((13,), float("nan"))
        kernel[(2,)](x, want, 13, 0.5, **meta)
        assert launch.interpreted((2,), (x, got), (13, 0.5), meta) is True
        assert torch.equal(got, want), meta
        got.fill_(float("nan"))
        launch((2,), (x, got), (13, 0.5), meta)
        assert torch.equal(got, want), meta
    with pytest.raises(InterpreterError):
        launch((2,), (x, torch.zeros(13)), (13, 0.5), {"BLOCK": 6})     # arange needs a power of two


def test_the_interpreter_launch_puts_triton_language_back():
    """The lean launch sets the interpreter's patches of triton.language for the launch only: after a launch, and
    after one that raised, every attribute of tl, tl.core, tl.math and tl.tensor is what it was."""
    import triton.language as tl
    from triton.runtime.errors import InterpreterError

    def attrs():
        return {(mod.__name__, name): getattr(mod, name) for mod in (tl, tl.core, tl.math, tl.tensor)
                for name in dir(mod)}

    import triton

    @triton.jit
    def scale(x_ptr, y_ptr, n, a, BLOCK: tl.constexpr):
        # no jit helper inside (tl.sum, tl.cumsum): Triton's interpreter patches the language again at each such
        # call and never restores it, with or without this launch
        offs = tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n, other=0.0) * a, mask=offs < n)

    launch = Launch(scale, interpret=True)
    assert launch.interpreted is not None
    before = attrs()
    launch((1,), (torch.ones(4), torch.zeros(4)), (4, 1.0), {"BLOCK": 4})
    assert attrs() == before
    with pytest.raises(InterpreterError):
        launch((1,), (torch.ones(4), torch.zeros(4)), (4, 1.0), {"BLOCK": 3})
    assert attrs() == before


def test_the_interpreter_launch_leaves_what_it_does_not_know_to_triton():
    """A kernel that is not an interpreted function (the fake here) has no lean path; a tensor that is not on the
    CPU is not run by it (Triton's path copies such a tensor to the host and back)."""
    from mamba_debug.triton_launch import Interpreted
    assert Launch(FakeKernel(), interpret=True).interpreted is None
    lean = Interpreted.make(_interpreted_kernel())
    meta_tensor = torch.empty(13, device="meta")
    assert lean((1,), (meta_tensor, meta_tensor), (13, 1.0), {"BLOCK": 16}) is False


def test_launch_paths_say_which_path_each_launcher_takes(monkeypatch):
    from mamba_debug.triton_launch import launch_paths
    monkeypatch.setenv("MAMBA_DEBUG_REPLAY", "1")
    module = SimpleNamespace(lean=Launch(_interpreted_kernel(), interpret=True),
                             fake=Launch(FakeKernel(), interpret=True), other=3)
    assert launch_paths(module) == {"lean": "interpreted (lean, replayed)",
                                    "fake": "interpreted (Triton's GridExecutor)"}
    monkeypatch.setenv("MAMBA_DEBUG_REPLAY", "0")
    assert launch_paths(module)["lean"] == "interpreted (lean)"
