"""Bad input is a clear error naming the thing and the fix; the command line exits 2 without a traceback."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import mamba_debug as md
from mamba_debug.arch import param_shapes
from mamba_debug.errors import CheckpointError, MambaDebugError
from mamba_debug.io import save_hf
from mamba_debug.io.weights import check_params

from conftest import random_model


@pytest.fixture
def hf_dir(tmp_path):
    return save_hf(random_model(n_layer=2), tmp_path / "m")


def test_round_trip_through_hf_folder(hf_dir):
    model = md.load_model(hf_dir)
    ref = random_model(n_layer=2)
    tokens = torch.arange(9)[None] % 61
    torch.testing.assert_close(model.logits(tokens), ref.logits(tokens), rtol=1e-6, atol=1e-6)


def test_missing_path(tmp_path):
    with pytest.raises(CheckpointError, match="no such file"):
        md.load_model(tmp_path / "nope")


def test_missing_weights(hf_dir):
    (hf_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights"):
        md.load_model(hf_dir)


def test_truncated_safetensors(hf_dir):
    f = hf_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or damaged"):
        md.load_model(hf_dir)


def test_truncated_pickle(tmp_path):
    folder = save_hf(random_model(n_layer=2), tmp_path / "m")
    sd = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    torch.save(sd, folder / "pytorch_model.bin")
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match="weights_only=True"):
        md.load_model(folder)


def test_missing_tensor_is_named(hf_dir):
    sd = load_file(str(hf_dir / "model.safetensors"))
    del sd["backbone.layers.1.mixer.x_proj.weight"]
    save_file(sd, str(hf_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"backbone\.layers\.1\.mixer\.x_proj\.weight"):
        md.load_model(hf_dir)


def test_wrong_shape_names_tensor_and_both_shapes(hf_dir):
    sd = load_file(str(hf_dir / "model.safetensors"))
    sd["backbone.layers.0.mixer.out_proj.weight"] = torch.zeros(32, 63)
    save_file(sd, str(hf_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"out_proj\.weight has shape \[32, 63\] but the config implies \[32, 64\]"):
        md.load_model(hf_dir)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights(hf_dir, bad):
    sd = load_file(str(hf_dir / "model.safetensors"))
    sd["backbone.layers.1.mixer.D"][3] = bad
    save_file(sd, str(hf_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"mixer\.D holds 1 NaN/Inf"):
        md.load_model(hf_dir)


@pytest.mark.parametrize("values,match", [((-math.inf,), "holds 1 NaN/Inf"), ((math.nan, math.inf), "holds 2 NaN/Inf"),
                                          ((1e39,), r"holds values beyond float32's range .*up to 1e\+39"),
                                          ((-2e39, 1e39), r"holds values beyond float32's range .*up to 2e\+39")])
def test_check_params_values(values, match):
    """One min/max pass finds each bad value wherever it lies (fresh random place, float64 masters from a float64
    file: the only source whose finite values can pass float32's range); a clean tensor passes unchanged."""
    cfg = random_model().config
    params = {k: torch.randn(shape, dtype=torch.float64) for k, shape in param_shapes(cfg).items()}
    kept = check_params(cfg, dict(params), "f")
    assert all(torch.equal(kept[k], v) for k, v in params.items())
    flat = params["layers.1.in_proj"].view(-1)
    for v, i in zip(values, torch.randperm(flat.numel())[:len(values)].tolist()):
        flat[i] = v
    with pytest.raises(CheckpointError, match=r"f: tensor layers\.1\.in_proj " + match):
        check_params(cfg, params, "f")


@pytest.mark.parametrize("patch,word", [({"model_type": "bamba", "architectures": ["BambaForCausalLM"]}, "Bamba"),
                                        ({"model_type": "falcon_mamba"}, "FalconMamba"),
                                        ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}, "Llama"),
                                        ({"model_type": "jamba"}, "Jamba")])
def test_other_architectures_are_named(hf_dir, patch, word):
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.update(patch)
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=f"looks like {word}.*not yet"):
        md.load_model(hf_dir)


def test_state_spaces_mamba2_config_without_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"d_model": 64, "n_layer": 2, "vocab_size": 50,
                                                      "ssm_cfg": {"layer": "Mamba2"}}))
    with pytest.raises(CheckpointError, match="no weights"):       # read as mamba_ssm's Mamba-2 layout
        md.load_model(tmp_path)


def test_bad_gguf_magic(tmp_path):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(CheckpointError, match="not b'GGUF'"):
        md.load_model(f)


def test_ubatch_and_prompt_errors(small_model):
    with pytest.raises(MambaDebugError, match="ubatch must be"):
        md.Runner(small_model, md.reference_backend()).prefill(torch.tensor([[1, 2]]), 0)
    with pytest.raises(MambaDebugError, match="prompt is empty"):
        small_model.logits(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(MambaDebugError, match="token ids must lie"):
        small_model.logits(torch.tensor([[1, 999]]))


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "mamba_debug", *args], capture_output=True, text=True, timeout=300)


def test_cli_user_errors_exit_2_without_traceback(tmp_path, hf_dir):
    for args in (["generate", "--model", str(tmp_path / "nope")],
                 ["generate", "--model", str(hf_dir), "--ubatch", "0"],
                 ["generate", "--model", str(hf_dir), "--prompt", "hello"]):   # no tokenizer in a random model
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr and "error" in r.stderr


def test_sweep_lists_are_checked_before_any_cell_runs(small_model, monkeypatch):
    """A bad list is a usage error that names its flag; an impossible cell (ubatch 0) stops the sweep before its
    first cell, in the API (run_sweep) as on the command line, instead of failing inside it."""
    from mamba_debug import sweep
    monkeypatch.setattr(sweep, "run_compare", lambda *a, **k: pytest.fail("a cell ran before the check"))
    run_sweep = sweep.run_sweep
    with pytest.raises(MambaDebugError, match="ubatch must be an integer >= 1"):
        run_sweep(small_model, [1, 2, 3], md.RunSettings(n_gen=1), offloads=[0], ubatches=[1, 0], progress=False)
    for args, said in ((["--ubatches", "1,x"], "argument --ubatches: expected a list like 1,2,8"),
                       (["--offloads", "3..1"], "argument --offloads: '3..1' is an empty list or a reversed range"),
                       (["--ubatches", "0", "--offloads", "0"], "ubatch must be an integer >= 1")):
        r = _cli("sweep", "--workers", "1", *args)
        assert r.returncode == 2 and said in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr and "This is a bug" not in r.stderr


def _shipped_with(tmp_path, name: str, **changes):
    """A copy of a shipped model folder whose config.json has `changes` (a value DELETE removes its key)."""
    import shutil
    from mamba_debug.io.load import DATA_DIR
    folder = shutil.copytree(DATA_DIR / name, tmp_path / name)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not DELETE}))
    return folder


DELETE = object()


@pytest.mark.parametrize("name, key, value, match", [
    ("tiny-mamba", "architectures", 7, "architectures must be a list of class names"),
    ("tiny-mamba", "tie_word_embeddings", "x", "tie_word_embeddings must be true or false, found 'x'"),
    ("tiny-mamba", "hidden_act", "gelu", "supports 'silu' only"),
    ("tiny-mamba2", "num_heads", None, "num_heads must be an integer, found None"),
    ("tiny-mamba2", "layer_norm_epsilon", -1, r"layer_norm_epsilon = -1(\.0)?: the norm's epsilon must be"),
    ("tiny-mamba2", "layer_norm_epsilon", math.nan, "layer_norm_epsilon must be a finite number"),
    ("tiny-mamba2", "use_conv_bias", "false", "use_conv_bias must be true or false"),
    ("tiny-mamba2", "num_hidden_layers", 10 ** 9, r"num_hidden_layers = 1000000000 is out of range"),
    ("tiny-granite-hybrid", "layer_types", 7, "layer_types must name each of the 8 layers"),
    ("tiny-granite-hybrid", "time_step_limit", 7, r"time_step_limit must be two numbers \[min, max\], found 7"),
    ("tiny-granite-hybrid", "logits_scaling", 0, "logits_scaling must be positive"),
    ("tiny-granite-hybrid", "num_attention_heads", 0, "n_attn_heads must be set"),
    ("tiny-granite-hybrid", "mamba_d_state", None, "mamba_d_state must be an integer, found None"),
])
def test_a_damaged_config_value_is_named(tmp_path, name, key, value, match):
    """Each of these crashed with a TypeError or ZeroDivisionError, or loaded as some other model (a string read as
    true, a NaN epsilon, 'gelu' computed as silu), before the readers typed every value they use."""
    folder = _shipped_with(tmp_path, name, **{key: value})
    with pytest.raises(CheckpointError, match=match):
        md.load_model(folder)


def test_mamba2_weights_of_more_layers_than_the_config_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"the weights hold layer\(s\) 7 but the config declares 7 layers"):
        md.load_model(_shipped_with(tmp_path, "tiny-mamba2", num_hidden_layers=7))


def test_an_untied_mamba2_config_without_a_head_is_read_as_tied_and_says_so(tmp_path):
    model = md.load_model(_shipped_with(tmp_path, "tiny-mamba2", tie_word_embeddings=DELETE))
    shipped = md.load_model("tiny-mamba2")
    assert model.config == shipped.config and any("no lm_head.weight" in n for n in model.notes)
    tokens = torch.arange(7)[None]
    assert torch.equal(model.logits(tokens), shipped.logits(tokens))


@pytest.mark.parametrize("ids, match", [
    ([1.5, 2.0], r"integer token ids, got 1\.5"), ([True, False], "integer token ids, got True"),
    ("hello", "prompt_ids is text; pass token ids, e.g. model.encode"), (None, "a list of token ids, got NoneType"),
    (torch.tensor([[1, 2, 3]]), r"one prompt, a 1-D list of token ids; got shape \[1, 3\]"),
    (np.array([1.0, 2.0]), "integer token ids, got 1.0"), ([[1, 2], [3]], r"integer token ids, got \[1, 2\]"),
    ([10 ** 30], "token id 1000000000000000000000000000000 is out of range"),
])
def test_prompt_ids_that_are_not_one_prompt_of_integers_are_named(small_model, ids, match):
    """Floats were truncated to ids (1.5 -> 1) and booleans read as 0 and 1; text, a [1, P] tensor, nested lists and
    huge ids raised TypeError, ValueError or an overflow from torch."""
    with pytest.raises(MambaDebugError, match=match):
        md.run_compare(small_model, ids, md.CompareSettings(device="cpu", kernels="torch", capture="metrics"))


def test_prompt_ids_of_any_integer_kind_give_one_answer(small_model):
    s = md.CompareSettings(device="cpu", kernels="torch", capture="metrics", ubatch=2)
    runs = [md.run_compare(small_model, ids, s) for ids in ([1, 2, 3], (1, 2, 3), np.array([1, 2, 3], np.int32),
                                                           torch.tensor([1, 2, 3]), iter([1, 2, 3]), range(1, 4))]
    assert all(torch.equal(r.tokens, runs[0].tokens) for r in runs)


def test_settings_take_numpy_values_and_comma_strings_and_refuse_truthy_strings(small_model):
    """An API user's values from numpy (np.arange offloads, a slider's np.int64, np.float32, np.bool_) were refused
    as 'must be an integer, got np.int64(8)'; `devices="cpu"` ran as the devices 'c', 'p', 'u'; `local="no"` and
    `ubatch=True` were taken (truthy, and bool is an int). Now numpy scalars are the Python values they stand for
    (equal and hashing like the same settings typed by hand), a comma string is its items, and a flag that is not
    True or False, a bool count and a layer that is not an integer are refused naming the field."""
    typed = md.RunSettings(offload=3, ubatch=8, n_gen=2, k_floor=5.0, local=False, capture_layers=(0, 1),
                           devices=("cpu", "cpu"), tensor_split=(3.0, 1.0))
    made = md.RunSettings(offload=np.int32(3), ubatch=np.uint64(8), n_gen=np.int64(2), k_floor=np.float32(5),
                          local=np.bool_(False), capture_layers=np.array([0, 1]), devices="cpu,cpu",
                          tensor_split="3,1")
    assert made == typed and hash(made) == hash(typed) and type(made.ubatch) is int
    assert md.RunSettings(capture_layers="0,3").capture_layers == (0, 3)
    for kw, said in ((dict(local="no"), "local must be True or False, got 'no'"),
                     (dict(free_run="yes"), "free_run must be True or False"),
                     (dict(ubatch=True), "ubatch must be an integer >= 1 (like -ub), got True"),
                     (dict(n_seqs=np.bool_(True)), "n_seqs must be an integer >= 1"),
                     (dict(capture_layers=("a",)), "capture layer 'a' is not a layer number: give integers 0..3"),
                     (dict(capture_layers=(1.5,)), "capture layer 1.5 is not a layer number")):
        with pytest.raises(MambaDebugError, match=re.escape(said)):
            md.RunSettings(**kw).validated(small_model.config)
    with pytest.raises(MambaDebugError, match="devices must be a list"):
        md.RunSettings(devices=5)
    res = md.run_compare(small_model, [1, 2, 3, 4, 5, 6], md.RunSettings(kernels="torch", ubatch=np.int64(4),
                                                                         n_gen=np.int64(1)))
    assert res.settings.ubatch == 4
    assert small_model.generate(torch.tensor([[1, 2, 3]]), np.int64(2)).shape == (1, 2)


def test_public_metrics_refuse_mismatched_shapes_naming_the_function_and_take_numpy():
    """md.nmse / md.site_errors / md.logit_stats of two shapes were torch broadcasting errors from inside them (or an
    IndexError for an empty site); numpy arrays an AttributeError."""
    a = torch.randn(2, 3, 4, dtype=torch.float64)
    for fn, args, said in ((md.nmse, (a, a[:1]), "nmse needs two tensors of one shape; got [2, 3, 4] and [1, 3, 4]"),
                           (md.site_errors, (a, a[:, :2]), "site_errors needs two tensors of one shape [S, T, ...]"),
                           (md.site_errors, (torch.zeros(0), torch.zeros(0)), "no size 0; got [0] and [0]"),
                           (md.logit_stats, (a, a[..., :3]), "logit_stats needs two tensors of one shape [..., V]")):
        with pytest.raises(MambaDebugError, match=re.escape(said)):
            fn(*args)
    assert md.nmse(a.numpy(), a.numpy()) == 0.0
    assert md.site_errors(a.numpy(), a.numpy())["rel_l2"].shape == (2, 3)


def test_model_config_takes_numpy_values_and_refuses_a_truthy_string_for_a_flag():
    """`ModelConfig(tie_embeddings="no")` built a tied model ("no" is truthy) and `d_model=True` a 1-wide one;
    `d_model=np.int64(64)` was refused as not an integer."""
    cfg = md.ModelConfig(d_model=np.int64(64), n_layer=np.int32(2), vocab_size=50, rms_eps=np.float64(1e-5),
                         tie_embeddings=np.bool_(False))
    assert type(cfg.d_model) is int and cfg.d_model == 64 and cfg.tie_embeddings is False
    for kw, said in ((dict(tie_embeddings="no"), "MambaConfig.tie_embeddings must be True or False, got 'no'"),
                     (dict(d_model=True), "MambaConfig.d_model must be a number, not True"),
                     (dict(rms_eps="x"), "MambaConfig.rms_eps must be a number, got 'x'")):
        with pytest.raises(ValueError, match=re.escape(said)):
            md.ModelConfig(**{**dict(d_model=64, n_layer=2, vocab_size=50), **kw})


def test_build_model_refuses_unknown_names_and_unreal_tensors_and_takes_arrays():
    """md.build_model ignored a name it did not know (a typo's tensor dropped silently), took a complex tensor
    (its imaginary part dropped), failed on a numpy array, a list or a dict config with an AttributeError, and on a
    meta tensor with a RuntimeError."""
    cfg = md.ModelConfig(d_model=16, n_layer=1, vocab_size=20)
    params = {k: torch.full(v, 0.1, dtype=torch.float64) for k, v in md.param_shapes(cfg).items()}
    params["layers.0.A"] = -params["layers.0.A"] - 1
    built = md.build_model({"d_model": 16, "n_layer": 1, "vocab_size": 20},
                           {**params, "embed": params["embed"].numpy(), "norm_f": [0.1] * 16})
    assert torch.equal(built.logits(torch.tensor([[1, 2]])), md.build_model(cfg, params).logits(torch.tensor([[1, 2]])))
    for changed, said in (({"layers.0.A_log": params["layers.0.A"]}, "unknown tensor name(s) layers.0.A_log"),
                          ({"norm_f": torch.ones(16, dtype=torch.complex64)}, "norm_f is torch.complex64"),
                          ({"norm_f": torch.ones(16, device="meta")}, "norm_f is torch.float32 on meta"),
                          ({"norm_f": "x"}, "norm_f is a str, not a tensor")):
        with pytest.raises(CheckpointError, match=re.escape(said)):
            md.build_model(cfg, {**params, **changed})
    with pytest.raises(MambaDebugError, match="params must be a dict of canonical name -> tensor"):
        md.build_model(cfg, list(params.values()))


def test_build_model_refuses_masters_that_contradict_the_config():
    """A distinct lm_head with tie_embeddings true, or a conv bias with conv_bias false: saved or exported, each
    became the config's (the head tied, the bias dropped), and the model changed on the way (logits 1.48 apart)."""
    cfg = md.ModelConfig(d_model=16, n_layer=1, vocab_size=20)
    params = {k: torch.full(v, 0.1, dtype=torch.float64) for k, v in md.param_shapes(cfg).items()}
    params["layers.0.A"] = -params["layers.0.A"] - 1
    with pytest.raises(CheckpointError, match="tie_embeddings is true but lm_head is not the embedding"):
        md.build_model(cfg, {**params, "lm_head": params["embed"] * 2})
    no_bias = md.ModelConfig(d_model=16, n_layer=1, vocab_size=20, conv_bias=False)
    with pytest.raises(CheckpointError, match="conv_bias is false but layers.0.conv_b is not zero"):
        md.build_model(no_bias, params)
    md.build_model(no_bias, {**params, "layers.0.conv_b": torch.zeros_like(params["layers.0.conv_b"])})


def test_public_functions_refuse_a_wrong_first_argument_naming_themselves(tmp_path):
    """None or another type where a result or a model goes was an AttributeError from inside; replay_case of a
    folder that is no case ran pytest there; describe_gguf of a text file was a numpy ValueError; example_inputs of
    an unknown op a KeyError."""
    for call, said in ((lambda: md.summary(None), "summary takes a CompareResult"),
                       (lambda: md.to_json("x"), "to_json takes a CompareResult"),
                       (lambda: md.write_report(None, tmp_path / "r.html"), "write_report takes a CompareResult"),
                       (lambda: md.save_trace(None, tmp_path / "t.safetensors"), "save_trace takes a CompareResult"),
                       (lambda: md.save_hf(None, tmp_path / "m"), "save_hf takes a model"),
                       (lambda: md.export_gguf(None, tmp_path / "m.gguf"), "export_gguf takes a model"),
                       (lambda: md.replay_case(tmp_path), "not an export-case folder (no case.json or test_case.py)"),
                       (lambda: md.example_inputs("nope"), "no example inputs for op 'nope'; the ops are rms_norm")):
        with pytest.raises(MambaDebugError, match=re.escape(said)):
            call()
    text = tmp_path / "notes.txt"
    text.write_text("not a gguf at all, but long enough to hold a header's first fields")
    with pytest.raises(CheckpointError, match="does not start with b'GGUF'"):
        md.describe_gguf(text)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]         # nothing written or run there


def test_run_sweep_axes_are_lists_of_distinct_integers_and_its_base_and_workers_checked(small_model):
    """ubatches="1,8" ran the 'ubatches' '1', ',' and '8' (refused only as "got '1'"); an empty axis made an empty
    sweep; a repeated offload ran and drew its cells twice; workers="2" was a TypeError and base=None an
    AttributeError (None is the defaults, as in run_compare)."""
    from mamba_debug.sweep import run_sweep
    base = md.RunSettings(kernels="torch", n_gen=0)
    for kw, said in ((dict(ubatches="1,8"), "ubatches must be a list of integers (e.g. [1, 8, 32] or range(0, 14))"),
                     (dict(offloads=[]), "offloads is empty: give at least one value"),
                     (dict(workers="2"), "workers must be an integer >= 1, got '2'"),
                     (dict(base="torch"), "run_sweep: base must be a md.RunSettings (or a dict of its fields)")):
        args = dict(base=base, offloads=[0], ubatches=[2], progress=False) | kw
        with pytest.raises(MambaDebugError, match=re.escape(said)):
            run_sweep(small_model, [1, 2, 3, 4], **args)
    sw = run_sweep(small_model, [1, 2, 3, 4], base, offloads=[1, np.int64(1), 1], ubatches=np.array([2]),
                   progress=False)
    assert sw["offloads"] == [1] and sw["ubatches"] == [2] and len(sw["cells"]) == 1


def test_run_functions_take_settings_as_a_dict_and_refuse_what_is_not_a_model_or_settings(small_model):
    """run_compare(None, ...) and bisect_layer(model, ids, None) were AttributeErrors from inside, settings as a dict
    an AttributeError ('validated'), model.logits("text") a TypeError from torch."""
    ids = [1, 2, 3, 4]
    res = md.run_compare(small_model, ids, {"kernels": "torch", "n_gen": 1, "ubatch": 2})
    assert res.settings.kernels == "torch" and res.settings.ubatch == 2
    for call, said in ((lambda: md.run_compare(None, ids), "run_compare takes a model"),
                       (lambda: md.bisect_layer("model", ids, {}), "bisect_layer takes a model"),
                       (lambda: md.run_compare(small_model, ids, {"kernel": "torch"}),
                        "run_compare: settings has no field(s) kernel"),
                       (lambda: md.run_compare(small_model, ids, "torch"), "settings must be a md.RunSettings"),
                       (lambda: small_model.logits("hello"), "tokens are text; pass token ids")):
        with pytest.raises(MambaDebugError, match=re.escape(said)):
            call()


def test_runner_placement_and_plugins_refuse_what_they_cannot_use(small_model):
    """Runner(model, None) was an AttributeError from inside; a plug-in loaded for device "tpu" was interpreted as if
    "interpret" without a word; Placement(12, np.int64(3)) was refused as not an integer."""
    for call, said in ((lambda: md.Runner(small_model, None), "Runner needs a host back-end"),
                       (lambda: md.Runner(small_model, "cpu"), "Runner: a back-end must be a md.Backend"),
                       (lambda: md.load_kernels("triton", device="tpu"),
                        "device 'tpu': a plug-in loads for 'cuda', 'interpret' or 'cpu'")):
        with pytest.raises(MambaDebugError, match=re.escape(said)):
            call()
    assert md.Placement(np.int64(4), np.int64(2)) == md.Placement(4, 2)


def test_kernels_as_a_path_is_text_in_the_settings_and_a_number_is_refused(small_model):
    """kernels=Path(...) stayed a Path in the settings (unlike the same path as text for equality, the cache and the
    trace's JSON); kernels=3 was a TypeError from pathlib."""
    from pathlib import Path
    from mamba_debug.plugins import KERNELS_DIR
    path = Path(KERNELS_DIR) / "bug_strided_gate.py"
    assert md.RunSettings(kernels=path) == md.RunSettings(kernels=str(path))
    with pytest.raises(MambaDebugError, match=re.escape("kernels 3: give a plug-in's name (md.list_kernels())")):
        md.run_compare(small_model, [1, 2, 3], md.RunSettings(kernels=3, n_gen=0))


def test_save_hf_takes_a_dtype_name_and_refuses_an_integer_dtype_or_a_file(tmp_path, small_model):
    """save_hf(dtype="float16") was a RuntimeError ('Invalid device string') after creating the folder;
    dtype=torch.int8 wrote the weights truncated to integers; a file as the folder a FileExistsError."""
    md.save_hf(small_model, tmp_path / "half", dtype="float16")
    assert md.load_model(tmp_path / "half").params["norm_f"].equal(small_model.params["norm_f"].half().double())
    with pytest.raises(MambaDebugError, match=re.escape("save_hf: dtype torch.int8 is not a floating dtype")):
        md.save_hf(small_model, tmp_path / "ints", dtype=torch.int8)
    (tmp_path / "afile").write_text("kept")
    with pytest.raises(MambaDebugError, match="is a file; save_hf writes a folder"):
        md.save_hf(small_model, tmp_path / "afile")
    assert not (tmp_path / "ints").exists() and (tmp_path / "afile").read_text() == "kept"


def test_load_trace_of_a_folder_or_a_missing_file_says_so(tmp_path):
    """A folder was 'not a readable trace file (No such device (os error 19))'."""
    with pytest.raises(MambaDebugError, match="is a folder; give the trace file"):
        md.load_trace(tmp_path)
    with pytest.raises(MambaDebugError, match="no such trace file"):
        md.load_trace(tmp_path / "t.safetensors")


def test_config_functions_take_a_dict_and_backends_name_a_bad_device():
    """md.param_shapes / md.site_order of a dict or None were AttributeErrors; md.reference_backend("tpu") a torch
    RuntimeError listing every device type torch knows."""
    fields = {"d_model": 16, "n_layer": 1, "vocab_size": 20}
    assert md.param_shapes(fields) == md.param_shapes(md.ModelConfig(**fields))
    for call, said in ((lambda: md.param_shapes(None), "param_shapes takes a md.ModelConfig (or a dict of its fields)"),
                       (lambda: md.site_order("x"), "site_order takes a md.ModelConfig"),
                       (lambda: md.reference_backend("tpu"), "device 'tpu': not a torch device")):
        with pytest.raises(MambaDebugError, match=re.escape(said)):
            call()
