"""Deliberate bug: Mamba-2's scan maps head h to B/C group h % G (tiled) instead of h // (H/G) (contiguous blocks).

The correct Triton ssd_scan is called with B and C expanded to one group per head in the tiled order. Heads whose
two mappings agree (h = 0, and every head when G = 1) stay exact; the others read another group's B and C from the
first token on.
"""
from mamba_debug.plugins import sibling

NAME = "bug_m2_group_tile"
DESCRIPTION = "Mamba-2 ssd_scan reads group h % G instead of h // (H/G) (the tiled head-to-group mapping)"
BUG = {
    "bug": "head h of the Mamba-2 scan reads B/C of group h % G (ggml repeat / torch .repeat semantics) instead of "
           "group h // (H/G) (repeat_interleave, what every checkpoint was trained with).",
    "incident": "llama.cpp PR #15625 (SSM_SCAN used h & (ng-1); Codestral-7B perplexity 16.14 -> 9.19 after the fix, "
                "only models with n_groups > 1); transformers PR #37533 (the same tiling in torch_forward via .repeat)",
    "symptom": "first bad site: y_scan of the first device layer at token 0; conv and dt before it are exact; only "
               "with G > 1; independent of ubatch and n_seqs.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1}, "model": {"arch": "mamba2"},
         "first_divergence": {"layer_from_boundary": 0, "site": "y_scan", "token": 0}},
        {"settings": {"offload": 4, "ubatch": 6, "n_seqs": 2}, "model": {"arch": "hybrid"},
         "first_divergence": {"layer_from_boundary": 0, "site": "y_scan", "token": 0}},
    ],
}

_TRITON = sibling("triton").ops


def _tiled(BC, H):
    G = BC.shape[2]
    return BC[:, :, [h % G for h in range(H)]]


def ssd_scan(ssm_state, x, dt, A, B, C, *, states_out=None):
    H = x.shape[2]
    return _TRITON["ssd_scan"](ssm_state, x, dt, A, _tiled(B, H), _tiled(C, H), states_out=states_out)


OPS = {"ssd_scan": ssd_scan}
