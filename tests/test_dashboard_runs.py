"""The dashboard's runs: offload n_layer and n_layer + 1 share one run where moving the head changes no bit (as a
sweep does), and the derived result is the one a run would give."""
from __future__ import annotations

import re

import pytest
import torch

from conftest import random_model

IDS = [(7 * i + 3) % 61 for i in range(10)]


def _same_numbers(a, b):
    assert a.errors.keys() == b.errors.keys()
    for key in a.errors:
        for m in a.errors[key]:
            torch.testing.assert_close(a.errors[key][m], b.errors[key][m], rtol=0, atol=0, equal_nan=True)
    for key in a.trace:
        torch.testing.assert_close(a.trace[key], b.trace[key], rtol=0, atol=0, equal_nan=True)
    for m in a.logits:
        torch.testing.assert_close(a.logits[m], b.logits[m], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kernels", ["triton", "bug_strided_gate"])
def test_offload_n_layer_and_n_layer_plus_one_share_a_run(kernels, monkeypatch):
    pytest.importorskip("ipywidgets", reason="the dashboard needs ipywidgets (requirements-lab.txt)")
    from mamba_debug.compare import run_compare
    from mamba_debug.dashboard import Dashboard, state

    model = random_model()
    L = model.config.n_layer
    dash = Dashboard(model, IDS, kernels=kernels, device="interpret", n_gen=2, offload=L, ubatch=4)
    calls = []
    real = state.run_compare
    monkeypatch.setattr(state, "run_compare", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    dash.set(offload=L + 1)
    assert dash.errors == [] and calls == [], "the head moved: the same bits, no new run"
    assert dash.timings["source"] == "same" and dash.result.timings["same_run_as"] == L
    res = dash.result
    assert res.placement.offload == L + 1 and res.placement.head_on_device and res.settings.offload == L + 1

    fresh = run_compare(model, IDS, dash.state.run)          # what a run of offload n_layer + 1 gives
    _same_numbers(res, fresh)
    assert res.first_divergence == fresh.first_divergence
    assert res.placement == fresh.placement

    dash.set(offload=L - 1)                                   # other blocks on the device: a run
    assert len(calls) == 1 and dash.timings["source"] == "run"


def test_a_new_run_reaches_the_page_status_first_then_the_views_in_screen_order(monkeypatch):
    """Each view reaches the page when it is drawn, so a new run shows its status line and text views before any
    figure, then the figures top to bottom; `first_view_ms` is when the first of them was on the page."""
    pytest.importorskip("ipywidgets", reason="the dashboard needs ipywidgets (requirements-lab.txt)")
    from mamba_debug.dashboard import Dashboard
    from mamba_debug.views import registry

    model = random_model()
    dash = Dashboard(model, IDS, kernels="bug_strided_gate", device="interpret", n_gen=2, offload=1, ubatch=4)
    shown = []
    real_png, real_status = dash.controls.show_png, dash._status_html
    monkeypatch.setattr(dash.controls, "show_png", lambda name, png: shown.append(name) or real_png(name, png))
    monkeypatch.setattr(dash, "_status_html", lambda: shown.append("status") or real_status())
    dash.set(offload=3)
    assert dash.errors == [] and dash.timings["source"] == "run"
    figures = [v.name for v in registry.VIEWS if v.kind == "figure"]
    assert shown[0] == "status" and [s for s in shown if s in figures] == figures, shown
    t = dash.timings
    assert t["run_ms"] < t["first_view_ms"] < t["update_ms"]
    assert "first view at" in dash.w_timing.value


def test_dashboard_arguments_are_refused_naming_them_not_clamped_by_a_slider():
    """offload=-1 showed offload 0 and ubatch=0 the whole prompt (the sliders clamped them); n_seqs=0 was an
    ipywidgets TraitError; an empty prompt a ValueError. numpy's integers are taken."""
    pytest.importorskip("ipywidgets", reason="the dashboard needs ipywidgets (requirements-lab.txt)")
    import numpy as np
    from mamba_debug import MambaDebugError
    from mamba_debug.dashboard import Dashboard
    model = random_model(n_layer=2)
    for kw, said in ((dict(offload=-1), "offload must be an integer >= 0, got -1"),
                     (dict(ubatch=0), "ubatch must be an integer >= 1, got 0"),
                     (dict(n_seqs=0), "n_seqs must be an integer >= 1, got 0"),
                     (dict(dpi="x"), "dpi must be an integer >= 1"),
                     (dict(prompt=[]), "prompt is empty"),
                     (dict(prompt=[1.5]), "prompt_ids must be integer token ids"),
                     (dict(engine="bogus"), r"engine='bogus': choose one of \['torch', 'llama.cpp'\]")):
        kw.setdefault("prompt", [1, 2, 3])
        with pytest.raises(MambaDebugError, match=said):
            Dashboard(model, kw.pop("prompt"), kernels="torch", autorun=False, **kw)
    d = Dashboard(model, [1, 2, 3, 4], kernels="torch", offload=np.int64(1), ubatch=np.int64(2), n_gen=1)
    assert d.result.settings.offload == 1 and d.result.settings.ubatch == 2
    other = random_model(n_layer=3)             # the same vocabulary and prompt: only the model tells them apart
    with pytest.raises(MambaDebugError, match="result= was computed with another model \\(n_layer 2 against this "
                                              "dashboard's 3\\)"):
        Dashboard(other, [1, 2, 3, 4], kernels="torch", result=d.result, autorun=False)


def test_dashboard_set_refuses_a_value_its_control_would_clamp_naming_the_control():
    """dash.set(token=999) showed the last token and dash.set(layer=50) the last layer (the sliders clamp); a site
    typo was an ipywidgets TraitError, an unknown control a TypeError. Past the top of offload and ubatch is kept:
    it means all of it, as -ngl 99 and a -ub past the prompt do."""
    pytest.importorskip("ipywidgets", reason="the dashboard needs ipywidgets (requirements-lab.txt)")
    from mamba_debug import MambaDebugError
    from mamba_debug.dashboard import Dashboard
    d = Dashboard(random_model(n_layer=2), [1, 2, 3, 4], kernels="torch", ubatch=2, n_gen=1)
    for kw, said in ((dict(token=9), "token=9: the control goes from 0 to 4"),
                     (dict(layer=5), "layer=5: the control goes from 0 to 1"),
                     (dict(site="nope"), "site='nope': choose one of"),
                     (dict(offload=-1), "offload must be an integer >= 0"),
                     (dict(bogus=1), "unknown dashboard control(s) ['bogus']")):
        with pytest.raises(MambaDebugError, match=re.escape(said)):
            d.set(**kw)
    d.set(offload=99, ubatch=512)
    assert d.state.run.offload == 3 and d.state.run.ubatch == 4
    with pytest.raises(MambaDebugError, match=re.escape("Dashboard(result=...) takes a CompareResult")):
        Dashboard(random_model(n_layer=2), [1, 2, 3, 4], kernels="torch", result="x", autorun=False)


def test_with_several_sequences_each_ubatch_up_to_all_their_prompt_tokens_is_its_own_run():
    """-ub counts tokens across the sequences: with 2 sequences of 10 tokens, ubatch 10 runs two ubatches and only
    20 holds the whole prompt. The dashboard once capped its ubatch at 10 tokens: a seeded ubatch-512 result stood
    in for ubatch 10 (a cache hit of another schedule), the status called ubatch 10 the whole prompt, and 20 could
    not be chosen."""
    pytest.importorskip("ipywidgets", reason="the dashboard needs ipywidgets (requirements-lab.txt)")
    from mamba_debug.compare import run_compare
    from mamba_debug.dashboard import Dashboard
    from mamba_debug.settings import RunSettings

    model, P = random_model(), len(IDS)
    whole = run_compare(model, IDS, RunSettings(device="interpret", kernels="bug_state_not_carried", n_gen=2,
                                                n_seqs=2, offload=2, ubatch=512))
    assert whole.first_divergence["token"] == P             # the prompt in one ubatch: no state to carry until then
    dash = Dashboard(model, IDS, kernels="bug_state_not_carried", device="interpret", n_gen=2, n_seqs=2,
                     result=whole)
    assert dash.w_ubatch.max == 2 * P and dash.w_ubatch.value == 2 * P
    assert "ubatch 20 (the whole prompt of every sequence)" in dash.w_status.value
    dash.set(ubatch=P)
    assert dash.errors == [] and dash.timings["source"] == "run"
    fd = dash.result.first_divergence
    assert fd["token"] == P // 2 and fd == run_compare(model, IDS, dash.state.run).first_divergence
    assert f"ubatch {P}<br>" in dash.w_status.value
    dash.set(ubatch=1000)                                    # past the top: the whole prompt's run again
    assert dash.result is whole and dash.timings["source"] == "cache"


def test_weights_edited_between_two_updates_are_run_again_not_served_from_the_cache():
    """The dashboard keyed its runs by settings alone: after `params[k] *= 3` a refresh showed the old run."""
    pytest.importorskip("ipywidgets", reason="the dashboard needs ipywidgets (requirements-lab.txt)")
    from mamba_debug.compare import run_compare
    from mamba_debug.dashboard import Dashboard

    model = random_model()
    dash = Dashboard(model, IDS, kernels="torch", device="cpu", n_gen=1, offload=2, ubatch=4)
    before = dash.result
    model.params["layers.1.D"] *= 3
    dash.refresh()
    assert dash.result is not before and dash.timings["source"] == "run"
    assert dash.result.perplexity == run_compare(model, IDS, dash.state.run).perplexity != before.perplexity
