"""Deliberate bug: the device ssm_conv and ssm_scan start every call from a zero state.

The correct Triton kernels are called with `zeros_like(state)` instead of the state handed over from the previous
ubatch; the state they return is right. So the first ubatch of a prompt is exact, and every later ubatch (every
generated token too) forgets the past: a layer without memory.
"""
import torch

from mamba_debug.plugins import sibling

NAME = "bug_state_not_carried"
DESCRIPTION = "ssm_conv/ssm_scan ignore the incoming state (every ubatch starts from zeros)"
BUG = {
    "bug": "the device ops read a zero state at the start of every call instead of the state written at the end of "
           "the previous ubatch (the returned state itself is correct).",
    "incident": "mamba_ssm #641 / #536 and HF transformers #46032 (chunked continuation ignores the initial state); "
                "seed-semantics §8 class D, §11 scenario 3",
    "symptom": "the first ubatch is exact; first bad site: conv of the first device layer at the first token of the "
               "second ubatch (token = ubatch), then y_scan; a prompt done in one ubatch is exact and the first "
               "generated token is the first bad one; independent of n_seqs; nothing with offload 0.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1},
         "first_divergence": {"layer_from_boundary": 0, "site": "conv", "token": 8}},
        {"settings": {"offload": 5, "ubatch": 40, "n_seqs": 1},
         "first_divergence": {"layer_from_boundary": 0, "site": "conv", "token": 40}},
        {"settings": {"offload": 5, "ubatch": 80, "n_seqs": 2}, "n_gen": 0, "first_divergence": None},
    ],
}

_TRITON = sibling("triton").ops


def ssm_conv(conv_state, x, weight):
    return _TRITON["ssm_conv"](torch.zeros_like(conv_state), x, weight)


def ssm_scan(ssm_state, x, dt, A, B, C, *, states_out=None):
    return _TRITON["ssm_scan"](torch.zeros_like(ssm_state), x, dt, A, B, C, states_out=states_out)


OPS = {"ssm_conv": ssm_conv, "ssm_scan": ssm_scan}
