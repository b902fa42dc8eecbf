"""Faults compiled into llama.cpp's CPU build, found through `LLAMA_CPP_LIB_PATH` by the command a user runs.

The CI tests inject faults by writing into a node's memory from the eval callback. This rehearses the other way a
bug reaches users: compiled into the library. It builds the llama.cpp that llama-cpp-python 0.3.36 vendors (its
source archive, cached by tests/llamacpp/build.sh) with seven faults edited into ggml's CPU code, each switched on at
run time by MDBG_FAULT=<name> (one build serves all seven, and with MDBG_FAULT unset it is the stock build), then runs

    mamba-debug compare --model tiny-f32.gguf --engine llama.cpp --device cpu --ubatch U --n-seqs S --json OUT

for each fault over a grid of -ub and sequences on the shipped Mamba-1 model (and the Mamba op faults over a few
schedules on the shipped Mamba-2 and Granite hybrid models), and checks `first_divergence` (seq, token, layer, site)
against where the fault is born, or null (exit 0) where it cannot trigger at that schedule. Prints a table; exit 1 on
any mismatch. Not part of `make test` (a second llama.cpp build costs ~8 minutes on 2 cores the first time); run
`make compiled-faults`. The build is kept in ~/.cache/mamba-debug/llama-faults-<key>/.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"
CACHE = Path(os.environ.get("MAMBA_DEBUG_CACHE") or Path.home() / ".cache" / "mamba-debug")
SDIST = CACHE / "wheels" / f"llama_cpp_python-{VERSION}.tar.gz"

# The fault switch, defined once in ggml-cpu.c (C) and declared in ops.cpp (C++).
SWITCH = r'''
int mdbg_fault_is(const char * name);
int mdbg_fault_is(const char * name) {          /* mamba-debug's compiled faults: MDBG_FAULT=<name> */
    static const char * f = (const char *) 1;
    if (f == (const char *) 1) f = getenv("MDBG_FAULT");
    return f != NULL && strcmp(f, name) == 0;
}
static void mdbg_fault_node(struct ggml_tensor * node) {
    float * d = (float *) node->data;
    if (node->type != GGML_TYPE_F32) return;
    if (mdbg_fault_is("mm_late") && node->op == GGML_OP_MUL_MAT && strcmp(node->src[0]->name, "blk.10.ssm_out.weight") == 0) {
        d[0] += 1.0f;                           /* a late layer's out projection, first column of each ubatch */
    }
    if (mdbg_fault_is("conv_state_l3") && node->op == GGML_OP_CPY && node->src[1]->view_src != NULL
            && strcmp(node->src[1]->view_src->name, "cache_r_l3") == 0) {
        d[1] += 0.5f;                           /* layer 3's conv state as written into the cache at a ubatch end */
    }
    if (mdbg_fault_is("emb") && node->op == GGML_OP_GET_ROWS && strcmp(node->src[0]->name, "token_embd.weight") == 0) {
        d[3] += 0.5f;                           /* the embedding lookup, first token of each ubatch */
    }
}
'''

# (file, anchor that must occur exactly once, replacement): each edit names the fault it adds.
EDITS = [
    ("ggml/src/ggml-cpu/ggml-cpu.c", "static thread_ret_t ggml_graph_compute_thread(void * data) {",
     SWITCH + "static thread_ret_t ggml_graph_compute_thread(void * data) {"),
    ("ggml/src/ggml-cpu/ggml-cpu.c", "            ggml_compute_forward(&params, node);\n        }\n",
     "            ggml_compute_forward(&params, node);\n        }\n"
     "        if (mdbg_fault_is(\"mm_late\") || mdbg_fault_is(\"emb\") || mdbg_fault_is(\"conv_state_l3\")) {\n"
     "            ggml_barrier(state->threadpool);\n"
     "            if (state->ith == 0) mdbg_fault_node(cgraph->nodes[node_n]);\n"
     "            ggml_barrier(state->threadpool);\n        }\n"),
    ("ggml/src/ggml-cpu/ops.cpp", '#include "ops.h"\n',
     '#include "ops.h"\nextern "C" int mdbg_fault_is(const char * name);\n'),
    # conv_seq1: the second sequence's convolution output is off (a per-sequence offset bug)
    ("ggml/src/ggml-cpu/ops.cpp", "                x[i1] = sumf;\n",
     "                x[i1] = sumf + ((i3 == 1 && mdbg_fault_is(\"conv_seq1\")) ? 0.25f : 0.0f);\n"),
    # scan_B_contig: B, a strided view of x_db, read as if contiguous (the seed's bug class)
    ("ggml/src/ggml-cpu/ops.cpp",
     "const float * B  = (const float *) ((const char *) src4->data + i2*(src4->nb[2]) + i3*(src4->nb[3]));",
     "const float * B  = (const float *) ((const char *) src4->data + (mdbg_fault_is(\"scan_B_contig\") ? "
     "(i2*ng*nc + i3*nt*ng*nc)*(int64_t) sizeof(float) : i2*(src4->nb[2]) + i3*(src4->nb[3])));"),
    # scan_state_end: the state written at the end of a ubatch of more than one token is halved
    ("ggml/src/ggml-cpu/ops.cpp",
     "            // use the output as the source when it's not the first token-wise iteration\n"
     "            s0 = s;\n        }\n    }\n}\n",
     "            // use the output as the source when it's not the first token-wise iteration\n"
     "            s0 = s;\n        }\n"
     "        if (nt > 1 && mdbg_fault_is(\"scan_state_end\")) {\n"
     "            for (int h = ih0; h < ih1; ++h) {\n"
     "                for (int64_t i = 0; i < nr*nc; ++i) s[h*nr*nc + i] *= 0.5f;\n            }\n        }\n"
     "    }\n}\n"),
    # rms_skip_last: RMS_NORM leaves the last element out of its sum of squares
    ("ggml/src/ggml-cpu/ops.cpp",
     "                for (int64_t i00 = 0; i00 < ne00; i00++) {\n"
     "                    sum += (ggml_float)(x[i00] * x[i00]);\n                }\n\n"
     "                const float mean  = sum/ne00;\n                const float scale = 1.0f/sqrtf(mean + eps);",
     "                for (int64_t i00 = 0; i00 < ne00 - (mdbg_fault_is(\"rms_skip_last\") ? 1 : 0); i00++) {\n"
     "                    sum += (ggml_float)(x[i00] * x[i00]);\n                }\n\n"
     "                const float mean  = sum/ne00;\n                const float scale = 1.0f/sqrtf(mean + eps);"),
]

UB_SEQS = [(1, 1), (8, 1), (1, 2), (3, 2), (512, 2), (2, 3), (17, 3)]
FAULTS = ("conv_seq1", "scan_B_contig", "scan_state_end", "conv_state_l3", "rms_skip_last", "mm_late", "emb")


def expected(fault: str, ub: int, S: int, n_prompt: int):
    """Where a node-by-node diff against the stock build shows the fault born: (seq, token, layer, site) by DESIGN.md's
    order (earliest token within its sequence, then lowest layer, then graph order), or None (cannot trigger)."""
    together = S if ub + 1 >= S else ub + 1                  # sequences in one ubatch (llama.cpp's split_equal)
    per_seq = max(1, ub // together) if together > 1 else ub  # tokens of each sequence in one ubatch
    first = min(per_seq, n_prompt)                           # tokens of sequence 0 in its first ubatch
    return {
        "conv_seq1": (1, 0, 0, "SSM_CONV") if together > 1 else None,
        "scan_B_contig": ((1, 0, 0, "y_scan") if together > 1 else (0, 1, 0, "y_scan") if first > 1 else None),
        "scan_state_end": (0, first - 1, 0, "ssm_state") if first > 1 else None,
        "rms_skip_last": (0, 0, 0, "RMS_NORM"),
        "mm_late": (0, 0, 10, "out"),
        "conv_state_l3": (0, first - 1, 3, "conv_state"),
        "emb": (0, 0, None, "GET_ROWS"),
    }[fault]


def build() -> Path:
    """The faulty library (cached by the edits' hash); the stock source comes from llama-cpp-python's archive."""
    if not SDIST.exists():
        sys.exit(f"{SDIST} is missing: run tests/llamacpp/build.sh first (it downloads and caches it)")
    key = hashlib.sha256(json.dumps([VERSION, EDITS]).encode()).hexdigest()[:12]
    out = CACHE / f"llama-faults-{key}"
    if (out / "libllama.so").exists():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(SDIST) as tf:
            tf.extractall(tmp, members=[m for m in tf.getmembers() if "/vendor/llama.cpp/" in m.name])
        src = Path(tmp) / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
        for rel, anchor, new in EDITS:
            path = src / rel
            text = path.read_text()
            if text.count(anchor) != 1:
                sys.exit(f"{path}: the anchor of an edit occurs {text.count(anchor)} times, not once; the "
                         f"llama.cpp source is not the one these faults were written for:\n{anchor}")
            path.write_text(text.replace(anchor, new))
        flags = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF", "-DGGML_OPENMP=ON",
                 "-DLLAMA_BUILD_COMMON=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF",
                 "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]
        print(f"building llama.cpp {VERSION} (vendored) with the faults into {out} (~8 min on 2 cores)", flush=True)
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        subprocess.run(["cmake", "-S", str(src), "-B", f"{tmp}/b", *gen, *flags], check=True, stdout=subprocess.DEVNULL)
        subprocess.run(["cmake", "--build", f"{tmp}/b", "-j", str(os.cpu_count() or 2)], check=True,
                       stdout=subprocess.DEVNULL)
        part = out.with_suffix(".part")
        shutil.rmtree(part, ignore_errors=True)
        shutil.copytree(f"{tmp}/b/bin", part, symlinks=True)
        part.rename(out)
    return out


def run(lib: Path, gguf: Path, work: Path, fault, ub: int, S: int) -> dict:
    out = work / f"{gguf.stem}_{fault}_{ub}_{S}.json"
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(lib)}
    env.pop("MDBG_FAULT", None)
    if fault:
        env["MDBG_FAULT"] = fault
    p = subprocess.run([sys.executable, "-m", "mamba_debug", "compare", "--model", str(gguf), "--engine", "llama.cpp",
                        "--device", "cpu", "--ubatch", str(ub), "--n-seqs", str(S), "--json", str(out)],
                       env=env, capture_output=True, text=True)
    if p.returncode not in (0, 1):
        return {"rc": p.returncode, "error": p.stderr[-400:]}
    return {"rc": p.returncode, **json.loads(out.read_text())}


# The shipped Mamba-1 model over the whole grid; the Mamba-2 and hybrid models (layer 0 a Mamba-2 layer in both) with
# the faults of the Mamba ops and the model input, over a few schedules (their layers 3 and 10 differ in kind).
PLAN = {
    "tiny-mamba": [(None, c) for c in UB_SEQS]
    + [(f, c) for f in FAULTS for c in (UB_SEQS if f in ("conv_seq1", "scan_B_contig", "scan_state_end")
                                        else UB_SEQS[::3])],
    **{name: [(f, c) for f in (None, "conv_seq1", "scan_B_contig", "scan_state_end", "rms_skip_last", "emb")
              for c in ((1, 1), (8, 2), (17, 3))] for name in ("tiny-mamba2", "tiny-granite-hybrid")},
}


def main() -> int:
    import mamba_debug as md
    lib = build()
    work = Path(tempfile.mkdtemp(prefix="compiled-faults-"))
    bad = 0
    print(f"library {lib}\n{'model':20s} {'fault':15s} {'ub':>4} {'S':>2}  {'expected':30s} {'got':30s} ok")
    for name, cells in PLAN.items():
        gguf = md.export_gguf(md.load_model(None if name == "tiny-mamba" else name), work / f"{name}-f32.gguf",
                              dtype="f32")
        for fault, (ub, S) in cells:
            r = run(lib, gguf, work, fault, ub, S)
            if "error" in r:
                got, want, ok = r["error"], "a result", False
            else:
                fd = r["first_divergence"]
                got = None if fd is None else (fd["seq"], fd["token"], fd["layer"], fd["site"])
                want = None if fault is None else expected(fault, ub, S, int(r["config"]["n_prompt"]))
                ok = got == want and r["rc"] == (0 if want is None else 1)
            bad += not ok
            print(f"{name:20s} {fault or 'stock':15s} {ub:>4} {S:>2}  {str(want):30s} {str(got):30s} "
                  f"{'yes' if ok else 'NO'}", flush=True)
    print(f"\n{bad} mismatch(es)" if bad else "\nevery fault found where it is born; no false alarm")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
