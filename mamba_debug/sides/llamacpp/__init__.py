"""The llama.cpp side: a llama.cpp build (llama-cpp-python's or the user's own) traced through its eval callback."""
from .side import LlamaCppSide, gguf_for

__all__ = ["LlamaCppSide", "gguf_for"]
