"""The package's layers import only downward, and no module imports itself back through others.

A reader follows a request from HTTP to kernels without climbing back up: `api` calls `engine`, which drives a
backend (`engine.reference` or `fast`), which runs `models` and `kernels`; `core` holds what all of them share.
Every import counts, also those inside functions or under TYPE_CHECKING: a deferred import is still a
dependency, and hiding one is how cycles crept in before.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "server" / "ddtree"

# Lowest first. A module may import its own layer's modules and those of lower layers.
LAYERS = [
    ("ddtree", "ddtree.errors", "ddtree.switches"),
    ("ddtree.core",),
    ("ddtree.kernels",),
    ("ddtree.models",),
    ("ddtree.fast",),
    ("ddtree.engine",),
    ("ddtree.api",),
    ("ddtree.training",),
    ("ddtree.bench",),
    ("ddtree.cli",),
]
LEAF = {"ddtree.kernels"}  # imports nothing of ddtree above the base layer (errors, switches)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """Index of the layer the module belongs to (the longest matching prefix wins)."""
    best, rank = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            matches = module == prefix or (prefix != "ddtree" and module.startswith(prefix + "."))
            if matches and len(prefix) > best:
                best, rank = len(prefix), index
    if rank is None:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS")
    return rank


def imports_of(path: Path, name: str) -> set[str]:
    """Every ddtree module `path` imports (absolute or relative, anywhere in the file)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}  # `from pkg import submodule`
    return {m for m in found if m == "ddtree" or m.startswith("ddtree.")}


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports_of(path, name) if m in modules and m != name} for name, path in modules.items()}


EDGES = graph()


def test_every_module_sits_in_a_layer():
    for module in EDGES:
        layer_of(module)


@pytest.mark.parametrize("module", sorted(EDGES))
def test_imports_only_downward(module: str):
    own = layer_of(module)
    for imported in sorted(EDGES[module]):
        theirs = layer_of(imported)
        assert theirs <= own, f"{module} ({LAYERS[own][0]}) imports {imported} ({LAYERS[theirs][0]}), a layer above"
        if any(module == p or module.startswith(p + ".") for p in LEAF):
            assert theirs == 0 or layer_of(imported) == own, f"{module} is in a leaf layer but imports {imported}"


def test_no_import_cycles():
    """Depth-first search over the import graph; a back edge is a cycle, reported with its path."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(EDGES[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt):], nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(EDGES):
        if module not in state:
            visit(module)
