"""The second opinion (mamba_debug/second_opinion.py): a borderline first divergence re-judged against two more
float32 samples of the floor, from copies of the model whose float32 weights moved one ulp.

The false alarm it answers (research/threshold_conditioning): the shipped Triton kernels, 5 sequences, offload 12,
one ubatch read DIVERGED at a fresh sequence's first `y_scan` whose C . B nearly cancels (1.5x its threshold on the
recording machine). A 1e-4 bug in y stays where it is."""
from __future__ import annotations

import json

import pytest
import torch

import mamba_debug as md
from mamba_debug import compare, second_opinion
from mamba_debug.views.summary import summary, to_json

CANCELLING = " with you; but I scorn to accept a hand while the heart was another"
BUG = '''"""ssm_scan whose y is off by a relative 1e-4 (the state is right)."""
from mamba_debug.ops import ssm_scan as _ref
def ssm_scan(s, x, dt, A, B, C, *, states_out=None):
    y, h = _ref(s, x, dt, A, B, C, states_out=states_out)
    return y * (1 + 1e-4), h
OPS = {"ssm_scan": ssm_scan}
'''


@pytest.fixture(scope="module")
def model():
    return md.load_model()


@pytest.fixture(scope="module")
def small_bug(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugin") / "bug_y_1e4.py"
    path.write_text(BUG)
    return str(path)


def bug_run(model, small_bug, **kw):
    ids = model.encode("The quick brown fox jumps over the lazy dog and then some more words follow here.")
    return md.run_compare(model, ids, md.RunSettings(kernels=small_bug, offload=11, **kw))


def test_a_cancelling_first_token_reads_as_rounding(model):
    """Correct kernels are clean whatever this CPU's rounding; where the first sample made it a divergence (it did
    on the recording machine, at token 0, seq 1, layer 9 'y_scan'), the second opinion says so and overrules it."""
    res = md.run_compare(model, model.encode(CANCELLING), md.RunSettings(n_seqs=5, offload=12, n_gen=0, ubatch=512))
    assert res.first_divergence is None, md.verdict(res)
    so = res.second_opinion
    if so is not None:
        assert so["taken"] and not so["confirmed"]
        assert "second opinion" in md.verdict(res)
        assert "rounding at an ill-conditioned token" in summary(res)


def test_a_small_real_bug_is_confirmed_where_it_was(model, small_bug):
    res = bug_run(model, small_bug, n_gen=2)
    so = res.second_opinion
    assert so is not None and so["taken"] and so["confirmed"]
    before, now = so["first_divergence_before"], res.first_divergence
    assert (now["token"], now["seq"], now["layer"], now["site"]) == \
           (before["token"], before["seq"], before["layer"], before["site"])
    assert now["threshold"] >= before["threshold"]            # the largest of three samples
    assert "confirmed against 2 more float32 samples" in summary(res)
    assert md.verdict(res).endswith("(past 3 float32 samples of the floor: a second opinion)")   # the dashboard's line
    j = json.loads(json.dumps(to_json(res)))
    assert j["second_opinion"]["confirmed"] is True and j["second_opinion"]["seeds"] == list(second_opinion.SEEDS)


def test_far_past_the_threshold_no_second_opinion_runs(model, monkeypatch):
    called = []
    monkeypatch.setattr(second_opinion, "nudged", lambda *a: called.append(a))
    ids = model.encode("The quick brown fox")
    res = md.run_compare(model, ids, md.RunSettings(kernels="bug_strided_gate", offload=6, ubatch=8))
    assert res.first_divergence["error"] > second_opinion.SECOND_OPINION_BELOW * res.first_divergence["threshold"]
    assert res.second_opinion is None and not called and "second_opinion" not in to_json(res)


def test_nudged_moves_each_float32_weight_one_ulp(model):
    a, b = second_opinion.nudged(model, 1), second_opinion.nudged(model, 1)
    away = nonzero = 0
    for k, v in model.params.items():
        n = a.params[k]
        assert torch.equal(n, b.params[k])                   # the same seed, the same moves
        w = v.to(torch.float32)
        if not torch.equal(w.double(), v):                   # not float32 values (A): moved by 2^-24 in float64
            rel = (n / v - 1).abs()[v != 0]
            assert n.dtype == v.dtype and torch.allclose(rel, torch.full_like(rel, 2.0**-24), rtol=1e-6, atol=0)
            continue
        assert n.dtype == torch.float32 and n.shape == v.shape
        up, down = torch.nextafter(w, torch.tensor(float("inf"))), torch.nextafter(w, torch.tensor(float("-inf")))
        assert bool(((n == up) | (n == down) | ((w == 0) & (n == 0))).all())
        away += int((n.abs() > w.abs()).sum())
        nonzero += int((w != 0).sum())
    assert 0.45 * nonzero < away < 0.55 * nonzero             # about half move away from zero
    assert not torch.equal(second_opinion.nudged(model, 2).params["embed"], a.params["embed"])
    ties = {k for k, v in model.params.items() if any(v is w for j, w in model.params.items() if j != k)}
    for k in ties:
        assert any(a.params[k] is a.params[j] for j in ties if j != k)
    assert md.load_model().params["embed"].equal(model.params["embed"])     # the model itself untouched


@pytest.mark.parametrize("name", [None, "tiny-granite-hybrid"])
def test_float32_masters_give_the_float64_masters_floors(name):
    """The nudged copy keeps its moved masters as float32 tensors: every back-end reads the same values as from
    float64 masters of those values, so a sample's floors are the same bits (NaN where a state was not captured)."""
    m = md.load_model(name) if name else md.load_model()
    a = second_opinion.nudged(m, 1)
    b = md.Model(m.config, {k: v.double() for k, v in a.params.items()}, m.tokenizer)
    s = md.RunSettings(n_seqs=2, n_gen=2, capture="metrics", offload=0, ubatch=6)
    ids = m.encode("The quick brown fox jumps over the lazy dog")
    fa, fb = md.run_compare(a, ids, s).floor, md.run_compare(b, ids, s).floor
    assert all(torch.equal(torch.nan_to_num(fa[k], nan=-1.0), torch.nan_to_num(fb[k], nan=-1.0)) for k in fa)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_nudging_on_a_gpu_moves_the_same_bits(model):
    """With the references on a GPU the moved masters are made there, from their float32 copy, and stay there: the
    same values as moved on the host, and the same floors."""
    cuda = torch.device("cuda")
    on_gpu, here = second_opinion.nudged(model, 1, cuda), second_opinion.nudged(model, 1)
    for k, v in here.params.items():
        assert torch.equal(on_gpu.params[k].cpu(), v), k
    s = md.RunSettings(n_seqs=2, n_gen=2, capture="metrics", offload=0, ubatch=6, ref_device="cuda")
    ids = model.encode("The quick brown fox jumps over the lazy dog")
    fa, fb = md.run_compare(on_gpu, ids, s).floor, md.run_compare(here, ids, s).floor
    assert all(torch.equal(torch.nan_to_num(fa[k], nan=-1.0), torch.nan_to_num(fb[k], nan=-1.0)) for k in fa)


def test_moved_values_at_the_edges():
    v = torch.tensor([0.0, -0.0, 3.4028234663852886e38, -3.4028234663852886e38, 1e-45, 1.5, -2.0]).double()
    for seed in second_opinion.SEEDS:
        m = second_opinion._moved(v, seed)
        assert bool(torch.isfinite(m).all()) and m[0] == 0 and m[1] == 0
        w = v.float()
        up, down = torch.nextafter(w, torch.tensor(float("inf"))), torch.nextafter(w, torch.tensor(float("-inf")))
        moved = (m == up) | (m == down)
        assert bool(moved[4:].all()) and bool((moved | (m == w))[2:4].all())    # the largest stays or moves in
    wide = torch.tensor([0.1, -3.0e-3, 0.0], dtype=torch.float64)          # not float32 values
    moved = second_opinion._moved(wide, 1)
    rel = (moved / wide - 1).abs()[:2]
    assert moved.dtype == torch.float64 and torch.allclose(rel, torch.full_like(rel, 2.0**-24), rtol=1e-6, atol=0)
    assert moved[2] == 0


def test_weights_built_in_float64_are_moved_too(model, small_bug):
    """A model whose weights are not float32 values (md.build_model from float64 tensors, an edit in place): the
    samples differ from the first run's (nothing moved made both samples that run again, 'confirmed' by itself)."""
    g = torch.Generator().manual_seed(0)
    wide = md.Model(model.config, {k: v * (1 + 1e-9 * torch.randn(v.shape, generator=g, dtype=v.dtype))
                                   for k, v in model.params.items()}, model.tokenizer)
    a = second_opinion.nudged(wide, 1)
    assert all(not torch.equal(a.params[k], v) for k, v in wide.params.items() if v.abs().sum() > 0)
    res = bug_run(wide, small_bug)
    assert res.second_opinion["taken"]
    before = res.second_opinion["first_divergence_before"]
    assert any(res.thresholds[k] > before["threshold"] for k in [(before["layer"], before["site"])])


def test_more_samples_never_lower_a_threshold(model, small_bug):
    """A token whose larger sample crosses OUTLIER x its site's median leaves the site's level: the threshold of
    the other tokens must not fall for it."""
    from mamba_debug.trace import OUTLIER
    res = bug_run(model, small_bug)
    first = dict(res.thresholds)
    res.thresholds, res.first_divergence = dict(first), res.second_opinion["first_divergence_before"]
    key = (1, "y_scan")
    f = res.floor[key]
    sample = {k: v.clone() for k, v in res.floor.items()}
    level_token = torch.nonzero(f == f.max())[0]
    sample[key][tuple(level_token)] = 10 * OUTLIER * float(f.median())      # the level's token, now an outlier
    second_opinion.merge(res, [sample, sample])
    assert all(res.thresholds[k] >= first[k] for k in first)


def test_the_samples_run_the_first_runs_tokens(model, small_bug, monkeypatch):
    """Generated tokens of the nudged runs are the first run's (forced), not their own references' choices."""
    seen = []
    real = compare._run_sides

    def spy(*a, **kw):
        out = real(*a, **kw)
        seen.append(out.tokens.clone())
        return out
    monkeypatch.setattr(compare, "_run_sides", spy)
    ids = model.encode("The quick brown fox jumps")
    s = md.RunSettings(kernels=small_bug, offload=11, n_gen=3).validated(model.config)
    prompts = torch.tensor([ids])
    fed = torch.cat([prompts, torch.tensor([[7, 8, 9]])], 1)           # not what any reference would pick
    floors = compare._nudged_floors(model, 1, s, prompts, fed, None)
    assert torch.equal(seen[-1], fed)
    assert all(f.shape == (1, fed.shape[1]) for f in floors.values())


def test_a_sweep_takes_its_samples_once(model, small_bug, monkeypatch):
    made = []
    real = second_opinion.nudged
    monkeypatch.setattr(second_opinion, "nudged",
                        lambda m, seed, device=None: made.append(seed) or real(m, seed, device))
    ids = model.encode("The quick brown fox jumps over the lazy dog")
    cache: dict = {}
    for offload in (11, 12):
        res = md.run_compare(model, ids, md.RunSettings(kernels=small_bug, offload=offload), ref_cache=cache)
        assert res.second_opinion["taken"]
    assert made == list(second_opinion.SEEDS)


def test_not_taken_when_the_copy_does_not_fit(model, small_bug, monkeypatch):
    monkeypatch.setattr(second_opinion, "available_host_bytes", lambda: 1e6)
    res = bug_run(model, small_bug)
    so = res.second_opinion
    assert so["taken"] is False and "host memory" in so["why"]
    assert res.first_divergence == so["first_divergence_before"]             # the first answer stands
    assert "second opinion not taken" in summary(res)
    assert md.verdict(res).endswith("(a second opinion was not taken)")


def test_a_trace_keeps_the_second_opinion(model, small_bug, tmp_path):
    res = bug_run(model, small_bug, capture="metrics")
    back = md.load_trace(md.save_trace(res, tmp_path / "t.safetensors"))
    assert back.second_opinion == json.loads(json.dumps(res.second_opinion))
    assert back.first_divergence == res.first_divergence and back.thresholds == res.thresholds


def test_a_damaged_second_opinion_is_refused_naming_the_file(model, small_bug, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file
    path = md.save_trace(bug_run(model, small_bug, capture="metrics"), tmp_path / "t.safetensors")
    with safe_open(str(path), framework="pt") as f:
        header, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    meta = json.loads(header["result"])
    del meta["second_opinion"]["first_divergence_before"]["site"]
    save_file(tensors, str(path), metadata={**header, "result": json.dumps(meta)})
    with pytest.raises(md.MambaDebugError, match="second opinion is not as written"):
        md.load_trace(path)


def test_groups_of_sequences_get_their_samples(model, small_bug):
    """-ub + 1 < n_seqs: groups of sequences run one after another; the nudged runs follow the same groups."""
    res = bug_run(model, small_bug, n_seqs=3, ubatch=1, n_gen=1)
    assert res.settings.seq_groups(3) != [(0, 3)]
    assert res.second_opinion["taken"] and res.second_opinion["confirmed"]
    assert all(f.shape == (3, res.tokens.shape[1]) for f in res.floor.values())


def test_a_sweep_cell_says_its_second_opinion(model, small_bug):
    """The matrix marks a divergence that stood past a second opinion (the cells show no verdict text)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mamba_debug.views.sweep_matrix import sweep_matrix
    ids = model.encode("The quick brown fox jumps over the lazy dog")
    sweep = md.run_sweep(model, ids, md.RunSettings(kernels=small_bug), offloads=[0, 11], ubatches=[512],
                         progress=False)
    by = {c["offload"]: c for c in sweep["cells"]}
    assert "second_opinion" not in by[0] and by[11]["second_opinion"] == "confirmed"
    fig, ax = plt.subplots()
    sweep_matrix(sweep, ax)
    texts = [t.get_text() for t in ax.texts]
    assert any(t.split("\n")[0].endswith("*") for t in texts) and "second opinion" in ax.get_title()
    plt.close(fig)


CHUNKED = '''"""Mamba-2's scan in mamba_ssm's chunked SSD form (cumsum of dA, exp of its differences), float32."""
from mamba_debug.ops import ssd_scan_chunked
SSD_CHUNK = 64
def ssd_scan(s, x, dt, A, B, C, *, states_out=None):
    return ssd_scan_chunked(s, x, dt, A, B, C, chunk_size=SSD_CHUNK, states_out=states_out)
OPS = {"ssd_scan": ssd_scan}
'''


def m2_run(tmp_path, source, name="tiny-granite-hybrid"):
    """A Mamba-2 model (the hybrid by default) compared with the plug-in `source`: 256 tokens, one ubatch."""
    m = md.load_model(name)
    plugin = tmp_path / "plugin.py"
    plugin.write_text(source)
    ids = m.encode((md.io.DATA_DIR / "tiny-mamba" / "val.txt").read_text()[:200000])[:256]
    return md.run_compare(m, ids, md.RunSettings(kernels=str(plugin), offload=m.config.n_layer, ubatch=512, n_gen=0))


def test_mamba_ssms_chunked_scan_reads_as_rounding_when_its_plugin_says_so(tmp_path):
    """The chunked SSD form errs several times the sequential scan at a long ubatch (a legitimate float32 order): it
    read DIVERGED at token 55 (1.1-1.4x its threshold) with sequential samples alone. A plug-in declaring
    SSD_CHUNK has its last sample's float32 reference scan so, and the floor covers both orders."""
    res = m2_run(tmp_path, CHUNKED)
    assert res.first_divergence is None, md.verdict(res)
    so = res.second_opinion
    assert so is not None and so["taken"] and so["chunked_ssd"] == 64
    assert "chunked SSD form, Q=64, as the plug-in declares" in summary(res)


def test_undeclared_the_samples_stay_sequential_and_the_summary_says_how_to_declare(tmp_path):
    """Not declared: the same run keeps its divergence (the sequential samples' sensitivity: a chunked sample
    raises y's thresholds ~2.5x) and the summary names SSD_CHUNK."""
    res = m2_run(tmp_path, CHUNKED.replace("SSD_CHUNK = 64", "Q = 64").replace("chunk_size=SSD_CHUNK",
                                                                                   "chunk_size=Q"))
    so = res.second_opinion
    assert so is not None and so["taken"] and so["chunked_ssd"] is None
    if so["confirmed"]:
        assert "declares SSD_CHUNK" in summary(res)


def test_only_a_mamba2_models_declared_last_sample_is_chunked(model):
    m2 = md.load_model("tiny-mamba2").config
    assert [second_opinion.ssd_chunk(m2, s, 64) for s in second_opinion.SEEDS] == [None, 64]
    assert [second_opinion.ssd_chunk(m2, s, None) for s in second_opinion.SEEDS] == [None, None]
    assert [second_opinion.ssd_chunk(model.config, s, 64) for s in second_opinion.SEEDS] == [None, None]


@pytest.mark.parametrize("value", ["64", 0, True, 6.4])
def test_a_bad_ssd_chunk_is_refused_naming_the_plugin(tmp_path, value):
    plugin = tmp_path / "bad_chunk.py"
    plugin.write_text(CHUNKED.replace("SSD_CHUNK = 64", f"SSD_CHUNK = {value!r}").replace("chunk_size=SSD_CHUNK",
                                                                                         "chunk_size=64"))
    with pytest.raises(md.MambaDebugError, match="bad_chunk.py: SSD_CHUNK"):
        md.load_kernels(str(plugin))


def test_a_small_mamba2_bug_stands_past_the_chunked_sample(tmp_path):
    """y off by 3e-5 in Mamba-2's scan, declared chunked: still found at layer 0's y_scan, token 0."""
    res = m2_run(tmp_path, BUG.replace("ssm_scan", "ssd_scan").replace("1e-4", "3e-5") + "SSD_CHUNK = 64\n",
                 name="tiny-mamba2")
    fd, so = res.first_divergence, res.second_opinion
    assert so["taken"] and so["confirmed"] and so["chunked_ssd"] == 64
    assert (fd["token"], fd["layer"], fd["site"]) == (0, 0, "y_scan") and fd["error"] > 1.2 * fd["threshold"]
