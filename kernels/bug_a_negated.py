"""Deliberate bug: A is negated once more on the device (A = +exp(A_log), so exp(delta*A) > 1).

The model already stores A = -exp(A_log) (like `ssm_a` in a GGUF); a device loader that applies the `-exp(.)`
convention again, or uses +exp, hands the scan a positive A. Emulation: the correct Triton scan called with -A.
"""
from mamba_debug.plugins import sibling

NAME = "bug_a_negated"
DESCRIPTION = "ssm_scan uses -A (A > 0): the SSM state grows instead of decaying"
BUG = {
    "bug": "the scan is given -A instead of A, so every step multiplies the state by exp(delta*|A|) > 1.",
    "incident": "seed-semantics §11 scenario 6 (ssm_a re-negated / +exp(A_log)); §8 class C: test-backend-ops drew A "
                "uniform in [-1, 1] until #22675, so an op test could not tell the sign apart",
    "symptom": "first bad site: y_scan of the first device layer at token 1, independent of ubatch and n_seqs. Not "
               "token 0 as §11 suggests: a fresh sequence starts from h = 0, and h_0 = delta*B*x does not involve A; "
               "from token 1 on the state grows geometrically with T.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1},
         "first_divergence": {"layer_from_boundary": 0, "site": "y_scan", "token": 1}},
        {"settings": {"offload": 5, "ubatch": 1, "n_seqs": 2}, "prompt_len": 12,
         "first_divergence": {"layer_from_boundary": 0, "site": "y_scan", "token": 1, "seq": 0}},
    ],
}

_TRITON = sibling("triton").ops


def ssm_scan(ssm_state, x, dt, A, B, C, *, states_out=None):
    return _TRITON["ssm_scan"](ssm_state, x, dt, -A, B, C, states_out=states_out)


OPS = {"ssm_scan": ssm_scan}
