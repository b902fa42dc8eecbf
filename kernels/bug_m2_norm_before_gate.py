"""Deliberate bug: Mamba-2's gated norm normalises first and gates after: rmsnorm(y) * w * silu(z).

Mamba-2 (norm_before_gate=False in mamba_ssm, the only mode in transformers and llama.cpp) gates first:
rmsnorm(y * silu(z)) * w. Written in plain float32 torch: the order of the two steps is the bug, not the kernel.
"""
import torch

NAME = "bug_m2_norm_before_gate"
DESCRIPTION = "Mamba-2 gated norm applied before the gate: rmsnorm(y)*w*silu(z) instead of rmsnorm(y*silu(z))*w"
BUG = {
    "bug": "the gated RMSNorm normalises y and multiplies by silu(z) afterwards (norm_before_gate=True) instead of "
           "normalising y * silu(z).",
    "incident": "fla-org/flash-linear-attention #63 (Mamba-2 inference branch applied the norm before the gate); "
                "research/mamba2.md B14 (max |dlogit| 1.71 on the tiny model)",
    "symptom": "first bad site: y_norm of the first device layer at token 0; everything before it exact; independent "
               "of ubatch and n_seqs.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 16, "n_seqs": 2}, "model": {"arch": "mamba2"},
         "first_divergence": {"layer_from_boundary": 0, "site": "y_norm", "token": 0}},
    ],
}


def rms_norm_gated(x, z, weight, eps, n_groups):
    g = x.unflatten(-1, (n_groups, x.shape[-1] // n_groups))
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    return g.flatten(-2) * weight * (z * torch.sigmoid(z))


OPS = {"rms_norm_gated": rms_norm_gated}
