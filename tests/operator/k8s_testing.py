"""Helpers shared by the Kubernetes tests (a uniquely named module: several test folders have a conftest)."""

from __future__ import annotations

import contextlib
import json
import lzma
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
KUBELITE = REPO.parent / "shared" / "kubelite"
CRD_FILE = REPO / "crds" / "ddtree.io_ddtreedeployments.yaml"
EXAMPLE = REPO / "examples" / "ddtree.yaml"
DDT = ("ddtree.io/v1alpha1", "DDTreeDeployment")

# Minimal stand-ins for the Prometheus Operator CRDs, so monitor objects can be applied and inspected.
MONITOR_CRDS = [
    {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
     "metadata": {"name": f"{plural}.monitoring.coreos.com"},
     "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
              "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
              "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                  "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}
    for kind, plural in (("ServiceMonitor", "servicemonitors"), ("PodMonitor", "podmonitors"))]


# Audit every request's metadata: the RBAC test derives the operator's verbs from what it actually called.
AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
"""
OPERATOR_USER_AGENTS = ("kopf/", "ddtree-operator/")


def start_kubelite() -> dict[str, str]:
    """Start kubelite (../shared/kubelite/up) with an audit log; returns KUBECONFIG, KUBELITE_DIR and AUDIT_LOG.

    `up` runs the API server binary it finds in KUBELITE_DIR, so a wrapper placed there adds the audit flags.
    """
    state = Path(tempfile.mkdtemp(prefix="kubelite."))
    real = state / "kubelite-apiserver.real"
    with lzma.open(KUBELITE / "kubelite-apiserver.xz") as packed, open(real, "wb") as out:
        shutil.copyfileobj(packed, out)
    real.chmod(0o755)
    (state / "audit-policy.yaml").write_text(AUDIT_POLICY)
    wrapper = state / "kubelite-apiserver"
    wrapper.write_text(f'#!/bin/sh\nexec "{real}" --audit-log-path="{state}/audit.log" '
                       f'--audit-policy-file="{state}/audit-policy.yaml" "$@"\n')
    wrapper.chmod(0o755)
    out = subprocess.run([str(KUBELITE / "up")], capture_output=True, text=True, check=True,
                         env={**os.environ, "KUBELITE_DIR": str(state)}).stdout
    env = dict(kv.split("=", 1) for kv in out.split()[1:])
    return {**env, "AUDIT_LOG": str(state / "audit.log")}


def audit_events(path: str | Path, offset: int = 0) -> list[dict[str, Any]]:
    """The audit events logged after byte `offset` (the log's size when the caller started watching)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return [json.loads(line) for line in f.read().splitlines() if line.strip()]


def operator_calls(events: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """(API group, resource[/subresource], verb) of every resource request an operator made. A server-side
    apply that created its object (201) is authorized as `create` too, as Kubernetes does."""
    calls = set()
    for e in events:
        ref = e.get("objectRef")
        if ref and e.get("userAgent", "").startswith(OPERATOR_USER_AGENTS):
            resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
            calls.add((ref.get("apiGroup", ""), resource, e["verb"]))
            if e["verb"] == "patch" and e.get("responseStatus", {}).get("code") == 201:
                calls.add((ref.get("apiGroup", ""), resource, "create"))
    return calls


def cr(spec: dict[str, Any] | None = None, name: str = "qwen") -> dict[str, Any]:
    """A DDTreeDeployment as the API server hands it to the operator (uid, namespace, generation set)."""
    base = {"target": {"model": {"uri": "hf://Qwen/Qwen3-8B"}}, "draft": {"model": {"uri": "hf://z-lab/Qwen3-8B-DFlash-b16"}}}
    return {"apiVersion": "ddtree.io/v1alpha1", "kind": "DDTreeDeployment",
            "metadata": {"name": name, "namespace": "ml", "uid": "u-1", "generation": 3},
            "spec": {**base, **(spec or {})}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check: Callable[[], Any], timeout: float = 30, what: str = "condition") -> Any:
    """Poll until `check()` returns something truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def install_crd(cluster, manifest: dict[str, Any]) -> None:
    """Create or replace a CRD and wait until it is served (typed client: kubelite's discovery does not
    list the apiextensions group, which the dynamic client relies on)."""
    from kubernetes import client

    api = client.ApiextensionsV1Api(cluster.api_client)
    name = manifest["metadata"]["name"]
    try:
        api.create_custom_resource_definition(manifest)
    except client.ApiException as err:
        if err.status != 409:
            raise
        manifest = {**manifest, "metadata": {**manifest["metadata"],
                                             "resourceVersion": api.read_custom_resource_definition(name)
                                             .metadata.resource_version}}
        api.replace_custom_resource_definition(name, manifest)

    def established() -> bool:
        conditions = api.read_custom_resource_definition(name).status.conditions or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)
    wait_for(established, what=f"CRD {name} established")


def delete_crd(cluster, name: str) -> None:
    """Delete a CRD (typed client, as in install_crd) and wait until its API is gone."""
    from kubernetes import client

    api = client.ApiextensionsV1Api(cluster.api_client)
    with contextlib.suppress(client.ApiException):
        api.delete_custom_resource_definition(name)

    def gone() -> bool:
        try:
            api.read_custom_resource_definition(name)
        except client.ApiException as err:
            return err.status == 404
        return False
    wait_for(gone, what=f"CRD {name} deleted")


@contextlib.contextmanager
def new_namespace(cluster, prefix: str) -> Iterator[str]:
    """A fresh namespace, deleted afterwards (our finalizers dropped first: no operator may be running)."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    cluster.dynamic.resources.get(api_version="v1", kind="Namespace").create(
        body={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    try:
        yield name
    finally:
        ddts = cluster.dynamic.resources.get(api_version=DDT[0], kind=DDT[1])
        for obj in cluster.list(*DDT, name, ""):
            ddts.patch(name=obj["metadata"]["name"], namespace=name, body={"metadata": {"finalizers": None}},
                       content_type="application/merge-patch+json")
        cluster.delete("v1", "Namespace", "", name)


def ddtree_serve_available() -> bool:
    """`ddtree serve` is the server team's part; the end-to-end tests need it."""
    exe = shutil.which("ddtree")
    return bool(exe) and subprocess.run([exe, "serve", "--help"], capture_output=True).returncode == 0


def http_get(url: str, timeout: float = 2) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()
    except OSError:
        return 0, ""


@contextlib.contextmanager
def running(argv: list[str], ready_url: str, env: dict[str, str] | None = None, timeout: float = 120,
            log: Path | None = None) -> Iterator[subprocess.Popen]:
    """Run a process until the block ends; wait until `ready_url` answers 200 first."""
    out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(argv, env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: proc.poll() is not None or http_get(ready_url)[0] == 200, timeout=timeout,
                 what=f"{argv[0]} ready at {ready_url}")
        assert proc.poll() is None, f"{argv} exited with {proc.returncode}: {log.read_text() if log else ''}"
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log:
            out.close()
