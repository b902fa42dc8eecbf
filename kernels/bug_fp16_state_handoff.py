"""Deliberate bug: the states handed to the next ubatch are rounded to fp16 (a half-precision state cache).

The Triton kernels compute in fp32; this variant rounds the conv and SSM states they return to float16 and back
(the tensors stay float32, as the contract requires), as a cache of type f16 or an fp16 CPU<->GPU copy would.
"""
import torch

from mamba_debug.plugins import sibling

NAME = "bug_fp16_state_handoff"
DESCRIPTION = "conv and SSM states are rounded to fp16 when written back at the end of each ubatch"
BUG = {
    "bug": "the new conv and SSM states are stored through float16, losing 13 mantissa bits at every ubatch "
           "boundary; the outputs inside a ubatch are fp32-exact.",
    "incident": "seed-semantics §11 scenario 11 (reduced-precision state hand-off / f16 recurrent cache); llama.cpp "
                "#22675 (fp16 intermediates in the Mamba-2 SSD path, NMSE limit raised to 2e-7)",
    "symptom": "small (~1e-4 relative) errors born at ubatch boundaries of device layers only: the first bad site is "
               "the conv_state of the first device layer at the last token of the first ubatch (token = ubatch-1); "
               "more boundaries (smaller ubatch) mean more accumulated error; nothing with offload 0.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1},
         "first_divergence": {"layer_from_boundary": 0, "site": "conv_state", "token": 7}},
        {"settings": {"offload": 5, "ubatch": 80, "n_seqs": 2}, "n_gen": 0,
         "first_divergence": {"layer_from_boundary": 0, "site": "conv_state", "token": 39}},
        {"settings": {"offload": 0, "ubatch": 8, "n_seqs": 1}, "first_divergence": None},
    ],
}

_TRITON = sibling("triton").ops


def _fp16(t):
    return t.to(torch.float16).to(t.dtype)


def ssm_conv(conv_state, x, weight):
    out, new = _TRITON["ssm_conv"](conv_state, x, weight)
    return out, _fp16(new)


def ssm_scan(ssm_state, x, dt, A, B, C, *, states_out=None):
    y, new = _TRITON["ssm_scan"](ssm_state, x, dt, A, B, C, states_out=states_out)
    return y, _fp16(new)


OPS = {"ssm_conv": ssm_conv, "ssm_scan": ssm_scan}
