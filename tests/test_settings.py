"""One RunSettings: every default once, one validation, the one Placement, the CLI's flags generated from it; and
the public API: names of `mamba_debug` itself, old module paths still importable."""
from __future__ import annotations

import dataclasses
import importlib

import pytest

import mamba_debug as md
from mamba_debug.cli import build_parser, settings_from
from mamba_debug.settings import DEFAULT_UBATCH, RunSettings

from conftest import random_model


def test_settings_are_frozen_hashable_and_list_fields_become_tuples():
    a = RunSettings(capture_layers=[1, 2], capture_sites=["gate"])
    b = RunSettings(capture_layers=(1, 2), capture_sites=("gate",))
    assert a == b and hash(a) == hash(b) and {a: 1}[b] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.offload = 3
    assert RunSettings(device="auto") == RunSettings()
    assert md.CompareSettings is RunSettings


def test_validated_resolves_offload_and_device_once():
    cfg = random_model(n_layer=4).config
    s = RunSettings().validated(cfg)
    assert s.offload == 5 and s.device in ("interpret", "cuda")
    assert s.placement(4).head_on_device and s.placement(4).first_device_layer == 0
    assert RunSettings(offload=2).placement(4).first_device_layer == 2
    for bad, match in [(dict(ubatch=0), "ubatch"), (dict(n_seqs=0), "n_seqs"), (dict(k_floor=1.0), "k_floor"),
                       (dict(capture_sites=["nope"]), "unknown site"), (dict(capture_layers=[9]), "out of range"),
                       (dict(device="tpu"), "unknown device"), (dict(rule="llama1999"), "rule")]:
        with pytest.raises(md.MambaDebugError, match=match):
            RunSettings(**bad).validated(cfg)


def _flags(command):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {a.dest: a for a in sub._actions}


def test_cli_flags_come_from_the_settings_fields():
    compare = _flags("compare")
    for f in dataclasses.fields(RunSettings):
        if f.metadata:
            assert f.name in compare, f"compare has no flag for RunSettings.{f.name}"
            assert compare[f.name].help == f.metadata["help"]
    assert compare["ubatch"].default == DEFAULT_UBATCH
    assert "offload" not in _flags("sweep") and "offload" in _flags("export-case")
    assert "ubatch" not in _flags("sweep") and "n_seqs" not in _flags("sweep"), "sweep takes --ubatches, --n-seqs-list"
    assert "ubatch" in _flags("bisect") and "n_seqs" in _flags("export-case")
    assert "capture" not in _flags("bisect")
    args = build_parser().parse_args(["compare", "--offload", "3", "--layers", "1..2", "--sites", "gate,resid"])
    s = settings_from(args)
    assert (s.offload, s.capture_layers, s.capture_sites, s.capture) == (3, (1, 2), ("gate", "resid"), "sites")
    assert settings_from(build_parser().parse_args(["compare"])) == RunSettings()


def test_public_api_and_old_paths():
    for name in ("load_model", "run_compare", "RunSettings", "summary", "to_json", "export_gguf", "save_hf",
                 "param_shapes", "build_model", "reference_ops", "example_inputs", "nmse", "logit_stats",
                 "replay_case", "load_trace", "run_sweep", "bisect_layer", "export_case", "write_report",
                 "MambaDebugError", "CheckpointError", "PluginError", "Model", "ModelConfig"):
        assert getattr(md, name) is not None, name
    assert importlib.import_module("mamba_debug.loading").load_model is md.load_model
    assert importlib.import_module("mamba_debug.result").to_json is md.to_json
    from mamba_debug.compare import CompareSettings, run_compare  # noqa: F401 (the README's old example)


def test_build_model_from_config_and_params():
    ref = random_model(n_layer=2)
    cfg = md.ModelConfig(**ref.config.to_dict())
    assert set(md.param_shapes(cfg)) == set(ref.params)
    model = md.build_model(cfg, dict(ref.params))
    torch = pytest.importorskip("torch")
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(model.logits(ids), ref.logits(ids))
    bad = dict(ref.params, **{"layers.0.A": ref.params["layers.0.A"][:, :2]})
    with pytest.raises(md.CheckpointError, match="layers.0.A"):
        md.build_model(cfg, bad)


@pytest.mark.parametrize("changes, said", [
    (dict(engine="llama.cpp", kernels="bug_a_negated"), "--kernels bug_a_negated: picks the torch engine's"),
    (dict(engine="llama.cpp", n_seqs=257), "llama.cpp holds at most 256 sequences"),
    (dict(op_offload=False), "--no-op-offload: a switch of llama.cpp's"),
    (dict(fp32_everywhere=True), "--fp32-everywhere: a switch of llama.cpp's")])
def test_a_flag_of_the_other_engine_is_refused_not_ignored(changes, said):
    """--kernels with llama.cpp ran llama.cpp and wrote the plug-in's name into the JSON; 257 sequences ended in an
    AttributeError from inside the llama.cpp side."""
    with pytest.raises(md.MambaDebugError, match=said):
        RunSettings(**changes).validated(random_model().config)
    assert RunSettings(engine="llama.cpp", n_seqs=256).validated(random_model().config).n_seqs == 256
