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
