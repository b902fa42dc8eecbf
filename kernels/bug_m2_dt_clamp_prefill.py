"""Deliberate bug: dt is clamped (softplus(dt) <= 0.05) in multi-token ubatches only, never in decode.

mamba_ssm's chunked prefill and transformers' chunked path apply `time_step_limit`; their decode paths and
llama.cpp never do. Here the clamp is applied (to the correct Triton kernel's input) when T > 1.
"""
import math

import torch

from mamba_debug.plugins import sibling

NAME = "bug_m2_dt_clamp_prefill"
DESCRIPTION = "Mamba-2 dt clamped to softplus(dt) <= 0.05 in prefill ubatches only (decode unclamped)"
LIMIT = 0.05
BUG = {
    "bug": "the dt limit (time_step_limit / dt_limit) is applied in the chunked prefill path but not in the decode "
           "path, so prefill and decode compute different models whenever softplus(dt) exceeds the limit.",
    "incident": "mamba_ssm _chunk_cumsum_fwd vs selective_state_update; transformers 5.24 mamba2_chunk_scan vs "
                "mamba2_selective_state_update; mlx-lm PRs #988/#1026; research/mamba2.md B12 (HF decode != HF "
                "forward by 4e-2..2e-1 with time_step_limit=(0, 0.05))",
    "symptom": "first bad site: y_scan of the first device layer at token 0 of a multi-token ubatch; with ubatch 1 "
               "(every token a decode step) nothing diverges.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1}, "model": {"arch": "mamba2"},
         "first_divergence": {"layer_from_boundary": 0, "site": "y_scan", "token": 0}},
        {"settings": {"offload": 2, "ubatch": 1, "n_seqs": 1}, "prompt_len": 12, "model": {"arch": "mamba2"},
         "first_divergence": None},
    ],
}

_TRITON = sibling("triton").ops
_DT_AT_LIMIT = math.log(math.expm1(LIMIT))          # softplus^-1(LIMIT)


def ssd_scan(ssm_state, x, dt, A, B, C, *, states_out=None):
    if x.shape[1] > 1:
        dt = torch.clamp(dt, max=_DT_AT_LIMIT)       # softplus is increasing: clamps softplus(dt) at LIMIT
    return _TRITON["ssd_scan"](ssm_state, x, dt, A, B, C, states_out=states_out)


OPS = {"ssd_scan": ssd_scan}
