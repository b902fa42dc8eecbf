"""Deliberate bug: ssm_conv applies the kernel taps in reverse order (weight orientation flipped).

out[t] must be sum_k w[k] * window[t + k] (w[K-1] multiplies the current token). This variant uses w[K-1-k], i.e.
weights [D, K] read as if stored newest-first: a plain-math error, not a state or batching one.
"""
from mamba_debug.plugins import sibling

NAME = "bug_conv_weight_flipped"
DESCRIPTION = "ssm_conv applies the conv taps in reverse order (w[c][k] on x[t-k])"
BUG = {
    "bug": "the depthwise conv weight is applied flipped along K: tap k multiplies x[t-k] instead of x[t-(K-1)+k].",
    "incident": "seed-semantics §11 scenario 10 (conv weight orientation: GGUF ssm_conv1d [d_conv, d_inner] vs HF "
                "conv1d.weight [d_inner, 1, d_conv])",
    "symptom": "first bad site: conv of the first device layer at token 0, independent of ubatch and n_seqs; the "
               "conv state itself stays exact (it holds inputs, not outputs).",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1},
         "first_divergence": {"layer_from_boundary": 0, "site": "conv", "token": 0}},
        {"settings": {"offload": 1, "ubatch": 1, "n_seqs": 2}, "prompt_len": 12,
         "first_divergence": {"layer_from_boundary": 0, "site": "conv", "token": 0, "seq": 0}},
        {"settings": {"offload": 0, "ubatch": 8, "n_seqs": 1}, "first_divergence": None},
    ],
}

_TRITON = sibling("triton").ops


def ssm_conv(conv_state, x, weight):
    return _TRITON["ssm_conv"](conv_state, x, weight.flip(1))


OPS = {"ssm_conv": ssm_conv}
