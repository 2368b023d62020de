"""Static checks of the image recipes (no container runtime in CI): multi-stage, bases pinned but
overridable by a build argument, non-root, entry points that exist, no torch in the operator image."""

from __future__ import annotations

import re
import tomllib

import pytest
from k8s_testing import REPO

IMAGES = {"server": "ddtree", "operator": "ddtree-operator"}


def stages(text: str) -> list[str]:
    return re.findall(r"^FROM\s+(\S+)", text, flags=re.M)


@pytest.mark.parametrize(("image", "entrypoint"), IMAGES.items())
def test_image_recipe(image, entrypoint):
    text = (REPO / "images" / image / "Dockerfile").read_text()
    bases = stages(text)
    assert len(bases) >= 2, "multi-stage: build tools stay out of the runtime image"
    args = dict(re.findall(r"^ARG\s+(\w+)=(\S+)", text, flags=re.M))
    for base in bases:
        arg = re.fullmatch(r"\$\{(\w+)\}", base)
        assert arg, f"base {base} must come from a build argument"
        default = args[arg.group(1)]
        assert re.search(r":\S*\d+\.\d+", default) and "latest" not in default, f"unpinned base {default}"
    final = text[text.rindex("\nFROM "):]
    assert "COPY --from=build" in final
    user = re.findall(r"^USER\s+(\d+)(?::(\d+))?", final, flags=re.M)
    assert user and int(user[-1][0]) != 0, "the runtime stage runs as a non-root numeric user"
    entry = re.search(r'^ENTRYPOINT \["([^"]+)"\]', final, flags=re.M).group(1)
    assert entry == entrypoint
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry in scripts
    ignore = [line for line in (REPO / "images" / image / "Dockerfile.dockerignore").read_text().splitlines()
              if line and not line.startswith("#")]
    assert ignore[0] == "*" and "!pyproject.toml" in ignore  # a minimal build context


def test_server_image_has_the_gpu_kernels_and_operator_image_has_no_torch():
    server = (REPO / "images" / "server" / "Dockerfile").read_text()
    for package in ("torch==", "causal-conv1d", "flash-linear-attention", "/src[server]"):
        assert package in server
    runtime = server[server.rindex("\nFROM "):]
    assert "gcc" in runtime and "python3-dev" in runtime  # Triton builds kernel launchers at run time
    assert "TRITON_CACHE_DIR=/tmp/" in runtime  # caches on the writable volume, root filesystem read-only
    operator = (REPO / "images" / "operator" / "Dockerfile").read_text()
    assert not [line for line in operator.splitlines() if "pip install" in line and "torch" in line]
    assert "pip install --no-deps /src" in operator
    assert "kopf==" in operator
