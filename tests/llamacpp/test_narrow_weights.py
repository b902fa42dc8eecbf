"""GGUFs whose matrices are narrower than float32 (f16, bf16, q8_0) against stock llama.cpp's CPU build.

ggml rounds such a matmul's activations to the weights' dot-product type (f16, bf16, 8-bit blocks), so every site
after the first one drifts past the float32 threshold: that is precision, and the verdict says so (each matmul's
local error, float64 with the same dequantized weights, within its family's limit), where it once read "DIVERGED at
layer 0 'xz', the error is born there". A real fault in such a model is still found at its node.
"""
from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed; run tests/llamacpp/build.sh")

import mamba_debug as md  # noqa: E402
from mamba_debug.io import export_gguf, load_model  # noqa: E402
from mamba_debug.sides.llamacpp import side as lside  # noqa: E402

PROMPT = "It was a fine morning in the country, and Mr. Darcy"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    folder, cache = tmp_path_factory.mktemp("narrow"), {}

    def get(dtype):
        if dtype not in cache:
            model = load_model(export_gguf(load_model(None), folder / f"tiny-{dtype}.gguf", dtype=dtype))
            cache[dtype] = (model, model.encode(PROMPT))
        return cache[dtype]
    return get


def _run(model, ids, **kw):
    return md.run_compare(model, ids, md.RunSettings(**{"engine": "llama.cpp", "device": "cpu", "ubatch": 8,
                                                         "n_gen": 2, **kw}))


def _run_with_xz_fault(model, ids, scale):
    """_run with layer 3's in_proj output (xz) scaled by `scale` in half its values at ubatch 1 (a fault in the
    build, written into the node's memory from the eval callback)."""
    def hook(node, a, u, first_seq):
        if node.layer == 3 and node.site == "xz" and u == 1:
            a.reshape(-1)[: a.size // 2] *= scale
    lside.FAULT = hook
    try:
        return _run(model, ids)
    finally:
        lside.FAULT = None


@pytest.mark.parametrize("dtype, family", [("f16", "f16 weights"), ("bf16", "bf16 weights"),
                                           ("q8_0", "8-bit weights")])
def test_narrow_weights_read_as_precision_not_a_fault(gguf, dtype, family):
    model, ids = gguf(dtype)
    res = _run(model, ids)
    assert res.first_divergence is None and res.precision is not None, res.first_divergence
    assert f"precision: {family} from layer 0 (xz)" in res.precision["text"]     # where the first one passed
    items = res.precision["items"]
    assert items and all(i["op"] == "MUL_MAT" and i["error"] <= i["limit"] / 4 for i in items)   # within its floor
    assert any("export-gguf --dtype f32" in s for s in res.precision["switches"])
    paths = {n["path"] for n in res.sides["device"].extra["nodes"] if n["op"] == "MUL_MAT"}
    assert any(p.startswith(family) for p in paths), paths          # the JSON's node list says so too


def test_a_fault_in_a_quantized_models_matmul_is_still_found_at_its_node(gguf):
    """A q8_0 model's layer 3 in_proj output (xz, a q8_0 matmul) 30% off in half its values at one ubatch: its local
    error (~0.2) passes the 8-bit limit (0.08; the model's clean matmuls err up to 0.014)."""
    fd = _run_with_xz_fault(*gguf("q8_0"), 1.3).first_divergence
    assert fd is not None and (fd["layer"], fd["ubatch"]) == (3, 1) and "8-bit weights" in fd["by"], fd


@pytest.mark.parametrize("dtype", ["q8_0", "f16", "bf16"])
def test_a_small_fault_beside_the_rounding_is_found_on_a_cpu_build(gguf, dtype):
    """The same matmul 1e-4 off in half its values: 1/100 of the q8_0 rounding it sits in (1/2 of f16's). A CPU
    build's activation rounding is emulated (activations.py), so the node is judged by k x the FP32 floor against
    it; with the family's limit alone (0.08 for 8-bit weights) it read as precision."""
    res = _run_with_xz_fault(*gguf(dtype), 1 + 1e-4)
    fd = res.first_divergence
    assert fd is not None and (fd["layer"], fd["site"], fd["ubatch"]) == (3, "xz", 1), md.verdict(res)
    assert "emulated" in fd["by"] and fd["error"] > 3 * fd["threshold"]


def test_clean_narrow_matmuls_match_their_emulated_rounding(gguf):
    res = _run(*gguf("q8_0"), n_seqs=2, ubatch=512)
    items = res.precision["items"]
    assert items and all(i["emulated_error"] < 1e-6 < i["error"] for i in items), items
    assert "within the FP32 floor of their activations' rounding, emulated" in res.precision["text"]


QUANTIZED_RUN = '''
import json, sys
import llama_cpp, ctypes
import mamba_debug as md
from mamba_debug.io import export_gguf, load_model
from mamba_debug.sides.llamacpp import side as lside
folder, kind = sys.argv[1], sys.argv[2]
if kind in ("Q4_0", "Q4_1", "Q5_1"):          # the shipped model
    model, layer = load_model(None), 3
else:                       # the K-quants need rows of 256: a random 256-wide Mamba-1
    sys.path.insert(0, "tests")
    from conftest import random_model
    model, layer = random_model(d_model=256, n_layer=2, vocab_size=512, d_state=16), 1
f32 = export_gguf(model, folder + "/f32.gguf", dtype="f32")
p = llama_cpp.llama_model_quantize_default_params()
p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + kind)
assert llama_cpp.llama_model_quantize(str(f32).encode(), (folder + "/q.gguf").encode(), ctypes.byref(p)) == 0
model = load_model(folder + "/q.gguf")
ids = list(range(5, 30))
s = md.RunSettings(engine="llama.cpp", device="cpu", ubatch=8, n_gen=2, local=True)
clean = md.run_compare(model, ids, s)
def hook(node, a, u, first_seq):
    if node.layer == layer and node.site == "xz" and u == 1:
        a.reshape(-1)[: a.size // 2] *= 1 + 1e-4
lside.FAULT = hook
faulty = md.run_compare(model, ids, s).first_divergence
print(json.dumps({"clean": clean.first_divergence, "precision": clean.precision["text"],
                  "faulty": [faulty["layer"] == layer, faulty["site"], faulty["ubatch"], faulty["by"]]}))
'''


@pytest.mark.parametrize("kind, weights", [("Q4_0", "q4_0"), ("Q4_K_M", "q4_K"), ("Q2_K", "q2_K"), ("Q4_1", "q4_1"),
                                           ("Q5_1", "q5_1")])
def test_llama_cpps_own_quantizations_are_read_and_emulated(tmp_path, kind, weights):
    """llama.cpp's own quantizations (llama_model_quantize). A CPU build keeps Q4_0 and q4_K weights in its
    CPU_REPACK buffer, which ggml cannot read back (ggml_backend_tensor_get segfaulted the process at the first
    local recompute); they are read from the GGUF file instead. Q4_0's activations are q8_0 blocks, the K-quants'
    q8_K blocks of 256, Q4_1's and Q5_1's q8_1 blocks whose f16 sums meet the weights' block minima (without those
    sums a clean q4_1 node read 4.4e-4 past its emulation: DIVERGED), all emulated: a 1e-4 fault is named at its
    node. In a child process, so that a crash fails this test alone."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", QUANTIZED_RUN, str(tmp_path), kind], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["clean"] is None and "8-bit weights" in got["precision"] and "emulated" in got["precision"], got
    assert got["faulty"][:3] == [True, "xz", 1] and weights in got["faulty"][3] and "emulated" in got["faulty"][3], got


WIDE_RUN = '''
import ctypes, json, sys
import llama_cpp
sys.path.insert(0, "tests")
import numpy as np
import mamba_debug as md
from conftest import random_model
from mamba_debug.io import export_gguf, load_model
from mamba_debug.sides.llamacpp import side as lside
folder = sys.argv[1]
f32 = export_gguf(random_model(seed=4, d_model=2560, n_layer=2, vocab_size=512, d_state=16), folder + "/f32.gguf",
                  dtype="f32")
ids = [int(i) for i in np.random.default_rng(1).integers(3, 499, 25)]
out = {}
for kind in ("Q4_K_M", "Q4_1"):
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + kind)
    assert llama_cpp.llama_model_quantize(str(f32).encode(), f"{folder}/{kind}.gguf".encode(), ctypes.byref(p)) == 0
    model = load_model(f"{folder}/{kind}.gguf")
    res = md.run_compare(model, ids, md.RunSettings(engine="llama.cpp", device="cpu", ubatch=512, n_gen=2, local=True))
    out[kind] = [res.first_divergence and res.first_divergence["by"], (res.precision or {}).get("text")]
def hook(node, a, u, first_seq):           # x_proj, where the split sums cancel
    if node.layer == 1 and node.site == "MUL_MAT#2" and u == 1:
        a.reshape(-1)[: a.size // 2] *= 1 + 1e-4
lside.FAULT = hook
fd = md.run_compare(model, ids, md.RunSettings(engine="llama.cpp", device="cpu", ubatch=8, n_gen=2,
                                               local=True)).first_divergence
out["fault"] = fd and [fd["layer"], fd["site"], fd["ubatch"], fd["by"]]
print(json.dumps(out))
'''


def test_wide_models_split_sums_read_as_float32_not_a_fault(tmp_path):
    """ggml-cpu sums a q4_1 / K-quant dot product in two float32 parts, the scaled values' and the offsets', and
    adds them at the end; at x_proj (inputs after SiLU, mostly positive) the two nearly cancel. On a random
    2560-wide Mamba-1 (mamba-2.8b's width) a clean Q4_K_M and Q4_1 read DIVERGED at x_proj (1.13e-5 and 1.2e-5 past
    the emulation, threshold 1e-5) until each such node was judged against 4x a float32 replay of those sums
    (activations.split_sum_reach); a 1e-4 fault at that node is still named there. In a child process."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", WIDE_RUN, str(tmp_path)], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    for kind in ("Q4_K_M", "Q4_1"):
        assert got[kind][0] is None and "split sums" in got[kind][1], (kind, got[kind])
    assert got["fault"][:3] == [1, "MUL_MAT#2", 1] and "emulated" in got["fault"][3], got["fault"]
