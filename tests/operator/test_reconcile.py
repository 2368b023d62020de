"""The reconcile step against an in-memory stand-in of the API: gating, pruning, and a cluster without the
Prometheus Operator (monitoring on, its CRDs absent)."""

from __future__ import annotations

import json
from typing import Any

from ddtree_operator import render
from ddtree_operator.reconcile import reconcile
from k8s_testing import cr
from kubernetes.client import ApiException
from kubernetes.dynamic.exceptions import ResourceNotFoundError


class FakeCluster:
    """Objects by (kind, name); no monitoring.coreos.com API, no pod logs."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.log: str | None = None

    def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        if manifest["apiVersion"].startswith("monitoring.coreos.com"):
            raise ResourceNotFoundError("no such kind")
        stored = self.objects.setdefault((manifest["kind"], manifest["metadata"]["name"]), {"status": {}})
        stored.update({k: v for k, v in manifest.items() if k != "status"})
        return stored

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((kind, name))

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        if api_version.startswith("monitoring.coreos.com"):
            raise ResourceNotFoundError("no such kind")
        return [o for (k, _), o in self.objects.items() if k == kind]

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.objects.pop((kind, name), None)

    def pod_log_tail(self, namespace: str, pod: str, container: str, lines: int = 40) -> str:
        if self.log is None:
            raise ApiException(status=400, reason="no kubelet")
        return self.log


def test_gating_pruning_and_missing_monitoring_api():
    cluster = FakeCluster()
    body = cr({"replicas": 2, "monitoring": {"enabled": True}})
    seen, monitoring_error = reconcile(cluster, body, "img:1")
    assert "ServiceMonitor CRD (Prometheus Operator) is not installed" in monitoring_error
    assert seen.deployment is None and ("Deployment", "qwen") not in cluster.objects  # gated on the pull
    assert {k for k, _ in cluster.objects} == {"PersistentVolumeClaim", "Job", "Service", "PodDisruptionBudget"}

    seen.job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    seen, _ = reconcile(cluster, body, "img:1")
    assert seen.deployment["spec"]["replicas"] == 2

    body["spec"]["replicas"] = 1
    reconcile(cluster, body, "img:1")
    assert ("PodDisruptionBudget", "qwen") not in cluster.objects  # pruned with the spec change


def test_pull_progress_comes_from_the_pull_pods_log():
    cluster = FakeCluster()
    body = cr()
    seen, _ = reconcile(cluster, body, "img:1")
    assert seen.download is None  # no pod yet
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "pull-abc", "creationTimestamp": "t"}}
    cluster.objects[("Pod", "pull-abc")] = pod
    assert reconcile(cluster, body, "img:1")[0].download is None  # a pod without a log (no kubelet here)
    dest = render.model_dest(body["spec"], "draft")
    cluster.log = json.dumps({"dest": dest, "bytesDone": 5, "bytesTotal": 10, "remainingSeconds": 2.5, "done": False})
    assert reconcile(cluster, body, "img:1")[0].download == {
        "draft": {"bytesDone": 5, "bytesTotal": 10, "remainingSeconds": 2.5, "done": False}}
