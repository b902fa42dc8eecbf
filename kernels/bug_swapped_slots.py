"""Deliberate bug: sequences 0 and 1 read each other's state slots.

llama.cpp copies each sequence's recurrent state into place through an index table (`s_copy`, later `ids`); #9126
used the loop index instead of the cell id. Emulation: the device ssm_conv and ssm_scan read their states through a
slot table that swaps slots 0 and 1 (when there are at least two sequences), and write the new states back to each
sequence's own slot. Sequence 0 therefore continues from sequence 1's history and vice versa.
"""
import torch

from mamba_debug.plugins import sibling

NAME = "bug_swapped_slots"
DESCRIPTION = "ssm_conv/ssm_scan read sequence 0's state from slot 1 and vice versa (wrong slot table)"
BUG = {
    "bug": "the state-slot table maps sequence 0 to slot 1 and sequence 1 to slot 0 when reading states; writes go "
           "to the right slot, so each of the two continues from the other's history.",
    "incident": "llama.cpp #9126 (s_copy built from the loop index instead of the cell id: multi-user broken); vLLM "
                "#33937 / vllm-gaudi #1431 (padding slot aliasing a real request's slot); §11 scenario 8",
    "symptom": "exact with one sequence; the first ubatch of fresh sequences is exact (all slots are zero); first bad "
               "site: conv of sequence 0 in the first device layer at the first token of the second ubatch "
               "(token = ubatch), all device layers at once; sequence 2 stays exact.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1}, "first_divergence": None},
        {"settings": {"offload": 2, "ubatch": 24, "n_seqs": 3},
         "first_divergence": {"layer_from_boundary": 0, "site": "conv", "token": 8, "seq": 0}},
        {"settings": {"offload": 1, "ubatch": 80, "n_seqs": 2},
         "first_divergence": {"layer_from_boundary": 0, "site": "conv", "token": 40, "seq": 0}},
    ],
}

_TRITON = sibling("triton").ops


def _slots(state):
    idx = torch.arange(state.shape[0])
    if len(idx) >= 2:
        idx[0], idx[1] = 1, 0
    return state[idx]


def ssm_conv(conv_state, x, weight):
    return _TRITON["ssm_conv"](_slots(conv_state), x, weight)


def ssm_scan(ssm_state, x, dt, A, B, C, *, states_out=None):
    return _TRITON["ssm_scan"](_slots(ssm_state), x, dt, A, B, C, states_out=states_out)


OPS = {"ssm_conv": ssm_conv, "ssm_scan": ssm_scan}
