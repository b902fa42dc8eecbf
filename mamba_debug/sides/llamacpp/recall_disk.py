"""recall.py's remembered tries on disk, so that a new process (each `mamba-debug compare --engine llama.cpp`)
recalls its first graphs instead of mapping them node by node (~18 us a node against ~6).

One file per remembered trie in the cache folder ($MAMBA_DEBUG_CACHE or ~/.cache/mamba-debug, `recall/`), named by
a hash of the trie's key (library file, version and commit, GGUF file by path, size and mtime, layer kinds, observed
sites), of the library file's size and mtime, and of the mapping code (nodes.py, maps.py, recall.py: a change to
how nodes are mapped is another file). What is written is what the trie holds, no address, buffer or value: each
step's key and outcome, flattened in a list (a path is hundreds of steps deep), as plain Python data; it is read
back with an unpickler that refuses every class, so a file that holds anything else is not loaded (and is
deleted, as is one that does not read). Written whole, under another name, then moved in; at most MAX_FILES
kept. MAMBA_DEBUG_LLAMA_KEEP=0 (nothing kept between runs) reads and writes nothing.
"""
from __future__ import annotations

import hashlib
import io
import os
import pickle
from pathlib import Path

import numpy as np

from ...safeio import cache_dir, write_bytes

VERSION = 1
MAX_FILES = 16              # tries kept in the folder (the least recently written go first): one per model and library
FIELDS = ("name", "op", "layer", "site", "backend", "extra", "size", "emb", "view", "conv")
_CODE: list = []


def keeping() -> bool:
    """Whether anything is kept between runs: contexts (contexts.py) and tries on disk (MAMBA_DEBUG_LLAMA_KEEP)."""
    return os.environ.get("MAMBA_DEBUG_LLAMA_KEEP", "1") not in ("0", "")


def _code_hash() -> str:
    if not _CODE:
        h = hashlib.sha256()
        for name in ("nodes.py", "maps.py", "recall.py", "recall_disk.py"):
            h.update(Path(__file__).with_name(name).read_bytes())
        _CODE.append(h.hexdigest())
    return _CODE[0]


def path(key: tuple) -> Path:
    lib = Path(key[0])
    st = lib.stat() if lib.is_file() else None
    h = hashlib.sha256(repr((VERSION, _canon(key), st and (st.st_size, st.st_mtime_ns), _code_hash())).encode())
    return cache_dir("recall", f"{h.hexdigest()[:24]}.pkl")


def _canon(x):
    """x with its sets as sorted tuples: a set's order (and repr) differs from process to process."""
    if isinstance(x, (set, frozenset)):
        return tuple(sorted((_canon(v) for v in x), key=repr))
    if isinstance(x, tuple):
        return tuple(_canon(v) for v in x)
    return x


def save(key: tuple, memory) -> None:
    """Write the trie (memory.root, memory.steps) for `key`; nothing when disabled. A failed write leaves no file."""
    if not keeping():
        return
    entries, stack = [], [(-1, None, memory.root)]
    while stack:                    # depth first, iteratively: parents before their children
        parent, k, kept = stack.pop()
        me = len(entries)
        entries.append((parent, k, None if parent < 0 else tuple(_plain(f, getattr(kept, f)) for f in FIELDS)))
        stack.extend((me, kk, kid) for kk, kid in kept.kids.items())
    out = path(key)
    try:
        write_bytes(out, pickle.dumps((VERSION, memory.steps, entries), protocol=4))
        old = sorted(out.parent.glob("*.pkl"), key=lambda f: f.stat().st_mtime_ns, reverse=True)[MAX_FILES:]
        for f in old:               # bounded: tests and one-off GGUFs would grow the folder forever
            f.unlink(missing_ok=True)
    except OSError:                 # a read-only or full cache: the next process maps its first graphs again
        return


def load(key: tuple, memory_cls, kept_cls):
    """The trie written for `key`, as a new memory_cls, or None (none written, disabled, or unreadable)."""
    if not keeping():
        return None
    f = path(key)
    if not f.is_file():
        return None
    try:
        version, steps, entries = _Plain(io.BytesIO(f.read_bytes())).load()
        if version != VERSION:
            raise ValueError(f"version {version}")
        m = memory_cls()
        nodes = [m.root]
        for parent, k, fields in entries[1:]:
            kid = kept_cls()
            for name, value in zip(FIELDS, fields):
                setattr(kid, name, _typed(name, value))
            nodes[parent].kids[k] = kid
            nodes.append(kid)
        m.steps = steps
        return m
    except Exception:  # noqa: BLE001 (a broken file is a cache miss: removed, the graphs mapped again)
        f.unlink(missing_ok=True)
        return None


def _plain(field: str, value):
    if field == "view" and value is not None:       # (shape, dtype, strides, nbytes): the dtype by its name
        return (value[0], np.dtype(value[1]).str, value[2], value[3])
    return value


def _typed(field: str, value):
    if field == "view" and value is not None:
        return (value[0], np.dtype(value[1]), value[2], value[3])
    return value


class _Plain(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"{module}.{name}: a remembered trie holds plain data only")
