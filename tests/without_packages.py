"""Run a Python command as if some installed packages were not installed.

    python tests/without_packages.py triton,fla,causal_conv1d -m ddtree.cli serve --port 8000
    python tests/without_packages.py torch -c "import ddtree_operator.handlers"

A user's CPU machine has only what `pip install -e '.[server]'` brings (no Triton, fla or causal-conv1d), the
operator image has no torch, but the test machine has them all. Every import finder is wrapped so that the
refused top-level modules are not found (`import triton` raises ModuleNotFoundError,
`importlib.util.find_spec("triton")` is None) and their distributions are not listed (`importlib.metadata`
raises PackageNotFoundError), which is what libraries probe when they look for an optional package.
"""

from __future__ import annotations

import importlib.metadata
import os
import runpy
import sys
from collections.abc import Iterator
from importlib.machinery import ModuleSpec
from typing import Any


class Refusing:
    """A meta path finder that finds nothing of the refused packages and everything else as `inner` does."""

    def __init__(self, inner: Any, modules: frozenset[str], distributions: frozenset[str]) -> None:
        self.inner, self.modules, self.distributions = inner, modules, distributions

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        if fullname.partition(".")[0] in self.modules:
            return None
        return self.inner.find_spec(fullname, path, target)

    def invalidate_caches(self) -> None:
        if hasattr(self.inner, "invalidate_caches"):
            self.inner.invalidate_caches()

    def find_distributions(self, *args: Any, **kwargs: Any) -> Iterator[importlib.metadata.Distribution]:
        found = getattr(self.inner, "find_distributions", None)
        for dist in found(*args, **kwargs) if found else ():
            if _normal(dist.metadata["Name"] or "") not in self.distributions:
                yield dist


def _normal(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def refuse(modules: set[str]) -> None:
    """From now on, this process finds none of `modules` (top-level names) nor the distributions that hold them."""
    holders = importlib.metadata.packages_distributions()
    distributions = frozenset(_normal(d) for m in modules for d in holders.get(m, [])) | {_normal(m) for m in modules}
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in modules)
    if loaded:
        raise SystemExit(f"already imported, cannot be refused: {', '.join(loaded)}")
    sys.meta_path[:] = [Refusing(f, frozenset(modules), distributions) for f in sys.meta_path]
    importlib.invalidate_caches()


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] not in ("-m", "-c"):
        raise SystemExit("usage: without_packages.py PKG[,PKG...] (-m MODULE | -c CODE) [ARGS...]")
    refuse(set(argv[0].split(",")))
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *argv[3:]]
        exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__"})


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # not this script's folder: the path `python -m` or `python -c` would start with
    main(sys.argv[1:])
