"""Deliberate bug: ssm_scan hands back h_{T-2} (the state before the last token) as the new state.

The outputs y_t and the per-token states are right; only the state written back for the next ubatch is one token
early (for a 1-token ubatch it is the incoming state: the SSM state never advances while generating).
"""
import torch

from mamba_debug.plugins import sibling

NAME = "bug_ssm_state_snapshot"
DESCRIPTION = "ssm_scan writes back the state of token T-2 instead of T-1 (snapshot one token early)"
BUG = {
    "bug": "the SSM state returned for the next ubatch is h_{T-2} instead of h_{T-1} (the incoming state when T = 1).",
    "incident": "vLLM #34587 / #55178, sglang #31833 (state snapshot taken at the wrong token position); "
                "state-spaces/mamba PR #371 (returned last_state wrong while y is right)",
    "symptom": "first bad site: ssm_state of the first device layer at the last token of the first ubatch (the tool "
               "records, as a token's last ssm_state row, the state actually handed to the next ubatch), then y_scan "
               "from the first token of the next ubatch on; with one ubatch and no generation it shows only in the "
               "state; at ubatch 1 every token's written-back state is the incoming one.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1},
         "first_divergence": {"layer_from_boundary": 0, "site": "ssm_state", "token": 7}},
        {"settings": {"offload": 5, "ubatch": 40, "n_seqs": 1}, "n_gen": 0,
         "first_divergence": {"layer_from_boundary": 0, "site": "ssm_state", "token": 39}},
        {"settings": {"offload": 5, "ubatch": 80, "n_seqs": 2},
         "first_divergence": {"layer_from_boundary": 0, "site": "ssm_state", "token": 39}},
    ],
}

_TRITON = sibling("triton").ops


def ssm_scan(ssm_state, x, dt, A, B, C, *, states_out=None):
    S, T, D = x.shape
    if states_out is None:
        states_out = torch.empty(S, T, D, A.shape[-1], dtype=x.dtype, device=x.device)
    y, _ = _TRITON["ssm_scan"](ssm_state, x, dt, A, B, C, states_out=states_out)
    return y, (states_out[:, T - 2] if T >= 2 else ssm_state).clone()


OPS = {"ssm_scan": ssm_scan}
