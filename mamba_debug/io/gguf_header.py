"""A GGUF header walked before the gguf library parses it: every count, string length, array length and tensor
dimension is checked against the bytes left in the file, so a header that declares 4e9 tensors or a 2^40-element
array is refused at once instead of being allocated or looped over."""
from __future__ import annotations

import struct
from pathlib import Path

from ..errors import CheckpointError

_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4


def check_gguf_header(path: Path) -> None:
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        _Walk(f, size, path).run()


class _Walk:
    def __init__(self, f, size: int, path: Path):
        self.f, self.size, self.path, self.pos = f, size, path, 0

    def fail(self, what: str):
        raise CheckpointError(f"{self.path}: GGUF header {what} (file of {self.size} bytes); the file is damaged or "
                              f"not a GGUF: re-download or re-export it")

    def read(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            self.fail(f"needs bytes up to {self.pos + n} at offset {self.pos}")
        data = self.f.read(n)
        if len(data) != n:
            self.fail(f"ends early at offset {self.pos}")
        self.pos += n
        return data

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def skip(self, n: int, what: str):
        if n < 0 or self.pos + n > self.size:
            self.fail(f"{what} of {n} bytes at offset {self.pos} runs past the end")
        self.f.seek(n, 1)
        self.pos += n

    def string(self, what: str):
        self.skip(self.u64(), what)

    def value(self, vtype: int, what: str):
        if vtype in _FIXED:
            self.skip(_FIXED[vtype], what)
        elif vtype == _STRING:
            self.string(what)
        elif vtype == _ARRAY:
            etype, count = self.u32(), self.u64()
            if etype in _FIXED:
                self.skip(count * _FIXED[etype], f"{what}: array of {count} elements")
            elif etype == _STRING:
                if count * 8 > self.size - self.pos:
                    self.fail(f"{what}: array of {count} strings cannot fit")
                for _ in range(count):
                    self.string(what)
            else:
                self.fail(f"{what}: array of unknown type {etype}")
        else:
            self.fail(f"{what}: unknown value type {vtype}")

    def run(self):
        if self.read(4) != b"GGUF":
            self.fail("does not start with b'GGUF'")
        version = self.u32()
        if version not in (2, 3):
            self.fail(f"has version {version}; mamba-debug reads GGUF versions 2 and 3")
        n_tensors, n_kv = self.u64(), self.u64()
        if n_tensors * 24 > self.size or n_kv * 12 > self.size:
            self.fail(f"declares {n_tensors} tensors and {n_kv} metadata keys, more than the file can hold")
        for i in range(n_kv):
            self.string(f"metadata key {i}")
            self.value(self.u32(), f"metadata value {i}")
        for i in range(n_tensors):
            self.string(f"tensor name {i}")
            n_dims = self.u32()
            if not 1 <= n_dims <= MAX_DIMS:
                self.fail(f"tensor {i} has {n_dims} dimensions (1..{MAX_DIMS})")
            n = 1
            for _ in range(n_dims):
                n *= self.u64()
            if n > self.size * 8:
                self.fail(f"tensor {i} declares {n} elements, more than the file holds")
            self.u32()
            self.u64()
