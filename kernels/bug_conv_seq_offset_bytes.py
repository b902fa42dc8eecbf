"""Deliberate bug: ssm_conv offsets the per-sequence conv state in bytes where elements were meant.

In jploski's first CUDA ssm_conv port the state pointer was `(float *)(base + ir0*nb1) + i3*nb2`: `nb2` is a stride in
bytes, added after the cast to float*, so sequence i3 lands at 4*i3 slots (sizeof(float) = 4). Emulation, on the
[S, K-1, D] state tensor: sequence s reads its state from slot 4*s and writes its new state to slot 4*s. Slot 0 is
sequence 0's own; for s >= 1 with 4*s >= S (outside the state buffer, i.e. unrelated memory) the read gives zeros
and the write is dropped; writes go in sequence order, so a later sequence wins a shared slot. Slots nobody writes
keep their old content. Reading out of range as zeros is the kindest choice: on a GPU it is whatever memory is there.
"""
import torch

from mamba_debug.plugins import sibling

NAME = "bug_conv_seq_offset_bytes"
DESCRIPTION = "ssm_conv puts sequence s's conv state at slot 4*s (bytes-vs-elements offset)"
BUG = {
    "bug": "the per-sequence conv-state offset is a byte stride added to a float pointer, so sequence s >= 1 reads and "
           "writes slot 4*s instead of s (emulated: out-of-range reads give zeros, out-of-range writes are dropped).",
    "incident": "llama.cpp #6758: jploski's CUDA ssm_conv `(float*)(... ) + i3*nb2` (697fab6b), found by compilade's "
                "test patch with n_seqs = 2 (ce2cba9c), fixed in 982a22e1; open cleanup #25669",
    "symptom": "exact with one sequence; with n_seqs >= 2 sequence 1's own slot is never written, so the first bad "
               "site is the conv_state of sequence 1 in the first device layer at the last token of the first ubatch "
               "(the fresh first ubatch itself reads zeros, which are right), then its conv output at the first token "
               "of the second ubatch; sequence 0 stays exact.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1}, "first_divergence": None},
        {"settings": {"offload": 2, "ubatch": 24, "n_seqs": 3},
         "first_divergence": {"layer_from_boundary": 0, "site": "conv_state", "token": 7, "seq": 1}},
        {"settings": {"offload": 5, "ubatch": 80, "n_seqs": 2},
         "first_divergence": {"layer_from_boundary": 0, "site": "conv_state", "token": 39, "seq": 1}},
    ],
}

_TRITON = sibling("triton").ops


def ssm_conv(conv_state, x, weight):
    S = conv_state.shape[0]
    slots = [4 * s for s in range(S)]
    read = torch.stack([conv_state[j] if j < S else torch.zeros_like(conv_state[0]) for j in slots])
    out, new = _TRITON["ssm_conv"](read, x, weight)
    written = conv_state.clone()
    for s, j in enumerate(slots):
        if j < S:
            written[j] = new[s]
    return out, written


OPS = {"ssm_conv": ssm_conv}
