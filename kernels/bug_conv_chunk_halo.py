"""Deliberate bug: the long-ubatch path of ssm_conv starts every 32-token chunk from a zero halo.

Real kernels switch paths with the ubatch length (llama.cpp's CUDA ssm_conv: n_t <= 32 vs a long-token path).
Emulation: for T <= 32 the correct Triton kernel runs on the whole ubatch; for T > 32 it runs chunk by chunk, the
first chunk with the real state and every later chunk with zeros where the previous chunk's last K-1 inputs (the
halo) should be. The new state is taken from the full window (correct), as a separate state-writing step would.
"""
import torch

from mamba_debug.plugins import sibling

NAME = "bug_conv_chunk_halo"
DESCRIPTION = "ssm_conv for ubatches > 32 tokens: each 32-token chunk starts from a zero halo"
BUG = {
    "bug": "on the long-token path (T > 32) every 32-token chunk of the ubatch is convolved as if the K-1 tokens "
           "before it were zeros; the path for T <= 32 is correct.",
    "incident": "llama.cpp CUDA ssm_conv n_t <= 32 vs long-token path (HIP unroll bug a4715f91); vLLM #55178 / "
                "#57605 (errors only at chunk boundaries); seed-semantics §8 class E, §11 scenario 9",
    "symptom": "exact for ubatch <= 32 (and for generation); for ubatch 40 the first bad site is conv of the first "
               "device layer at token 32 (then tokens 33, 34 of the same chunk), then downstream layers through the "
               "residual stream; '-ub 32 good, -ub 33 bad'.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 40, "n_seqs": 1},
         "first_divergence": {"layer_from_boundary": 0, "site": "conv", "token": 32}},
        {"settings": {"offload": 2, "ubatch": 64, "n_seqs": 2}, "first_divergence": None},
        {"settings": {"offload": 5, "ubatch": 33, "n_seqs": 1}, "n_gen": 0,
         "first_divergence": {"layer_from_boundary": 0, "site": "conv", "token": 32}},
    ],
}

CHUNK = 32
_TRITON = sibling("triton").ops


def ssm_conv(conv_state, x, weight):
    T = x.shape[1]
    if T <= CHUNK:
        return _TRITON["ssm_conv"](conv_state, x, weight)
    outs = []
    for c in range(0, T, CHUNK):
        halo = conv_state if c == 0 else torch.zeros_like(conv_state)
        outs.append(_TRITON["ssm_conv"](halo, x[:, c:c + CHUNK], weight)[0])
    new_state = torch.cat([conv_state, x], dim=1)[:, T:].contiguous()
    return torch.cat(outs, dim=1), new_state


OPS = {"ssm_conv": ssm_conv}
