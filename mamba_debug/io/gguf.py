# TEMPORARY until the io branch merges
from ..gguf_io import DTYPES  # noqa: F401
