"""Deliberate bug: above 128 tokens per sequence in a ubatch, the SSD operands are rounded to fp16.

llama.cpp's CUDA SSM_SCAN takes a chunked SSD path with fp16 operands (x*dt, B, C) when a ubatch holds more than
128 tokens per sequence (SSM_SSD_MIN_TOKENS) and the fp32 recurrence otherwise, so `-ub` selects the numerics.
Modelled here by rounding x, B and C to fp16 before the correct Triton kernel when T > 128.
"""
import torch

from mamba_debug.plugins import sibling

NAME = "bug_m2_ssd_fp16"
DESCRIPTION = "Mamba-2 ssd_scan with fp16-rounded x, B, C when a ubatch holds more than 128 tokens per sequence"
SSD_MIN_TOKENS = 128
BUG = {
    "bug": "the prefill SSD path (ubatches of more than 128 tokens per sequence) feeds x*dt, B and C to its matrix "
           "products as fp16, while shorter ubatches and decode use the fp32 recurrence.",
    "incident": "llama.cpp PR #22675 (2026-07-28, the CUDA SSD path: fp16 operands, plus in-PR int32 offset and "
                "shared-memory race fixes); research/mamba2.md key fact 4 and B5",
    "symptom": "drift depends on -ub: first bad site y_scan of the first device layer at token 0 when the ubatch "
               "holds more than 128 tokens of a sequence; ubatch 128 or less is exact.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 256, "n_seqs": 1}, "prompt_len": 140, "n_gen": 1,
         "model": {"arch": "mamba2"}, "first_divergence": {"layer_from_boundary": 0, "site": "y_scan", "token": 0}},
        {"settings": {"offload": 2, "ubatch": 128, "n_seqs": 1}, "prompt_len": 140, "n_gen": 1,
         "model": {"arch": "mamba2"}, "first_divergence": None},
    ],
}

_TRITON = sibling("triton").ops


def ssd_scan(ssm_state, x, dt, A, B, C, *, states_out=None):
    if x.shape[1] > SSD_MIN_TOKENS:
        x, B, C = (t.to(torch.float16).to(t.dtype) for t in (x, B, C))
    return _TRITON["ssd_scan"](ssm_state, x, dt, A, B, C, states_out=states_out)


OPS = {"ssd_scan": ssd_scan}
