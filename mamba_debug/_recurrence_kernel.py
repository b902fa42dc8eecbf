"""The reference scans' recurrence (`ops._recurrence`, `ops._recurrence_heads`) on a GPU as one launch a block.

    out[s, t, g, m] = h = f[s, t, g, m] * h + u[s, t, g, m]      (h starts at h0[s, g, m]; a multiply, then an add)

Torch's way takes two launches a token (the multiply, then the add), each a pass over a token's whole state: for a
Mamba-2 2.7B layer that is 5.2 MB of float64 read and written five times a token, 58 ms a 2048-token call on an
H100. Here a program keeps BLOCK state elements in registers and walks the block's tokens, reading f and u once and
writing out once. Every element is the same two IEEE roundings in the same order as the torch loop (fused
multiply-adds are off: `enable_fp_fusion=False`, which Triton also passes to ptxas as --fmad=false), so the bits
are the per-token loop's; `tests/test_reference_scans.py` holds them to it, compiled and interpreted.

Mamba-1 (`_recurrence`): f = exp(δA), u = δBx, one group (g) of D*N elements. Mamba-2 (`_recurrence_heads`): f =
exp(δA) per head, read with element stride 0, u = δx ⊗ B, out = u (in place), a group per head of P*N elements.

Do not import this file: ops.py executes it once per mode, like _site_metrics.py (see that file's docstring).
"""
import os

import torch
import triton
import triton.language as tl

from mamba_debug.triton_launch import Launch, cdiv, check_mode, on_device

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

check_mode(INTERPRET, "the reference scans' recurrence kernel")

BLOCK = 4096 if INTERPRET else 256     # state elements a program (interpreter: the fewest programs)
STAGES = 1 if INTERPRET else 4         # tokens whose loads are in flight: they do not wait for h


@triton.jit
def _recurrence_kernel(f_ptr, u_ptr, h_ptr, out_ptr, L, M,
                       f_s, f_t, f_g, f_m, u_s, u_t, u_g, h_s, h_g, o_s, o_t, o_g,
                       BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """BLOCK elements of group g of sequence s, token after token. Strides in elements; u, h0 and out have unit
    stride along m, f has f_m (0: one factor for the whole group)."""
    s, g = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    m = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    ok = m < M
    h = tl.load(h_ptr + s * h_s + g * h_g + m, mask=ok)
    f_at = f_ptr + s * f_s + g * f_g + m * f_m
    u_at, o_at = u_ptr + s * u_s + g * u_g + m, out_ptr + s * o_s + g * o_g + m
    for t in tl.range(0, L, num_stages=STAGES):
        h = tl.load(f_at + t * f_t, mask=ok) * h
        h = h + tl.load(u_at + t * u_t, mask=ok)
        tl.store(o_at + t * o_t, h, mask=ok)


_launch = Launch(_recurrence_kernel, INTERPRET)


def recurrence(f, u, h0, out, groups: int):
    """out[:, t] = f[:, t] * h + u[:, t] for every t of the block (h = h0 first); the last state, a view of out.

    u, out: [S, L, G, ...] with `groups` = G (or [S, L, ...] with groups = 1), f the same but for its last
    dimensions, which may be 1 (one factor a group), h0: [S, G, ...] (or [S, ...]). Each group's elements must be
    contiguous in u, out and f (h0 is copied when they are not): None, nothing written, where they are not (the
    callers' fresh tensors always are; the caller then runs its torch loop)."""
    S, L = u.shape[:2]
    M = u[0, 0].numel() // groups
    if not _groups_contiguous(h0, 1, groups):
        h0 = h0.contiguous()
    f_m = 0 if f[0, 0].numel() == groups and M > 1 else 1
    for t in (f, u, out)[1 - f_m:]:
        if not _groups_contiguous(t, 2, groups):
            return None
    h_g = h0.stride(1) if groups > 1 else 0
    args = (L, M, *_strides(f, groups), f_m, *_strides(u, groups), h0.stride(0), h_g, *_strides(out, groups))
    with on_device(u.device, INTERPRET):
        _launch((S, groups, cdiv(M, BLOCK)), (f, u, h0, out), args,
                {"BLOCK": BLOCK, "STAGES": STAGES, "num_warps": 4, "enable_fp_fusion": False})
    return out[:, -1]


def _groups_contiguous(t: torch.Tensor, lead: int, groups: int) -> bool:
    """The elements of each group (the dimensions after the `lead` ones and the group's) lie at unit stride."""
    inner = t.shape[lead + (1 if groups > 1 else 0):]
    expect = 1
    for n, st in reversed(list(zip(inner, t.stride()[len(t.shape) - len(inner):]))):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True


def _strides(t: torch.Tensor, groups: int) -> tuple:
    """(sequence, token, group) strides of a [S, L, ...] tensor whose groups are its third dimension (or one)."""
    return t.stride(0), t.stride(1), (t.stride(2) if groups > 1 else 0)
