"""ggml's CPU rounding of a MUL_MAT's activations, emulated (mamba_debug/sides/llamacpp/activations.py), against
independent implementations: torch's float16 / bfloat16 conversions and gguf-py's Q8_0 quantizer (bit-exact with
ggml's scalar reference)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mamba_debug.sides.llamacpp.activations import Q8_FORMS, rounded


def acts(seed=0, shape=(3, 5, 96)):
    g = np.random.default_rng(seed)
    x = (g.standard_normal(shape) * np.exp(g.uniform(-6, 3, shape[:-1] + (1,)))).astype(np.float32)
    x[0, 0, :32] = 0.0                          # a block of zeros: scale 0, values 0
    x[0, 1, 5] = np.nan                           # NaN stays NaN where the type keeps it (f16, bf16)
    return x


def test_f16_and_bf16_round_to_nearest_even_as_torch_does():
    x = acts()
    for name, dtype in (("f16", torch.float16), ("bf16", torch.bfloat16)):
        want = torch.from_numpy(x).to(dtype).double().numpy()
        assert np.array_equal(rounded(x, name), want, equal_nan=True), name


def test_q8_0_scalar_form_is_gguf_pys_quantizer():
    gq = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType as T
    x = np.nan_to_num(acts(1))
    want = gq.dequantize(gq.quantize(x.reshape(-1, 96), T.Q8_0), T.Q8_0).reshape(x.shape)
    assert np.array_equal(rounded(x, "q8_0", "scalar"), want.astype(np.float64))


def test_q8_0_forms_differ_only_at_halves():
    """The three quantizers give one grid point of difference at most, and only where x / d sits within float32's
    reach of a half (ties and 127 / amax against 1 / (amax / 127))."""
    x = np.nan_to_num(acts(2, (64, 8, 256)))
    base = rounded(x, "q8_0", "x86")
    d32 = np.abs(x.reshape(-1, 32)).max(1, keepdims=True) / np.float32(127)
    d = d32.astype(np.float16).astype(np.float64)       # the scale a block keeps
    for form in Q8_FORMS[1:]:
        steps = np.abs(rounded(x, "q8_0", form) - base).reshape(-1, 32) / np.where(d > 0, d, 1)
        assert steps.max() <= 1.0 + 1e-12 and (steps > 0).mean() < 1e-3, form
        v = np.abs(x.reshape(-1, 32).astype(np.float64) / np.where(d32 > 0, d32, 1))
        assert np.all(np.abs(v[steps > 0] % 1 - 0.5) < 1e-2), form


def test_q8_k_follows_ggmls_reference_loop():
    """quantize_row_q8_K_ref, one value at a time (nearest_int's magic-number rounding: halves to even): the signed
    value of largest magnitude sets iscale = -127 / max; q capped at 127; d = 1 / iscale."""
    x = np.nan_to_num(acts(3, (2, 3, 512)))
    want = np.empty(x.size)
    for i, block in enumerate(x.reshape(-1, 256)):
        top = block[np.argmax(np.abs(block))]
        if top == 0:
            want[i * 256:(i + 1) * 256] = 0.0
            continue
        iscale = np.float32(-127) / top
        for j, v in enumerate(block):
            magic = np.array([np.float32(iscale * v) + np.float32(12582912)], dtype=np.float32).view(np.int32)[0]
            want[i * 256 + j] = min((int(magic) & 0x007FFFFF) - 0x00400000, 127) * float(np.float32(1) / iscale)
    assert np.array_equal(rounded(x, "q4_K"), want.reshape(x.shape)) and np.array_equal(rounded(x, "q6_K"),
                                                                                        want.reshape(x.shape))


def test_not_emulated_types_and_shapes_say_so():
    x = acts()
    assert rounded(x, "q4_1") is None and rounded(x, "q4_K") is None and rounded(x[..., :40], "q8_0") is None
