"""Bad input is a clear error naming the thing and the fix; the command line exits 2 without a traceback."""
from __future__ import annotations

import json
import math
import subprocess
import sys

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
