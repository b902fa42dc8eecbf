"""Deliberate bug: a shared-memory race in the scan, emulated: some channels consume token t+1's B and C at token t.

A kernel that stages B_t, C_t in shared memory and lets the next token's load overwrite them before every warp has
consumed them (a missing __syncthreads) makes a timing-dependent subset of channels use B_{t+1}, C_{t+1}.
Emulation in a small torch scan: at every token t < T-1 of a ubatch, each channel of each sequence is hit with
probability 1/4 and at least one channel always is, drawn afresh on every call (so two runs of the same input
differ); the last token of a ubatch has nothing staged after it and is never hit, so 1-token ubatches are exact.
"""
import torch

from mamba_debug.ops import softplus

NAME = "bug_scan_race"
DESCRIPTION = "ssm_scan race (emulated): random channels read B/C of token t+1 at token t; nondeterministic"
SUPPORTS_STATES_OUT = True
BUG = {
    "bug": "B_t/C_t staging is overwritten by token t+1 before all channels have used it: a random subset of channels "
           "uses B_{t+1}, C_{t+1} at token t (never at a ubatch's last token), different on every run.",
    "incident": "llama.cpp #24360 (missing __syncthreads around CUB TempStorage reuse and between tokens in the CUDA "
                "scan); #24030 (PDL + __restrict__ race on Hopper); seed-semantics §11 scenario 7",
    "symptom": "first bad site: y_scan of the first device layer at token 0 whenever ubatch >= 2, and the device side "
               "differs between two runs of the same input (repeat = 2 reports nondeterminism); exact and "
               "deterministic with ubatch 1.",
    "expect": [
        {"settings": {"offload": 2, "ubatch": 8, "n_seqs": 1}, "repeat": 2, "nondeterministic": True,
         "first_divergence": {"layer_from_boundary": 0, "site": "y_scan", "token": 0}},
        {"settings": {"offload": 2, "ubatch": 1, "n_seqs": 1}, "prompt_len": 12, "repeat": 2,
         "nondeterministic": False, "first_divergence": None},
    ],
}


def ssm_scan(ssm_state, x, dt, A, B, C, *, states_out=None):
    S, T, D = x.shape
    delta = softplus(dt.float())
    h = ssm_state.float()
    ys = []
    for t in range(T):
        Bt, Ct = B[:, t, None, :].float(), C[:, t, None, :].float()           # [S, 1, N]
        if t < T - 1:
            hit = torch.rand(S, D) < 0.25
            hit[torch.arange(S), torch.randint(D, (S,))] = True
            hit = hit[:, :, None].to(x.device)                                 # [S, D, 1]
            Bt = torch.where(hit, B[:, t + 1, None, :].float(), Bt)
            Ct = torch.where(hit, C[:, t + 1, None, :].float(), Ct)
        d_t = delta[:, t, :, None]
        h = torch.exp(d_t * A.float()) * h + d_t * Bt * x[:, t, :, None].float()
        ys.append((h * Ct).sum(-1))
        if states_out is not None:
            states_out[:, t] = h
    return torch.stack(ys, dim=1).to(x.dtype), h.to(ssm_state.dtype).contiguous()


OPS = {"ssm_scan": ssm_scan}
