"""Deliberate bug: the hand-off of the hidden state between two devices copies half of it.

A split placement (`--devices cuda:0,cuda:1 --tensor-split ...`, llama.cpp's `--split-mode layer`) copies the hidden
state from one GPU to the next at each device boundary. This `transfer` counts the bytes of the copy with the element
size of f16 (2 bytes) for an f32 tensor, so only the first half of the elements arrive; the rest of the destination
buffer keeps its zeros. The hidden state is [S, T, E] row-major: with one sequence and a ubatch of 8, tokens 0..3 cross
intact and tokens 4..7 arrive as zeros. Every op of every layer is correct; only the crossing is wrong, so the first
bad site is the first site of the first block after the boundary (its `norm`), or the head's `final_norm` when the
boundary is between the last block and the head. With one device, or a split that leaves every offloaded block on
one device, no boundary exists and the run is clean.
"""
import torch

NAME = "bug_device_handoff"
DESCRIPTION = "the copy of the hidden state to the next device counts f16 bytes for f32 data: only its first half crosses"
BUG = {
    "bug": "transfer copies numel * 2 bytes (the f16 element size) of an f32 hidden state, so the second half of "
           "its elements (the later tokens of the ubatch, or the last channels of a one-token ubatch) arrive as "
           "the destination buffer's zeros.",
    "incident": "the class of multi-GPU hand-off bugs of llama.cpp's layer split (a peer copy between the devices "
                "of --split-mode layer with a wrong byte count or type); the fault is modelled, not a known commit",
    "symptom": "first bad site: norm of the first block on the second device, at the first token of the second "
               "half of the ubatch (token 4 at -ub 8 with one sequence); final_norm when only the head is on the "
               "second device; clean with one device and when the split leaves every block on one device.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1, "devices": ["cpu", "cpu"], "tensor_split": [1, 1]},
         "first_divergence": {"layer_from_boundary": 1, "site": "norm", "token": 4}},
        {"settings": {"offload": 5, "ubatch": 8, "n_seqs": 1, "devices": ["cpu", "cpu"], "tensor_split": [3, 1]},
         "first_divergence": {"layer": None, "site": "final_norm", "token": 4}},
        {"settings": {"offload": 4, "ubatch": 1, "n_seqs": 1, "devices": ["cpu", "cpu"], "tensor_split": [3, 1]},
         "prompt_len": 12, "first_divergence": {"layer_from_boundary": 3, "site": "norm", "token": 0}},
        {"settings": {"offload": 5, "ubatch": 8, "n_seqs": 1}, "first_divergence": None},
        {"settings": {"offload": 4, "ubatch": 8, "n_seqs": 1, "devices": ["cpu", "cpu"], "tensor_split": [1, 0]},
         "first_divergence": None},
    ],
}


def transfer(x, device):
    out = torch.zeros(x.shape, dtype=x.dtype, device=device)
    n = x.numel() * 2 // x.element_size()          # the bug: f16's 2 bytes per element, for f32 data
    out.view(-1)[:n] = x.reshape(-1)[:n].to(device)
    return out


OPS = {"transfer": transfer}
