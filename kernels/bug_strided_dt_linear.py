"""Deliberate bug: `linear` reads a non-contiguous input as if it were contiguous (flat rows of `in` values).

`dt` is the first R columns of `linear(conv_act, x_proj)` (row stride R + 2N), and it is the only strided input a
`linear` gets in the layer. A GEMM that takes `x.data_ptr()` with an assumed row stride of `in` features reads the
R values of row 0 correctly and, for every other row, a slice of dt|B|C of earlier rows. Same class as the #6758 gate
bug, but on the dt projection: it shows at the `dt` site, not the gate.
"""
import torch
import torch.nn.functional as F

NAME = "bug_strided_dt_linear"
DESCRIPTION = "linear ignores the strides of a non-contiguous input (the dt slice of x_proj's output)"
BUG = {
    "bug": "linear reads its input from the view's offset as contiguous rows of `in` values; only the dt slice of "
           "the x_proj output is strided, so every dt row but the first is computed from the wrong numbers.",
    "incident": "vLLM #32710 (ROCm GEMM wrong on the non-contiguous Mamba-1 time_step split); llama.cpp #9932 / #11659 "
                "(CUDA norm on the non-contiguous dt/B/C views); class A of seed-semantics §8",
    "symptom": "first bad site: dt of the first device layer, token 1; exact at ubatch 1 with one sequence; with "
               "n_seqs > 1 sequence 1 is already wrong at token 0 (only the very first row of the ubatch is right); "
               "B and C (read through views by the scan) stay right.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1},
         "first_divergence": {"layer_from_boundary": 0, "site": "dt", "token": 1}},
        {"settings": {"offload": 2, "ubatch": 1, "n_seqs": 1}, "prompt_len": 12, "first_divergence": None},
        {"settings": {"offload": 2, "ubatch": 1, "n_seqs": 3}, "prompt_len": 12,
         "first_divergence": {"layer_from_boundary": 0, "site": "dt", "token": 0, "seq": 1}},
    ],
}


def linear(x, weight, bias=None):
    flat = torch.as_strided(x, x.shape, torch.empty(x.shape, device="meta").stride(), x.storage_offset())
    return F.linear(flat, weight, bias)


OPS = {"linear": linear}
