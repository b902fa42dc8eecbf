"""A CUDA build's quantized matmul of at most 8 columns (mul_mat_vec_q) emulated (activations.emulation), against
an independent block-by-block replay of its arithmetic written from ggml-cuda's quantize.cu and vecdotq.cuh: the
activations rounded to q8_1 blocks (d = amax / 127, q = roundf(x / d), d and the sum of x kept as f16), integer dot
products with the weights' own integers, float32 scale products and sums. No library needed.

On an H100 (2026-12-06, benchmarks/llamacpp_h200.md) clean q8_0 nodes of this kernel sat within 7.5e-8 of the
emulation; a 1e-4 fault is named at its node there. Here: the rules that make that so."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from mamba_debug.sides.llamacpp.activations import cuda_sums, emulation, rounded, wants_scales, with_block_sums
from mamba_debug.sides.llamacpp.local import LocalErrors, path_of
from mamba_debug.sides.llamacpp.nodes import offsets, scales

gq = pytest.importorskip("gguf.quants")
T = pytest.importorskip("gguf").GGMLQuantizationType
F16, F32 = np.float16, np.float32


def node(backend="CUDA0", cols=4, index=7):
    return SimpleNamespace(op="MUL_MAT", backend=backend, ne=(48, cols, 1, 1), layer=1, site="xz", name="node_7",
                           index=index, extra={})


def q8_1_blocks(x):
    """quantize_q8_1, one block at a time: the integers, the f16 scale, the f16 sum of the float32 values."""
    out = []
    for block in x.reshape(-1, 32):
        amax = F32(np.abs(block).max())
        d = F32(amax / F32(127))
        q = np.array([0 if amax == 0 else np.sign(F32(v / d)) * np.floor(abs(float(F32(v / d))) + 0.5)
                      for v in block], dtype=np.int64)
        out.append((q, float(F16(d)), float(F16(np.sum(block, dtype=np.float64)))))
    return out


def block_ints(blk, kind):
    """A weight block's f16 scale, f16 minimum (0 where none) and 32 integers (ggml-common.h's layouts)."""
    dw = float(blk[:2].view(F16)[0])
    if kind == "q8_0":
        return dw, 0.0, blk[2:].view(np.int8).astype(np.int64)
    if kind == "q4_0":
        return dw, 0.0, np.concatenate([blk[2:] & 0xF, blk[2:] >> 4]).astype(np.int64)
    m = float(blk[2:4].view(F16)[0])
    qs = blk[4:] if kind == "q4_1" else blk[8:]
    ints = np.concatenate([qs & 0xF, qs >> 4]).astype(np.int64)
    if kind == "q5_1":                       # the fifth bits: qh's bit j for value j
        qh = int(blk[4:8].view(np.uint32)[0])
        ints |= np.array([((qh >> j) & 1) << 4 for j in range(32)])
    return dw, m, ints


def q1_term(q8, d8, s8, dw, m, ints):
    """vec_dot_q4_1_q8_1_impl / q5_1's, as mmvq runs it: two threads per block (vdr 2: values 0-7 and 16-23, then
    8-15 and 24-31), each adding sumi * d4d8 + m4s8 / 2 in float32, both products of f16 pairs rounded to f16
    (__hmul2, FAST_FP16_AVAILABLE)."""
    d4d8, m4s8 = F32(F16(F32(dw) * F32(d8))), F32(F16(F32(m) * F32(s8)))
    term = F32(0)
    for half in (np.r_[0:8, 16:24], np.r_[8:16, 24:32]):
        term = F32(term + F32(F32(int(ints[half] @ q8[half])) * d4d8 + m4s8 / F32(2)))
    return term


def mmvq_replay(raw, kind, x, flip=None):
    """The kernel's result (cols, rows) for weights `raw` (rows, bytes) of q8_0, q4_0, q4_1 or q5_1, in float32 as
    it sums. flip: (column, value index) of one value rounded the other way (fast math's division at a half)."""
    acts = q8_1_blocks(x)
    if flip is not None:
        t, j = flip
        q8, d8, s8 = acts[t * (x.shape[-1] // 32) + j // 32]
        q8 = q8.copy()
        q8[j % 32] -= 1
        acts[t * (x.shape[-1] // 32) + j // 32] = (q8, d8, s8)
    nb = x.shape[-1] // 32
    got = np.zeros((x.shape[0], raw.shape[0]), F32)
    for r in range(raw.shape[0]):
        size = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_1": 24}[kind]
        for b in range(nb):
            dw, m, qw = block_ints(raw[r, b * size:(b + 1) * size], kind)
            for t in range(x.shape[0]):
                q8, d8, s8 = acts[t * nb + b]
                sumi = int(qw @ q8)
                if kind in ("q4_1", "q5_1"):
                    term = q1_term(q8, d8, s8, dw, m, qw)
                elif kind == "q8_0":
                    term = F32(F32(dw) * F32(d8)) * F32(sumi)
                else:
                    term = F32(dw) * (F32(sumi) * F32(d8) - F32(8) * F32(s8))
                got[t, r] = F32(got[t, r] + F32(term))
    return got


def case(kind, seed=0, cols=4, K=256, rows=48):
    g = np.random.default_rng(seed)
    w = g.standard_normal((rows, K)).astype(F32)
    x = (g.standard_normal((cols, K)) * np.exp(g.uniform(-2, 2, (cols, 1)))).astype(F32)
    raw = gq.quantize(w, getattr(T, kind.upper()))
    wd = gq.dequantize(raw, getattr(T, kind.upper())).astype(np.float64)
    ggml_type = {"q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_1": 7}[kind]
    return raw, wd, x, ggml_type, offsets(raw, ggml_type)


def judged(kind, got, wd, x, ggml_type, offs, n=None, raw=None):
    """The node as LocalErrors judges it on a CUDA build (raw: the weights' bytes, whose block scales q4_1 / q5_1
    read)."""
    le = LocalErrors(10.0, emulate="cuda")
    le.add(n or node(cols=x.shape[0]), [wd[None, None], x[None, None]], got[None, None], 0, 0, ggml_type, offs,
           None if raw is None else scales(raw, ggml_type))
    return le


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1", "q5_1"])
def test_a_clean_mmvq_node_sits_at_the_fp32_floor_of_its_emulation(kind):
    raw, wd, x, ggml_type, offs = case(kind)
    got = mmvq_replay(raw, kind, x)
    le = judged(kind, got, wd, x, ggml_type, offs, raw=raw)
    (rec,) = le.excused.values()
    assert le.fault is None and rec["error"] > 1e-3 and rec["emulated_error"] < 3e-7, rec
    assert rec["path"] == f"8-bit weights ({kind}; activations rounded to 8-bit, CUDA mmvq)"


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1", "q5_1"])
def test_a_1e4_fault_in_an_mmvq_node_is_named(kind):
    """1e-4 in half the values: far below the 0.08 an 8-bit node is otherwise excused to."""
    raw, wd, x, ggml_type, offs = case(kind, seed=1)
    got = mmvq_replay(raw, kind, x)
    got.reshape(-1)[: got.size // 2] *= F32(1 + 1e-4)
    le = judged(kind, got, wd, x, ggml_type, offs, raw=raw)
    assert le.fault is not None and le.fault["path"].endswith("CUDA mmvq, emulated)"), le.fault
    assert le.fault["error"] > 3 * le.fault["threshold"] and not le.excused


def test_q4_0_without_its_block_sums_would_not_fit():
    """q4_0's offset meets the f16 sum of the unrounded x, not the rounded values' sum: dropping that term leaves
    the clean node far past the floor (what makes the offsets worth reading)."""
    raw, wd, x, ggml_type, offs = case("q4_0", seed=2)
    got = mmvq_replay(raw, "q4_0", x)
    xr = rounded(x, "q8_0", "scalar")
    plain = np.linalg.norm(got - xr @ wd.T) / np.linalg.norm(xr @ wd.T)
    assert plain > 1e-4
    assert judged("q4_0", got, wd, x, ggml_type, None).excused[("1.xz", path_of(node(), 2))].get(
        "emulated_error") is None                   # no offsets read: not emulated, its family's limit


@pytest.mark.parametrize("kind", ["q4_1", "q5_1"])
def test_q1_types_scale_products_are_rounded_to_f16(kind):
    """q4_1 / q5_1 on mmvq multiply d * d8 and m * s8 in f16 (__hmul2): the same product with those two in float32
    (their CPU dot product's way) leaves a clean node far past the floor, and without its scales read the node keeps
    its family's limit (not emulated)."""
    raw, wd, x, ggml_type, offs = case(kind, seed=6)
    got = mmvq_replay(raw, kind, x)
    xr = rounded(x, "q8_0", "scalar")
    f32_way = with_block_sums(xr @ wd.T, xr, cuda_sums(x), offs)
    assert np.linalg.norm(got - f32_way) / np.linalg.norm(f32_way) > 1e-5
    le = judged(kind, got, wd, x, ggml_type, offs)
    (rec,) = le.excused.values()
    assert le.fault is None and "emulated_error" not in rec, rec


@pytest.mark.parametrize("kind, ggml_type, top", [("q4_1", 3, 15), ("q5_1", 7, 31)])
def test_q1_block_scales_are_read_from_the_weight_bytes(kind, ggml_type, top):
    """The scale d read from each block's first two bytes, with the minimum m: every dequantized value is m plus d
    times an integer in 0..15 (0..31); read only where CUDA's mmvq multiplies it in f16."""
    raw, wd, _, _, offs = case(kind, seed=7)
    d = scales(raw, ggml_type)
    ints = (wd.reshape(d.shape[0], -1, 32) - offs[..., None]) / d[..., None]
    assert np.abs(ints - np.rint(ints)).max() < 1e-3 and ints.min() > -1e-3 and ints.max() < top + 1e-3
    assert np.rint(ints).max() == top and scales(raw, 8) is None and scales(raw[:, :-1], ggml_type) is None
    assert wants_scales("cuda", kind, node()) and not wants_scales("cuda", kind, node(backend="CUDA_Host"))
    assert not wants_scales("cpu", kind, node(backend="CPU")) and not wants_scales("cuda", "q4_0", node())


def test_which_nodes_are_emulated_on_a_cuda_build():
    """mmvq runs for at most 8 columns (MMVQ_MAX_BATCH_SIZE) in CUDA memory; more columns go to MMQ (not emulated); f16
    weights are not emulated on CUDA; a CUDA_Host node ran on the CPU beside the GPU."""
    assert emulation("cuda", "q8_0", node(cols=8)) == "cuda" and emulation("cuda", "q6_K", node(cols=1)) == "cuda"
    assert emulation("cuda", "q8_0", node(cols=9)) is None and emulation("cuda", "q4_0", node(cols=9)) is None
    assert emulation("cuda", "q8_0", node(backend="CUDA_Host")) == "cpu"
    assert emulation("cuda", "f16", node()) is None and emulation("cuda", "q4_1", node()) == "cuda"
    assert emulation(None, "q8_0", node()) is None and emulation("cpu", "q4_1", node(backend="CPU")) == "cpu"
    # a CUDA build's layers left on the CPU (-ngl below the layer count): the CPU's rounding, at any column count
    assert emulation("cuda", "q4_1", node(backend="CUDA_Host", cols=512)) == "cpu"
    assert emulation("cuda", "f16", node(backend="CPU")) == "cpu"
    assert path_of(node(cols=9), 2) == "8-bit weights (q4_0; activations rounded to 8-bit)"
    raw, wd, x, ggml_type, offs = case("q4_0", seed=3, cols=9)
    got = mmvq_replay(raw, "q4_0", x)
    got.reshape(-1)[: got.size // 2] *= F32(1 + 1e-4)
    le = judged("q4_0", got, wd, x, ggml_type, offs)
    assert le.fault is None and all("emulated_error" not in r for r in le.excused.values())


def test_cuda_block_sums_are_the_f16_sum_of_the_float32_values():
    x = (np.random.default_rng(4).standard_normal((3, 128)) * 50).astype(F32)
    want = np.array([s for _, _, s in q8_1_blocks(x)]).reshape(3, 4)
    assert np.array_equal(cuda_sums(x), want)
    assert cuda_sums(x[:, :40]) is None


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q5_1"])
def test_a_value_at_a_half_rounded_the_other_way_is_not_a_fault(kind):
    """ggml-cuda is built with -use_fast_math: x / d is an approximate division, so a value at a half may round
    down where the emulation rounds it up. Such a value moves its whole column by one step times a weight column
    (1e-3 relative here: a clean head node read DIVERGED so on an H100); it is settled as a tie, while a 1e-4 fault
    spread over the node is still named."""
    raw, wd, x, ggml_type, offs = case(kind, seed=5)
    d = np.abs(x[1, 32:64]).max() / F32(127)
    x[1, 40] = F32(11.5) * d            # x / d = 11.5: roundf and the CPU's halves-to-even both give 12, the kernel 11
    assert abs(float(x[1, 40]) / float(d) - 11.5) < 1e-5
    got = mmvq_replay(raw, kind, x, flip=(1, 40))
    le = judged(kind, got, wd, x, ggml_type, offs, raw=raw)
    (rec,) = le.excused.values()
    assert le.fault is None and rec["emulated_error"] < 3e-7, rec
    got.reshape(-1)[: got.size // 2] *= F32(1 + 1e-4)
    assert judged(kind, got, wd, x, ggml_type, offs, raw=raw).fault is not None

