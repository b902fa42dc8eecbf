"""Several devices (issue 19): llama.cpp's layer split (--devices, --tensor-split), the hidden state handed over at
each device boundary by the plug-in op `transfer`, the JSON, report and views saying which block ran where.

No GPU here: the devices are CPU stand-ins (`--devices cpu,cpu`), distinct device slots of the placement whose
tensors live on the CPU, so the split, the states per device and the crossing code run for real."""
from __future__ import annotations

import json

import matplotlib
import pytest
import torch

from mamba_debug.backends import cpu_backend, device_backends
from mamba_debug.cli import main as cli_main
from mamba_debug.compare import run_compare
from mamba_debug.errors import MambaDebugError
from mamba_debug.model import Runner
from mamba_debug.ops import OpTable, TORCH_OPS
from mamba_debug.placement import Placement
from mamba_debug.settings import RunSettings
from mamba_debug.sides.llamacpp.side import layer_backends, split_array
from mamba_debug.sweep import run_sweep
from mamba_debug.trace import load_trace, save_trace
from mamba_debug.views import summary, to_json

from conftest import random_model

matplotlib.use("Agg")
PROMPT = [(11 * i + 5) % 61 for i in range(12)]
SPLIT = {"devices": ("cpu", "cpu"), "tensor_split": (3, 1)}


@pytest.fixture(scope="module")
def model():
    return random_model(1, n_layer=4, d_model=32)


def _run(model, **kw):
    s = RunSettings(**{"device": "cpu", "kernels": "torch", "n_gen": 2, "ubatch": 4, "free_run": False, **kw})
    return run_compare(model, PROMPT, s)


# -- the split: llama.cpp's llama_model::load_tensors ----------------------------------------------------------------
@pytest.mark.parametrize("n_layer,offload,rule,split,slots,head", [
    (4, 4, "llama2024", (3, 1), (0, 0, 0, 1), None),         # 3/4 = 0.75 is not above the split point 0.75
    (4, 5, "llama2024", (3, 1), (0, 0, 0, 0), 1),            # act = 5: the head alone on the second device
    (4, 5, "llama2024", (1, 1), (0, 0, 0, 1), 1),            # the head on the last device, as llama.cpp puts it
    (4, 2, "llama2024", (1, 1), (None, None, 0, 1), None),   # --offload 2: the last two blocks, one per device
    (4, 1, "llama2024", (1, 1), (None, None, None, 0), None),  # one offloaded block: the second device gets none
    (4, 3, "llama2025", (1, 1), (None, None, 0, 0), 1),      # the 2025 rule: the head is an offloaded slot
    (4, 5, "llama2024", (1, 0), (0, 0, 0, 0), 0),            # a share of 0: that device gets nothing
    (4, 5, "llama2024", (0, 1), (1, 1, 1, 1), 1),
    (12, 13, "llama2024", (1, 1, 1), (0,) * 5 + (1,) * 4 + (2,) * 3, 2),
    (4, 0, "llama2024", (1, 1), (None,) * 4, None),
])
def test_split_follows_llama_cpp(n_layer, offload, rule, split, slots, head):
    p = Placement(n_layer, offload, rule, ("cpu",) * len(split), split)
    assert (p.layer_slots, p.head_slot) == (slots, head)
    assert (p.head_slot is not None) == p.head_on_device
    assert [i for i in range(n_layer) if p.layer_slot(i) is not None] == \
        [i for i in range(n_layer) if p.on_device(i)]            # --offload still says which blocks leave the host


def test_split_rounds_in_float32_like_llama_cpp():
    """0.1 + 0.2 + 0.7 sums to 1.0000001 in float32 and 0.1/1.0000001 < 0.1: slot 1 of 10 goes to the second device
    in float32, where float64 arithmetic would keep it on the first (upper_bound: strictly above the split point)."""
    p = Placement(10, 10, "llama2024", ("cpu",) * 3, (0.1, 0.2, 0.7))
    assert p.layer_slots == (0, 1, 1, 2, 2, 2, 2, 2, 2, 2)


def test_device_boundaries_and_description():
    p = Placement(4, 5, "llama2024", ("cuda:0", "cuda:1"), (1, 1))
    assert p.device_boundaries == [3]
    assert p.describe().endswith("split 1:1 over cuda:0 (blocks 0..2), cuda:1 (block 3, head)")
    assert Placement(4, 5, "llama2024", ("cpu", "cpu"), (3, 1)).device_boundaries == [4]    # the head's input
    assert Placement(4, 5).device_boundaries == [] and Placement(4, 5).n_slots == 1


@pytest.mark.parametrize("kw,match", [
    ({"devices": ["cpu", "cpu"], "tensor_split": [1, 2, 3]}, r"--tensor-split has 3 value\(s\) for 2 device"),
    ({"devices": ["cpu", "cpu"], "tensor_split": [1, -1]}, "--tensor-split shares must be finite numbers >= 0"),
    ({"devices": ["cpu", "cpu"], "tensor_split": [1, float("nan")]}, "--tensor-split shares must be finite"),
    ({"devices": ["cpu", "cpu"], "tensor_split": [0, 0]}, "--tensor-split 0,0 gives every device a share of 0"),
    # llama.cpp works the shares in float32: all zero there, or a sum past its range (an IndexError from inside)
    ({"devices": ["cpu", "cpu"], "tensor_split": [1e-50, 1e-50]}, "a share of 0 in float32"),
    ({"devices": ["cpu", "cpu"], "tensor_split": [1e40, 1]}, "the shares add up past float32's range"),
    ({"devices": ["cpu", "cpu"], "tensor_split": [3e38, 3e38]}, "the shares add up past float32's range"),
    ({"tensor_split": [3, 1]}, "--tensor-split needs --devices"),
    ({"devices": ["cpu"] * 17}, "--devices lists 17 devices"),
    ({"devices": ["cuda:0", "cuda:1"]}, "--devices cuda:0,cuda:1: the device side runs on the CPU here"),
    ({"devices": ["tpu"]}, "--devices: unknown device 'tpu'"),
    ({"devices": ["cuda:x"]}, "--devices: 'cuda:x' is not a device name"),
    ({"devices": []}, "--devices names nothing"),
    ({"devices": ["cpu", "cpu"], "engine": "llama.cpp", "device": "cpu"}, "llama.cpp's CPU build runs every layer"),
])
def test_bad_splits_are_refused_naming_the_flag(model, kw, match):
    with pytest.raises(MambaDebugError, match=match):
        RunSettings(**{"device": "cpu", **kw}).validated(model.config)


def test_bad_split_on_the_command_line_exits_2(capsys):
    assert cli_main(["compare", "--devices", "cpu,cpu", "--tensor-split", "1,1,1", "--device", "cpu",
                     "--kernels", "torch", "--n-gen", "1"]) == 2
    err = capsys.readouterr().err
    assert "--tensor-split has 3 value(s) for 2 device(s)" in err and "Traceback" not in err


# -- the runner: states per device, the hand-off as an op --------------------------------------------------------
class _Recorded(OpTable):
    """torch ops whose `transfer` notes where it was called (by the tensor it got)."""

    def __init__(self, calls: list):
        super().__init__("rec", {**TORCH_OPS, "transfer": lambda x, d: calls.append(x.shape) or TORCH_OPS["transfer"](x, d)})


def test_each_block_on_its_device_and_transfer_at_each_boundary(model):
    p = Placement(4, 5, "llama2024", ("cpu", "cpu"), (1, 1))       # blocks 0..2 | block 3 and the head
    calls: list = []
    devs = device_backends("torch", "cpu", p.devices)
    for b in devs:
        b.ops = _Recorded(calls)
    runner = Runner(model, cpu_backend(), devs, p)
    assert [b is devs[k] for b, k in zip(runner.layer_backends, p.layer_slots)] == [True] * 4
    assert runner.head_backend is devs[1]
    runner.reset(2)
    for i, states in enumerate(runner.states):          # each block's states allocated on its own back-end
        assert all(t.device == runner.layer_backends[i].device for t in states.values())
    tokens = torch.tensor([PROMPT[:5], PROMPT[5:10]])
    logits = runner.prefill(tokens, 3)                  # two ubatches: one hand-off (before block 3) each
    assert calls == [torch.Size([2, 3, 32]), torch.Size([2, 2, 32])]
    one = Runner(model, cpu_backend(), device_backends("torch", "cpu"), Placement(4, 5))
    assert torch.equal(logits, one.prefill(tokens, 3))   # a plain hand-off changes no bit


def test_split_run_equals_the_one_device_run_and_says_where_each_block_ran(model, tmp_path):
    one, two = _run(model, offload=4), _run(model, **SPLIT, offload=4)
    assert two.first_divergence is None
    for key in one.errors:                              # the hand-off is a copy: the same bits
        torch.testing.assert_close(one.errors[key]["rel_l2"], two.errors[key]["rel_l2"], rtol=0, atol=0,
                                   equal_nan=True, msg=str(key))
    j = to_json(two)
    c = j["config"]
    assert (c["devices"], c["tensor_split"], c["split_mode"]) == (["cpu", "cpu"], [3, 1], "layer")
    assert c["layer_devices"] == ["cpu#0", "cpu#0", "cpu#0", "cpu#1"] and c["head_device"] == "host"
    assert c["device_boundaries"] == [3]
    assert [r["device"] for r in j["per_layer"]] == c["layer_devices"]
    assert "devices" not in to_json(one)["config"] and "device" not in to_json(one)["per_layer"][0]
    assert "split 3:1 over cpu#0 (blocks 0..2), cpu#1 (block 3)" in summary(two)
    json.dumps(j)
    back = load_trace(save_trace(two, tmp_path / "t.safetensors"))
    assert back.placement == two.placement


def test_views_mark_each_device_boundary(model):
    from mamba_debug.views.curve import layer_curve
    from mamba_debug.views.heatmap import heatmap
    import matplotlib.pyplot as plt
    res = _run(model, **SPLIT, offload=4)
    fig, (a, b) = plt.subplots(1, 2)
    layer_curve(res, a)
    heatmap(res, b)
    styled = lambda ax, attr: [getattr(ln, attr)()[0] for ln in ax.lines if ln.get_linestyle() == "-."]  # noqa
    assert styled(a, "get_xdata") == [2.5] and styled(b, "get_ydata") == [2.5]
    assert any("device boundary" in t.get_text() for t in a.get_legend().get_texts())
    assert any(t.get_text().strip() == "cpu#1 above" for t in b.texts)
    plt.close(fig)


def test_the_triton_kernels_split_over_stand_ins_show_no_divergence(model):
    res = _run(model, **SPLIT, offload=5, kernels="triton", device="interpret", ubatch=5)
    assert res.placement.device_boundaries == [4] and res.first_divergence is None


# -- the bug variant: found after the boundary, only where one exists ------------------------------------------------
def test_handoff_bug_is_found_after_the_boundary_only(model):
    bad = _run(model, kernels="bug_device_handoff", **SPLIT, offload=4)
    fd = bad.first_divergence
    assert (fd["layer"], fd["site"], fd["token"]) == (3, "norm", 2)    # -ub 4: tokens 2, 3 arrived as zeros
    assert "layer 3 on cpu#1 (just after a device boundary)" in to_json(bad)["verdict"]
    assert _run(model, kernels="bug_device_handoff", offload=4).first_divergence is None
    assert _run(model, kernels="bug_device_handoff", offload=4, devices=("cpu",)).first_divergence is None


# -- sweeps ------------------------------------------------------------------------------------------------------
def test_sweep_with_a_split_runs_each_slot_assignment(model):
    """--offload 4 and 5 put the same blocks on the device, but the split moves with the offload (act_gpu_layers 4
    vs 5): both run."""
    base = RunSettings(device="cpu", kernels="bug_device_handoff", n_gen=1, devices=("cpu", "cpu"),
                       tensor_split=(1, 1))
    sw = run_sweep(model, PROMPT, base, offloads=(0, 2, 4, 5), ubatches=(4,), progress=False)
    cells = {c["offload"]: c for c in sw["cells"]}
    assert all("same_run_as" not in c for c in cells.values())
    assert cells[0]["first_divergence"] is None
    assert [cells[o]["first_layer"] for o in (2, 4, 5)] == [3, 2, 3]     # 4: blocks 0, 1 | 2, 3; 5: 0..2 | 3


# -- llama.cpp: the tensor_split array and the backends read back ------------------------------------------------
def test_llama_cpp_split_array():
    gpus = [("CPU", "cpu"), ("CUDA0", "gpu"), ("CUDA1", "gpu"), ("CUDA2", "gpu")]
    assert split_array(("cuda:0", "cuda:2"), (3, 1), gpus) == [3.0, 0.0, 1.0]
    assert split_array(("cuda:1",), None, gpus) == [0.0, 1.0, 0.0]
    with pytest.raises(MambaDebugError, match="this llama.cpp build sees 0 GPU"):
        split_array(("cuda:0", "cuda:1"), None, [("CPU", "cpu")])
    with pytest.raises(MambaDebugError, match="ascending order"):
        split_array(("cuda:1", "cuda:0"), None, gpus)
    nodes = [{"layer": 0, "backend": "CUDA0"}, {"layer": 1, "backend": "CUDA1"}, {"layer": None, "backend": "CUDA1"}]
    assert layer_backends(nodes) == {"0": ["CUDA0"], "1": ["CUDA1"], "head": ["CUDA1"]}


def test_llama_cpp_cpu_build_refuses_a_split(capsys):
    code = cli_main(["compare", "--engine", "llama.cpp", "--device", "cpu", "--devices", "cuda:0,cuda:1",
                     "--n-gen", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "llama.cpp's CPU build runs every layer on the CPU" in err and "Traceback" not in err


def test_ray_sweep_equals_the_serial_sweep_cell_by_cell(tmp_path):
    ray = pytest.importorskip("ray")
    import mamba_debug as md
    from mamba_debug.io import save_hf
    model = md.load_model(save_hf(random_model(2, n_layer=3, d_model=32), tmp_path / "m"))
    base = RunSettings(device="cpu", kernels="bug_device_handoff", n_gen=1, devices=("cpu", "cpu"))
    kw = dict(offloads=(0, 3, 4), ubatches=(1, 4), progress=False)
    serial = run_sweep(model, PROMPT, base, **kw)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        spread = run_sweep(model, PROMPT, base, ray="local", **kw)
    finally:
        ray.shutdown()
    strip = lambda cells: [{k: v for k, v in c.items() if k != "seconds"} for c in cells]  # noqa: E731
    assert strip(spread["cells"]) == strip(serial["cells"]) and spread["ray"] == "local"
    assert any(c["first_divergence"] for c in serial["cells"])


def test_a_ray_address_that_nothing_answers_is_refused_within_seconds():
    """Ray retries an unreachable address for minutes without a word; the sweep asks the port first."""
    pytest.importorskip("ray")
    import socket
    import time
    import mamba_debug as md
    from mamba_debug.errors import MambaDebugError
    from mamba_debug.settings import RunSettings
    from mamba_debug.sweep import run_sweep
    with socket.socket() as s:              # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.perf_counter()
    with pytest.raises(MambaDebugError, match=rf"--ray 127.0.0.1:{port}: nothing answers there"):
        run_sweep(md.load_model("tiny-mamba"), [1, 2, 3], RunSettings(device="cpu", kernels="torch"), offloads=[0],
                  ubatches=[2], progress=False, ray=f"127.0.0.1:{port}")
    assert time.perf_counter() - t0 < 30
