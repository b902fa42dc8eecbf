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
    return md.run_compare(model, ids, md.RunSettings(engine="llama.cpp", device="cpu", ubatch=8, n_gen=2, **kw))


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
    model, ids = gguf("q8_0")

    def hook(node, a, u, first_seq):
        if node.layer == 3 and node.site == "xz" and u == 1:
            a.reshape(-1)[: a.size // 2] *= 1.3
    lside.FAULT = hook
    try:
        res = _run(model, ids)
    finally:
        lside.FAULT = None
    fd = res.first_divergence
    assert fd is not None and (fd["layer"], fd["ubatch"]) == (3, 1) and "8-bit weights" in fd["by"], fd
