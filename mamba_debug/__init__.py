"""mamba-debug: run a traced Mamba on a CPU reference and on device kernels side by side.

The public Python API (README "Python API"): everything a user or a notebook needs is a name here, so no user code
imports an internal module path. Heavier parts (plots, dashboard, loaders) load on first use.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from . import ops
from .arch import MODEL_SITES, param_shapes, site_order
from .arch.mamba1 import Mamba1
from .backends import Backend, cpu_backend, device_backend, reference_backend
from .config import MambaConfig, ModelConfig, as_config
from .errors import CheckpointError, MambaDebugError, PluginError
from .metrics import logit_stats, nmse, site_errors
from .model import MambaModel, Model, Runner
from .ops import OP_NAMES, TORCH_OPS, OpTable
from .placement import Placement
from .plugins import list_kernels, load_kernels, load_plugin
from .settings import CompareSettings, RunSettings

__version__ = "0.1.0"

LAYER_SITES = Mamba1.sites                 # Mamba-1's sites in graph order (as before the layer-type seam)
SITES = LAYER_SITES + MODEL_SITES
reference_ops = TORCH_OPS                  # the plain-torch reference ops, op name -> callable

# name -> (module, attribute): loaded on first use
_LAZY = {
    "load_model": ("io", "load_model"), "DEFAULT_MODEL": ("io", "DEFAULT_MODEL"), "save_hf": ("io", "save_hf"),
    "export_gguf": ("io", "export_gguf"), "load_gguf": ("io", "load_gguf"), "describe_gguf": ("io", "describe_gguf"),
    "check_params": ("io", "check_params"),
    "run_compare": ("compare", "run_compare"), "CompareResult": ("trace", "CompareResult"),
    "load_trace": ("trace", "load_trace"), "save_trace": ("trace", "save_trace"),
    "run_sweep": ("sweep", "run_sweep"), "bisect_layer": ("sweep", "bisect_layer"),
    "export_case": ("export", "export_case"), "replay_case": ("export", "replay_case"),
    "example_inputs": ("ops", "example_inputs"),
    "summary": ("views.summary", "summary"), "to_json": ("views.summary", "to_json"),
    "per_layer": ("views.summary", "per_layer"), "verdict": ("views.summary", "verdict"),
    "write_report": ("views.report", "write_report"), "views": ("views", None),
    "Dashboard": ("dashboard", "Dashboard"),
    # frees the llama.cpp model and context a finished run keeps for the next one (sides/llamacpp/contexts.py)
    "release_llama_cpp": ("sides.llamacpp.contexts", "release"),
}


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'mamba_debug' has no attribute {name!r}")
    module, attr = _LAZY[name]
    mod = importlib.import_module(f".{module}", __name__)
    return mod if attr is None else getattr(mod, attr)


def build_model(config: ModelConfig, params: dict, tokenizer=None, source: str = "") -> Model:
    """A model from a config and a dict of parameters (canonical names, `param_shapes(config)`), checked like a
    checkpoint: every tensor present, of its shape and finite, no unknown name; stored as float64 masters. A dict
    config is read as `ModelConfig(**config)`."""
    from .io import check_params  # noqa: PLC0415
    from .io.weights import check_config_agrees, in_memory_params  # noqa: PLC0415
    config = as_config(config, "build_model")
    params = check_params(config, in_memory_params(config, params), source or "in-memory model")
    check_config_agrees(config, params, source or "in-memory model")
    return Model(config, params, tokenizer, source=source)


# Module paths from before the restructure stay importable (old notebooks, user scripts): each old name is the
# module that took its place.
_MOVED = {"loading": "io.load", "saving": "io.hf", "gguf_io": "io.gguf", "weights": "io.weights",
          "result": "views.summary", "plots": "views", "report": "views.report", "engine_cli": "cli"}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        head, _, tail = fullname.partition(".")
        if head == __name__ and tail in _MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(f"{__name__}.{_MOVED[spec.name.partition('.')[2]]}")

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _MovedModules())
