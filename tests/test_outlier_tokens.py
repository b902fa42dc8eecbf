"""A token whose floor is far above its site's (a value near zero, whose relative error is large for any
implementation) is judged by its own floor and no longer raises the threshold of every other token of the site
(trace.OUTLIER). Before, one such y_scan token of a later sequence set layer 1's threshold to 0.09 and a 1e-4 bug in
y was reported a layer late (research/threshold_conditioning/repro_blind_token.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import mamba_debug as md
from mamba_debug.io import DATA_DIR
from mamba_debug.trace import MIN_FLOOR, OUTLIER, thresholds_from_floor
from mamba_debug.views.base import token_thresholds
from mamba_debug.views.heatmap import error_image

BUG = '''"""ssm_scan whose y is off by a relative 1e-4 (the state is right)."""
from mamba_debug.ops import ssm_scan as _ref
def ssm_scan(s, x, dt, A, B, C, *, states_out=None):
    y, h = _ref(s, x, dt, A, B, C, states_out=states_out)
    return y * (1 + 1e-4), h
OPS = {"ssm_scan": ssm_scan}
'''


def test_an_outlier_floor_is_left_out_of_its_sites_level():
    f = torch.full((2, 50), 1e-6, dtype=torch.float64)
    f[0, 3] = 2e-6
    f[1, 0] = 1e-2                                   # 10^4 x the median: a token near zero
    thr = thresholds_from_floor({(0, "y_scan"): f}, 10.0)[(0, "y_scan")]
    assert thr == pytest.approx(2e-5)                # 10 x the largest of the others
    f[1, 0] = 0.9 * OUTLIER * 1e-6                   # within OUTLIER x the median: still part of the level
    assert thresholds_from_floor({(0, "y_scan"): f}, 10.0)[(0, "y_scan")] == pytest.approx(10 * 0.9 * OUTLIER * 1e-6)
    zero = torch.zeros(1, 4, dtype=torch.float64)     # float32 and float64 agree exactly: MIN_FLOOR still holds
    assert thresholds_from_floor({(0, "norm"): zero}, 10.0)[(0, "norm")] == 10 * MIN_FLOOR


@pytest.fixture(scope="module")
def blind_runs(tmp_path_factory):
    bug = tmp_path_factory.mktemp("plugin") / "bug_y_1e4.py"
    bug.write_text(BUG)
    m = md.load_model()
    ids = m.encode((DATA_DIR / "tiny-mamba" / "val.txt").read_text()[:4000])[:300]
    s = md.RunSettings(device="cpu", kernels=str(bug), offload=11, ubatch=512, n_gen=2)
    return {n: md.run_compare(m, ids, s.replace(n_seqs=n)) for n in (1, 3)}


def test_a_near_zero_token_no_longer_blinds_its_site(blind_runs):
    """The 1e-4 bug is found at the same layer with 1 and 3 sequences (layer 2 with 3 before)."""
    one, three = (blind_runs[n].first_divergence for n in (1, 3))
    assert (one["layer"], one["site"]) == (1, "y_scan")
    assert (three["layer"], three["site"]) == (1, "y_scan")
    res = blind_runs[3]
    f = res.floor[(1, "y_scan")]
    outliers = f > OUTLIER * float(f[torch.isfinite(f)].median())
    assert outliers.any()                                       # the near-zero token is there
    tok = res.token_thresholds((1, "y_scan"))
    assert bool((tok[outliers] > res.thresholds[(1, "y_scan")]).all())   # judged by its own floor
    assert bool((tok[~outliers] == res.thresholds[(1, "y_scan")]).all())
    assert three["threshold"] == float(tok[three["seq"], three["token"]])
    site = md.per_layer(res)[1]["sites"]["y_scan"]                  # the JSON says why max_rel_l2 > threshold
    assert site["outlier_tokens"] == int(outliers.sum())
    assert "outlier_tokens" not in md.per_layer(res)[1]["sites"]["resid"]


def test_the_curve_returns_what_it_draws(blind_runs):
    """At the worst token of each layer: the largest error / threshold (an outlier token's error is past the site's
    threshold but within its own), and the view's data is the plotted line."""
    from mamba_debug.views import registry
    from mamba_debug.views.base import ViewState, new_figure
    from mamba_debug.views.curve import curve_values
    res = blind_runs[3]
    view = registry.BY_NAME["curve"]
    for seq in range(3):
        y = view.draw(new_figure(view.figsize), res, ViewState(token=None, site="y_scan", seq=seq))
        want, thr = curve_values(res, "y_scan", "rel_l2", seq)
        assert np.array_equal(y, want, equal_nan=True)
        line = view.draw(new_figure(view.figsize), res, ViewState(token=None, site="y_scan", seq=seq))
        assert np.array_equal(line, y, equal_nan=True)
        ratio = res.ratio((1, "y_scan"))[seq]
        assert y[1] / thr[1] == pytest.approx(float(ratio.max()))


def test_the_views_colour_each_token_by_its_own_threshold(blind_runs):
    res = blind_runs[3]
    key = (1, "y_scan")
    seq, t = (int(i) for i in torch.nonzero(res.floor[key] == res.floor[key].max())[0])
    thr = token_thresholds(res, "y_scan", seq)
    assert thr[1, t] == pytest.approx(res.settings.k_floor * float(res.floor[key][seq, t]))
    _img, err, _ = error_image(res, "y_scan", "rel_l2", seq)
    ratio = err[1] / thr[1]
    assert np.allclose(ratio, res.ratio(key)[seq].numpy(), equal_nan=True)
