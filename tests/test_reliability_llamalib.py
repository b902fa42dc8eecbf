"""Issue 17 for the llama.cpp side's library checks (`sides/llamacpp/lib.py`, `elf.py`), under hypothesis: random
files named libllama.so, truncated ELF libraries (libllama.so or a libggml beside it), random struct sizes and
default parameters, random libraries behind the symbols, random device lists and folder names. Every outcome is a
`MambaDebugError` whose message names the file, or a library that passes every check; never another exception,
never a crash. Whatever reaches `dlopen` runs in a forked child, so a crash (a truncated library used to kill the
process with SIGBUS) fails the test instead of killing pytest.

llama-cpp-python is not needed: when it is installed, its libllama.so is one more ELF file to cut."""
from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import shutil
import signal
import string
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from mamba_debug.errors import MambaDebugError
from mamba_debug.sides.llamacpp import lib as llib
from mamba_debug.sides.llamacpp.elf import check_elf

FUZZ = settings(max_examples=20, deadline=10000, suppress_health_check=list(HealthCheck), derandomize=True)
pytestmark = pytest.mark.usefixtures("bounded_rss")
TEXT = st.text(alphabet=string.ascii_letters + string.digits + " ._-/\\\n\x00\u00e9\u2603", max_size=12)
TENSOR_OVERHEAD = llib.GGML_OBJECT_SIZE + ctypes.sizeof(llib.GgmlTensor)


def _sources() -> list:
    """Real shared libraries to cut and copy: CPython's _ctypes module, and llama-cpp-python's libllama.so when
    it is installed (found without importing it)."""
    import _ctypes
    out = [Path(_ctypes.__file__)]
    try:
        own = llib.default_dir() / "libllama.so"
        if own.is_file():
            out.append(own)
    except MambaDebugError:
        pass
    return out


SOURCES = _sources()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("llamalib")


def _folder(root: Path) -> Path:
    return Path(tempfile.mkdtemp(dir=root))


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def _outcome(fn, timeout: float = 30.0, memory_mb: int = 512) -> tuple:
    """fn() in a forked child with at most `memory_mb` more address space: ("ok", "", repr), ("error", type name,
    message), ("crash", signal, "") or ("hang", "", "")."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                    # the child: never returns into pytest
        code = 0
        try:
            os.close(r)
            resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + (memory_mb << 20), resource.RLIM_INFINITY))
            try:
                out = ["ok", "", repr(fn())]
            except BaseException as exc:  # noqa: BLE001 (every outcome is reported to the parent)
                out = ["error", type(exc).__name__, str(exc)]
            os.write(w, json.dumps(out).encode())
        except BaseException:  # noqa: BLE001
            code = 3
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    with os.fdopen(r, "rb") as f:
        while True:
            if not select.select([f], [], [], timeout)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return ("hang", "", "")
            chunk = f.read1(1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return ("crash", signal.Signals(os.WTERMSIG(status)).name, "")
    return tuple(json.loads(b"".join(chunks))) if chunks else ("crash", f"exit {os.waitstatus_to_exitcode(status)}", "")


def _refused_naming(outcome: tuple, path: Path):
    kind, name, message = outcome
    assert kind == "error" and name == "MambaDebugError", outcome
    assert str(path) in message and "\n" not in message.replace(str(path), "").strip(), outcome


# -- files named libllama.so -------------------------------------------------------------------------------------
def _elf_head() -> bytes:
    with open(SOURCES[0], "rb") as f:
        return f.read(64)


PREFIXES = st.sampled_from([b"", b"\x7fELF", b"\x7fELF\x02\x01\x01", b"\x7fELF\x01\x01\x01", _elf_head()])


@FUZZ
@given(PREFIXES, st.binary(max_size=2048))
def test_random_file_named_libllama_so_is_refused_naming_it(root, prefix, data):
    path = _folder(root) / "libllama.so"
    path.write_bytes(prefix + data)
    _refused_naming(_outcome(lambda: llib._open(path)), path)


@FUZZ
@given(st.sampled_from(SOURCES), st.sampled_from(["libllama.so", "libggml-base.so"]),
       st.one_of(st.just(1.0), st.floats(0.0, 1.0, exclude_max=True)))
def test_truncated_library_is_refused_naming_it_and_never_crashes(root, source, which, fraction):
    folder = _folder(root)
    path = folder / "libllama.so"
    shutil.copyfile(source, path)
    cut = folder / which
    if which != "libllama.so":
        shutil.copyfile(source, cut)
    size = cut.stat().st_size
    keep = size if fraction == 1.0 else min(size - 1, int(size * fraction))
    os.truncate(cut, keep)
    outcome = _outcome(lambda: llib._open(path))
    if keep < size:
        _refused_naming(outcome, cut)
        assert "truncated" in outcome[2] or "ELF header" in outcome[2], outcome
    elif outcome[0] != "ok":                    # whole: not llama.cpp, its ggml missing, or a real llama.cpp
        _refused_naming(outcome, path)


def test_a_whole_library_passes_the_elf_check():
    for source in SOURCES:
        check_elf(source)


# -- the library's answers: struct sizes, default parameters, symbols, versions, devices -----------------------------
def _params(data: bytes | None, changes: dict) -> llib.ContextParams:
    if data is not None:
        return llib.ContextParams.from_buffer_copy(data.ljust(ctypes.sizeof(llib.ContextParams), b"\0"))
    p = llib.ContextParams()
    for k, v in {**llib.EXPECTED_DEFAULTS, **changes}.items():
        setattr(p, k, v)
    return p


param_bytes = st.none() | st.binary(min_size=ctypes.sizeof(llib.ContextParams),
                                    max_size=ctypes.sizeof(llib.ContextParams))
param_changes = st.dictionaries(st.sampled_from(sorted(llib.EXPECTED_DEFAULTS)), st.integers(0, 2 ** 32 - 1),
                                max_size=2)
overheads = st.one_of(st.just(TENSOR_OVERHEAD), st.integers(0, 2 ** 64 - 1), st.integers(0, 1024))


@FUZZ
@given(overheads, param_bytes, param_changes)
def test_random_struct_sizes_and_defaults_are_refused_naming_the_library(overhead, data, changes):
    defaults = _params(data, changes)
    right = overhead == TENSOR_OVERHEAD and all(getattr(defaults, k) == v for k, v in llib.EXPECTED_DEFAULTS.items())
    try:
        llib.check_layout("/some/where/libllama.so", overhead, defaults)
    except MambaDebugError as exc:
        assert not right and "/some/where/libllama.so" in str(exc)
        return
    assert right


class _Fn:
    """A C function of the fake library: ctypes' restype/argtypes are set on it and ignored."""

    def __init__(self, answer):
        self.answer, self.restype, self.argtypes = answer, None, None

    def __call__(self, *args):
        return self.answer(*args)


class _FakeDll:
    def __init__(self, fns: dict):
        self.__dict__.update({k: _Fn(v) for k, v in fns.items()})


c_strings = st.none() | st.binary(max_size=16)
device_answers = st.lists(st.tuples(c_strings, st.integers(-2 ** 31, 2 ** 31 - 1) | st.integers(0, 3)), min_size=1,
                          max_size=4)
device_names = st.sampled_from(["cpu", "cuda", "interpret", "", "auto"]) | TEXT


def _library_answers(root, monkeypatch, missing=(), overhead=TENSOR_OVERHEAD, data=None, changes=None,
                     versions=(), count=1, devices=((b"CPU", 0),)) -> Path:
    """A whole ELF file named libllama.so (the checks before dlopen pass) whose "dlopen" gives a library answering
    as told: the symbols but `missing`, ggml_tensor_overhead(), the default parameters, the version strings and
    the backend devices (count, then (name, type) in turn)."""
    path = _folder(root) / "libllama.so"
    shutil.copyfile(SOURCES[0], path)
    fns = {name: (lambda *a: None) for name in llib.SYMBOLS}
    fns.update(ggml_tensor_overhead=lambda: overhead, llama_context_default_params=lambda: _padded(data, changes or {}),
               ggml_backend_dev_count=lambda: count, ggml_backend_dev_get=lambda i: i,
               ggml_backend_dev_name=lambda d: devices[d % len(devices)][0],
               ggml_backend_dev_type=lambda d: devices[d % len(devices)][1])
    fns.update({name: (lambda v=v: v) for name, v in zip(llib.OPTIONAL, versions)})
    for name in missing:
        fns.pop(name)
    monkeypatch.setattr(llib, "_dlopen", lambda p: _FakeDll(fns))
    return path


@FUZZ
@given(st.sets(st.sampled_from(sorted(llib.SYMBOLS)), max_size=2), overheads, param_bytes, param_changes)
def test_a_library_with_other_symbols_or_layout_is_refused_naming_it(root, monkeypatch, missing, overhead, data,
                                                                     changes):
    path = _library_answers(root, monkeypatch, missing, overhead, data, changes)
    try:
        llib._open(path)
    except MambaDebugError as exc:
        assert str(path) in str(exc)
        return
    right = all(getattr(_params(data, changes), k) == v for k, v in llib.EXPECTED_DEFAULTS.items())
    assert not missing and overhead == TENSOR_OVERHEAD and right


@FUZZ
@given(st.lists(c_strings, max_size=3), st.integers(0, 2 ** 64 - 1) | st.integers(0, 4), device_answers,
       device_names)
def test_a_library_with_garbage_versions_and_devices_is_refused_naming_it_or_checked(root, monkeypatch, versions,
                                                                                    count, devices, device):
    path = _library_answers(root, monkeypatch, versions=versions, count=count, devices=devices)

    def open_and_check():                       # in a child: a device count taken at its word would run away
        try:
            lib = llib._open(path)
        except MambaDebugError as exc:
            assert str(path) in str(exc) and count > llib.MAX_DEVICES
            return "refused"
        assert isinstance(lib.version, str) and len(lib.devices) == count
        assert all(isinstance(n, str) and n for n, _ in lib.devices)
        assert {kind for _, kind in lib.devices} <= {"cpu", "gpu", "igpu", "accel", "?"}
        _check_device(lib, device)
        return "checked"
    outcome = _outcome(open_and_check)
    assert outcome[0] == "ok", outcome


def _padded(data, changes) -> llib._Padded:
    out = llib._Padded()
    out.params = _params(data, changes)
    return out


def _check_device(lib, device):
    try:
        llib.check_device(lib, device)
    except MambaDebugError as exc:
        assert str(lib.path) in str(exc)
        assert device != "cpu" and not (device == "cuda" and lib.has_gpu)
        return
    assert device == "cpu" or (device == "cuda" and lib.has_gpu)


@FUZZ
@given(st.lists(st.tuples(TEXT, st.sampled_from(["cpu", "gpu", "igpu", "accel", "?"]) | TEXT), max_size=5),
       st.sampled_from(["cpu", "cuda", "interpret", "", "auto"]) | TEXT | st.none())
def test_random_device_lists_are_checked_naming_the_library(devices, device):
    _check_device(llib.Library(Path("/opt/llama/libllama.so"), None, "x", "unknown", devices), device)


@FUZZ
@given(TEXT)
def test_random_folder_names_are_refused_naming_the_library_path(root, name):
    folder = f"{root}/{name}"                   # inside the test's folder whatever the name
    outcome = _outcome(lambda: llib.load_library(folder))
    _refused_naming(outcome, Path(folder) / "libllama.so")


def test_a_folder_named_libllama_so_is_not_a_file(root):
    path = _folder(root) / "libllama.so"
    path.mkdir()
    with pytest.raises(MambaDebugError, match=f"{path}: not a file"):
        llib._open(path)


@pytest.mark.parametrize("cut", [None, "libllama.so", "libggml-cpu.so.0", "libggml-base.so.0"])
def test_llama_cpp_pythons_own_folder_loads_and_any_library_cut_short_is_refused(root, cut):
    """With llama-cpp-python installed: a copy of its library folder loads (in a child); the same folder with one
    library cut in half is refused naming that library, before dlopen could crash on it."""
    folder = _copy_of_llama_cpp_pythons_folder(root)
    if cut is None:
        outcome = _outcome(lambda: llib._open(folder / "libllama.so").version)
        assert outcome[0] == "ok", outcome
        return
    os.truncate(folder / cut, (folder / cut).stat().st_size // 2)
    _refused_naming(_outcome(lambda: llib._open(folder / "libllama.so")), folder / cut)


def test_a_build_folder_copied_out_of_its_build_tree_loads(root):
    """A library folder whose RUNPATH no longer leads to its ggml libraries (a build's bin/ copied elsewhere keeps a
    RUNPATH into the build tree): the loader takes libggml.so.0 and libggml-base.so.0 from the folder itself. Made
    real by overwriting the copies' RUNPATH "$ORIGIN" with a path that does not exist (the same length)."""
    folder = _copy_of_llama_cpp_pythons_folder(root, edit=lambda data: data.replace(b"$ORIGIN\x00", b"/nowhr/\x00"))
    if b"/nowhr/" not in (folder / "libllama.so").read_bytes():
        pytest.skip("this llama-cpp-python's libllama.so has no $ORIGIN RUNPATH to break")
    outcome = _outcome(lambda: llib._open(folder / "libllama.so").version)
    assert outcome[0] == "ok", outcome


def _copy_of_llama_cpp_pythons_folder(root, edit=lambda data: data) -> Path:
    """A copy of llama-cpp-python's library folder (each file's bytes through `edit`); skips without it."""
    try:
        own = llib.default_dir()
    except MambaDebugError:
        pytest.skip("llama-cpp-python is not installed")
    folder = _folder(root)
    for f in own.glob("lib*.so*"):
        (folder / f.name).write_bytes(edit(f.read_bytes()))
    return folder
