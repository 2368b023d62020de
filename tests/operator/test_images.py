"""The image recipes (no container runtime in CI): buildable by the classic builder and BuildKit alike, offline
(no frontend image), from a small context; pinned bases and Python packages; OCI labels; non-root; the
operator image without the server package; `scripts/dev images` builds both where Docker runs."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from k8s_testing import REPO

IMAGES = {"server": "ddtree", "operator": "ddtree-operator"}
OCI_LABELS = ("title", "description", "source", "licenses", "version", "revision")


def dockerfile(image: str) -> str:
    return (REPO / "images" / image / "Dockerfile").read_text()


def stages(text: str) -> list[str]:
    return re.findall(r"^FROM\s+(\S+)", text, flags=re.M)


def instructions(text: str, name: str) -> list[str]:
    """The arguments of every `name` instruction, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [m.group(1) for m in re.finditer(rf"^{name}\s+(.+)$", joined, flags=re.M)]


def in_context(path: str) -> bool:
    """Whether the root .dockerignore lets `path` into the build context (its last matching rule wins)."""
    included = True
    for line in (REPO / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate, pattern = line.startswith("!"), line.lstrip("!").rstrip("/")
        parts = Path(path).parts
        if any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            included = negate
    return included


def pins(image: str) -> dict[str, str]:
    lines = (REPO / "images" / image / "constraints.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize(("image", "entrypoint"), IMAGES.items())
def test_image_recipe(image, entrypoint):
    text = dockerfile(image)
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
    labels = " ".join(instructions(final, "LABEL"))
    for key in OCI_LABELS:
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert 'org.opencontainers.image.version="${VERSION}"' in labels  # set by scripts/dev images


@pytest.mark.parametrize("image", IMAGES)
def test_both_builders_build_it_offline_from_a_small_context(image):
    text = dockerfile(image)
    assert not re.search(r"^#\s*syntax\s*=", text, flags=re.M | re.I), "a syntax directive pulls a frontend image"
    assert "--mount=" not in text and "<<" not in text, "BuildKit-only syntax: the classic builder rejects it"
    assert not list((REPO / "images").glob("*/*.dockerignore")), \
        "per-Dockerfile ignore files are BuildKit-only: the classic builder would send the whole repository"
    assert not in_context(".git/HEAD") and not in_context("tests/operator/test_images.py")
    assert not in_context("server/ddtree/__pycache__/api.cpython-311.pyc")
    for copy in instructions(text, "COPY"):
        if copy.startswith("--from="):
            continue
        for source in copy.split()[:-1]:
            assert in_context(source), f"{source} is copied but .dockerignore leaves it out of the context"
    assert {"PIP_INDEX_URL", "PIP_FIND_LINKS"} <= set(re.findall(r"^ARG\s+(\w+)$", text, flags=re.M))


@pytest.mark.parametrize("image", IMAGES)
def test_python_packages_are_pinned(image):
    text = dockerfile(image)
    assert f"COPY images/{image}/constraints.txt /tmp/constraints.txt" in text
    assert "PIP_CONSTRAINT=/tmp/constraints.txt" in text
    pinned = {canonical(n) for n in pins(image)}
    for command in instructions(text, "RUN"):
        for install in re.findall(r"pip install ([^&]+)", command):
            for word in install.split():
                word = word.strip('"')
                if word.startswith(("-", "/", "$", "http")):
                    continue
                name = re.split(r"[<>=\[]", word)[0]
                if canonical(name) == "torch":
                    assert word == "torch==${TORCH_VERSION}"
                    continue
                assert not re.search(r"[<>=]", word), f"{word}: the version belongs in constraints.txt"
                assert canonical(name) in pinned, f"{name} is not pinned in images/{image}/constraints.txt"
    project = "operator/pyproject.toml" if image == "operator" else "pyproject.toml"
    meta = tomllib.loads((REPO / project).read_text())["project"]
    wanted = meta["dependencies"] + meta.get("optional-dependencies", {}).get("server", [])
    for requirement in wanted:
        name = canonical(re.split(r"[<>=;\[ ]", requirement)[0])
        assert name == "torch" or name in pinned, f"{name} ({project}) is not pinned"


def test_server_image_has_the_gpu_kernels_and_operator_image_has_no_server():
    server = dockerfile("server")
    for package in ("torch==", "causal-conv1d", "flash-linear-attention", "/src[server]"):
        assert package in server
    runtime = server[server.rindex("\nFROM "):]
    assert "gcc" in runtime and "python3-dev" in runtime  # Triton builds kernel launchers at run time
    assert "TRITON_CACHE_DIR=/tmp/" in runtime  # caches on the writable volume, root filesystem read-only
    operator = dockerfile("operator")
    copies = [c.split()[0] for c in instructions(operator, "COPY") if not c.startswith("--from=")]
    assert all(source.startswith(("operator/", "images/operator/")) for source in copies), copies
    assert not [line for line in operator.splitlines() if "pip install" in line and "torch" in line]


def test_the_operator_package_builds_without_the_server(tmp_path):
    """What the operator image installs: operator/pyproject.toml's wheel holds ddtree_operator and nothing else."""
    source = tmp_path / "operator"  # a copy: building writes build/ and *.egg-info next to pyproject.toml
    shutil.copytree(REPO / "operator", source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("ddtree_operator-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.startswith("ddtree_operator-")} == {"ddtree_operator"}
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "ddtree-operator = ddtree_operator.main:main" in entry_points


def fake_docker(tmp_path: Path, info_ok: bool) -> dict[str, str]:
    """A `docker` on PATH that records its arguments (and whose `docker info` succeeds or not)."""
    log = tmp_path / "docker.log"
    script = tmp_path / "bin" / "docker"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\nif [ "$1" = info ]; then exit {0 if info_ok else 1}; fi\n'
                      f'echo "$@" >> "{log}"\n')
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{script.parent}:{os.environ['PATH']}", "REGISTRY": "registry.example.com/ml"}


def test_dev_images_builds_both(tmp_path):
    env = fake_docker(tmp_path, info_ok=True)
    done = subprocess.run([str(REPO / "scripts" / "dev"), "images", "--build-arg", "PIP_INDEX_URL=http://mirror"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    builds = (tmp_path / "docker.log").read_text().splitlines()
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert len(builds) == 2
    for image, build in zip(("server", "operator"), builds, strict=True):
        args = build.split()
        assert args[:3] == ["build", "-f", f"images/{image}/Dockerfile"] and args[-1] == "."
        assert f"registry.example.com/ml/ddtree-{image}:{version}" in args
        assert f"VERSION={version}" in args and "PIP_INDEX_URL=http://mirror" in args
        assert any(a.startswith("REVISION=") and a != "REVISION=unknown" for a in args)


def test_dev_images_says_when_there_is_no_docker(tmp_path):
    done = subprocess.run([str(REPO / "scripts" / "dev"), "images"], env=fake_docker(tmp_path, info_ok=False),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "no Docker daemon here" in done.stderr
    assert not (tmp_path / "docker.log").exists()
