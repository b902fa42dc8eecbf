"""The model's GGUF file for llama.cpp: its own when it was loaded from one, else an f32 export kept in the cache
folder under a digest of what the file holds, so an edited config (an eps, Granite's multipliers, the layer types)
or edited weights get a new export, never a stale one."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Optional

import torch

from ...safeio import cache_dir as default_cache_dir


def gguf_for(model, cache_dir: Optional[Path] = None) -> Path:
    """The model's GGUF file: its own path when it was loaded from one and its weights are still the file's, else an
    f32 export into a cache folder (an edited weight of a loaded GGUF ran the file's: a false DIVERGED)."""
    src = str(model.source or "").split(" [")[0]
    if src and Path(src).is_file() and src.endswith(".gguf") and model.file_state == model.params_state():
        return Path(src)
    from ...io import export_gguf  # noqa: PLC0415
    base = cache_dir or default_cache_dir()
    h = hashlib.sha256()
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    for k in sorted(model.params):
        h.update(k.encode())
        h.update(model.params[k].to(torch.float32).numpy().tobytes())
    path = base / "gguf" / f"{Path(src).name or 'model'}-{h.hexdigest()[:16]}-f32.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        export_gguf(model, path.with_suffix(".part"), dtype="f32").rename(path)
        print(f"mamba-debug: {src or 'the in-memory model'} exported to {path} (f32 GGUF) for llama.cpp",
              file=sys.stderr)
    return path


def model_key(gguf: Path) -> tuple:
    """What tells this model's file from another's for what the Tracer remembers across runs (observe.py, recall.py):
    its path, size and modification time (a file rewritten in place is another model)."""
    st = Path(gguf).stat()
    return str(Path(gguf).resolve()), st.st_size, st.st_mtime_ns


def matmul_weights_narrower(gguf: Path) -> bool:
    """Whether any matrix of the file is stored narrower than float32 (f16, bf16, quantized): llama.cpp then rounds
    those matmuls' activations (local.py's weight paths), so a divergence needs every ubatch's local errors."""
    from gguf import GGMLQuantizationType, GGUFReader  # noqa: PLC0415
    return any(t.tensor_type != GGMLQuantizationType.F32 and len(t.shape) >= 2 for t in GGUFReader(str(gguf)).tensors)
