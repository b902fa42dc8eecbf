"""The plug-in contract: load by name or path, unknown ops and misbehaving ops are clear errors."""
from __future__ import annotations

import pytest
import torch

import mamba_debug as md
from mamba_debug.errors import PluginError
from mamba_debug.model import Runner
from mamba_debug.placement import Placement

from conftest import random_model


def _write(tmp_path, body, name="plug.py"):
    f = tmp_path / name
    f.write_text("import torch\n" + body)
    return str(f)


def _run(model, path, offload=2):
    dev = md.device_backend(path, "cpu")
    Runner(model, md.cpu_backend(), dev, Placement(model.config.n_layer, offload)).prefill(
        torch.tensor([[1, 2, 3, 4, 5]]), 3)


def test_load_by_path_and_override_only_some_ops(tmp_path):
    path = _write(tmp_path, 'NAME = "neg"\nDESCRIPTION = "negated silu"\n'
                            'OPS = {"silu": lambda x: -x * torch.sigmoid(x)}\n')
    ops = md.load_kernels(path, device="cpu")
    assert set(ops) == {"silu"}
    x = torch.randn(3, 4)
    torch.testing.assert_close(ops["silu"](x), -torch.nn.functional.silu(x))
    assert md.device_backend(path, "cpu").label.startswith("device cpu: float32 kernels 'neg' (silu")


def test_a_plugin_whose_ops_the_model_never_calls_says_so(tmp_path):
    """A Mamba-1 kernel on a Mamba-2 model runs nothing of its own: the device line says so instead of reading as
    an ordinary torch run."""
    path = _write(tmp_path, 'NAME = "scan1"\nOPS = {"ssm_scan": lambda *a: None}\n')
    res = md.run_compare(md.load_model("tiny-mamba2"), [1, 2, 3], md.CompareSettings(device="cpu", kernels=str(path)))
    assert res.sides["device"].label.endswith("(plug-in 'scan1' replaces none of the ops this model calls: ssm_scan)")


def test_unknown_op_name_is_rejected(tmp_path):
    path = _write(tmp_path, 'OPS = {"ssm_scna": lambda *a: None}\n')
    with pytest.raises(PluginError, match=r"unknown op name\(s\) \['ssm_scna'\]"):
        md.load_kernels(path, device="cpu")


def test_missing_ops_dict_and_syntax_error(tmp_path):
    with pytest.raises(PluginError, match="defines no OPS"):
        md.load_kernels(_write(tmp_path, "x = 1\n", "a.py"), device="cpu")
    with pytest.raises(PluginError, match="failed to load"):
        md.load_kernels(_write(tmp_path, "def (:\n", "b.py"), device="cpu")
    with pytest.raises(PluginError, match="no such plug-in"):
        md.load_kernels("no_such_kernel", device="cpu")


def test_wrong_output_shape_names_plugin_op_and_shapes(tmp_path):
    path = _write(tmp_path, 'NAME = "short"\nOPS = {"linear": lambda x, w, b=None: (x @ w.T)[..., :-1]}\n')
    with pytest.raises(PluginError, match=r"plug-in short: op linear\(1x3x32, 128x32.*output 0 is 1x3x127 .*"
                                          r"expected 1x3x128"):
        _run(random_model(), path)


def test_wrong_dtype_and_crash(tmp_path):
    path = _write(tmp_path, 'OPS = {"silu": lambda x: (x * torch.sigmoid(x)).double()}\n', "d.py")
    with pytest.raises(PluginError, match="float64.*expected .*float32"):
        _run(random_model(), path)
    path = _write(tmp_path, 'def boom(*a, **k):\n    raise RuntimeError("kaboom")\nOPS = {"ssm_scan": boom}\n', "c.py")
    with pytest.raises(PluginError, match=r"op ssm_scan\(.*\) raised RuntimeError: kaboom"):
        _run(random_model(), path)


def test_list_kernels_names_the_shipped_plugins():
    kernels = md.list_kernels()
    assert "triton" in kernels and kernels["triton"]


NO_STATES = '''
import mamba_debug as md
{flag}
def {op}(s, x, dt, A, B, C, *, states_out=None):
    return md.ops.{op}(s, x, dt, A, B, C)
OPS = {{"{op}": {op}}}
'''


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("op", ["ssm_scan", "ssd_scan"])
def test_a_scan_that_leaves_states_out_unwritten_is_named_with_the_fix(tmp_path, monkeypatch, op, deferred):
    """A correct scan that ignores `states_out` read as a NaN (or a wrong state) born in the kernel: the buffer was
    `torch.empty`'s leftovers. deferred: the check read with the forward pass's others, as on a GPU."""
    from mamba_debug import isolation
    from test_mamba2 import mamba2_model
    monkeypatch.setattr(isolation, "DEFER_ON_CPU", deferred)
    model = random_model() if op == "ssm_scan" else mamba2_model()
    settings = md.RunSettings(device="cpu", n_gen=1, kernels=_write(tmp_path, NO_STATES.format(op=op, flag="")))
    with pytest.raises(PluginError, match=rf"op {op}\(.*left `states_out` unwritten.*SUPPORTS_STATES_OUT = False"):
        md.run_compare(model, [1, 2, 3, 4, 5], settings)
    declared = _write(tmp_path, NO_STATES.format(op=op, flag="SUPPORTS_STATES_OUT = False"), "declared.py")
    assert md.run_compare(model, [1, 2, 3, 4, 5], settings.replace(kernels=declared)).first_divergence is None


def test_a_one_output_op_returning_a_list_is_named(tmp_path):
    """It passed the output check and failed later, inside the model: 'list' object has no attribute ..."""
    path = _write(tmp_path, 'OPS = {"silu": lambda x: [x * torch.sigmoid(x)]}\n')
    with pytest.raises(PluginError, match=r"op silu\(1x3x64\) returned a list; an op with one output returns the "
                                          r"tensor itself"):
        _run(random_model(), path)


def test_an_output_that_requires_grad_runs_like_any_other(tmp_path):
    """Autograd once stopped the reference scan's writes into `out=` buffers (RuntimeError from torch)."""
    path = _write(tmp_path, 'OPS = {"silu": lambda x: (x * torch.sigmoid(x)).requires_grad_()}\n')
    res = md.run_compare(random_model(), [1, 2, 3, 4, 5], md.RunSettings(device="cpu", n_gen=1, kernels=path))
    assert res.first_divergence is None
