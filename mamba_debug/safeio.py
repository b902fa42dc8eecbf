"""Outputs that never destroy inputs and are never half-written.

`atomic_path(path)`: a context manager that yields a unique temporary path in the destination's folder (so the
rename is atomic on the same file system); on success it is renamed over `path`, on any failure (full disk,
Ctrl-C, an exception) it is removed, so `path` keeps its old content or does not exist. `write_text`/`write_bytes`
are the one-liners over it.

`cache_dir(*parts)`: the cache folder ($MAMBA_DEBUG_CACHE or ~/.cache/mamba-debug), where exported GGUFs, the
llama.cpp side's compiled callback and its remembered node maps go.

`refuse_inputs(outputs, inputs)`: every output path of a run against every file the run reads (the model's
files, the trace being shown, the plug-in file) and against each other: an output that is an input is refused
(`MambaDebugError`, exit 2) before anything runs.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

from .errors import MambaDebugError


def cache_dir(*parts: str) -> Path:
    return Path(os.environ.get("MAMBA_DEBUG_CACHE") or Path.home() / ".cache" / "mamba-debug", *parts)


@contextlib.contextmanager
def atomic_path(path):
    """Yield a fresh temporary path next to `path`; rename it over `path` when the block ends without error. A
    symbolic link is written through (its target replaced, the link kept). A device or a pipe (`--json /dev/null`,
    /dev/stdout, a FIFO) gets the finished file's bytes copied into it: a rename would replace the node itself,
    which root may do."""
    path = Path(path)
    if path.is_dir():
        raise MambaDebugError(f"{path}: is a folder; give a file name for this output")
    node = path.exists() and not path.is_file()        # (links followed) a device or a pipe
    if path.is_symlink() and not node:                  # to a file, or dangling: the target is the output
        path = Path(os.path.realpath(path))
    if not node:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=None if node else path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        if node:
            with open(tmp, "rb") as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.unlink(tmp)
        else:
            os.chmod(tmp, _mode_for(path))      # mkstemp's 0600 would stay: a report no one else could read
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _mode_for(path: Path) -> int:
    """The permissions an output gets: the replaced file's, else what the umask gives a new file (as open() does)."""
    with contextlib.suppress(OSError):
        return stat.S_IMODE(os.stat(path).st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_bytes(path, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return Path(path)


def write_text(path, text: str) -> Path:
    return write_bytes(path, text.encode("utf-8"))


def _same(a: Path, b: Path) -> bool:
    try:
        if a.exists() and b.exists():
            return os.path.samefile(a, b)
    except OSError:
        pass
    return os.path.realpath(a) == os.path.realpath(b)


def _char_device(p: Path) -> bool:
    try:
        return stat.S_ISCHR(os.stat(p).st_mode)
    except OSError:
        return False


def model_inputs(model_path) -> list:
    """The files a model load reads: a GGUF file, or every file of a model folder (config, weights, tokenizer)."""
    if model_path is None:
        return []
    p = Path(model_path)
    if p.is_file() and p.name == "config.json":
        p = p.parent
    if p.is_dir():
        return [("a file of the model folder " + str(p), f) for f in sorted(p.iterdir()) if f.is_file()]
    return [("the model file", p)]


def refuse_inputs(outputs: dict, inputs: list):
    """outputs: flag -> path (None = not asked); inputs: (what, path). Refuse an output that is an input or that
    another output also names."""
    given = [(flag, Path(p)) for flag, p in outputs.items() if p is not None]
    for flag, out in given:                 # refused now, not after the run
        if out.is_dir():
            raise MambaDebugError(f"{flag} {out} is a folder; give a file name for this output")
        parent = next((a for a in out.absolute().parents if a.exists()), None)
        if parent is not None and (not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK)):
            raise MambaDebugError(f"{flag} {out}: cannot write into {parent} (not a writable folder); choose "
                                  f"another output path")
    for flag, out in given:
        for what, inp in inputs:
            if inp is not None and _same(out, Path(inp)):
                raise MambaDebugError(f"{flag} {out} is {what} this run reads; writing it would destroy it. "
                                      f"Choose another output path.")
    for i, (flag, out) in enumerate(given):
        for flag2, out2 in given[i + 1:]:
            if _same(out, out2) and not _char_device(out):     # two outputs into /dev/null (or a terminal) harm none
                raise MambaDebugError(f"{flag} and {flag2} both name {out}; give each output its own path")
