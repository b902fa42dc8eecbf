"""No GPU needed: kernels/triton.py's prefill scan compiled for an H200 (sm_90) and its step loop counted in SASS.

Compiles `_ssm_scan_kernel` as a real launch specializes it (integer arguments equal to 1 become constants,
multiples of 16 are marked divisible, pointers 16-byte aligned) for d_inner 5120, L 2048, d_state 16, contiguous
inputs, the default GPU plan's blocks (32 channels, one warp, four slots, tiles), then reads the SASS with the
cuobjdump Triton ships: registers, and the longest loop (four tokens of one warp) by opcode. Counts are per warp
and four tokens; "per element" is per state element and token (a lane holds one channel's 16 states).

    pip install --target /tmp/t36 --no-deps triton==3.6.0     # the H200's Triton, aside
    PYTHONPATH=/tmp/t36 python3 research/scan_rows/sass.py

A count is not a time: the H200 decides (tune.py). What it shows is where a step's instructions go.
"""
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402

from mamba_debug.plugins import load_plugin  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SHOWN = ("MUFU", "FFMA", "FMUL", "FADD", "LDS", "STSM", "BAR", "LDG", "STG", "LEA", "MOV", "ISETP")


def launch_values(S, L, D, N, n_chunks):
    """The integer arguments of a launch on contiguous [S, L, D] inputs (no states_out)."""
    v = dict(T=L, D=D, N=N, CHUNK_T=-(-L // n_chunks), N_CHUNKS=n_chunks)
    for name, dims, strides in (("state", "sdn", (D * N, N, 1)), ("x", "std", (L * D, D, 1)),
                                ("dt", "std", (L * D, D, 1)), ("A", "dn", (N, 1)), ("B", "stn", (L * N, N, 1)),
                                ("C", "stn", (L * N, N, 1)), ("y", "std", (L * D, D, 1)),
                                ("new", "sdn", (D * N, N, 1)), ("so", "stdn", (0, 0, 0, 0))):
        v.update({f"stride_{name}_{d}": s for d, s in zip(dims, strides)})
    return v


def build(kernel, values, consts, warps=1):
    sig, attrs, cx = {}, {}, dict(consts)
    for i, a in enumerate(kernel.arg_names):
        if a in consts:
            sig[a] = "constexpr"
        elif a.endswith("_ptr"):
            sig[a], attrs[(i,)] = "*fp32", [["tt.divisibility", 16]]
        elif values[a] == 1:
            sig[a], cx[a] = "constexpr", 1
        else:
            sig[a] = "i32"
            if values[a] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return compile(ASTSource(kernel, sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": warps})


def _tool(name, flag, compiled):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([str(BIN / name), flag, f.name], capture_output=True, text=True, check=True).stdout


def instructions(sass: str) -> list:
    """(address, instruction) of each line of cuobjdump's SASS listing."""
    return [(int(m.group(1), 16), m.group(2)) for m in
            (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]


def longest_loop(sass: str) -> collections.Counter:
    """Opcodes of the longest backward branch's body."""
    rows = instructions(sass)
    where = {a: i for i, (a, _) in enumerate(rows)}
    best = []
    for i, (addr, ins) in enumerate(rows):
        m = re.search(r"\bBRA\s+0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr and int(m.group(1), 16) in where:
            body = rows[where[int(m.group(1), 16)]:i + 1]
            best = body if len(body) > len(best) else best
    ops = (re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0].split(".")[0] for _, ins in best)
    return collections.Counter(ops)


def main():
    mod = load_plugin("triton", device="cuda").module
    base = dict(SLOTS=4, TILES=True, HAS_STATES_OUT=False, BLOCK_D=32, BLOCK_N=16)
    off = dict(DELTA=False, REVERSE=False, CARRY2=False)
    cases = [("batch 1, 24 chunks: pass 1", 1, 24, dict(SUMMARY=True, **off)),
             ("batch 1, 24 chunks: pass 2", 1, 24, dict(SUMMARY=False, **off)),
             ("  DELTA: pass 1 (every chunk)", 1, 24, dict(off, SUMMARY=True, DELTA=True)),
             ("  DELTA: pass 2", 1, 24, dict(off, SUMMARY=False, DELTA=True)),
             ("  DELTA, REVERSE, CARRY2: pass 2", 1, 24, dict(SUMMARY=False, DELTA=True, REVERSE=True, CARRY2=True)),
             ("batch 8, one pass", 8, 1, dict(SUMMARY=False, **off)),
             ("64 channels a warp: batch 8, one pass", 8, 1, dict(SUMMARY=False, BLOCK_D=64, **off)),
             ("  batch 1: DELTA pass 1", 1, 24, dict(off, SUMMARY=True, DELTA=True, BLOCK_D=64)),
             ("  batch 1: DELTA pass 2", 1, 24, dict(off, SUMMARY=False, DELTA=True, BLOCK_D=64))]
    print(f"triton {triton.__version__}, sm_90, d_inner 5120, L 2048; loop = four tokens of one warp\n")
    print(f"| case | registers | loop | per element | {' | '.join(SHOWN)} |")
    print("|---|---|---|---|" + "---|" * len(SHOWN))
    for name, S, chunks, consts in cases:
        k = build(mod._ssm_scan_kernel, launch_values(S, 2048, 5120, 16, chunks),
                  dict(base, CHUNKED=chunks > 1) | consts)
        regs = re.search(r"REG:(\d+)", _tool("cuobjdump", "-res-usage", k)).group(1)
        ops = longest_loop(_tool("cuobjdump", "-sass", k))
        n = sum(ops.values())
        lanes_rows = consts.get("BLOCK_D", base["BLOCK_D"]) // 32          # state rows a lane holds
        counts = " | ".join(str(ops[o]) for o in SHOWN)
        print(f"| {name} | {regs} | {n} | {n / (4 * 16 * lanes_rows):.2f} | {counts} |")


if __name__ == "__main__":
    main()
