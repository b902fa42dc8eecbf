"""Issue 17, by class: hostile and careless input gets a clear error (exit 2); nothing is lost, half-written,
silently wrong or run away. One test (or a few) per class; the property-based ones are in test_reliability_fuzz.py."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch

from conftest import random_model
from mamba_debug import cli
from mamba_debug.budget import check_host_memory
from mamba_debug.compare import run_compare
from mamba_debug.errors import CheckpointError, MambaDebugError
from mamba_debug.io import load_model
from mamba_debug.io.hf import save_hf
from mamba_debug.refcheck import NonFiniteReference
from mamba_debug.safeio import write_text
from mamba_debug.settings import RunSettings

FAST = ["--prompt", "1 2 3 4 5", "--n-gen", "1", "--device", "cpu"]


@pytest.fixture
def folder(tmp_path):
    return save_hf(random_model(n_layer=2), tmp_path / "m")


def _plugin(tmp_path, body: str):
    p = tmp_path / "plug.py"
    p.write_text("import sys, torch\nimport torch.nn.functional as F\n" + body)
    return str(p)


def _run(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


# -- 1. no traceback reaches a user ------------------------------------------------------------------
@pytest.mark.parametrize("body, words", [
    ("def silu(x):\n    sys.exit(0)\nOPS = {'silu': silu}\n", ["plug", "silu", "SystemExit"]),
    ("sys.exit(0)\nOPS = {}\n", ["plug.py", "failed to load", "SystemExit"]),
    ("def silu(x):\n    return 'garbage'\nOPS = {'silu': silu}\n", ["plug", "silu", "not a tensor"]),
    ("def silu(x):\n    raise ValueError('boom')\nOPS = {'silu': silu}\n", ["plug", "silu", "boom"]),
])
def test_plugin_that_exits_raises_or_returns_garbage_is_exit_2(tmp_path, folder, capsys, body, words):
    rc, _, err = _run(capsys, "compare", "--model", folder, "--kernels", _plugin(tmp_path, body), *FAST)
    assert rc == 2 and "Traceback" not in err and err.count("\n") == 1
    assert all(w in err for w in words), err


def test_unexpected_error_is_one_line_and_debug_shows_the_traceback(folder, capsys, monkeypatch):
    def broken(args):
        raise ZeroDivisionError("x")
    monkeypatch.setattr(cli, "cmd_compare", broken)
    rc, _, err = _run(capsys, "compare", "--model", folder)
    assert rc == 2 and "Traceback" not in err and "--debug" in err
    rc, _, err = _run(capsys, "--debug", "compare", "--model", folder)
    assert rc == 2 and "Traceback" in err


# -- 2. outputs never destroy inputs -----------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--json", "--report", "--trace"])
def test_output_that_is_a_model_file_is_refused(folder, capsys, flag):
    target = folder / "model.safetensors"
    before = target.read_bytes()
    rc, _, err = _run(capsys, "compare", "--model", folder, flag, target, *FAST)
    assert rc == 2 and "destroy" in err and target.read_bytes() == before


def test_show_refuses_its_own_trace_and_export_gguf_its_model(tmp_path, folder, capsys):
    trace = tmp_path / "t.safetensors"
    assert _run(capsys, "compare", "--model", folder, "--trace", trace, *FAST)[0] in (0, 1)
    before = trace.read_bytes()
    assert _run(capsys, "show", trace, "--json", trace)[0] == 2 and trace.read_bytes() == before
    g = tmp_path / "m.gguf"
    assert _run(capsys, "export-gguf", "--model", folder, "--out", g)[0] == 0
    assert _run(capsys, "export-gguf", "--model", g, "--out", g)[0] == 2


def test_plugin_file_is_never_an_output(tmp_path, folder, capsys):
    plug = _plugin(tmp_path, "OPS = {'silu': F.silu}\n")
    assert _run(capsys, "compare", "--model", folder, "--kernels", plug, "--json", plug, *FAST)[0] == 2


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    from mamba_debug.safeio import atomic_path
    target = tmp_path / "out.json"
    write_text(target, "old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("disk full")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["out.json"]


def test_an_output_gets_the_umasks_mode_or_keeps_the_replaced_files(tmp_path):
    """Every output was 0600 (mkstemp's), a replaced 0644 report too: no one else could read it."""
    import stat
    old = os.umask(0o022)
    try:
        write_text(tmp_path / "new.json", "x")
        kept = tmp_path / "kept.json"
        kept.write_text("old")
        kept.chmod(0o640)
        write_text(kept, "new")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == 0o644
    assert stat.S_IMODE(kept.stat().st_mode) == 0o640 and kept.read_text() == "new"


# -- 3. non-finite is never agreement ------------------------------------------------------------------
def test_weight_that_overflows_float32_is_refused_naming_the_tensor(tmp_path):
    m = random_model(n_layer=2)
    m.params["layers.1.D"][3] = 1e39
    save_hf(m, tmp_path / "m", dtype=torch.float64)
    with pytest.raises(CheckpointError, match=r"backbone\.layers\.1\.mixer\.D.*float32"):
        load_model(tmp_path / "m")


@pytest.mark.parametrize("reference", ["float32", "float64"])
def test_activations_past_float32s_range_are_refused_naming_where_float32_left(reference):
    """Embeddings at 1e25: x**2 overflows in layer 0's norm, whose float32 output is finite zeros. Every floor was
    then ~1, every threshold ~10: "no divergence" with a KLD of 8 and a reference perplexity of inf."""
    from mamba_debug.refcheck import OutOfFloat32Range
    from mamba_debug.settings import RunSettings
    m = random_model()
    m.params["embed"] = m.params["embed"] * 1e25
    with pytest.raises(OutOfFloat32Range, match="float32 reference left the float64 one at layer 0, site norm, token 0"):
        run_compare(m, [1, 2, 3, 4, 5], RunSettings(device="cpu", kernels="torch", n_gen=1, reference=reference))


@pytest.mark.parametrize("eps", [-1, 0, float("nan"), 5])
def test_norm_eps_out_of_range_is_refused_naming_the_key(folder, eps):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["layer_norm_epsilon"] = eps
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="layer_norm_epsilon"):
        load_model(folder)


@pytest.mark.parametrize("how", ["compare", "sweep"])
def test_reference_that_becomes_nan_is_reported_with_layer_and_site(how):
    """Also in a sweep, whose cells share the reference's steps (checked once, by the run that makes them)."""
    from mamba_debug.sweep import run_sweep
    m = random_model(n_layer=2)
    m.params["layers.0.norm"].fill_(3e38)     # finite in float32, but in_proj's sums overflow float32
    s = RunSettings(n_gen=0, device="cpu", kernels="torch")
    with pytest.raises(NonFiniteReference, match="ref32.*layer 0, site norm"):
        if how == "compare":
            run_compare(m, [1, 2, 3], s)
        else:
            run_sweep(m, [1, 2, 3], s, offloads=[0, 2], ubatches=[1, 3], progress=False, workers=1)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the multi-tensor path runs on a GPU"))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nan_or_inf_anywhere_in_a_reference_ubatch_is_seen(device, dtype):
    """One bad value at a fresh random place (a contiguous site, a transposed view or the logits) among sites of
    awkward shapes and an empty one; clean sites pass, and so do float64 values whose sum overflows."""
    from mamba_debug.refcheck import all_finite, check_reference
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    rand = lambda *s: torch.randn(*s, generator=g, dtype=dtype).to(device)   # noqa: E731
    for bad in (float("nan"), float("inf"), -float("inf")):
        sites = {(i, "x"): (rand(3, 7 + i), True) for i in range(5)}
        sites[(5, "t")] = (rand(5, 3).t(), True)
        sites[(6, "e")] = (rand(0, 4), False)
        logits = rand(3, 11)
        assert all_finite([v for v, _ in sites.values()] + [logits])
        k = int(torch.randint(0, 7, (), generator=g))
        target = logits if k == 6 else sites[list(sites)[k]][0]
        target[tuple(int(torch.randint(0, n, (), generator=g)) for n in target.shape)] = bad
        assert not all_finite([v for v, _ in sites.values()] + [logits]), (bad, k)
        with pytest.raises(NonFiniteReference, match="logits" if k == 6 else f"layer {list(sites)[k][0]}"):
            check_reference("ref32", "test", sites, logits, 0, list(sites))
    if dtype == torch.float64:
        huge = {(0, "x"): (torch.full((4,), 1e308, dtype=dtype, device=device), True)}
        check_reference("ref64", "test", huge, rand(2, 3), 0, [(0, "x")])


@pytest.mark.parametrize("k", [float("nan"), float("inf"), 1.0, -3])
def test_k_floor_must_be_finite_and_above_one(k):
    with pytest.raises(MambaDebugError, match="k-floor"):
        RunSettings(k_floor=k).validated(random_model().config)


# -- 4. sides isolated ---------------------------------------------------------------------------------
def test_plugin_writing_into_its_inputs_is_reported(tmp_path, folder, capsys):
    plug = _plugin(tmp_path, "def silu(x):\n    out = F.silu(x)\n    x.zero_()\n    return out\nOPS = {'silu': silu}\n")
    rc, _, err = _run(capsys, "compare", "--model", folder, "--kernels", plug, *FAST)
    assert rc == 2 and "silu" in err and "wrote into its input" in err


@pytest.mark.parametrize("then", ["returns", "crashes"])
def test_a_write_into_the_inputs_found_at_the_end_of_the_forward_pass(tmp_path, folder, capsys, monkeypatch, then):
    """On a GPU the check is deferred to the end of each forward pass (one wait, not one per call): forced on the
    CPU here. The same error names the op and the input, also when a later op fails on what the write left, and a
    clean plug-in passes."""
    from mamba_debug import isolation
    monkeypatch.setattr(isolation, "DEFER_ON_CPU", True)
    queued = []
    real = isolation.defer
    monkeypatch.setattr("mamba_debug.plugins.defer", lambda *a: queued.append(1) or real(*a))
    later = "" if then == "returns" else ("def ssm_scan(*a, **k):\n    raise RuntimeError('garbage in')\n"
                                           "OPS['ssm_scan'] = ssm_scan\n")        # runs after silu
    plug = _plugin(tmp_path, "def silu(x):\n    out = F.silu(x)\n    x[..., :1] = 7\n    return out\n"
                   "OPS = {'silu': silu}\n" + later)
    rc, _, err = _run(capsys, "compare", "--model", folder, "--kernels", plug, *FAST)
    assert queued and rc == 2 and "op silu" in err and "wrote into its input(s) argument 0" in err
    (tmp_path / "clean").mkdir()
    clean = _plugin(tmp_path / "clean", "def silu(x):\n    return F.silu(x)\nOPS = {'silu': silu}\n")
    rc, _, err = _run(capsys, "compare", "--model", folder, "--kernels", clean, *FAST)
    assert rc == 0, err


def test_deferred_checks_belong_to_the_thread_that_opened_them(monkeypatch):
    """Another thread's op is checked at once, never settled (or reported) by this thread's forward pass."""
    import threading
    from mamba_debug import isolation
    monkeypatch.setattr(isolation, "DEFER_ON_CPU", True)
    snap = isolation.snapshot_inputs((torch.zeros(3),), {})
    queued = []
    with isolation.deferred():
        other = threading.Thread(target=lambda: queued.append(isolation.defer(snap, str)))
        other.start()
        other.join()
        queued.append(isolation.defer(snap, str))
    assert queued == [False, True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU run checks this")
def test_a_write_into_the_inputs_on_a_gpu_is_found_with_one_wait(tmp_path, folder, capsys):
    plug = _plugin(tmp_path, "def silu(x):\n    out = F.silu(x)\n    x[..., :1] = 7\n    return out\n"
                   "OPS = {'silu': silu}\n")
    rc, _, err = _run(capsys, "compare", "--model", folder, "--kernels", plug, "--prompt", "1 2 3 4 5", "--n-gen",
                      "1", "--device", "cuda", "--ref-device", "cuda")
    assert rc == 2 and "op silu" in err and "wrote into its input(s) argument 0" in err


def test_device_never_holds_a_reference_weight_tensor():
    from mamba_debug.backends import cpu_backend, device_backend
    m = random_model()
    ref, dev = m.weights(cpu_backend()), m.weights(device_backend("torch", "cpu"))
    assert all(ref[k].data_ptr() != dev[k].data_ptr() for k in ref)


# -- 5. sizes before memory, arguments once ------------------------------------------------------------
def test_config_declaring_ten_million_layers_is_refused_at_once(folder):
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_hidden_layers"] = 10 ** 7
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="num_hidden_layers"):
        load_model(folder)


def test_gguf_header_with_a_huge_array_is_refused(tmp_path):
    import struct
    p = tmp_path / "x.gguf"
    key = b"tokenizer.ggml.scores"
    p.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                  + struct.pack("<IIQ", 9, 6, 2 ** 40) + b"\0" * 64)
    with pytest.raises(CheckpointError, match="array of"):
        load_model(p)


def test_run_that_does_not_fit_is_refused_with_the_figure_and_a_setting_that_fits():
    cfg = random_model().config
    with pytest.raises(MambaDebugError, match=r"GB.*--n-seqs \d+"):
        check_host_memory(cfg, RunSettings(n_seqs=5000), 40, available=1.5e9)   # ~1.6 GB: logits and metrics


def test_host_estimate_splits_the_ubatch_over_the_sequences():
    """-ub counts tokens across the sequences (llama.cpp's equal split): 4 sequences at -ub 32 or 35 hold 8 tokens
    each in a ubatch, the same memory; at -ub 36, 9 each."""
    from mamba_debug.budget import host_bytes
    cfg = random_model().config
    est = lambda ub: host_bytes(cfg, RunSettings(ubatch=ub, n_seqs=4).validated(cfg), 40)  # noqa: E731
    assert est(32) == est(35) < est(36)


def test_a_parallel_sweep_starts_no_more_workers_than_the_memory_holds(folder, monkeypatch, capsys):
    """Each worker loads its own copy of the model: with memory for two, an auto sweep starts two and says why; with
    room for none beside the parent, one (judged by the run's own check)."""
    import mamba_debug.budget as budget
    from mamba_debug.io import load_model
    from mamba_debug.sweep import auto_workers
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    model = load_model(folder)
    largest = RunSettings(ubatch=32, device="cpu", capture="metrics")
    one = budget.host_bytes(model.config, largest.validated(model.config), 40) + 8 * sum(
        v.numel() for v in {id(v): v for v in model.params.values()}.values())
    for room, expected in ((10 * one, 4), (2.6 * one / 0.8, 2), (0.5 * one, 1)):
        monkeypatch.setattr(budget, "_available_host_bytes", lambda room=room: room)
        assert auto_workers(model, "cpu", largest, 40) == expected
        err = capsys.readouterr().err
        assert (f"{expected} worker process(es), not 4" in err) == (expected < 4)
    assert auto_workers(model, "cpu") == 4                  # no cell given: the cores


def test_loaded_weights_are_not_counted_twice_against_the_memory_left():
    """A 2.8B model loaded on a 64 GB host (23 GB of float64 masters, ~39 GB left) with the reference on the CPU and
    the device on a GPU: the run adds ~18 GB at ubatch 16 and fits. Counting the resident masters again (and the tied
    head twice) refused it at every ubatch; ubatch 512 (~144 GB of sites) is still refused, naming one that fits."""
    from mamba_debug.config import MambaConfig
    cfg = MambaConfig(d_model=2560, n_layer=64, d_inner=5120, d_state=16, d_conv=4, dt_rank=160, vocab_size=50280)
    check_host_memory(cfg, RunSettings(ubatch=16, device="cuda"), 2052, available=39e9)
    with pytest.raises(MambaDebugError, match=r"more memory .* --ubatch (16|32)\b"):
        check_host_memory(cfg, RunSettings(ubatch=512, device="cuda"), 2052, available=39e9)


def test_a_comparison_hands_the_freed_heap_back_and_a_sweep_cell_does_not(monkeypatch):
    """What glibc keeps of a run's freed blocks is given back when a comparison ends (else the next run's host check
    counts it as used); a sweep's cells keep it, since the next cell reuses it."""
    import mamba_debug.compare as compare
    calls = []
    monkeypatch.setattr(compare, "give_back_freed_heap", lambda: calls.append(1))
    m, s = random_model(), RunSettings(ubatch=4, device="cpu", capture="metrics")
    run_compare(m, [1, 2, 3, 4, 5], s)
    assert calls == [1]
    run_compare(m, [1, 2, 3, 4, 5], s, ref_cache={})
    assert calls == [1]


@pytest.mark.skipif(not hasattr(__import__("ctypes").CDLL(None), "malloc_trim"), reason="glibc's malloc_trim")
def test_freed_heap_is_given_back_to_the_system():
    """4000 freed 64 KB blocks below a live one (so the heap's top cannot shrink): glibc keeps their ~260 MB of pages
    until they are handed back."""
    from mamba_debug.budget import give_back_freed_heap

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    give_back_freed_heap()          # what earlier tests left resident would be reused below, and not counted
    before = rss_mb()
    blocks = [torch.ones(16384) for _ in range(4000)]
    live = blocks[::16]
    del blocks
    kept = rss_mb() - before
    give_back_freed_heap()
    assert kept > 200 and rss_mb() - before < kept - 200 and len(live) == 250


@pytest.mark.parametrize("argv", [["sweep", "--ubatches", "5..2"], ["sweep", "--n-seqs-list", ","],
                                  ["compare", "--prompt", " "], ["compare", "--k-floor", "nan"],
                                  ["compare", "--layers", ","], ["compare", "--devices", "cpu,,cpu"],
                                  ["compare", "--sites", "gate,"], ["sweep", "--ubatches", "1,,2"]])
def test_empty_reversed_or_nan_arguments_are_exit_2(folder, capsys, argv):
    with pytest.raises(SystemExit) as e:
        rc = cli.main(argv[:1] + ["--model", str(folder)] + argv[1:] + ["--device", "cpu"])
        raise SystemExit(rc)
    assert e.value.code == 2


@pytest.mark.parametrize("command", ["generate", "compare"])
def test_n_gen_over_the_cap_is_refused_naming_the_flag_and_the_limit(folder, capsys, monkeypatch, command):
    import mamba_debug.io
    from mamba_debug.settings_checks import N_GEN_MAX
    monkeypatch.setattr(mamba_debug.io, "load_model", lambda *a: pytest.fail("loaded the model before refusing"))
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--model", str(folder), "--n-gen", str(10 ** 9)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--n-gen" in err and str(N_GEN_MAX) in err and "Traceback" not in err
    with pytest.raises(MambaDebugError, match=f"n_gen.*{N_GEN_MAX}"):
        RunSettings(n_gen=N_GEN_MAX + 1).validated(random_model().config)
    with pytest.raises(MambaDebugError, match=f"n_gen.*{N_GEN_MAX}"):
        random_model().generate(torch.tensor([[1, 2]]), N_GEN_MAX + 1)


def test_offload_beyond_the_layers_means_everything(folder):
    m = load_model(folder)
    s = RunSettings(offload=99).validated(m.config)
    p = s.placement(m.config.n_layer)
    assert p.first_device_layer == 0 and p.head_on_device and not math.isnan(s.k_floor)


# -- 5. model folders and trace files --------------------------------------------------------------------
def test_stray_second_weights_file_is_never_mixed_in(folder):
    from safetensors.torch import save_file
    save_file({"backbone.embeddings.weight": torch.zeros(61, 32)}, str(folder / "zz-other.safetensors"))
    (folder / "README.md").write_text("hello")
    m = load_model(folder)                                   # model.safetensors is the weights; the rest ignored
    assert m.params["embed"].abs().sum() > 0
    (folder / "model.safetensors").rename(folder / "a.safetensors")
    with pytest.raises(CheckpointError, match="a.safetensors.*zz-other.safetensors"):
        load_model(folder)


def test_a_save_over_another_checkpoint_is_refused_and_the_single_file_wins_over_an_old_index(tmp_path):
    """A sharded checkpoint's index and shards left in the folder were read back instead of the model.safetensors
    save_hf had just written (transformers reads the single file first); a tokenizer-less model saved over a folder
    with a tokenizer.json came back with that tokenizer."""
    from safetensors.torch import load_file, save_file
    old, new = random_model(n_layer=2, seed=1), random_model(n_layer=2, seed=2)
    folder = save_hf(old, tmp_path / "m")
    sd = load_file(str(folder / "model.safetensors"))
    save_file(sd, str(folder / "model-00001-of-00001.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model-00001-of-00001.safetensors" for k in sd}}))
    with pytest.raises(MambaDebugError, match="holds model-00001-of-00001.safetensors, model.safetensors.index.json "
                                              "of another checkpoint"):
        save_hf(new, folder)
    save_hf(new, tmp_path / "n")                                           # an ordinary save, then an old index
    for name in ("model.safetensors.index.json", "model-00001-of-00001.safetensors"):
        (folder / name).rename(tmp_path / "n" / name)
    torch.testing.assert_close(load_model(tmp_path / "n").params["embed"], new.params["embed"].double())
    (folder / "tokenizer.json").write_text("{}")
    new.tokenizer = None
    with pytest.raises(MambaDebugError, match="holds tokenizer.json of another checkpoint"):
        save_hf(new, folder)


def test_extra_layer_in_the_checkpoint_is_refused(tmp_path):
    save_hf(random_model(n_layer=3), tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["num_hidden_layers"] = 2
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="layer"):
        load_model(tmp_path / "m")


def test_trace_with_unknown_keys_or_contradicting_metadata_is_refused(tmp_path, folder, capsys):
    from safetensors import safe_open
    from safetensors.torch import save_file
    trace = tmp_path / "t.safetensors"
    assert _run(capsys, "compare", "--model", folder, "--trace", trace, *FAST)[0] in (0, 1)
    with safe_open(str(trace), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    meta = json.loads(header["result"])
    for change in ({"surprise": 1}, {"n_prompt": 10 ** 6}, {"layer_sites": meta["layer_sites"][:1]}):
        bad = tmp_path / "bad.safetensors"
        save_file(tensors, str(bad), metadata={**header, "result": json.dumps({**meta, **change})})
        rc, _, err = _run(capsys, "show", bad)
        assert rc == 2 and "bad.safetensors" in err, (change, err)


# -- 6. interrupts keep work and lose none ---------------------------------------------------------------
def test_interrupted_sweep_keeps_finished_cells_apart_and_exits_130(tmp_path, folder, capsys, monkeypatch):
    import mamba_debug.sweep as sweep
    real, calls = sweep.run_compare, []

    def stop_on_third(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(sweep, "run_compare", stop_on_third)
    out = tmp_path / "sw.json"
    out.write_text("previous")
    rc, _, err = _run(capsys, "sweep", "--model", folder, "--workers", 1, "--ubatches", "1,2", "--json", out, *FAST)
    partial = json.loads((tmp_path / "sw.incomplete.json").read_text())
    assert rc == 130 and out.read_text() == "previous" and "sw.incomplete.json" in err
    assert partial["incomplete"] and partial["cells_done"] >= 2 and partial["cells_done"] < partial["cells_total"]
    assert partial["cells_done"] + len(partial["not_run"]) == partial["cells_total"]
    assert sum(line.startswith("mamba-debug:") for line in err.splitlines()) == 1      # beside the progress bar


def test_interrupted_bisect_keeps_its_runs_and_the_bracket_and_exits_130(tmp_path, folder, capsys, monkeypatch):
    import mamba_debug.sweep as sweep
    real, calls = sweep.run_compare, []

    def stop_on_second(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)
    monkeypatch.setattr(sweep, "run_compare", stop_on_second)
    wrong = _plugin(tmp_path, "OPS = {'silu': lambda x: F.silu(x) * 1.01}\n")      # diverges wherever it runs
    out = tmp_path / "b.json"
    out.write_text("previous")
    rc, so, err = _run(capsys, "bisect", "--model", folder, "--kernels", wrong, "--json", out, *FAST)
    partial = json.loads((tmp_path / "b.incomplete.json").read_text())
    assert rc == 130 and out.read_text() == "previous" and "b.incomplete.json" in err and "1 run(s)" in err
    assert partial["incomplete"] and partial["runs_done"] == 1 and partial["runs"][0]["offload"] == 3
    assert (partial["clean_offload"], partial["diverging_offload"], partial["not_run"]) == (0, 3, [1, 2])
    assert "one of 1..3" in so


def test_sigterm_in_compare_exits_130_and_leaves_the_outputs_as_they_were(tmp_path, folder, capsys):
    plug = _plugin(tmp_path, "import os, signal\n"
                             "def silu(x):\n    os.kill(os.getpid(), signal.SIGTERM)\n    return F.silu(x)\n"
                             "OPS = {'silu': silu}\n")
    outs = {flag: tmp_path / f"out{flag[2:]}" for flag in ("--json", "--trace", "--report")}
    for p in outs.values():
        p.write_text("previous")
    before = sorted(os.listdir(tmp_path))
    rc, _, err = _run(capsys, "compare", "--model", folder, "--kernels", plug,
                      *[x for flag, p in outs.items() for x in (flag, p)], *FAST)
    assert rc == 130 and "interrupted (SIGTERM)" in err and err.count("\n") == 1, err
    assert all(p.read_text() == "previous" for p in outs.values()) and sorted(os.listdir(tmp_path)) == before


def test_interrupt_while_writing_the_trace_keeps_the_old_trace_and_no_temporary(tmp_path, folder, capsys,
                                                                                monkeypatch):
    import safetensors.torch

    def half_then_interrupt(tensors, filename, metadata=None):
        open(filename, "wb").write(b"half a trace")
        raise KeyboardInterrupt
    monkeypatch.setattr(safetensors.torch, "save_file", half_then_interrupt)
    js, trace = tmp_path / "r.json", tmp_path / "t.safetensors"
    js.write_text("previous")
    trace.write_text("previous")
    rc, _, err = _run(capsys, "compare", "--model", folder, "--json", js, "--trace", trace, *FAST)
    assert rc == 130 and "interrupted (Ctrl-C)" in err
    assert json.loads(js.read_text())["config"] and trace.read_text() == "previous"   # the json was finished first
    assert sorted(os.listdir(tmp_path)) == ["m", "r.json", "t.safetensors"]


def test_sigterm_stops_a_parallel_sweep_within_seconds(tmp_path, folder):
    import signal
    import subprocess
    import sys
    import time
    out = tmp_path / "sw.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    # long enough to outlast the wait below on a fast machine (a 5-token prompt's 72 cells once took 2 s, a 40-token
    # prompt's 120 cells 2.6 s under CI, and the signal then met a process already exiting: -15, not 130)
    prompt = " ".join(str(i % 50 + 1) for i in range(200))
    p = subprocess.Popen([sys.executable, "-m", "mamba_debug", "sweep", "--model", str(folder), "--workers", "2",
                          "--ubatches", "1..40", "--json", str(out), "--prompt", prompt, "--n-gen", "1",
                          "--device", "cpu"], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60            # wait for the workers (two spawned children), then let them run
    while time.time() < deadline and p.poll() is None and len(
            subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()) < 2:
        time.sleep(0.2)
    time.sleep(3)
    assert p.poll() is None, "the sweep ended before the signal; make it longer"
    workers = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=30)
    time.sleep(1)
    alive = [w for w in workers if os.path.exists(f"/proc/{w}") and open(f"/proc/{w}/stat").read().split()[2] != "Z"]
    assert not alive, f"workers {alive} still running"
    assert p.returncode == 130 and time.time() - t0 < 20 and "Traceback" not in err, err
    assert not out.exists() and (tmp_path / "sw.incomplete.json").exists()


def test_output_that_is_a_folder_is_refused_before_the_run(folder, capsys, monkeypatch):
    import mamba_debug.compare as compare
    monkeypatch.setattr(compare, "run_compare", lambda *a, **k: pytest.fail("ran before refusing"))
    rc, _, err = _run(capsys, "compare", "--model", folder, "--json", folder.parent, *FAST)
    assert rc == 2 and "folder" in err


@pytest.mark.parametrize("flag, name", [("--json", "r.json"), ("--trace", "t.safetensors"), ("--report", "r.html")])
def test_an_output_that_is_a_pipe_or_a_link_is_written_through_not_replaced(tmp_path, folder, capsys, flag, name):
    """A FIFO (as /dev/null is a device) was replaced by a regular file by the rename of an atomic write (as root,
    `--trace /dev/null` replaced the device node); a symbolic link was replaced by the file it pointed to."""
    import stat
    import threading
    fifo = tmp_path / f"pipe.{name}"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()), daemon=True)
    reader.start()
    rc, _, err = _run(capsys, "compare", "--model", folder, flag, fifo, *FAST)
    reader.join(timeout=60)
    assert rc in (0, 1), err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and got and len(got[0]) > 100
    target, link = tmp_path / name, tmp_path / f"link.{name}"
    link.symlink_to(target)
    rc, _, err = _run(capsys, "compare", "--model", folder, flag, link, *FAST)
    assert rc in (0, 1) and link.is_symlink() and target.stat().st_size > 100, err


def test_export_case_into_a_file_is_refused_naming_it(tmp_path, folder, capsys):
    f = tmp_path / "afile"
    f.write_text("kept")
    rc, _, err = _run(capsys, "export-case", "--model", folder, "--out", f, *FAST)
    assert rc == 2 and f"--out {f} is a file; export-case writes three files into a folder" in err
    assert f.read_text() == "kept"


def test_sweep_far_past_the_layers_says_which_offloads_share_a_run_in_one_clause(folder, capsys):
    rc, out, _ = _run(capsys, "sweep", "--model", folder, "--offloads", "0..40", "--ubatches", "2", "--workers", "1",
                      "--kernels", "torch", *FAST)
    last = out.strip().splitlines()[-1]
    assert rc == 0 and last.count("the run of offload") == 1 and "offloads 2, 4..40 are the run of offload 3" in last


def test_export_gguf_into_a_pipe_is_refused_and_the_pipe_kept(tmp_path, folder, capsys):
    """The GGUF is read back to describe it, which a pipe or /dev/null cannot give (an 'Invalid argument' before)."""
    import stat
    fifo = tmp_path / "m.gguf"
    os.mkfifo(fifo)
    rc, _, err = _run(capsys, "export-gguf", "--model", folder, "--out", fifo)
    assert rc == 2 and "is a device or a pipe; export-gguf reads the GGUF back" in err
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_two_outputs_into_dev_null_run_and_two_into_one_file_are_refused(tmp_path, folder, capsys):
    """`--json /dev/null --trace /dev/null` (keep only the exit code and the printed report) was refused as two
    outputs naming one file; a device takes both. Two outputs into one regular file are still refused."""
    import stat
    rc, out, err = _run(capsys, "compare", "--model", folder, "--json", "/dev/null", "--trace", "/dev/null", *FAST)
    assert rc in (0, 1) and "both name" not in err and out.strip(), err
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    f = tmp_path / "r.json"
    rc, _, err = _run(capsys, "compare", "--model", folder, "--json", f, "--trace", f, *FAST)
    assert rc == 2 and f"--json and --trace both name {f}" in err and not f.exists()


def test_json_dash_writes_the_json_alone_to_stdout_and_the_summary_to_stderr(tmp_path, folder, capsys, monkeypatch):
    """`--json -` wrote a file named '-' in the working folder; now `mamba-debug compare --json - | jq` works (every
    command with --json), and `--trace -` / `--report -` are refused naming the flag."""
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(capsys, "compare", "--model", folder, "--json", "-", *FAST)
    assert rc in (0, 1) and json.loads(out)["verdict"] and "verdict" in err and "json      -" in err
    rc, out, err = _run(capsys, "sweep", "--model", folder, "--offloads", "0", "--ubatches", "2", "--workers", "1",
                        "--json", "-", *FAST)
    assert rc in (0, 1) and len(json.loads(out)["cells"]) == 1, err
    for command, flag in (("compare", "--trace"), ("compare", "--report"), ("export-gguf", "--out"),
                          ("export-case", "--out")):
        with pytest.raises(SystemExit) as stop:
            cli.main([command, "--model", str(folder), flag, "-"])
        assert stop.value.code == 2 and f"{flag} -: only --json can go to stdout" in capsys.readouterr().err
    assert not (tmp_path / "-").exists()
