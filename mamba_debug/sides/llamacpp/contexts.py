"""The llama.cpp side's eval callback as handed to a context, and the model and context a process keeps between runs.

Callback: the Tracer's Python callback, fronted by the C fast path where it compiles (fastpath.py); `callback_text`
says which one ran (`config.llama_cpp.callback`).

Kept between runs: a side that closes leaves its model, context and Tracer here (one of each per process) instead
of freeing them, and the next side with the same library, GGUF file, device, offload, ubatch, sequences, threads
and op offload takes them over: its memory is cleared (as between the runs of one side), and the Tracer's trie
still knows the context's graphs, so every node of a repeated graph is answered in C from the first ubatch
(a fresh context would map the first graph of each kind again in Python: recall.py). A side with other settings
frees what is kept first. MAMBA_DEBUG_LLAMA_KEEP=0 keeps nothing (each run loads the model and makes its
context). What the Tracer keeps is its trie and the buffers of its observed values (one graph's sites); its
weights, local errors and last graphs are dropped at close as before.
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

from . import fastpath
from .lib import EvalCallback
from .observe import NAME_OFF, STRUCT, Tracer
from .recall_disk import keeping

_KEPT: dict = {}        # "model": (key, lib, lmodel), "context": (key, bundle)
KEEP_ALIVE = []         # ctypes callbacks and fast-path states handed to a library live as long as the process


class Bundle:
    """A context and what traces it: the Tracer, its ctypes callback, the fast path (None: Python only)."""

    def __init__(self, ctx, mem, tracer: Tracer, callback_text: str):
        self.ctx, self.mem, self.tracer, self.callback_text = ctx, mem, tracer, callback_text


def callback(lib, tracer: Tracer, cp) -> str:
    """Set the context params' eval callback to trace with `tracer`; what runs, in words."""
    cb = EvalCallback(tracer.eval)
    KEEP_ALIVE.append(cb)
    cp.cb_eval = ctypes.cast(cb, ctypes.c_void_p)
    dll, why = fastpath.load() if not os.environ.get("MAMBA_DEBUG_NO_FASTPATH") else (None, "off by request")
    if dll is None:
        return f"Python ({why})"
    fast = tracer.fast = fastpath.FastPath(dll, cb, ctypes.cast(lib.dll.ggml_backend_tensor_get, ctypes.c_void_p).value,
                                           ctypes.sizeof(STRUCT), NAME_OFF, tracer.copier)
    KEEP_ALIVE.append(fast)
    cp.cb_eval, cp.cb_eval_user_data = fast.address, fast.user_data
    return "C fast path (sides/llamacpp/fastpath.c), Python for nodes of graphs not seen in this context"


def take_model(key: tuple, lib):
    """The kept model loaded with these settings, or None (what is kept for other settings is freed)."""
    kept = _KEPT.get("model")
    if kept is not None and kept[0] == key and kept[1] is lib:
        return _KEPT.pop("model")[2]
    release()
    return None


def take_context(key: tuple) -> Optional[Bundle]:
    """The kept context made with these settings (of the model just taken), or None (another one is freed)."""
    kept = _KEPT.pop("context", None)
    if kept is None:
        return None
    if kept[0] == key:
        return kept[1]
    _free_context(kept[1])
    return None


def keep(lib, model_key: tuple, lmodel, context_key: Optional[tuple], bundle: Bundle) -> bool:
    """Keep a closing side's model, and its context unless it has no key (a failed decode: that one is freed here),
    for the next run; False: nothing kept (the caller frees both)."""
    if not keeping() or not lmodel:
        return False
    release()
    _KEPT["model"] = (model_key, lib, lmodel)
    if bundle.ctx and context_key is not None:
        bundle.tracer.park()
        _KEPT["context"] = (context_key, bundle)
    elif bundle.ctx:
        _free_context(bundle)
    return True


def release():
    """Free whatever is kept (a side with other settings needs the memory)."""
    kept = _KEPT.pop("context", None)
    if kept is not None:
        _free_context(kept[1])
    model = _KEPT.pop("model", None)
    if model is not None:
        model[1].llama_model_free(model[2])


def _free_context(bundle: Bundle):
    bundle.tracer.lib.llama_free(bundle.ctx)
    bundle.tracer.release()
