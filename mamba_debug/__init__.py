"""mamba-debug: run a traced Mamba on a CPU reference and on device kernels side by side."""
from .config import MambaConfig
from .errors import CheckpointError, MambaDebugError, PluginError
from .ops import OP_NAMES, OpTable
from .plugins import list_kernels, load_kernels, load_plugin

__version__ = "0.1.0"
