"""export-case: the calls it records are the ones the failing run made (a group of sequences' own ubatches, the output
head's ops), and its replay has a float64 reference for every op a plug-in may override (Mamba-2 and hybrids too).
A group's own ubatches also survive a saved trace and reach the views."""
from __future__ import annotations

import pytest

from mamba_debug.errors import MambaDebugError
from mamba_debug.export import export_case, replay_case
from mamba_debug.settings import RunSettings

from conftest import random_model
from test_mamba2 import hybrid_model, mamba2_model

PROMPT = [(11 * i + 5) % 53 for i in range(12)]

WRONG = '''
from mamba_debug import ops
def {op}(*args, **kwargs):
    out = ops.{op}(*args, **kwargs)
    return (1.5 * out[0], out[1]) if isinstance(out, tuple) else 1.5 * out
OPS = {{"{op}": {op}}}
'''
RIGHT = '''
from mamba_debug import ops
OPS = {{"{op}": ops.{op}}}
'''


def _write(tmp_path, name, src):
    f = tmp_path / name
    f.write_text(src)
    return str(f)


@pytest.mark.parametrize("op, make", [("ssd_scan", mamba2_model), ("rms_norm_gated", mamba2_model),
                                      ("attention", hybrid_model)])
def test_a_mamba2_or_hybrid_op_replays_against_its_float64_reference(tmp_path, op, make):
    """The replay's references were Mamba-1's only: every Mamba-2 or hybrid case failed with KeyError: 'ssd_scan'
    (its op), a correct plug-in's as well as the bug's."""
    case = export_case(make(), PROMPT, RunSettings(device="cpu", kernels=_write(tmp_path, "bad.py", WRONG.format(op=op)),
                                                   ubatch=4, n_gen=1), tmp_path / "case")
    assert {c["op"] for c in case["calls"]} == {op}
    bad = replay_case(tmp_path / "case")
    assert bad.returncode == 1 and "NMSE" in bad.stdout, bad.stdout[-2000:]
    good = replay_case(tmp_path / "case", _write(tmp_path, "good.py", RIGHT.format(op=op)))
    assert good.returncode == 0, good.stdout[-2000:]


def test_a_case_folder_given_relative_to_the_working_directory_replays(tmp_path, monkeypatch):
    """The replay runs in the case's folder, where a relative path (the case's, or the plug-in's to replay with) was
    read from there: pytest found no file."""
    export_case(random_model(), PROMPT, RunSettings(device="cpu", ubatch=4, n_gen=1,
                                                    kernels=_write(tmp_path, "bad.py", WRONG.format(op="silu"))),
                tmp_path / "case")
    monkeypatch.chdir(tmp_path)
    r = replay_case("case")
    assert r.returncode == 1 and "NMSE" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    _write(tmp_path, "good.py", RIGHT.format(op="silu"))
    r = replay_case("case", "good.py")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


MULTI_TOKEN_SILU = '''
from mamba_debug.ops import silu as ref
def silu(x):
    y = ref(x)
    if x.shape[1] > 1:                 # wrong only where a call holds several tokens of a sequence
        y = y.clone(); y[:, 1:] += 0.5
    return y
OPS = {"silu": silu}
'''


def test_a_group_of_sequences_is_replayed_with_its_own_ubatches(tmp_path):
    """-ub 3 with 5 sequences: llama.cpp runs sequences 0-3 one token each, then sequence 4 alone three tokens at a
    time, where this plug-in fails. The case once held all five sequences one token at a time, calls the kernel
    never received, and its replay passed."""
    case = export_case(random_model(), PROMPT, RunSettings(device="cpu", ubatch=3, n_seqs=5, n_gen=1,
                                                           kernels=_write(tmp_path, "p.py", MULTI_TOKEN_SILU)),
                       tmp_path / "case")
    assert case["first_divergence"]["seq"] == 4 and case["seqs"] == [4, 5]
    assert [c["args"][0]["size"][:2] for c in case["calls"]] == [[1, 3], [1, 3]]
    r = replay_case(tmp_path / "case")
    assert r.returncode == 1 and "2 failed" in r.stdout, r.stdout[-2000:]


HEAD_LINEAR = '''
from mamba_debug.ops import linear as ref
def linear(x, w, b=None):
    y = ref(x, w, b)
    return y + 1.0 if w.shape[0] == 61 else y      # the vocab projection only
OPS = {"linear": linear}
'''


def test_a_divergence_in_the_output_head_exports_the_heads_calls(tmp_path):
    """It once exported the first device layer's calls instead, which replayed clean."""
    path = _write(tmp_path, "p.py", HEAD_LINEAR)
    case = export_case(random_model(), PROMPT, RunSettings(device="cpu", ubatch=4, n_gen=1, kernels=path),
                       tmp_path / "case")
    assert case["layer"] is None and case["first_divergence"]["site"] == "logits"
    assert [(c["op"], c["args"][1]["size"][0]) for c in case["calls"]] == [("linear", 61)]
    r = replay_case(tmp_path / "case")
    assert r.returncode == 1 and "the output head" in r.stdout, r.stdout[-2000:]


def test_a_head_on_the_host_has_no_device_op_to_export(tmp_path):
    """Device blocks whose small errors add up past the logits' threshold in a head that ran on the host."""
    res = _Diverged(site="logits")
    with pytest.raises(MambaDebugError, match="ran on the host"):
        export_case(None, None, None, tmp_path / "case", result=res)
    assert not (tmp_path / "case").exists()


class _Diverged:
    """Just what export_case reads of a result before it refuses."""

    def __init__(self, site):
        from mamba_debug.placement import Placement
        self.first_divergence = {"layer": None, "site": site, "seq": 0, "ubatch": 0}
        self.placement = Placement(4, 2)


def test_a_saved_run_of_groups_with_their_own_ubatches_reopens_with_the_same_first_divergence(tmp_path):
    """The smaller last group's schedule was restored after the first divergence was found again, which then read
    group 0's schedule: another ubatch and position than the run's."""
    from mamba_debug.compare import run_compare
    from mamba_debug.trace import load_trace, save_trace
    from mamba_debug.views import summary
    res = run_compare(random_model(), PROMPT, RunSettings(device="cpu", ubatch=3, n_seqs=5, n_gen=1,
                                                          kernels=_write(tmp_path, "p.py", MULTI_TOKEN_SILU)))
    fd = res.first_divergence
    assert (fd["seq"], fd["token"], fd["ubatch"], fd["index_in_ubatch"]) == (4, 1, 0, 1) and res.seq_token_info
    back = load_trace(save_trace(res, tmp_path / "run.safetensors"))
    assert back.first_divergence == fd and summary(back) == summary(res)
    from mamba_debug.views import to_json
    assert to_json(res)["config"]["seq_groups"] == [{"seqs": [0, 4], "ubatch_per_seq": 1},
                                                    {"seqs": [4, 5], "ubatch_per_seq": 3}]


def test_the_views_mark_each_sequences_own_ubatch_boundaries(tmp_path):
    """Sequences 0-3 ran one token a ubatch, sequence 4 three: its heatmap's boundary lines are its own."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from mamba_debug.compare import run_compare
    from mamba_debug.views.base import mark_ubatches
    res = run_compare(random_model(), PROMPT, RunSettings(device="cpu", ubatch=3, n_seqs=5, n_gen=1))
    lines = {}
    for seq in (0, 4):
        fig, ax = plt.subplots()
        mark_ubatches(ax, res, seq)
        lines[seq] = sorted(float(ln.get_xdata()[0]) for ln in ax.lines)
        plt.close(fig)
    assert lines[4] == [2.5, 5.5, 8.5, 11.5] and lines[0] == [t - 0.5 for t in range(1, 13)]


def test_a_small_real_bug_replays_as_failing(tmp_path):
    """A scan whose y is off by a relative 1e-4 (NMSE 1e-8) diverged in the run but its case passed the fixed NMSE
    limit of 1e-7: the replay's limit is now also the square of the run's threshold at the first divergence."""
    bug = _write(tmp_path, "y_1e4.py", '''
from mamba_debug import ops
def ssm_scan(*args, **kwargs):
    y, h = ops.ssm_scan(*args, **kwargs)
    return y * (1 + 1e-4), h
OPS = {"ssm_scan": ssm_scan}
''')
    import mamba_debug as md
    m = md.load_model()
    ids = m.encode("The quick brown fox jumps over the lazy dog and then some more words follow here.")
    case = export_case(m, ids, RunSettings(device="cpu", kernels=bug, offload=11, n_gen=2), tmp_path / "case")
    assert case["first_divergence"]["site"] == "y_scan"
    bad = replay_case(tmp_path / "case")
    assert bad.returncode == 1 and "NMSE" in bad.stdout, bad.stdout[-2000:]
    good = replay_case(tmp_path / "case", _write(tmp_path, "good.py", RIGHT.format(op="ssm_scan")))
    assert good.returncode == 0, good.stdout[-2000:]
