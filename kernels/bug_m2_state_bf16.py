"""Deliberate bug: the Mamba-2 SSM state is stored in bfloat16 between ubatches.

The correct Triton ssd_scan computes in fp32, but the state it returns (the cache written back for the next
ubatch or token) is rounded to bfloat16 and back, as when the cache is allocated in the model's 16-bit dtype.
"""
import torch

from mamba_debug.plugins import sibling

NAME = "bug_m2_state_bf16"
DESCRIPTION = "Mamba-2 SSM state rounded to bfloat16 when written back at the end of each ubatch"
BUG = {
    "bug": "the SSM state handed from one ubatch (or decode step) to the next is stored in bf16 (cache allocated in "
           "the weights' dtype) while the math runs in fp32.",
    "incident": "vLLM #13466 and PR #22928 (mamba_ssm_cache_dtype), PR #39032 (NemotronH defaults to an fp32 state); "
                "ml-explore/mlx-lm PR #988 (gibberish after 15-20 decode tokens); research/mamba2.md B9",
    "symptom": "first bad site: ssm_state of the first device layer at the last token of the first ubatch (the state "
               "handed on); y_scan follows at the first token of the next ubatch; every output inside the first "
               "ubatch is exact.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1}, "model": {"arch": "mamba2"},
         "first_divergence": {"layer_from_boundary": 0, "site": "ssm_state", "token": 7}},
        {"settings": {"offload": 1, "ubatch": 40, "n_seqs": 1}, "n_gen": 0, "model": {"arch": "mamba2"},
         "first_divergence": {"layer_from_boundary": 0, "site": "ssm_state", "token": 39}},
        {"settings": {"offload": 0, "ubatch": 8, "n_seqs": 1}, "model": {"arch": "mamba2"}, "first_divergence": None},
    ],
}

_TRITON = sibling("triton").ops


def ssd_scan(ssm_state, x, dt, A, B, C, *, states_out=None):
    y, state = _TRITON["ssd_scan"](ssm_state, x, dt, A, B, C, states_out=states_out)
    state = state.to(torch.bfloat16).to(state.dtype)
    if states_out is not None:
        states_out[:, -1] = state
    return y, state


OPS = {"ssd_scan": ssd_scan}
