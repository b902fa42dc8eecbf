"""Deliberate bug: attention accumulates softmax * V in fp16 without subtracting the row's KQ maximum.

The flash-attention fp16 accumulator of llama.cpp's CUDA back-end overflowed on Granite-4.0-H at long context.
Here exp(scale * q.k) is taken without the max offset and the weighted sum of V is accumulated in fp16 (normalised
at the end in fp32): rounding at every context length, inf/NaN once scores grow large.
"""
import torch

NAME = "bug_m2_attn_fp16_acc"
DESCRIPTION = "hybrid attention: softmax*V accumulated in fp16 with no KQ-max offset (Granite-4.0-H long-context)"
BUG = {
    "bug": "the attention kernel accumulates exp(scale q.k) * v in an fp16 accumulator without offsetting the scores "
           "by their row maximum.",
    "incident": "llama.cpp #17610 -> PR #17746 and #18606 -> PR #18614 (Granite-4.0-H-1B '??????' at 32k on CUDA, "
                "H-Small/Micro at 100k-200k; CPU fine); research/mamba2.md B4",
    "symptom": "first bad site: attn of the first device attention layer at token 0; Mamba-2 layers before it exact; "
               "grows with context length rather than with -ub.",
    "expect": [
        {"settings": {"offload": 3, "ubatch": 8, "n_seqs": 1}, "model": {"arch": "hybrid"},
         "first_divergence": {"layer_from_boundary": 0, "site": "attn", "token": 0}},
        {"settings": {"offload": 2, "ubatch": 10, "n_seqs": 2}, "model": {"arch": "hybrid"},
         "first_divergence": {"layer_from_boundary": 1, "site": "attn", "token": 0}},
    ],
}


def attention(q, k_cache, v_cache, scale):
    T, Hq, Tk = q.shape[1], q.shape[2], k_cache.shape[1]
    k = k_cache.repeat_interleave(Hq // k_cache.shape[2], dim=2)
    v = v_cache.repeat_interleave(Hq // v_cache.shape[2], dim=2)
    scores = torch.einsum("sthd,sjhd->shtj", q, k) * scale
    pos = torch.arange(T, device=q.device)[:, None] + (Tk - T)
    p = torch.exp(scores).masked_fill(torch.arange(Tk, device=q.device)[None, :] > pos, 0.0)
    acc = torch.einsum("shtj,sjhd->sthd", p.half(), v.half())               # fp16 accumulator, no max offset
    return (acc.float() / p.sum(-1).transpose(1, 2)[..., None]).to(q.dtype)


OPS = {"attention": attention}
