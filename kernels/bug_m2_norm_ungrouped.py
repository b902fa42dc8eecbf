"""Deliberate bug: Mamba-2's gated RMSNorm normalises over all of d_inner instead of within each of the G groups.

The correct Triton rms_norm_gated is called with n_groups = 1. With G = 1 nothing changes; with G > 1 every token's
y_norm is off by the ratio of its group's RMS to the whole vector's.
"""
from mamba_debug.plugins import sibling

NAME = "bug_m2_norm_ungrouped"
DESCRIPTION = "Mamba-2 gated RMSNorm over all of d_inner instead of per group (n_groups ignored)"
BUG = {
    "bug": "rms_norm_gated normalises y * silu(z) over the whole d_inner vector instead of over each of the n_groups "
           "groups of d_inner / G channels (or uses the wrong group size under tensor parallelism).",
    "incident": "transformers PR #35943 (Zamba2) and PR #40861 (Mamba2); vLLM could not use HF as a baseline; "
                "mamba_ssm #910 and #908/#916/#951 (group_size under TP); research/mamba2.md B3",
    "symptom": "first bad site: y_norm of the first device layer at token 0 (y_scan and y_skip exact); only G > 1; "
               "independent of ubatch, n_seqs and the token.",
    "expect": [
        {"settings": {"offload": 3, "ubatch": 8, "n_seqs": 1}, "model": {"arch": "mamba2"},
         "first_divergence": {"layer_from_boundary": 0, "site": "y_norm", "token": 0}},
        {"settings": {"offload": 0, "ubatch": 8, "n_seqs": 1}, "model": {"arch": "mamba2"}, "first_divergence": None},
    ],
}

_TRITON = sibling("triton").ops


def rms_norm_gated(x, z, weight, eps, n_groups):
    return _TRITON["rms_norm_gated"](x, z, weight, eps, 1)


OPS = {"rms_norm_gated": rms_norm_gated}
