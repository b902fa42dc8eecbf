"""Deliberate bug: the chunked Mamba-2 scan loses the state at chunk boundaries inside a ubatch.

The scan runs chunk by chunk (Q = 16 tokens) with the correct Triton kernel, but every chunk after the first of a
ubatch starts from zeros instead of the state the previous chunk passed on. Ubatches of at most 16 tokens (and
decode) are exact; a longer ubatch goes wrong from its 17th token.
"""
import torch

from mamba_debug.plugins import sibling

NAME = "bug_m2_chunk_state_dropped"
DESCRIPTION = "chunked Mamba-2 ssd_scan drops the state passed between chunks of 16 tokens inside a ubatch"
BUG = {
    "bug": "state passing between SSD chunks is skipped: each chunk after the first of the ubatch starts from a zero "
           "state (the inter-chunk term exp(cumsum) * C * S_prev is lost), while the state returned is the last "
           "chunk's.",
    "incident": "vLLM PR #23279, #21783, #22034 (chunked prefill != full prefill when a sequence starts or ends inside "
                "a chunk; dA_cumsum from the chunk start); transformers #47246 -> PR #47513 (wrong only when T > "
                "chunk_size); research/mamba2.md B7, B10",
    "symptom": "first bad site: y_scan of the first device layer at token 16 (the first token of the second chunk) "
               "when a ubatch is longer than 16 tokens; ubatches of 16 or fewer tokens are exact except that the "
               "state handed on is then also fine, so ubatch 8 shows nothing.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 40, "n_seqs": 1}, "model": {"arch": "mamba2"},
         "first_divergence": {"layer_from_boundary": 0, "site": "y_scan", "token": 16}},
        {"settings": {"offload": 2, "ubatch": 16, "n_seqs": 2}, "model": {"arch": "mamba2"}, "first_divergence": None},
    ],
}

Q = 16
_TRITON = sibling("triton").ops


def ssd_scan(ssm_state, x, dt, A, B, C, *, states_out=None):
    ys, state = [], ssm_state
    for t0 in range(0, x.shape[1], Q):
        sl = slice(t0, t0 + Q)
        start = ssm_state if t0 == 0 else torch.zeros_like(ssm_state)
        y, state = _TRITON["ssd_scan"](start, x[:, sl], dt[:, sl], A, B[:, sl], C[:, sl],
                                       states_out=None if states_out is None else states_out[:, sl])
        ys.append(y)
    return torch.cat(ys, dim=1), state


OPS = {"ssd_scan": ssd_scan}
