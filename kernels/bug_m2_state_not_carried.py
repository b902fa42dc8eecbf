"""Deliberate bug: Mamba-2's scan starts every call from a zero SSM state (the state handed over is ignored).

The correct Triton ssd_scan is called with zeros_like(ssm_state). The first ubatch of a prompt is exact; every
later ubatch, and every generated token, forgets what came before (the conv state is still carried).
"""
import torch

from mamba_debug.plugins import sibling

NAME = "bug_m2_state_not_carried"
DESCRIPTION = "Mamba-2 ssd_scan ignores the incoming SSM state (each ubatch starts from zeros)"
BUG = {
    "bug": "ssd_scan reads a zero state at the start of every call instead of the state written at the end of the "
           "previous ubatch (initial_states dropped).",
    "incident": "TensorRT-LLM PR #6334 (initial_states dropped when batch == 1); vLLM PR #23279; transformers #46032 "
                "(chunked continuation ignored the cache); research/mamba2.md B7, B8",
    "symptom": "first bad site: y_scan of the first device layer at the first token of the second ubatch "
               "(token = ubatch); a prompt in one ubatch is exact until the first generated token; nothing with "
               "offload 0. In a hybrid the first device Mamba-2 layer shows it (attention layers carry a KV cache, which grows).",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1}, "model": {"arch": "mamba2"},
         "first_divergence": {"layer_from_boundary": 0, "site": "y_scan", "token": 8}},
        {"settings": {"offload": 3, "ubatch": 80, "n_seqs": 2}, "model": {"arch": "hybrid"},
         "first_divergence": {"layer_from_boundary": 1, "site": "y_scan", "token": 40}},
        {"settings": {"offload": 0, "ubatch": 8, "n_seqs": 1}, "model": {"arch": "mamba2"}, "first_divergence": None},
    ],
}

_TRITON = sibling("triton").ops


def ssd_scan(ssm_state, x, dt, A, B, C, *, states_out=None):
    return _TRITON["ssd_scan"](torch.zeros_like(ssm_state), x, dt, A, B, C, states_out=states_out)


OPS = {"ssd_scan": ssd_scan}
