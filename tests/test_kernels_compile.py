"""The product's Triton kernels, the metric kernels and the reference's recurrence compiled for an H200 (sm_90) on a
machine without a GPU.

CI runs every kernel under Triton's interpreter, which executes what the compiler refuses (a global that is not a
tl.constexpr cost a GPU call once). Here each kernel is compiled for CUDA with the launch parameters the GPU plans
use, in a process whose triton is not interpreted; nothing runs. A GPU run (MAMBA_DEBUG_TEST_DEVICE=cuda) compiles
them for real, so this file is skipped there.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if os.environ.get("MAMBA_DEBUG_TEST_DEVICE") == "cuda":
    pytest.skip("the GPU run compiles the kernels for real", allow_module_level=True)

CODE = """
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from mamba_debug.metrics import _fused_module
from mamba_debug.ops import _kernel_copy
from mamba_debug.plugins import load_plugin

def build(kernel, consts, floats=(), types=None, warps=4, **options):
    types = types or {}
    sig = {a: "constexpr" if a in consts else types.get(a) or ("*fp32" if a.endswith(("_ptr", "anchor")) else
           "fp32" if a in floats else "i32") for a in kernel.arg_names}
    return compile(ASTSource(kernel, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps, **options})

k1, k2 = (load_plugin(name, device="cuda").module for name in ("triton", "triton_mamba2"))
m = _fused_module(False)
build(k1._ssm_conv_kernel, dict(K=4, BLOCK_KM1=4, BLOCK_K=4, BLOCK_T=32, BLOCK_D=64))
for chunked, summary, opts, slots in ((True, True, False, 4), (True, False, False, 4), (True, True, True, 4),
                                     (True, False, True, 4), (False, False, False, 1), (False, False, False, 8),
                                     (True, True, False, 8)):
    # opts: the chunked plans' DELTA, REVERSE, CARRY2; slots: tokens in flight (8: a long prompt in one pass, and
    # pass 1 with SLOTS_PASS1)
    build(k1._ssm_scan_kernel, dict(SUMMARY=summary, SLOTS=slots, TILES=slots > 1, CHUNKED=chunked,
                                    HAS_STATES_OUT=True, BLOCK_D=64, BLOCK_N=16, DELTA=opts, REVERSE=opts,
                                    CARRY2=opts), warps=2)
interp = k1._schedules      # the interpreter's schedules: no GPU plan runs them, but they stay valid Triton
for even in (False, True):      # masks where the blocks overhang; none, one sequence, shared offsets, where not
    build(interp._ssm_conv_one_token_kernel, dict(K=4, BLOCK_K=4, BLOCK_S=2, BLOCK_D=64, EVEN=even, ONE_SEQ=even,
                                                  SAME_STATE=even))
    build(interp._ssm_scan_one_token_kernel, dict(HAS_STATES_OUT=True, BLOCK_D=64, BLOCK_N=16, EVEN_D=even,
                                                  EVEN_N=even, DENSE=even, ONE_SEQ=even))
build(interp._ssm_scan_tiled_kernel, dict(HAS_STATES_OUT=True, BLOCK_D=64, BLOCK_N=16, TILE_T=16, STEPS=16))
build(k2._ssd_steps_kernel, dict(HAS_STATES_OUT=True, BLOCK_P=64, BLOCK_N=128, STAGES=1))
build(k2._ssd_chunked_kernel, dict(BLOCK_Q=64, BLOCK_P=64, BLOCK_N=128))
for states in (False, True):      # the GPU's plan (scan_plan), with per-token states and without
    build(k2._ssd_steps_kernel, dict(HAS_STATES_OUT=states, BLOCK_P=8, BLOCK_N=128, STAGES=4), warps=1)
build(k2._gated_norm_kernel, dict(BLOCK=1024), floats=("eps",))
build(k2._ssd_steps_heads_kernel, dict(HAS_STATES_OUT=True, BLOCK_H=8, BLOCK_P=32, BLOCK_N=32))   # interpreter's
build(k2._gated_norm_rows_kernel, dict(BLOCK_R=16, BLOCK_Q=2, BLOCK=128), floats=("eps",))
f64 = {"b_ptr": "*fp64", "out_ptr": "*fp64", "part_ptr": "*fp64", "table_ptr": "*i64",
       **{f"b{k}_ptr": "*fp64" for k in range(16)}}
build(m._sites_kernel, dict(A_TWO=True, A_VEC=0, B_TWO=False, B_VEC=2, X_VEC=2, ROWS=1, BLOCK_X=512), types=f64,
      warps=4)
build(m._sites_kernel, dict(A_TWO=False, A_VEC=1, B_TWO=True, B_VEC=0, X_VEC=1, ROWS=4, BLOCK_X=256), types=f64)
build(m._combine_kernel, dict(BLOCK_R=128), types=f64)
# the reference scans' recurrence (mamba_debug/_recurrence_kernel.py) as ops launches it: a multiply, then an add
r = _kernel_copy(False)
for dtype in ("*fp64", "*fp32"):
    ptx = build(r._recurrence_kernel, dict(BLOCK=r.BLOCK, STAGES=r.STAGES), types=dict.fromkeys(
        ("f_ptr", "u_ptr", "h_ptr", "out_ptr"), dtype), enable_fp_fusion=False).asm["ptx"]
    assert "fma" not in ptx, f"the recurrence kernel ({dtype}) fuses a multiply-add: the reference's bits change"
print("ok")
"""


def test_every_kernel_compiles_for_a_gpu():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-4000:]
