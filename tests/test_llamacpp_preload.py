"""A CUDA build of llama.cpp loaded after numpy can die silently at model load (sides/llamacpp/preload.py): the
command line restarts itself once with libstdc++ preloaded, a library user is warned with the fix, and a CPU build,
an already preloaded process or the opt-out change nothing. No GPU needed: a CUDA build is told by its files'
names, so a folder of stand-in files shows the whole path up to the library check that refuses them."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from mamba_debug.errors import MambaDebugError
from mamba_debug.sides.llamacpp import lib as llib, preload

ROOT = Path(__file__).resolve().parent.parent


def _fake_build(tmp_path: Path, cuda: bool) -> Path:
    """libllama.so and ggml's libraries as stand-in files (not ELF: the library check refuses them by name)."""
    folder = tmp_path / ("cuda" if cuda else "cpu")
    folder.mkdir()
    for name in ("libllama.so", "libggml.so", "libggml-base.so", "libggml-cpu.so") + (("libggml-cuda.so",) * cuda):
        (folder / name).write_bytes(b"not a library")
    return folder


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", preload.GUARD, preload.OPT_OUT)}
    return {**env, **extra}


def test_the_restart_plan_preloads_libstdcxx_for_a_cuda_build_only(tmp_path):
    cuda, cpu = _fake_build(tmp_path, True), _fake_build(tmp_path, False)
    exe, argv, env = preload.restart_plan(cuda, _clean_env(LD_PRELOAD="/opt/other.so"))
    assert exe == sys.executable and argv == list(sys.orig_argv)
    first = env["LD_PRELOAD"].split(":")
    assert "libstdc++.so" in first[0] and os.path.isfile(first[0]) and first[1] == "/opt/other.so"
    assert env[preload.GUARD] == "1"
    assert preload.restart_plan(cpu, _clean_env()) is None                          # the CPU build is unaffected
    assert preload.restart_plan(cuda, _clean_env(LD_PRELOAD=first[0])) is None      # already preloaded
    assert preload.restart_plan(cuda, _clean_env(**{preload.GUARD: "1"})) is None   # restarted once already
    assert preload.restart_plan(cuda, _clean_env(**{preload.OPT_OUT: "1"})) is None


def _compare(folder: Path, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mamba_debug", "compare", "--engine", "llama.cpp", "--llama-lib", str(folder),
           "--device", "cpu", "--n-gen", "1"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_command_line_restarts_once_with_libstdcxx_preloaded(tmp_path):
    folder = _fake_build(tmp_path, True)
    res = _compare(folder, _clean_env())
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("restarting with LD_PRELOAD=") == 1, res.stderr
    note = next(line for line in res.stderr.splitlines() if "restarting with" in line)
    assert str(folder) in note and "libstdc++.so" in note and preload.OPT_OUT in note
    # the restarted process went on to the library check, which names the stand-in file
    assert "libllama.so" in res.stderr.splitlines()[-1] or "libggml" in res.stderr.splitlines()[-1], res.stderr
    quiet = _compare(folder, _clean_env(**{preload.OPT_OUT: "1"}))
    assert quiet.returncode == 2 and "restarting" not in quiet.stderr, quiet.stderr


def test_a_library_user_is_warned_with_the_fix(tmp_path, monkeypatch):
    for key in ("LD_PRELOAD", preload.GUARD, preload.OPT_OUT):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(llib, "_LOADED", None)      # an earlier test's library would refuse a second one first
    cuda = _fake_build(tmp_path, True)
    with pytest.warns(UserWarning, match="LD_PRELOAD=.*libstdc"), \
            pytest.raises(MambaDebugError, match="libllama|libggml"):
        llib.load_library(str(cuda))
    monkeypatch.setenv(preload.OPT_OUT, "1")
    with warnings.catch_warnings(record=True) as seen, pytest.raises(MambaDebugError):
        warnings.simplefilter("always")
        llib.load_library(str(cuda))
    assert not [w for w in seen if "LD_PRELOAD" in str(w.message)]
