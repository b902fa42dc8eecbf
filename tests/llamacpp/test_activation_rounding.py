"""ggml's CPU rounding of a MUL_MAT's activations, emulated (mamba_debug/sides/llamacpp/activations.py), against
independent implementations: torch's float16 / bfloat16 conversions and gguf-py's Q8_0 quantizer (bit-exact with
ggml's scalar reference); q8_1's block sums against ggml's reference loop, and the q4_1 / q5_1 weights' block
minima against gguf-py's quantizers."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from mamba_debug.sides.llamacpp.activations import (Q8_FORMS, q8_1_sums, rounded, split_sum_reach,
                                                    with_block_sums)
from mamba_debug.sides.llamacpp.nodes import offsets


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


def test_q8_1_block_sums_follow_ggmls_reference_loop():
    """quantize_row_q8_1_ref, one block at a time: d = amax / 127, q = roundf(x / d), s = f16(sum(q) * d) with d in
    float32; the values are q8_0's, and with_block_sums adds each offset times s less what the kept f16(d) times
    sum(q) gives."""
    x = np.nan_to_num(acts(4, (2, 3, 128)))
    sums, excess = [], []
    for block in x.reshape(-1, 32):
        d = np.float32(np.abs(block).max()) / np.float32(127)
        inv = np.float32(1) / d if d else np.float32(0)
        q = [float(np.sign(v * inv) * np.floor(abs(float(np.float32(v * inv))) + 0.5)) for v in block]
        total = int(sum(q))
        sums.append(float(np.float16(np.float32(total) * d)))
        excess.append(sums[-1] - float(np.float16(d)) * total)
    got = q8_1_sums(x, "scalar")
    assert got.shape == (2, 3, 4) and np.array_equal(got.reshape(-1), np.array(sums))
    xr = rounded(x, "q4_1", "scalar")
    assert np.array_equal(xr, rounded(x, "q8_0", "scalar"))
    unit = with_block_sums(np.zeros((2, 3, 4)), xr, got, np.eye(4))      # offsets of 1 per block: the excess itself
    assert np.array_equal(unit.reshape(-1), np.array(excess)) and np.abs(unit).max() > 0


@pytest.mark.parametrize("kind, ggml_type", [("Q4_1", 3), ("Q5_1", 7)])
def test_block_offsets_are_read_from_the_raw_blocks(kind, ggml_type):
    """gguf-py's Q4_1 / Q5_1 quantizers keep each block's minimum as m (f16): `offsets` finds it from the bytes."""
    gq = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType as T
    w = np.random.default_rng(5).standard_normal((6, 96)).astype(np.float32)
    raw = gq.quantize(w, getattr(T, kind))
    want = w.reshape(6, 3, 32).min(axis=2).astype(np.float16).astype(np.float64)
    assert np.array_equal(offsets(raw, ggml_type), want)
    assert offsets(raw, 8) is None              # q8_0 keeps no offset


@pytest.mark.parametrize("kind, ggml_type, shift", [("Q4_0", 2, 8), ("Q5_0", 6, 16)])
def test_q4_0_and_q5_0_offsets_are_their_constant_times_the_scale(kind, ggml_type, shift):
    """q4_0 and q5_0 hold d * (q - 8) and d * (q - 16): with the integers zeroed a block is -8 d / -16 d (what
    CUDA's mmvq multiplies by the activations' block sums)."""
    gq = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType as T
    raw = gq.quantize(np.random.default_rng(8).standard_normal((5, 128)).astype(np.float32), getattr(T, kind))
    d = raw.reshape(5, 4, -1)[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float64)
    assert np.array_equal(offsets(raw, ggml_type), -shift * d)


def test_a_repacked_weights_offsets_come_from_its_gguf_file(tmp_path):
    """A weight in a buffer ggml cannot read back (CPU_REPACK, AMX) has its offsets read from the GGUF file."""
    gguf = pytest.importorskip("gguf")
    from types import SimpleNamespace
    from mamba_debug.sides.llamacpp.nodes import read_offsets
    w = np.random.default_rng(6).standard_normal((4, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    writer = gguf.GGUFWriter(str(tmp_path / "w.gguf"), "mamba")
    writer.add_tensor("blk.0.ssm_in.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    node = SimpleNamespace(name="blk.0.ssm_in.weight", type=3, backend="CPU_REPACK")
    assert np.array_equal(read_offsets(None, node, tmp_path / "w.gguf"), offsets(raw, 3))
    assert read_offsets(None, SimpleNamespace(name="nope", type=3, backend="AMX"), tmp_path / "w.gguf") is None


def test_not_emulated_types_and_shapes_say_so():
    x = acts()
    assert rounded(x, "iq4_nl") is None and rounded(x, "q4_K") is None and rounded(x[..., :40], "q8_0") is None
    assert rounded(x[..., :40], "q4_1") is None and q8_1_sums(x[..., :40]) is None


def test_split_sums_reach_grows_where_the_two_sums_cancel():
    """float32's own error on ggml's two sums (scaled part, offsets' part): small on zero-mean activations, larger
    past the FP32 floor where the activations are positive and wide rows make the two sums nearly cancel."""
    g = np.random.default_rng(7)
    rows, K = 16, 8192
    offs = -g.uniform(0.0059, 0.0061, (rows, K // 32))   # the integers average 7.5 x 0.0008: w near zero mean
    w = np.repeat(offs, 32, axis=1) + g.integers(0, 16, (rows, K)) * 0.0008       # an offset plus a scaled integer
    mixed = g.standard_normal((3, K)).astype(np.float32).astype(np.float64)
    positive = np.abs(mixed)
    low, high = (split_sum_reach(w, x, offs, 256) for x in (mixed, positive))
    assert low < 1e-6 < high and high > 10 * low, (low, high)
