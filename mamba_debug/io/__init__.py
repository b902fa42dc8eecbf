# TEMPORARY until the io branch merges
from ..loading import DEFAULT_MODEL, load_model  # noqa: F401
from ..gguf_io import describe_gguf, export_gguf  # noqa: F401
