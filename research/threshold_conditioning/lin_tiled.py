import torch
NAME="lin_seqacc"; DESCRIPTION="linear with sequential fp32 accumulation over K in tiles of 16 (a naive GPU kernel)"
def linear(x, w, b=None):
    K = x.shape[-1]; acc = None
    for k0 in range(0, K, 16):
        p = torch.matmul(x[..., k0:k0+16], w[:, k0:k0+16].t())
        acc = p if acc is None else acc + p
    return acc if b is None else acc + b
OPS={"linear": linear}
