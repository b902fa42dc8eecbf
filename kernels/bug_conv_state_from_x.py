"""Deliberate bug: ssm_conv takes the new conv state from this ubatch's x alone, not from the window.

The new state must be the last K-1 rows of window = concat(conv_state, x). This variant keeps the last K-1 rows of x,
padded with zeros in front when the ubatch has fewer than K-1 tokens. For T >= K-1 both are identical, so prompt
processing with normal ubatches is exact; ubatches of 1 .. K-2 tokens (token generation, or the short tail
ubatch of a prompt) lose the older rows of the state.
"""
import torch

from mamba_debug.plugins import sibling

NAME = "bug_conv_state_from_x"
DESCRIPTION = "ssm_conv keeps the last K-1 rows of x (zero-padded) as the new state instead of the window's"
BUG = {
    "bug": "the new conv state is built from the ubatch's x only (zero-padded to K-1 rows) instead of from "
           "concat(old state, x); wrong exactly when the ubatch has fewer than K-1 tokens.",
    "incident": "state-spaces/mamba #56 (conv_state updated from x[..., -d_conv:] when the input is shorter than "
                "d_conv; fixed in v1.1.0); seed-semantics §11 scenario 4(b)",
    "symptom": "invisible for ubatches of >= K-1 tokens (K = 4 here); first bad site: conv_state of the first device "
               "layer at the first ubatch shorter than K-1 tokens: the first generated token (token 40), or the "
               "1-token tail ubatch of a 40-token prompt at ubatch 3 (token 39); prompt fine, generation broken.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1}, "n_gen": 0, "first_divergence": None},
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1},
         "first_divergence": {"layer_from_boundary": 0, "site": "conv_state", "token": 40}},
        {"settings": {"offload": 2, "ubatch": 6, "n_seqs": 2}, "n_gen": 0,
         "first_divergence": {"layer_from_boundary": 0, "site": "conv_state", "token": 39, "seq": 0}},
    ],
}

_TRITON = sibling("triton").ops


def ssm_conv(conv_state, x, weight):
    out, _ = _TRITON["ssm_conv"](conv_state, x, weight)
    km1 = conv_state.shape[1]
    padded = torch.cat([torch.zeros_like(conv_state), x], dim=1)
    return out, padded[:, -km1:].contiguous()


OPS = {"ssm_conv": ssm_conv}
