"""Where the project's kernels/ and data/ folders are.

In a checkout (and an editable install, which imports the package from the checkout) they sit beside the package.
A wheel (`pip install .`, no -e) carries them as two packages of their own, `mamba_debug_kernels` and
`mamba_debug_data` (pyproject.toml maps the folders to those names), since site-packages has no room for a
top-level `kernels/` (another distribution may own that name). The checkout is recognised by its pyproject.toml,
which no site-packages holds.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IN_CHECKOUT = (ROOT / "pyproject.toml").is_file() and (ROOT / "kernels").is_dir()


def shipped_dir(name: str) -> Path:
    """The folder `name` ("kernels" or "data"): the checkout's, else the installed package's. A folder that is in
    neither comes back as the checkout's path, for the caller's error message to name."""
    if IN_CHECKOUT:
        return ROOT / name
    spec = importlib.util.find_spec(f"mamba_debug_{name}")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return ROOT / name
