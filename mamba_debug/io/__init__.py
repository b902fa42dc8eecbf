"""Loaders and writers: HF folders (`hf`), llama.cpp GGUF files (`gguf`, vocabulary in `gguf_vocab`), the check
of loaded tensors against the shapes the arch declares (`weights`), and `load_model`, which picks the reader."""
from .gguf import describe_gguf
from .gguf_mamba2 import export_gguf, load_gguf
from .hf import save_hf
from .load import DATA_DIR, DEFAULT_MODEL, load_model
from .weights import check_params

__all__ = ["DATA_DIR", "DEFAULT_MODEL", "check_params", "describe_gguf", "export_gguf", "load_gguf", "load_model",
           "save_hf"]
