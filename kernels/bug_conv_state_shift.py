"""Deliberate bug: ssm_conv writes back the conv state shifted by one token.

The new state must be the last K-1 rows of window = concat(conv_state, x), rows T .. T+K-2. This variant keeps rows
T-1 .. T+K-3 (an off-by-one in the write-back index). Outputs inside a ubatch are right; the state handed to the
next ubatch is stale by one token. At T = 1 (generation) the "new" state is the old one: the conv state never
advances while generating.
"""
import torch

from mamba_debug.plugins import sibling

NAME = "bug_conv_state_shift"
DESCRIPTION = "ssm_conv writes back window rows T-1..T+K-3 instead of T..T+K-2 (conv state off by one)"
BUG = {
    "bug": "the conv state written at the end of a ubatch starts one row too early in the window (off-by-one), so it "
           "holds x_{T-K}..x_{T-2} instead of x_{T-K+1}..x_{T-1}.",
    "incident": "seed-semantics §11 scenario 4(a) (conv-state write-back index); cf. vLLM #34587 / sglang #31833 "
                "(state snapshot taken at the wrong token position)",
    "symptom": "conv outputs inside a ubatch are exact; the first bad site is the conv_state of the first device "
               "layer, recorded at the last token of the first ubatch (token = ubatch-1), then the conv output of the "
               "first K-1 tokens of the next ubatch. §11 expected the single-ubatch case to be exact: it is not, "
               "because the tool compares the written-back state itself (it is wrong even if nobody reads it). "
               "Independent of n_seqs; nothing with offload 0.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1},
         "first_divergence": {"layer_from_boundary": 0, "site": "conv_state", "token": 7}},
        {"settings": {"offload": 5, "ubatch": 40, "n_seqs": 1}, "n_gen": 0,
         "first_divergence": {"layer_from_boundary": 0, "site": "conv_state", "token": 39}},
        {"settings": {"offload": 0, "ubatch": 8, "n_seqs": 1}, "first_divergence": None},
    ],
}

_TRITON = sibling("triton").ops


def ssm_conv(conv_state, x, weight):
    out, _ = _TRITON["ssm_conv"](conv_state, x, weight)
    T, km1 = x.shape[1], conv_state.shape[1]
    window = torch.cat([conv_state, x], dim=1)
    return out, window[:, T - 1:T - 1 + km1].contiguous()


OPS = {"ssm_conv": ssm_conv}
