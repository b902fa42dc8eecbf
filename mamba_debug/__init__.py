"""mamba-debug: run a traced Mamba on a CPU reference and on device kernels side by side."""
from .config import MambaConfig
from .errors import CheckpointError, MambaDebugError, PluginError
from .ops import OP_NAMES, OpTable
from .plugins import list_kernels, load_kernels, load_plugin

__version__ = "0.1.0"
from .backends import Backend, cpu_backend, device_backend, reference_backend
from .loading import load_model
from .model import LAYER_SITES, MODEL_SITES, SITES, MambaModel, Runner
from .placement import Placement
