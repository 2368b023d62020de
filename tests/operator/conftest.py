"""Fixtures for the Kubernetes tests: a real API server (KUBECONFIG, else kubelite from ../shared), the CRD,
a namespace per test and the operator running in-process under kopf's KopfRunner."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from k8s_testing import CRD_FILE, KUBELITE, MONITOR_CRDS, free_port, install_crd, new_namespace, start_kubelite


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("filterwarnings", "ignore:Unverified HTTPS request")  # kubelite's self-signed cert


@pytest.fixture(scope="session")
def kubeconfig() -> Iterator[str]:
    """A KUBECONFIG for a real API server: the caller's, else a fresh kubelite."""
    if os.environ.get("KUBECONFIG"):
        yield os.environ["KUBECONFIG"]
        return
    if not (KUBELITE / "up").exists():
        pytest.skip("no Kubernetes API server: set KUBECONFIG (any cluster, e.g. kind) or provide ../shared/kubelite")
    if not shutil.which("etcd"):
        pytest.skip("kubelite needs etcd on PATH (apt-get install etcd-server), or set KUBECONFIG to a cluster")
    env = start_kubelite()
    os.environ.update(KUBECONFIG=env["KUBECONFIG"], DDTREE_TEST_AUDIT_LOG=env["AUDIT_LOG"])
    try:
        yield env["KUBECONFIG"]
    finally:
        os.environ.pop("KUBECONFIG", None)
        os.environ.pop("DDTREE_TEST_AUDIT_LOG", None)
        subprocess.run([str(KUBELITE / "down"), env["KUBELITE_DIR"]], check=False)


@pytest.fixture(scope="session")
def audit_log(kubeconfig: str) -> str:
    """The API server's audit log: kubelite started by this session has one, another cluster may not."""
    path = os.environ.get("DDTREE_TEST_AUDIT_LOG")
    if not path:
        pytest.skip("no audit log: the session runs against $KUBECONFIG, not its own kubelite")
    return path


@pytest.fixture(scope="session")
def cluster(kubeconfig: str):
    """The operator's own API wrapper, pointed at the test cluster."""
    from ddtree_operator.reconcile import Cluster
    from kubernetes import client, config

    config.load_kube_config(config_file=kubeconfig)
    return Cluster(client.ApiClient())


@pytest.fixture(scope="session")
def crd(cluster) -> None:
    """Our CRD plus stand-ins for the Prometheus Operator's, installed once per session."""
    for manifest in [yaml.safe_load(CRD_FILE.read_text()), *MONITOR_CRDS]:
        install_crd(cluster, manifest)
    cluster.dynamic.resources.invalidate_cache()


@pytest.fixture
def namespace(cluster) -> Iterator[str]:
    """A namespace the session's operator watches (it watches t-*)."""
    with new_namespace(cluster, "t") as name:
        yield name


@pytest.fixture(scope="module")  # stopped after the module, not left running under other teams' tests
def operator(crd, kubeconfig: str) -> Iterator[dict[str, Any]]:
    """The operator, in-process under KopfRunner, watching the t-* namespaces with a 1-second resync."""
    from kopf.testing import KopfRunner

    metrics_port = free_port()
    os.environ.update(DDTREE_OPERATOR_RESYNC_SECONDS="1", DDTREE_OPERATOR_METRICS_PORT=str(metrics_port),
                      DDTREE_OPERATOR_WATCH_TIMEOUT="10", DDTREE_SERVER_IMAGE="ddtree-server:test")
    liveness = free_port()
    args = ["run", "--namespace=t-*", "--standalone", "-m", "ddtree_operator.handlers",
            f"--liveness=http://127.0.0.1:{liveness}/healthz"]
    with KopfRunner(args, timeout=60) as runner:
        yield {"runner": runner, "metrics_port": metrics_port, "liveness_port": liveness}
    assert runner.exception is None, runner.output

