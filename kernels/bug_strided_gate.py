"""Deliberate bug: `silu` reads its input as a flat contiguous buffer (the #6758 CUDA SILU bug).

In the layer, `gate = silu(z)` gets `z = xz[..., D:]`, a strided view (row stride 2D, offset D). The old CUDA
`silu` ignored the strides (`silu_f32_cuda(src0->data, dst->data, ggml_nelements(src0))`): element j of the output
is silu(storage[offset + j]). Token 0 of sequence 0 is still right (its D values are contiguous); every other row
reads a mix of other tokens' x and z. `conv_act = silu(conv)` gets a contiguous tensor, so it stays correct.
"""
import torch

NAME = "bug_strided_gate"
DESCRIPTION = "silu ignores the strides of its input and reads z as contiguous: the #6758 strided-gate bug"
BUG = {
    "bug": "silu treats its input as a contiguous buffer starting at the view's offset; z is a strided half of xz, "
           "so every row but the first gates with other tokens' x/z values.",
    "incident": "llama.cpp #6758 (CUDA SILU on the non-contiguous z view; fixed by ggml_cont(z) in jploski 7509b9ee "
                "and the contiguity check of PR #7857)",
    "symptom": "first bad site: gate of the first device layer, token 1 (the first non-leading token of the first "
               "ubatch); exact at ubatch 1 with one sequence; with n_seqs > 1 only token 0 of sequence 0 is exact, "
               "so sequence 1 is wrong at token 0 even at ubatch 1; the layer's own states stay exact, the next "
               "layers' states are poisoned; nothing when no layer is offloaded.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1},
         "first_divergence": {"layer_from_boundary": 0, "site": "gate", "token": 1}},
        {"settings": {"offload": 2, "ubatch": 1, "n_seqs": 1}, "prompt_len": 12, "first_divergence": None},
        {"settings": {"offload": 1, "ubatch": 1, "n_seqs": 3}, "prompt_len": 12,
         "first_divergence": {"layer_from_boundary": 0, "site": "gate", "token": 0, "seq": 1}},
        {"settings": {"offload": 0, "ubatch": 8, "n_seqs": 1}, "first_divergence": None},
    ],
}


def silu(x):
    flat = torch.as_strided(x, x.shape, torch.empty(x.shape, device="meta").stride(), x.storage_offset())
    return flat * torch.sigmoid(flat)


OPS = {"silu": silu}
