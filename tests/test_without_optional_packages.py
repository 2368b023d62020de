"""The README's first command on a CPU machine: what `pip install -e '.[server]'` brings (no Triton, fla or
causal-conv1d) must import every ddtree module, generate and serve; the operator image (no torch) must import
every ddtree_operator module.

The test machine has those packages, so each command runs in a process that refuses them
(tests/without_packages.py). A module that imports one of them at the top, or a name that exists only where
one of them does, fails here as it would for a new user.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from api.servers import start_server

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("without_packages.py")
CPU_INSTALL_LACKS = "triton,fla,causal_conv1d"  # what `pip install -e '.[server]'` on a CPU machine leaves out
OPERATOR_IMAGE_LACKS = "torch,transformers,numpy,ddtree"  # images/operator installs the operator package alone
PROMPT = "def fibonacci(n):"

IMPORT_EVERY_MODULE = """
import importlib, json, pkgutil, sys
import {package} as package
imported, failed = [], {{}}
for info in pkgutil.walk_packages(package.__path__, "{package}."):
    try:
        importlib.import_module(info.name)
        imported.append(info.name)
    except Exception as exc:
        failed[info.name] = f"{{type(exc).__name__}}: {{exc}}"
refused = {refused!r}.split(",")
try:
    importlib.import_module(refused[0])
    still_importable = True
except ImportError:
    still_importable = False
print(json.dumps({{"imported": imported, "failed": failed, "still_importable": still_importable,
                  "loaded": sorted(m for m in sys.modules if m.partition(".")[0] in refused)}}))
"""


def without(packages: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), packages, *args], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def modules_on_disk(package_dir: Path) -> set[str]:
    """Every module of the package, from its files (subpackages without __init__.py hold data, not code)."""
    names = set()
    for path in package_dir.rglob("*.py"):
        parts = path.relative_to(package_dir.parent).with_suffix("").parts
        if all((package_dir.parent.joinpath(*parts[:i]) / "__init__.py").exists() for i in range(1, len(parts))):
            names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names - {package_dir.name}


@pytest.mark.parametrize(("package", "lacks"),
                         [("ddtree", CPU_INSTALL_LACKS), ("ddtree_operator", OPERATOR_IMAGE_LACKS)])
def test_every_module_imports_where_the_optional_packages_are_missing(package: str, lacks: str):
    done = without(lacks, "-c", IMPORT_EVERY_MODULE.format(package=package, refused=lacks))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert not report["still_importable"], "the refusal did not take: this test would prove nothing"
    assert report["failed"] == {}, f"modules that fail to import without {lacks}: {report['failed']}"
    source = ROOT / ("server" if package == "ddtree" else "operator") / package
    assert set(report["imported"]) == modules_on_disk(source)
    assert report["loaded"] == []


def generate(*python: str) -> dict:
    done = subprocess.run([*python, "-m", "ddtree.cli", "generate", "--prompt", PROMPT, "--max-new-tokens", "24",
                           "--device", "cpu", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
def test_generate_and_serve_the_demo_pair_without_triton(tmp_path):
    """`ddtree generate` and `ddtree serve` on the embedded demo pair, as on a new user's CPU machine: the same
    tokens as with every package present (the CPU path is PyTorch's either way), one completion served."""
    python = (sys.executable, str(SCRIPT), CPU_INSTALL_LACKS)
    alone = generate(*python)
    assert alone["token_ids"] == generate(sys.executable)["token_ids"]
    assert alone["stats"]["method"] == "ddtree" and alone["stats"]["acceptance_length"] > 1

    server = start_server(tmp_path, "--device", "cpu", python=python)
    try:
        reply = server.http.post(f"{server.url}/v1/completions", json={
            "model": "ddtree-demo", "prompt": PROMPT, "max_tokens": 24, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == alone["text"]
    finally:
        assert server.stop() == 0
    assert "Traceback" not in server.log.read_text()


def test_the_operator_command_starts_without_torch():
    done = without(OPERATOR_IMAGE_LACKS, "-m", "ddtree_operator.main", "--help")
    assert done.returncode == 0, done.stderr
    assert "DDTreeDeployment" in done.stdout
