"""compare --three-way: the float64 reference vs llama.cpp's CPU backend vs its CUDA backend in one run.

CI has the CPU build only, so the plumbing runs with two CPU runs of the same library (`devices=("cpu", "cpu")`):
identical runs compare as identical; a fault written into the second run only is that run's divergence and the
first place the two runs differ. The CLI refuses a CPU-only build (no CUDA backend), and the flag without
--engine llama.cpp, with exit 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed; run tests/llamacpp/build.sh")

from mamba_debug.io import load_model  # noqa: E402
from mamba_debug.settings import RunSettings  # noqa: E402
from mamba_debug.sides.llamacpp import side as lside  # noqa: E402
from mamba_debug.three_way import run_three_way, summary_three_way, to_json_three_way  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "It was a fine morning in the country"


@pytest.fixture(scope="module")
def subject():
    model = load_model(None)
    return model, model.encode(PROMPT)


def _settings(**kw):
    return RunSettings(engine="llama.cpp", ubatch=4, n_seqs=2, n_gen=2, **kw)


def test_two_identical_runs_agree_everywhere(subject):
    tw = run_three_way(*subject, _settings(), devices=("cpu", "cpu"))
    assert not tw.diverged and len(tw.runs) == 2
    c = tw.cross
    assert c["sites_compared"] > 100 and c["first_difference"] is None and c["logits_rel_l2_max"] == 0.0
    j = json.loads(json.dumps(to_json_three_way(tw)))
    assert set(j["three_way"]["runs"]) == {"llama.cpp cpu #1", "llama.cpp cpu #2"}
    assert all(r["first_divergence"] is None for r in j["three_way"]["runs"].values())
    assert "no site differs" in summary_three_way(tw)


def test_a_fault_in_one_run_is_its_divergence_and_the_first_difference(subject):
    active = {"run": None}

    def hook(node, a, u, first_seq):
        if active["run"] == "llama.cpp cpu #2" and node.layer == 5 and node.site == "y_scan" and u == 1:
            a.reshape(-1)[3 * 256] += 0.05 * max(1.0, abs(float(a.reshape(-1)[3 * 256])))   # seq 1, token 1
    lside.FAULT = hook
    try:
        tw = run_three_way(*subject, _settings(), devices=("cpu", "cpu"), on_run=lambda label: active.update(run=label))
    finally:
        lside.FAULT = None
    first, second = tw.runs.values()
    assert first.first_divergence is None
    fd = second.first_divergence
    assert (fd["layer"], fd["site"], fd["seq"], fd["token"]) == (5, "y_scan", 1, 3), fd
    d = tw.cross["first_difference"]
    assert (d["layer"], d["site"], d["seq"], d["token"]) == (5, "y_scan", 1, 3), d
    assert tw.diverged


def test_cli_refuses_a_cpu_only_build_and_a_torch_engine(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    base = [sys.executable, "-m", "mamba_debug", "compare", "--three-way", "--n-gen", "1"]
    p = subprocess.run(base + ["--engine", "llama.cpp"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and "no GPU backend" in p.stderr, p.stderr[-1500:]
    p = subprocess.run(base, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 2 and "add --engine llama.cpp" in p.stderr, p.stderr[-1500:]
