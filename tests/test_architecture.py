"""The house stays one-way: every import inside mamba_debug points down the table in docs/architecture.md.

The table lists the package's modules from the top (imports the most) to the bottom (imports nothing of ours). A
module may import only modules listed below it, at module level or inside a function. A module missing from the
table fails too: place it before it lands. And no module grows past 500 lines.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "mamba_debug"
DOC = ROOT / "docs" / "architecture.md"
MAX_LINES = 500


def _order() -> list:
    """Module names from the table, top first (`mamba_debug` for the package itself, `arch` for arch/__init__)."""
    text = DOC.read_text()
    table = text.split("<!-- import order: top -->")[1].split("<!-- import order: bottom -->")[0]
    return [m for row in table.splitlines() for m in re.findall(r"^\|\s*`([\w.]+)`", row)]


def _modules() -> dict:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts and parts[-1].startswith("_") and parts[-1] != "__main__":
            continue               # _site_metrics.py: a Triton file executed by path, never imported
        out[".".join(parts) or "mamba_debug"] = path
    return out


def _imports(name: str, path: Path) -> set:
    """Our modules that `name` imports anywhere in its file."""
    is_pkg = path.name == "__init__.py"
    package = name.split(".") if is_pkg and name != "mamba_debug" else ([] if name == "mamba_debug"
                                                                         else name.split(".")[:-1])
    known = set(_modules())
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                mod = ".".join(base + (node.module.split(".") if node.module else []))
            elif node.module and node.module.split(".")[0] == "mamba_debug":
                mod = ".".join(node.module.split(".")[1:])
            else:
                continue
            for alias in node.names:           # `from . import ops`: a submodule
                sub = f"{mod}.{alias.name}" if mod else alias.name
                found.add(sub if sub in known else (mod or "mamba_debug"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "mamba_debug":
                    found.add(".".join(alias.name.split(".")[1:]) or "mamba_debug")
    found.discard(name)
    return found


def test_every_module_is_in_the_table():
    order = _order()
    missing = sorted(set(_modules()) - set(order))
    assert not missing, f"modules not placed in docs/architecture.md's import table: {missing}"
    gone = sorted(set(order) - set(_modules()))
    assert not gone, f"docs/architecture.md lists modules that do not exist: {gone}"


def test_imports_point_down():
    order = _order()
    rank = {m: len(order) - i for i, m in enumerate(order)}      # top of the table = highest rank
    up = [f"{name} imports {target}" for name, path in _modules().items()
          for target in _imports(name, path) if target in rank and rank[target] >= rank.get(name, 0)]
    assert not up, "imports that run up (or sideways) in docs/architecture.md's table:\n" + "\n".join(sorted(up))


def test_no_module_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_check_catches_an_upward_import(tmp_path, monkeypatch):
    """The test itself can fail: an import from a module above is reported."""
    fake = tmp_path / "errors.py"
    fake.write_text("from .compare import run_compare\n")
    assert "compare" in _imports("errors", fake)
