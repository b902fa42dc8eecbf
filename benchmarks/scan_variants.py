"""H200 experiment: the prefill scan's register layout and per-step arithmetic, before changing kernels/triton.py.

The step kernel keeps h as [BLOCK_D, BLOCK_N]. Which lanes Triton gives which (d, n) decides how much per-channel
work (softplus: exp, log, a division) every lane repeats and how many shuffles the sum over N needs. This script
builds variants of the step kernel:
  TRANS  h as [BLOCK_N, BLOCK_D] (d the fast dimension: one lane per channel, all N in its registers)
  FAST   exp2 with A * log2(e) taken once per program, and delta * x once per channel (llama.cpp's order)
  NOSPEC the n-strides not specialised to 1 (so no load can anchor an n-fast layout)
and for each: the layout Triton chose (TTGIR), MUFU/SHFL counts in the SASS, error vs float64, and cold timings at
the gated shapes. Run: TRITON_INTERPRET=0 python benchmarks/scan_variants.py (writes scan_variants.json to $OUT).
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from h200 import bench_cold, copy_bandwidth, scan_inputs, TODAY  # noqa: E402
from mamba_debug import ops  # noqa: E402

OUT = Path(os.environ.get("OUT", ROOT / "benchmarks" / "results"))
LOG2E = 1.4426950408889634


@triton.jit
def _softplus(dt):
    u = tl.exp(tl.minimum(dt, 20.0))
    w = 1.0 + u
    return tl.where(dt > 20.0, dt, tl.log(w) - ((w - 1.0) - u) / w)


def _body(state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, y_ptr, new_state_ptr, end_ptr, decay_ptr,
          T, D, N, CHUNK_T, N_CHUNKS,
          stride_state_s, stride_state_d, stride_state_n, stride_x_s, stride_x_t, stride_x_d,
          stride_dt_s, stride_dt_t, stride_dt_d, stride_A_d, stride_A_n,
          stride_B_s, stride_B_t, stride_B_n, stride_C_s, stride_C_t, stride_C_n,
          stride_y_s, stride_y_t, stride_y_d, stride_new_s, stride_new_d, stride_new_n,
          SUMMARY: tl.constexpr, CHUNKED: tl.constexpr, TRANS: tl.constexpr, FAST: tl.constexpr,
          BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_s = tl.program_id(0).to(tl.int64)
    pid_d = tl.program_id(1).to(tl.int64)
    pid_c = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D).to(tl.int64) + pid_d * BLOCK_D
    offs_n = tl.arange(0, BLOCK_N).to(tl.int64)
    mask_d = offs_d < D
    mask_n = offs_n < N
    if TRANS:       # 2-D tiles are [n, d]
        dd = offs_d[None, :]
        nn = offs_n[:, None]
    else:           # [d, n]
        dd = offs_d[:, None]
        nn = offs_n[None, :]
    mask_dn = (dd < D) & (nn < N)
    A = tl.load(A_ptr + dd * stride_A_d + nn * stride_A_n, mask=mask_dn, other=0.0).to(tl.float32)
    if FAST:
        A = A * 1.4426950408889634
    summary_offs = (pid_s * N_CHUNKS) * D * N + dd * N + nn
    if SUMMARY:
        h = tl.zeros(A.shape, dtype=tl.float32)
        decay = tl.full(A.shape, 1.0, dtype=tl.float32)
    else:
        h = tl.load(state_ptr + pid_s * stride_state_s + dd * stride_state_d + nn * stride_state_n,
                    mask=mask_dn, other=0.0).to(tl.float32)
        if CHUNKED:
            c = 0
            while c < pid_c:
                h = (tl.load(decay_ptr + summary_offs + c * D * N, mask=mask_dn, other=0.0) * h
                     + tl.load(end_ptr + summary_offs + c * D * N, mask=mask_dn, other=0.0))
                c += 1
    t = pid_c * CHUNK_T
    n_tok = tl.minimum(T - t, CHUNK_T)
    x_ptrs = x_ptr + pid_s * stride_x_s + offs_d * stride_x_d + t * stride_x_t
    dt_ptrs = dt_ptr + pid_s * stride_dt_s + offs_d * stride_dt_d + t * stride_dt_t
    B_ptrs = B_ptr + pid_s * stride_B_s + offs_n * stride_B_n + t * stride_B_t
    C_ptrs = C_ptr + pid_s * stride_C_s + offs_n * stride_C_n + t * stride_C_t
    y_ptrs = y_ptr + pid_s * stride_y_s + offs_d * stride_y_d + t * stride_y_t
    # prefetch two tokens ahead, as kernels/triton.py's PREFETCH=2 did until 2026-12-02 (research/scan_rows/)
    m0 = tl.where(0 < n_tok, mask_d, False)
    n0 = tl.where(0 < n_tok, mask_n, False)
    x0 = tl.load(x_ptrs, mask=m0, other=0.0)
    dt0 = tl.load(dt_ptrs, mask=m0, other=0.0)
    B0 = tl.load(B_ptrs, mask=n0, other=0.0)
    C0 = tl.load(C_ptrs, mask=n0, other=0.0)
    m1 = tl.where(1 < n_tok, mask_d, False)
    n1 = tl.where(1 < n_tok, mask_n, False)
    x1 = tl.load(x_ptrs + stride_x_t, mask=m1, other=0.0)
    dt1 = tl.load(dt_ptrs + stride_dt_t, mask=m1, other=0.0)
    B1 = tl.load(B_ptrs + stride_B_t, mask=n1, other=0.0)
    C1 = tl.load(C_ptrs + stride_C_t, mask=n1, other=0.0)
    x_ptrs += 2 * stride_x_t
    dt_ptrs += 2 * stride_dt_t
    B_ptrs += 2 * stride_B_t
    C_ptrs += 2 * stride_C_t
    i = 0
    while i < n_tok:
        x_t, dt_t, B_t, C_t = x0, dt0, B0, C0
        mm = tl.where(i + 2 < n_tok, mask_d, False)
        mn = tl.where(i + 2 < n_tok, mask_n, False)
        x0, dt0, B0, C0 = x1, dt1, B1, C1
        x1 = tl.load(x_ptrs, mask=mm, other=0.0)
        dt1 = tl.load(dt_ptrs, mask=mm, other=0.0)
        B1 = tl.load(B_ptrs, mask=mn, other=0.0)
        C1 = tl.load(C_ptrs, mask=mn, other=0.0)
        x_ptrs += stride_x_t
        dt_ptrs += stride_dt_t
        B_ptrs += stride_B_t
        C_ptrs += stride_C_t
        delta = _softplus(dt_t)
        if TRANS:
            dl = delta[None, :]
            Bb = B_t[:, None]
            Cb = C_t[:, None]
            xb = x_t[None, :]
            dxb = (delta * x_t)[None, :]
        else:
            dl = delta[:, None]
            Bb = B_t[None, :]
            Cb = C_t[None, :]
            xb = x_t[:, None]
            dxb = (delta * x_t)[:, None]
        if FAST:
            decay_t = tl.exp2(dl * A)
            h = decay_t * h + Bb * dxb
        else:
            decay_t = tl.exp(dl * A)
            h = decay_t * h + (dl * Bb) * xb
        if SUMMARY:
            decay = decay * decay_t
        else:
            y_t = tl.sum(h * Cb, axis=0 if TRANS else 1)
            tl.store(y_ptrs, y_t, mask=mask_d)
            y_ptrs += stride_y_t
        i += 1
    if SUMMARY:
        tl.store(end_ptr + summary_offs + pid_c * D * N, h, mask=mask_dn)
        tl.store(decay_ptr + summary_offs + pid_c * D * N, decay, mask=mask_dn)
    else:
        store_mask = tl.where(pid_c == N_CHUNKS - 1, mask_dn, False)
        tl.store(new_state_ptr + pid_s * stride_new_s + dd * stride_new_d + nn * stride_new_n, h, mask=store_mask)


KERNELS = {"spec": triton.jit(_body),
           "nospec": triton.jit(do_not_specialize=["stride_A_n", "stride_state_n", "stride_new_n"])(_body)}


def scan(h0, x, dt, A, B, C, *, trans, fast, kernel="spec", BD=32, warps=1, per_sm=20):
    S, T, D = x.shape
    N = A.shape[1]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    programs = S * triton.cdiv(D, BD)
    n_chunks = 1 if programs >= 8 * sms or T < 128 else min(T // 64, triton.cdiv(per_sm * sms, programs))
    chunk_t = triton.cdiv(T, n_chunks)
    n_chunks = triton.cdiv(T, chunk_t)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    new = torch.empty_like(h0)
    summ = torch.empty((2, S, n_chunks, D, N), device=x.device)
    args = (h0, x, dt, A, B, C, y, new, summ[0], summ[1], T, D, N, chunk_t, n_chunks,
            *h0.stride(), *x.stride(), *dt.stride(), *A.stride(), *B.stride(), *C.stride(), *y.stride(), *new.stride())
    k = KERNELS[kernel]
    meta = dict(CHUNKED=n_chunks > 1, TRANS=trans, FAST=fast, BLOCK_D=BD, BLOCK_N=triton.next_power_of_2(N),
                num_warps=warps)
    compiled = []
    if n_chunks > 1:
        compiled.append(k[(S, triton.cdiv(D, BD), n_chunks - 1)](*args, SUMMARY=True, **meta))
    compiled.append(k[(S, triton.cdiv(D, BD), n_chunks)](*args, SUMMARY=False, **meta))
    return y, new, compiled


def describe(ck) -> dict:
    """The blocked layouts in the TTGIR and a few SASS instruction counts of one compiled kernel."""
    info = {"layouts": sorted(set(re.findall(r"#blocked\d* = (#ttg\.blocked<[^>]*>|#triton_gpu\.blocked<[^>]*>)",
                                             ck.asm.get("ttgir", ""))))}
    try:
        sass = ck.asm["sass"]
        for op in ("MUFU.EX2", "MUFU.LG2", "MUFU.RCP", "SHFL", "FFMA", "FMUL", "FADD", "LDG", "STG"):
            info[op] = len(re.findall(r"\b" + re.escape(op), sass))
        info["instructions"] = len(re.findall(r"/\*[0-9a-f]{4}\*/", sass))
    except Exception as exc:  # noqa: BLE001 - no disassembler: say so
        info["sass"] = f"unavailable: {exc!r}"[:200]
    try:
        info["registers"] = ck.n_regs
        info["spills"] = ck.n_spills
    except Exception:  # noqa: BLE001
        pass
    return info


VARIANTS = [dict(trans=False, fast=False), dict(trans=False, fast=True), dict(trans=True, fast=False),
            dict(trans=True, fast=True), dict(trans=True, fast=True, kernel="nospec")]


def main():
    bw = copy_bandwidth()
    rows, layouts = [], {}
    # correctness against float64 on an awkward shape (D not a multiple of the block, 3 sequences, chunks)
    h0, x, dt, A, B, C = scan_inputs(3, 300, 200)
    y64, s64 = ops.ssm_scan(h0.double(), x.double(), dt.double(), A.double(), B.double(), C.double())
    for v in VARIANTS:
        name = "/".join(k for k, on in v.items() if on is True) or "current"
        name += "" if v.get("kernel", "spec") == "spec" else "/nospec"
        y, s, cks = scan(h0, x, dt, A, B, C, **v, per_sm=4)
        err = float(((y.double() - y64) ** 2).sum() / (y64 ** 2).sum())
        serr = float(((s.double() - s64) ** 2).sum() / (s64 ** 2).sum())
        layouts[name] = {"nmse_y": err, "nmse_state": serr, "pass2": describe(cks[-1])}
        print(name, json.dumps(layouts[name]), flush=True)
    for D, L, S in ((5120, 2048, 1), (5120, 2048, 8), (1536, 2048, 1), (5120, 8192, 1), (5120, 512, 1)):
        h0, x, dt, A, B, C = scan_inputs(S, L, D)
        nbytes = 4 * (3 * S * L * D + 2 * S * L * 16 + D * 16 + 2 * S * D * 16)
        y_ref = None
        for v in VARIANTS:
            name = "/".join(k for k, on in v.items() if on is True) or "current"
            name += "" if v.get("kernel", "spec") == "spec" else "/nospec"
            for BD, warps, per_sm in ((32, 1, 20), (32, 1, 10), (64, 2, 10), (64, 2, 20), (128, 4, 10)):
                if not v["trans"] and BD != 32:
                    continue
                try:
                    y, _, _ = scan(h0, x, dt, A, B, C, **v, BD=BD, warps=warps, per_sm=per_sm)
                    if y_ref is None:
                        y_ref = y
                    rel = float((y - y_ref).norm() / y_ref.norm())
                    us = bench_cold(lambda: scan(h0, x, dt, A, B, C, **v, BD=BD, warps=warps, per_sm=per_sm))
                except Exception as exc:  # noqa: BLE001 - a variant that fails to build is a result too
                    print("failed", name, BD, warps, repr(exc)[:300], flush=True)
                    continue
                rows.append({"variant": name, "BD": BD, "warps": warps, "per_sm": per_sm, "d_inner": D, "L": L,
                             "batch": S, "time_us": round(us, 1), "floor_us": round(nbytes / bw * 1e6, 1),
                             "rel_vs_current": rel, "date": TODAY})
                print(rows[-1], flush=True)
    # decode (one token): the one-pass kernel at batch 1 and 64, CUDA graphs
    for S in (1, 64):
        h0, x, dt, A, B, C = scan_inputs(S, 1, 5120)
        for v in VARIANTS[:4]:
            name = "/".join(k for k, on in v.items() if on is True) or "current"
            for BD, warps in ((32, 1), (64, 2), (16, 1)):
                if not v["trans"] and BD == 16:
                    continue
                us = do_bench_cudagraph(lambda: scan(h0, x, dt, A, B, C, **v, BD=BD, warps=warps)) * 1e3
                rows.append({"variant": name, "BD": BD, "warps": warps, "d_inner": 5120, "L": 1, "batch": S,
                             "time_us": round(us, 2), "date": TODAY})
                print(rows[-1], flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scan_variants.json").write_text(json.dumps({"layouts": layouts, "rows": rows}, indent=1))
    print("\n| variant | BD | w | per SM | D | L | S | µs |")
    for r in rows:
        print(f"| {r['variant']} | {r['BD']} | {r['warps']} | {r.get('per_sm', '')} | {r['d_inner']} | {r['L']} | "
              f"{r['batch']} | {r['time_us']} |")


if __name__ == "__main__":
    main()
