"""Deliberate bug: the scan's softplus drops the `dt > 20` threshold and computes log1p(exp(dt)) in fp32.

llama.cpp's kernels compute `dt <= 20 ? log1pf(expf(dt)) : dt`. Without the threshold, fp32 `expf` overflows to
inf for dt > 88.72, and then delta = inf: exp(delta*A) = 0 and delta*B*x = +-inf, so the state and y turn inf/NaN.
Between 20 and 88.72 nothing changes in fp32 (log1p(exp(dt)) rounds to dt there), and real dt are far below 20, so
the bug is invisible on ordinary weights and inputs: the test builds a model whose dt_bias is 100 on a few channels
("model": {"dt_bias": 100.0} in the expectations below). Emulation: the correct Triton scan, given dt = +inf where
fp32 exp(dt) overflows (its own softplus then returns inf there, exactly what the threshold-less formula gives).
"""
import torch

from mamba_debug.plugins import sibling

NAME = "bug_softplus_no_threshold"
DESCRIPTION = "ssm_scan softplus without the dt > 20 threshold: fp32 exp(dt) overflows to inf for dt > 88.7"
BUG = {
    "bug": "softplus(dt) is computed as log1p(exp(dt)) for every dt; in fp32 exp overflows above dt = 88.72 and "
           "delta becomes inf (identical to the thresholded formula below that).",
    "incident": "llama.cpp ssm_scan kernels (CPU/CUDA/Metal) all keep the `dt <= 20.0f ? log1pf(expf(dt)) : dt` "
                "branch; seed-semantics §11 scenario 5 (dropping the threshold, in fp16 it overflows from dt > 11.1)",
    "symptom": "nothing at all on a model with ordinary dt (the random model: dt < 0 everywhere); with dt > 88.72 on "
               "some channels (dt_bias = 100) the first bad site is y_scan of the first device layer at token 0 "
               "(inf/NaN), independent of ubatch and n_seqs.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1}, "first_divergence": None},
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1}, "model": {"dt_bias": 100.0},
         "first_divergence": {"layer_from_boundary": 0, "site": "y_scan", "token": 0}},
        {"settings": {"offload": 1, "ubatch": 1, "n_seqs": 2}, "prompt_len": 12, "model": {"dt_bias": 100.0},
         "first_divergence": {"layer_from_boundary": 0, "site": "y_scan", "token": 0, "seq": 0}},
    ],
}

_TRITON = sibling("triton").ops


def ssm_scan(ssm_state, x, dt, A, B, C, *, states_out=None):
    overflow = torch.isinf(torch.exp(dt.float()))
    dt = torch.where(overflow, torch.full_like(dt, float("inf")), dt)
    return _TRITON["ssm_scan"](ssm_state, x, dt, A, B, C, states_out=states_out)


OPS = {"ssm_scan": ssm_scan}
