"""Kubernetes operator for DDTreeDeployment resources."""

import contextlib
import importlib.metadata


def _version() -> str:
    """The installed distribution's version: `ddtree-operator` in the operator image, else `ddtree`."""
    for dist in ("ddtree-operator", "ddtree"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(dist)
    return "unknown"


__version__ = _version()
