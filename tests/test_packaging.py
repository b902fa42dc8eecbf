"""A wheel (`pip install .`, not -e) carries the whole library, the kernels and the shipped models, and runs
without the checkout."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _packages() -> list:
    tomllib = pytest.importorskip("tomllib")        # Python 3.11+; the wheel test below runs on 3.10 too
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]


def test_every_subpackage_is_listed_in_pyproject():
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "mamba_debug").rglob("__init__.py")}
    missing = sorted(found - set(_packages()))
    assert not missing, f"pyproject.toml's [tool.setuptools] packages lacks {missing}: a wheel would leave them out"


def test_a_wheel_runs_a_comparison_without_the_checkout(tmp_path):
    src = tmp_path / "src"            # built from a copy: setuptools writes build/ and egg-info beside the sources
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("mamba_debug", "kernels", "data"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
                    str(src)], check=True, cwd=tmp_path, timeout=300)
    site = tmp_path / "site"
    with zipfile.ZipFile(next(wheels.glob("*.whl"))) as whl:    # what pip install would unpack
        whl.extractall(site)
    shutil.rmtree(src)                # nothing of a checkout left to fall back on
    code = """
import mamba_debug as md, mamba_debug.plugins as plugins, mamba_debug.io.load as load
from mamba_debug.compare import CompareSettings, run_compare
from mamba_debug.sides.llamacpp import fastpath
site = {site!r}
for path in (md.__file__, plugins.KERNELS_DIR, load.DATA_DIR, fastpath.SOURCE):
    assert str(path).startswith(site), path
assert fastpath.SOURCE.is_file()
assert {{"triton", "bug_strided_gate"}} <= set(md.list_kernels())
model = md.load_model()
assert md.load_model("tiny-mamba2").config.n_layer > 0
ids = model.encode("It is a truth universally")[:4]
clean = run_compare(model, ids, CompareSettings(kernels="triton", device="interpret", n_gen=1))
bug = run_compare(model, ids, CompareSettings(kernels="bug_strided_gate", device="interpret", n_gen=1, ubatch=2))
assert clean.first_divergence is None and bug.first_divergence is not None
print("ok")
""".format(site=str(site))
    env = {**os.environ, "PYTHONPATH": str(site), "TRITON_INTERPRET": "1"}
    env.pop("MAMBA_DEBUG_KERNELS_DIR", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
