"""Loading a llama.cpp library through ctypes, and checking it before anything is called.

Which library: `--llama-lib DIR` (RunSettings.llama_lib), else `LLAMA_CPP_LIB_PATH=DIR` (llama-cpp-python's own
convention: a folder holding libllama.so and its ggml libraries), else the one llama-cpp-python installed. The
package `llama_cpp` is never imported: its module loads a library at import time, and two llama.cpp builds cannot
share a process (the second one's libggml*.so.0 would resolve to the first one's by soname). So one library per
process; asking for another is an error that says so.

Checks (a `MambaDebugError` naming the file and what does not match, exit 2): before `dlopen`, libllama.so and the
libggml libraries beside it are whole 64-bit ELF shared libraries (`elf.py`: a truncated one would crash the
process); every symbol this side calls is exported; `ggml_tensor_overhead()` gives the struct size the `GgmlTensor`
mirror below reads (LP64 layout of llama.cpp 0c1e570, the commit llama-cpp-python 0.3.36 vendors);
`llama_context_default_params()` returns the defaults of that layout (a different llama.h would scramble them); the
device count is a count (<= 256) and names are decoded whatever their bytes; `--device cuda` needs a GPU device in
the build.
"""
from __future__ import annotations

import ctypes
import os
import re
from ctypes import POINTER, c_bool, c_char, c_char_p, c_float, c_int, c_int8, c_int32, c_int64, c_size_t
from ctypes import c_uint32, c_void_p
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ...errors import MambaDebugError
from . import preload
from .elf import check_elf

GGML_OBJECT_SIZE = 32


class GgmlTensor(ctypes.Structure):
    """struct ggml_tensor (ggml/include/ggml.h, LP64): only type, buffer, ne, nb, src, view_src, view_offs, data and
    name are read."""
    _fields_ = [("type", c_int), ("buffer", c_void_p), ("ne", c_int64 * 4), ("nb", c_size_t * 4), ("op", c_int),
                ("op_params", c_int32 * 16), ("flags", c_int32), ("src", c_void_p * 10), ("view_src", c_void_p),
                ("view_offs", c_size_t), ("data", c_void_p), ("name", c_char * 64), ("extra", c_void_p),
                ("padding", c_char * 8)]


class LlamaBatch(ctypes.Structure):
    _fields_ = [("n_tokens", c_int32), ("token", POINTER(c_int32)), ("embd", POINTER(c_float)),
                ("pos", POINTER(c_int32)), ("n_seq_id", POINTER(c_int32)), ("seq_id", POINTER(POINTER(c_int32))),
                ("logits", POINTER(c_int8))]


class ModelParams(ctypes.Structure):
    _fields_ = [("devices", c_void_p), ("tensor_buft_overrides", c_void_p), ("n_gpu_layers", c_int32),
                ("split_mode", c_int), ("load_mode", c_int), ("lazy_mode", c_int), ("main_gpu", c_int32),
                ("tensor_split", c_void_p), ("progress_callback", c_void_p), ("progress_callback_user_data", c_void_p),
                ("kv_overrides", c_void_p), ("vocab_only", c_bool), ("check_tensors", c_bool),
                ("use_extra_bufts", c_bool), ("no_host", c_bool), ("no_alloc", c_bool), ("load_mtp", c_bool)]


class ContextParams(ctypes.Structure):
    _fields_ = [("n_ctx", c_uint32), ("n_batch", c_uint32), ("n_ubatch", c_uint32), ("n_seq_max", c_uint32),
                ("n_rs_seq", c_uint32), ("n_outputs_max", c_uint32), ("n_outputs_max_per_seq", c_uint32),
                ("n_threads", c_int32), ("n_threads_batch", c_int32), ("ctx_type", c_int),
                ("rope_scaling_type", c_int), ("pooling_type", c_int), ("attention_type", c_int),
                ("flash_attn_type", c_int), ("rope_freq_base", c_float), ("rope_freq_scale", c_float),
                ("yarn_ext_factor", c_float), ("yarn_attn_factor", c_float), ("yarn_beta_fast", c_float),
                ("yarn_beta_slow", c_float), ("yarn_orig_ctx", c_uint32), ("defrag_thold", c_float),
                ("cb_eval", c_void_p), ("cb_eval_user_data", c_void_p), ("type_k", c_int), ("type_v", c_int),
                ("abort_callback", c_void_p), ("abort_callback_data", c_void_p), ("embeddings", c_bool),
                ("offload_kqv", c_bool), ("no_perf", c_bool), ("op_offload", c_bool), ("swa_full", c_bool),
                ("kv_unified", c_bool), ("samplers", c_void_p), ("n_samplers", c_size_t), ("ctx_other", c_void_p)]


class _Padded(ctypes.Structure):
    """Room for a by-value struct return larger than the mirror: a library whose struct is bigger writes into this,
    not past it, and the check below then reports the mismatch instead of a crash."""
    _fields_ = [("params", ContextParams), ("spare", c_char * 512)]


class _PaddedModel(ctypes.Structure):
    _fields_ = [("params", ModelParams), ("spare", c_char * 512)]


EvalCallback = ctypes.CFUNCTYPE(c_bool, c_void_p, c_bool, c_void_p)
LogCallback = ctypes.CFUNCTYPE(None, c_int, c_char_p, c_void_p)

# name -> (restype, argtypes): every function this side calls; all are checked before the first call
SYMBOLS = {
    "llama_backend_init": (None, []),
    "llama_log_set": (None, [c_void_p, c_void_p]),
    "llama_model_default_params": (_PaddedModel, []),
    "llama_context_default_params": (_Padded, []),
    "llama_model_load_from_file": (c_void_p, [c_char_p, ModelParams]),
    "llama_model_free": (None, [c_void_p]),
    "llama_init_from_model": (c_void_p, [c_void_p, ContextParams]),
    "llama_free": (None, [c_void_p]),
    "llama_batch_init": (LlamaBatch, [c_int32, c_int32, c_int32]),
    "llama_batch_free": (None, [LlamaBatch]),
    "llama_decode": (c_int32, [c_void_p, LlamaBatch]),
    "llama_get_logits_ith": (POINTER(c_float), [c_void_p, c_int32]),
    "llama_get_memory": (c_void_p, [c_void_p]),
    "llama_memory_clear": (None, [c_void_p, c_bool]),
    "llama_model_n_layer": (c_int32, [c_void_p]),
    "llama_model_get_vocab": (c_void_p, [c_void_p]),
    "llama_vocab_n_tokens": (c_int32, [c_void_p]),
    "llama_state_seq_get_size": (c_size_t, [c_void_p, c_int32]),
    "llama_state_seq_get_data": (c_size_t, [c_void_p, c_void_p, c_size_t, c_int32]),
    "llama_state_seq_set_data": (c_size_t, [c_void_p, c_void_p, c_size_t, c_int32]),
    "llama_print_system_info": (c_char_p, []),
    "ggml_tensor_overhead": (c_size_t, []),
    "ggml_nbytes": (c_size_t, [c_void_p]),
    "ggml_op_desc": (c_char_p, [c_void_p]),
    "ggml_backend_tensor_get": (None, [c_void_p, c_void_p, c_size_t, c_size_t]),
    "ggml_backend_tensor_set": (None, [c_void_p, c_void_p, c_size_t, c_size_t]),
    "ggml_backend_buffer_name": (c_char_p, [c_void_p]),
    "ggml_backend_dev_count": (c_size_t, []),
    "ggml_backend_dev_get": (c_void_p, [c_size_t]),
    "ggml_backend_dev_name": (c_char_p, [c_void_p]),
    "ggml_backend_dev_type": (c_int, [c_void_p]),
}
OPTIONAL = {"llama_version": (c_char_p, []), "ggml_version": (c_char_p, []), "ggml_commit": (c_char_p, []),
            # the fast path's deferred, asynchronous copies (defer.py); without them it copies as before
            "ggml_backend_buffer_is_host": (c_bool, [c_void_p]),
            "ggml_backend_buffer_get_type": (c_void_p, [c_void_p]),
            "ggml_backend_buft_get_device": (c_void_p, [c_void_p]),
            "ggml_backend_dev_init": (c_void_p, [c_void_p, c_char_p]),
            "ggml_backend_tensor_get_async": (None, [c_void_p, c_void_p, c_void_p, c_size_t, c_size_t]),
            "ggml_backend_synchronize": (None, [c_void_p]),
            "ggml_backend_dev_host_buffer_type": (c_void_p, [c_void_p]),
            "ggml_backend_buft_alloc_buffer": (c_void_p, [c_void_p, c_size_t]),
            "ggml_backend_buffer_get_base": (c_void_p, [c_void_p]),
            "ggml_backend_buffer_free": (None, [c_void_p])}
MAX_DEVICES = 256       # more than any host has: a count beyond it is garbage from a mismatched library
DEV_GPU = {1, 2}        # GGML_BACKEND_DEVICE_TYPE_GPU, _IGPU (CPU 0, ACCEL 3)
# llama_context_default_params() of the mirrored llama.h: a library with another layout returns other numbers here
EXPECTED_DEFAULTS = {"n_ctx": 512, "n_batch": 2048, "n_ubatch": 512, "n_seq_max": 1}


@dataclass
class Library:
    path: Path                  # libllama.so
    dll: ctypes.CDLL
    version: str                # "llama.cpp <v> (ggml <v>, commit <c>)" or "unknown"
    commit: str                 # "unknown" when the build does not say (a source archive)
    devices: list               # [(name, kind)] of ggml's backend devices: kind cpu | gpu | igpu | accel

    def __getattr__(self, name):
        return getattr(self.dll, name)

    @property
    def has_gpu(self) -> bool:
        return any(kind in ("gpu", "igpu") for _, kind in self.devices)

    @property
    def rounding(self) -> Optional[str]:
        """The build whose narrow-weight rounding --local emulates (activations.emulation): "cpu" without a GPU,
        "cuda" where every GPU is a CUDA device, None for another GPU back-end (its kernels are not emulated)."""
        gpus = [name for name, kind in self.devices if kind in ("gpu", "igpu")]
        if not gpus:
            return "cpu"
        return "cuda" if all(name.startswith("CUDA") for name in gpus) else None


_LOADED: Optional[Library] = None


def default_dir() -> Path:
    """The folder of llama-cpp-python's own library (found without importing the package)."""
    import importlib.util  # noqa: PLC0415
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise MambaDebugError("--engine llama.cpp: llama-cpp-python is not installed and no library was given; "
                              "pip install llama-cpp-python==0.3.36 (or run tests/llamacpp/build.sh), or pass "
                              "--llama-lib DIR / LLAMA_CPP_LIB_PATH=DIR, a folder holding libllama.so")
    return Path(list(spec.submodule_search_locations)[0]) / "lib"


def library_dir(llama_lib: Optional[str]) -> Path:
    chosen = llama_lib or os.environ.get("LLAMA_CPP_LIB_PATH")
    return Path(chosen).expanduser() if chosen else default_dir()


def load_library(llama_lib: Optional[str] = None, device: str = "cpu") -> Library:
    """The checked library of this process (see the module docstring)."""
    global _LOADED
    folder = library_dir(llama_lib)
    path = folder / "libllama.so"
    if _LOADED is not None:
        if not _same_file(_LOADED.path, path):
            raise MambaDebugError(f"{path}: this process already runs the llama.cpp library {_LOADED.path}; two "
                                  f"llama.cpp builds cannot share a process (their ggml libraries collide by "
                                  f"name): run another mamba-debug process for the other library")
        lib = _LOADED
    else:
        lib = _open(path)
    check_device(lib, device)
    _LOADED = lib
    return lib


def _open(path: Path) -> Library:
    if not path.is_file():
        own = path.parent == _default_dir_or_none()
        where = "llama-cpp-python's folder" if own else "--llama-lib / LLAMA_CPP_LIB_PATH"
        what = "not a file" if path.exists() else "no such file"
        raise MambaDebugError(f"{path}: {what}; {where} must name a folder holding libllama.so and its ggml "
                              f"libraries (a llama.cpp build's lib or bin folder)")
    preload.warn(path.parent)       # a CUDA build after numpy: the fix named before the process can die
    for file in [path] + sorted(f for f in path.parent.glob("libggml*.so*") if f.is_file()):
        check_elf(file)             # a truncated library would kill the process with SIGBUS inside dlopen
    try:
        dll = _dlopen(path)
    except OSError as exc:
        raise MambaDebugError(f"{path}: cannot be loaded as a shared library ({exc})") from exc
    missing = [name for name in SYMBOLS if not hasattr(dll, name)]
    if missing:
        what = "not a llama.cpp library" if "llama_decode" in missing else "a llama.cpp library of another version"
        raise MambaDebugError(f"{path}: {what}: it does not export {', '.join(missing[:6])}"
                              f"{' ...' if len(missing) > 6 else ''}; mamba-debug reads llama.cpp as vendored by "
                              f"llama-cpp-python 0.3.36 (commit 0c1e570)")
    for name, (res, args) in {**SYMBOLS, **{k: v for k, v in OPTIONAL.items() if hasattr(dll, k)}}.items():
        fn = getattr(dll, name)
        fn.restype, fn.argtypes = res, args
    check_layout(path, dll.ggml_tensor_overhead(), dll.llama_context_default_params().params)
    return Library(path, dll, *_version(dll), _devices(dll, path))


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except (OSError, ValueError, RuntimeError):     # a path the system refuses (a NUL byte, a symlink loop)
        return False


_NOT_FOUND = re.compile(r"([^\s:/]+\.so[.\d]*): cannot open shared object file")


def _dlopen(path: Path, mode: int = ctypes.DEFAULT_MODE, depth: int = 0):
    """dlopen, with a dependency the loader cannot find taken from the library's own folder: a build folder copied
    out of its build tree keeps a RUNPATH into that tree, so libllama.so's libggml.so.0 (and that one's
    libggml-base.so.0) would not be found next to it. Such a library is loaded first from the folder, its symbols
    global, and the load tried again; a dependency missing from the folder too is the loader's own error."""
    try:
        return ctypes.CDLL(str(path), mode=mode)
    except OSError as exc:
        missing = _NOT_FOUND.search(str(exc))
        dep = path.parent / missing.group(1) if missing else None
        if dep is None or not dep.is_file() or dep.name == path.name or depth >= 8:
            raise
        check_elf(dep)
        _dlopen(dep, ctypes.RTLD_GLOBAL, depth + 1)
        return _dlopen(path, mode, depth + 1)


def _default_dir_or_none() -> Optional[Path]:
    try:
        return default_dir()
    except MambaDebugError:
        return None


def check_layout(path, overhead: int, defaults: ContextParams):
    size = overhead - GGML_OBJECT_SIZE
    if size != ctypes.sizeof(GgmlTensor):
        raise MambaDebugError(f"{path}: struct ggml_tensor is {size} bytes in this library (ggml_tensor_overhead() "
                              f"= {overhead}) but mamba-debug reads the {ctypes.sizeof(GgmlTensor)}-byte layout of "
                              f"llama.cpp 0c1e570 (llama-cpp-python 0.3.36); use a build of that commit")
    got = {k: getattr(defaults, k) for k in EXPECTED_DEFAULTS}
    if got != EXPECTED_DEFAULTS:
        raise MambaDebugError(f"{path}: llama_context_default_params() gives {got}, not the {EXPECTED_DEFAULTS} of "
                              f"the llama.h mamba-debug mirrors (llama.cpp 0c1e570): struct llama_context_params "
                              f"differs in this build; use a build of that commit")


def check_device(lib: Library, device: str):
    if device not in ("cpu", "cuda"):
        raise MambaDebugError(f"{lib.path}: --engine llama.cpp runs on --device cpu or cuda, not {device!r}")
    if device == "cuda" and not lib.has_gpu:
        names = ", ".join(n for n, _ in lib.devices) or "none"
        raise MambaDebugError(f"{lib.path}: --device cuda asked for, but this llama.cpp build has no GPU backend "
                              f"(its devices: {names}); build llama.cpp with -DGGML_CUDA=on and pass it with "
                              f"--llama-lib DIR, or use --device cpu")


def _version(dll) -> tuple:
    get = lambda name: _text(getattr(dll, name)()) if hasattr(dll, name) else ""  # noqa: E731
    llama, ggml, commit = get("llama_version"), get("ggml_version"), get("ggml_commit")
    commit = commit if commit and commit != "unknown" else "unknown"
    if not (llama or ggml):
        return "unknown", commit
    return f"llama.cpp {llama or '?'} (ggml {ggml or '?'}, commit {commit})", commit


def _text(raw) -> str:
    """A C string from the library, readable whatever its bytes (a foreign build may return anything)."""
    return (raw or b"").decode("utf-8", errors="replace")


def _devices(dll, path=None) -> list:
    kinds = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}
    count = dll.ggml_backend_dev_count()
    if not 0 <= count <= MAX_DEVICES:
        raise MambaDebugError(f"{path}: ggml_backend_dev_count() = {count}, not a device count (0..{MAX_DEVICES}): "
                              f"the library does not match the llama.h mamba-debug mirrors (llama.cpp 0c1e570)")
    out = []
    for i in range(count):
        dev = dll.ggml_backend_dev_get(i)
        out.append((_text(dll.ggml_backend_dev_name(dev)) or "?", kinds.get(dll.ggml_backend_dev_type(dev), "?")))
    return out
