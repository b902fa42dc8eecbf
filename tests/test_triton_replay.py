"""mamba_debug.triton_replay: an interpreted kernel's builder calls recorded once per argument key, then replayed.

A replay must give the bits a full interpretation gives, for the product's kernels (fresh inputs at every call, so a
trace that kept a value it should not have would show) and for kernels whose Python reads values back: a loop bound
from a scalar argument (in the key), a branch on the program id (one trace per grid point), a branch on a loaded
value (not recorded at all).
"""
import pytest
import torch

import mamba_debug as md
from mamba_debug import triton_replay
from mamba_debug.triton_launch import Launch

SHAPES = [dict(S=1, T=1, D=64, N=8), dict(S=2, T=1, D=48, N=8), dict(S=2, T=16, D=64, N=8),
          dict(S=3, T=5, D=48, N=16)]


def _flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for o in out for t in _flat(o)] if isinstance(out, (tuple, list)) else []


def _call(op, fn, shape, seed):
    args = md.example_inputs(op, seed=seed, **shape)
    return [t.clone() for t in _flat(fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args]))]


def _launchers(plugin):
    """Every interpreted Launch of the plug-in modules loaded (the triton plug-in runs triton_mamba2's kernels)."""
    import sys
    mods = [m for name, m in sys.modules.items() if name.startswith("mamba_debug_plugin_")]
    # a copy of each module's names: making a launcher's interpreted form (at first use) adds to them
    objs = [obj for m in mods for obj in list(vars(m).values()) if isinstance(obj, Launch)]
    return [obj for obj in objs if obj.interpreted is not None]


@pytest.mark.parametrize("plugin", ["triton", "triton_mamba2"])
def test_replays_give_the_bits_of_a_full_interpretation(plugin, monkeypatch):
    """Each op of the shipped kernels, at decode, prompt and awkward shapes, over fresh inputs each call: the second
    call of a shape records, the third replays; every output equals the interpreter's own, bit for bit."""
    ops = md.load_kernels(plugin)
    before = {id(x): (len(x.interpreted.traces), x.interpreted.replays) for x in _launchers(plugin)}
    for shape in SHAPES:
        for op, fn in ops.items():
            monkeypatch.setenv("MAMBA_DEBUG_REPLAY", "0")
            want = [_call(op, fn, shape, seed) for seed in (1, 2, 3)]
            monkeypatch.setenv("MAMBA_DEBUG_REPLAY", "1")
            got = [_call(op, fn, shape, seed) for seed in (1, 2, 3)]
            for w, g in zip(want, got):
                assert len(w) == len(g) and all(torch.equal(a, b) for a, b in zip(w, g)), (op, shape)
    # the third call of each op and shape replayed (earlier tests may have recorded the keys already)
    launchers = _launchers(plugin)
    replayed = sum(x.interpreted.replays - before.get(id(x), (0, 0))[1] for x in launchers)
    assert replayed >= len(SHAPES) * len(ops), replayed
    ran = [x for x in launchers if (len(x.interpreted.traces), x.interpreted.replays) != before.get(id(x), (0, 0))]
    assert not any(x.interpreted.refused for x in ran), {x.interpreted.fn.__name__: x.interpreted.refused for x in ran}


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def loop(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        # a runtime scalar as a loop bound: read into Python, so it is part of the key
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(n):
            acc += tl.load(x_ptr + i * BLOCK + offs)
        tl.store(y_ptr + offs, acc + tl.sum(acc, 0))

    @triton.jit
    def first_program(x_ptr, y_ptr, BLOCK: tl.constexpr):
        # Python branches on the program id: one trace per grid point
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs)
        if pid == 0:
            v = v * 2.0
        tl.store(y_ptr + offs, tl.cumsum(v, 0))

    @triton.jit
    def data_branch(x_ptr, y_ptr, BLOCK: tl.constexpr):
        # Python branches on a loaded value: never recorded
        offs = tl.arange(0, BLOCK)
        v = tl.load(x_ptr + offs)
        if tl.load(x_ptr) > 0:
            v = -v
        tl.store(y_ptr + offs, v)
    return loop, first_program, data_branch


def test_what_python_reads_back_decides_how_a_kernel_is_replayed(monkeypatch):
    loop, first_program, data_branch = _kernels()
    g = torch.Generator().manual_seed(0)

    def both(kernel, grid, make, scalars, meta, calls=3, launch=None):
        # the reference: the same lean launch with replays off (Triton 3.6's own launch cannot read a loop bound
        # under numpy 2.5: triton_launch._index)
        plain = Launch(kernel, interpret=True)
        launch = launch or Launch(kernel, interpret=True)
        for _ in range(calls):
            x, n_out = make()
            want, got = torch.zeros(n_out), torch.zeros(n_out)
            monkeypatch.setenv("MAMBA_DEBUG_REPLAY", "0")
            plain(grid, (x, want), scalars, meta)
            monkeypatch.setenv("MAMBA_DEBUG_REPLAY", "1")
            launch(grid, (x, got), scalars, meta)
            assert torch.equal(got, want)
        assert not plain.interpreted.traces
        return launch.interpreted

    launch = Launch(loop, interpret=True)
    lean = both(loop, (1,), lambda: (torch.randn(5 * 8, generator=g), 8), (3,), {"BLOCK": 8}, launch=launch)
    assert lean.replays == 1 and not lean.refused          # launched, recorded, replayed
    both(loop, (1,), lambda: (torch.randn(5 * 8, generator=g), 8), (5,), {"BLOCK": 8}, calls=3, launch=launch)
    assert lean.replays == 2 and len(lean.traces) == 2     # another loop bound: another key
    per_point = both(first_program, (3,), lambda: (torch.randn(24, generator=g), 24), (), {"BLOCK": 8})
    trace = next(iter(per_point.traces.values()))
    assert isinstance(trace, list) and len(trace) == 3 and per_point.replays == 1
    signs = iter([1.0, -1.0, 1.0, -1.0])
    refused = both(data_branch, (1,), lambda: (torch.randn(8, generator=g).abs() * next(signs), 8), (), {"BLOCK": 8},
                   calls=4)
    assert refused.replays == 0 and "loaded value" in refused.refused["data_branch"]


def test_recording_leaves_the_interpreter_as_it_was(monkeypatch):
    """The hooks of a recording (builder methods, the reductions, tl.tensor's conversions) are gone after it, after
    a kernel that raised too; MAMBA_DEBUG_REPLAY=0 records nothing."""
    import triton.language as tl
    from triton.runtime import interpreter as I
    from triton.runtime.errors import InterpreterError

    def attrs():
        return ({n: getattr(tl.tensor, n, None) for n in ("__index__", "__bool__", "__repr__", "__str__")},
                {k: v for k, v in vars(I.interpreter_builder).items() if callable(v)},   # hooks: none left
                I.ReduceScanOpInterface.apply, I.TensorHandle.__bool__,
                I._patch_lang)

    monkeypatch.setenv("MAMBA_DEBUG_REPLAY", "1")
    loop, first_program, _ = _kernels()
    before = attrs()
    launch = Launch(loop, interpret=True)
    for _ in range(2):                                      # the second launch of a key is recorded
        launch((1,), (torch.ones(16), torch.zeros(8)), (2,), {"BLOCK": 8})
    assert attrs() == before and launch.interpreted.traces
    with pytest.raises(InterpreterError):
        Launch(first_program, interpret=True)((1,), (torch.ones(8), torch.zeros(8)), (), {"BLOCK": 6})
    assert attrs() == before
    monkeypatch.setenv("MAMBA_DEBUG_REPLAY", "0")
    off = Launch(loop, interpret=True)
    for _ in range(2):
        off((1,), (torch.ones(16), torch.zeros(8)), (2,), {"BLOCK": 8})
    assert not off.interpreted.traces
    assert triton_replay.MAX_OPS > 1000


def test_replayed_loads_and_stores_touch_the_bytes_the_interpreter_does(monkeypatch):
    """A replay's loads and stores are numpy gathers and scatters (triton_replay.Memory): a strided view at an
    offset into a larger storage, masked lanes, repeated store addresses (the last lane wins, as in the
    interpreter's helper) and boolean data (the helper's own path) give what Triton's launch gives."""
    import triton
    import triton.language as tl

    @triton.jit
    def gather_scatter(x_ptr, flag_ptr, y_ptr, flag_out_ptr, n, stride, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        v = tl.load(x_ptr + offs * stride, mask=mask, other=-1.0)
        f = tl.load(flag_ptr + offs, mask=mask, other=0)
        tl.store(y_ptr + offs, tl.where(f, v, 2 * v), mask=mask)
        tl.store(y_ptr + BLOCK + offs // 4, v, mask=mask)       # four lanes to an address: the last one stays
        tl.store(flag_out_ptr + offs, f == 0, mask=mask)

    monkeypatch.setenv("MAMBA_DEBUG_REPLAY", "1")
    launch = Launch(gather_scatter, interpret=True)
    g = torch.Generator().manual_seed(1)
    for n in (13, 13, 16, 13, 13):
        buf = torch.randn(100, generator=g)
        x = buf[5:]                                           # an offset into a larger storage, read with stride 3
        flag = torch.rand(16, generator=g) > 0.5
        outs = [(torch.full((16 + 4,), float("nan")), torch.zeros(16, dtype=torch.bool)) for _ in range(2)]
        gather_scatter[(1,)](x, flag, *outs[0], n, 3, BLOCK=16)
        launch((1,), (x, flag, *outs[1]), (n, 3), {"BLOCK": 16})
        assert torch.equal(outs[0][0].nan_to_num(7.0), outs[1][0].nan_to_num(7.0)) and torch.equal(*[o[1] for o in outs])
    assert launch.interpreted.replays == 2 and not launch.interpreted.refused


def test_a_load_at_an_address_fixed_by_the_key_is_read_again(monkeypatch):
    """An address passed as an integer (in the key) still points at memory that changes between launches: a replay
    loads it again, never keeps what the recording loaded."""
    import triton
    import triton.language as tl

    @triton.jit
    def from_address(y_ptr, addr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        src = addr.to(tl.pointer_type(tl.float32))
        tl.store(y_ptr + offs, tl.load(src + offs) * 2.0)

    from triton.runtime.errors import InterpreterError
    x = torch.zeros(8)
    try:
        from_address[(1,)](torch.zeros(8), x.data_ptr(), BLOCK=8)
    except InterpreterError as e:     # Triton 3.6's interpreter: int64 -> pointer fails its own numpy view
        pytest.skip(f"this Triton's interpreter cannot cast an integer to a pointer: {e}")
    monkeypatch.setenv("MAMBA_DEBUG_REPLAY", "1")
    launch = Launch(from_address, interpret=True)
    for k in range(4):
        x.copy_(torch.arange(8.0) + k)
        y = torch.zeros(8)
        launch((1,), (y,), (x.data_ptr(),), {"BLOCK": 8})
        assert torch.equal(y, 2 * x), k
    assert launch.interpreted.replays == 2


def test_a_device_print_prints_at_every_launch(monkeypatch, capfd):
    """A builder call made for its effect (tl.device_print) is replayed too: one line per launch."""
    import triton
    import triton.language as tl

    @triton.jit
    def say(y_ptr, BLOCK: tl.constexpr):
        tl.device_print("replayed message", tl.program_id(0))
        tl.store(y_ptr + tl.arange(0, BLOCK), tl.full([BLOCK], 1.0, tl.float32))

    monkeypatch.setenv("MAMBA_DEBUG_REPLAY", "1")
    launch = Launch(say, interpret=True)
    capfd.readouterr()
    for _ in range(3):
        launch((1,), (torch.zeros(4),), (), {"BLOCK": 4})
    assert launch.interpreted.replays == 1
    assert capfd.readouterr().out.count("replayed message") == 3
