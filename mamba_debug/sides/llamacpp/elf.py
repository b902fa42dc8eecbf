"""A shared library's ELF header against the file's size, before `dlopen` sees it.

glibc maps a library's segments as its program headers place them; a file cut short (an interrupted copy or
download) maps pages past its end, and the process dies of SIGBUS the moment the loader touches them: no exception,
no message. So before loading, the header tables and every segment the loader maps (PT_LOAD, PT_DYNAMIC) must lie
inside the file, and the section headers too (they sit at the end of a file, so a truncation shows there first).
Anything else `dlopen` reports itself, as an error.
"""
from __future__ import annotations

import struct
from pathlib import Path

from ...errors import MambaDebugError

EHDR, PHDR = 64, 56                     # ELF64 header and program header sizes
ET_DYN, PT_LOAD, PT_DYNAMIC = 3, 1, 2


def check_elf(path) -> None:
    """Refuse (MambaDebugError naming the file) what is not a 64-bit ELF shared library lying whole in the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(EHDR)
            if head[:4] != b"\x7fELF":
                raise MambaDebugError(f"{path}: not a shared library (no ELF header: the file starts with "
                                      f"{head[:4]!r}); give the folder of a llama.cpp build's libllama.so")
            if len(head) < EHDR:
                _within(path, "the ELF header", 0, EHDR, size)
            if head[4] != 2 or head[5] not in (1, 2):
                raise MambaDebugError(f"{path}: not a 64-bit ELF library (ELF class {head[4]}, data {head[5]}); "
                                      f"mamba-debug needs a 64-bit build")
            end = "<" if head[5] == 1 else ">"
            (e_type, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _) = struct.unpack(
                end + "HHIQQQIHHHHHH", head[16:])
            if e_type != ET_DYN:
                raise MambaDebugError(f"{path}: an ELF file of type {e_type}, not a shared library (type {ET_DYN})")
            if phentsize != PHDR or phnum == 0:
                _damaged(path, f"program headers of {phentsize} bytes x {phnum}")
            _within(path, "the program header table", phoff, phnum * PHDR, size)
            if shoff:
                _within(path, "the section header table", shoff, max(shnum, 1) * shentsize, size)
            f.seek(phoff)
            table = f.read(phnum * PHDR)
    except OSError as exc:
        raise MambaDebugError(f"{path}: cannot be read ({exc.strerror or exc})") from exc
    for i in range(phnum):
        p_type, _, offset, _, _, filesz, _, _ = struct.unpack(end + "IIQQQQQQ", table[i * PHDR:(i + 1) * PHDR])
        if p_type in (PT_LOAD, PT_DYNAMIC):
            _within(path, f"segment {i}", offset, filesz, size)


def _within(path, what: str, offset: int, length: int, size: int):
    if offset + length > size:
        raise MambaDebugError(f"{path}: truncated or damaged shared library: {what} ends at byte {offset + length:,} "
                              f"but the file has {size:,} bytes; copy or build the library again (loading it would "
                              f"crash the process)")


def _damaged(path, what: str):
    raise MambaDebugError(f"{path}: damaged shared library ({what}); copy or build the library again")
