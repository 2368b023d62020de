"""The reconcile step against an in-memory stand-in of the API: gating, pruning, pull retries and their
backoff, foreign objects, rejected applies and a cluster without the Prometheus Operator."""

from __future__ import annotations

import copy
import datetime
import json
from typing import Any

import pytest
from ddtree_operator import resource
from ddtree_operator.reconcile import pull_retry_delay, reconcile
from k8s_testing import cr
from kubernetes.client import ApiException
from kubernetes.dynamic.exceptions import ResourceNotFoundError

NOW = datetime.datetime(2026, 6, 1, 12, 0, tzinfo=datetime.UTC)


class FakeCluster:
    """Objects by (kind, name); no monitoring.coreos.com API unless `monitoring`, no pod logs unless `log`."""

    def __init__(self, apis: tuple[str, ...] = ()) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.log: str | None = None
        self.apis = apis
        self.reject: dict[str, str] = {}  # kind -> the API server's message
        self.calls: list[tuple[str, str, str]] = []

    def _check_api(self, api_version: str) -> None:
        if api_version.startswith(("monitoring.coreos.com", "keda.sh")) and api_version not in self.apis:
            raise ResourceNotFoundError("no such kind")

    def apply(self, manifest: dict[str, Any], uid: str | None = None) -> dict[str, Any]:
        self._check_api(manifest["apiVersion"])
        self.calls.append(("apply", manifest["kind"], manifest["metadata"]["name"]))
        if manifest["kind"] in self.reject:
            err = ApiException(status=422, reason="Unprocessable Entity")
            err.body = json.dumps({"message": self.reject[manifest["kind"]]})
            raise err
        key = (manifest["kind"], manifest["metadata"]["name"])
        stored = self.objects.setdefault(key, {"status": {}})
        stored.update({k: copy.deepcopy(v) for k, v in manifest.items() if k != "status"})
        stored["metadata"].setdefault("uid", f"uid-{key[1]}")
        return stored

    def create(self, manifest: dict[str, Any]) -> dict[str, Any]:
        if (manifest["kind"], manifest["metadata"]["name"]) in self.objects:
            raise ApiException(status=409, reason="Conflict")
        self.calls.append(("create", manifest["kind"], manifest["metadata"]["name"]))
        return self.apply(manifest)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self._check_api(api_version)
        return self.objects.get((kind, name))

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        self._check_api(api_version)
        wanted = dict(kv.split("=", 1) for kv in label_selector.split(",") if kv)
        return [o for (k, _), o in self.objects.items()
                if k == kind and wanted.items() <= o["metadata"].get("labels", {}).items()]

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self.calls.append(("delete", kind, name))
        self.objects.pop((kind, name), None)

    def pod_log_tail(self, namespace: str, pod: str, container: str, lines: int = 40) -> str:
        if self.log is None:
            raise ApiException(status=400, reason="no kubelet")
        return self.log

    def api_available(self, group_version: str) -> bool:
        return any(api.startswith(group_version) for api in self.apis)


def fail(job: dict[str, Any], at: datetime.datetime) -> None:
    job["status"] = {"conditions": [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                     "lastTransitionTime": at.strftime("%Y-%m-%dT%H:%M:%SZ")}]}


def test_gating_pruning_and_missing_monitoring_api():
    cluster = FakeCluster()
    body = cr({"replicas": 2, "monitoring": {"enabled": True}})
    seen = reconcile(cluster, body, "img:1", now=NOW)
    assert seen.monitoring[:2] == ("False", "MonitorUnavailable")
    assert "ServiceMonitor CRD (Prometheus Operator) is not installed" in seen.monitoring[2]
    assert seen.deployment is None and ("Deployment", "qwen") not in cluster.objects  # gated on the pull
    assert {k for k, _ in cluster.objects} == {"PersistentVolumeClaim", "Job", "Service", "PodDisruptionBudget"}

    seen.job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    seen = reconcile(cluster, body, "img:1", now=NOW)
    assert seen.deployment["spec"]["replicas"] == 2

    body["spec"]["replicas"] = 1
    reconcile(cluster, body, "img:1", now=NOW)
    assert ("PodDisruptionBudget", "qwen") not in cluster.objects  # pruned with the spec change


def test_the_pull_job_is_created_once_and_never_changed():
    cluster = FakeCluster()
    body = cr()
    job = reconcile(cluster, body, "img:1", now=NOW).job
    newer = cr({"image": "img:2", "nodeSelector": {"pool": "a"}})  # an operator upgrade, a placement change
    assert reconcile(cluster, newer, "img:2", now=NOW).job["metadata"]["name"] == job["metadata"]["name"]
    assert [c for c in cluster.calls if c[1] == "Job"] == [("create", "Job", job["metadata"]["name"]),
                                                           ("apply", "Job", job["metadata"]["name"])]
    assert cluster.objects[("Job", job["metadata"]["name"])]["spec"]["template"]["spec"]["containers"][0][
        "image"] == "img:1"


def test_a_failed_pull_is_retried_with_backoff_and_on_demand():
    cluster = FakeCluster()
    body = cr()
    first = reconcile(cluster, body, "img:1", now=NOW).job
    fail(first, NOW)
    waiting = reconcile(cluster, body, "img:1", now=NOW + datetime.timedelta(seconds=30))
    assert waiting.job is first and waiting.pull_attempt == 0
    assert waiting.pull_retry_at == NOW + datetime.timedelta(seconds=pull_retry_delay(0))

    retried = reconcile(cluster, body, "img:1", now=NOW + datetime.timedelta(seconds=pull_retry_delay(0)))
    assert retried.pull_attempt == 1 and retried.job["metadata"]["name"] == first["metadata"]["name"] + "-1"
    assert ("Job", first["metadata"]["name"]) not in cluster.objects  # the failed attempt is pruned
    fail(retried.job, NOW + datetime.timedelta(seconds=60))
    second_wait = reconcile(cluster, body, "img:1", now=NOW + datetime.timedelta(seconds=90))
    assert second_wait.pull_retry_at == NOW + datetime.timedelta(seconds=60 + pull_retry_delay(1))
    assert pull_retry_delay(1) == 2 * pull_retry_delay(0) and pull_retry_delay(20) == 1800  # capped

    body["metadata"]["annotations"] = {resource.ANNOTATION_RETRY_PULL: "now"}
    on_demand = reconcile(cluster, body, "img:1", now=NOW + datetime.timedelta(seconds=91))
    assert on_demand.pull_attempt == 0 and on_demand.job["metadata"]["name"] not in (
        first["metadata"]["name"], retried.job["metadata"]["name"])
    assert [k for k in cluster.objects if k[0] == "Job"] == [("Job", on_demand.job["metadata"]["name"])]


def test_a_failed_pull_reports_the_pods_last_error():
    cluster = FakeCluster()
    body = cr()
    job = reconcile(cluster, body, "img:1", now=NOW).job
    fail(job, NOW)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "p", "creationTimestamp": "t", "labels": {
               resource.LABEL_OWNER: "qwen", resource.LABEL_PULL_JOB: job["metadata"]["name"]}},
           "status": {"containerStatuses": [{"name": "pull", "state": {"terminated": {
               "exitCode": 1, "reason": "Error",
               "message": '{"dest": "/models/x"}\nddtree pull: hf://Qwen/Qwen3-8B: 401 gated repo\n'}}}]}}
    cluster.objects[("Pod", "p")] = pod
    assert reconcile(cluster, body, "img:1", now=NOW).pull_error == "ddtree pull: hf://Qwen/Qwen3-8B: 401 gated repo"
    del pod["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
    cluster.log = "ddtree pull: out of disk space"  # no termination message: the log says it
    assert reconcile(cluster, body, "img:1", now=NOW).pull_error == "ddtree pull: out of disk space"


def test_a_foreign_object_is_never_changed():
    cluster = FakeCluster()
    body = cr()
    foreign = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "qwen", "uid": "theirs"},
               "spec": {"selector": {"app": "web"}}}
    cluster.objects[("Service", "qwen")] = copy.deepcopy(foreign)
    seen = reconcile(cluster, body, "img:1", now=NOW)
    assert seen.conflict.startswith("Service qwen already exists and is not owned by this DDTreeDeployment")
    assert cluster.objects == {("Service", "qwen"): foreign} and cluster.calls == []  # nothing applied at all


def test_a_rejected_child_is_reported_and_the_rest_applied():
    cluster = FakeCluster(apis=("monitoring.coreos.com/v1",))
    cluster.reject["ServiceMonitor"] = 'ServiceMonitor.monitoring.coreos.com "qwen" is invalid: spec.jobLabel: Required'
    seen = reconcile(cluster, cr({"monitoring": {"enabled": True}}), "img:1", now=NOW)
    assert seen.apply_errors == ('ServiceMonitor qwen: ServiceMonitor.monitoring.coreos.com "qwen" is invalid: '
                                 "spec.jobLabel: Required",)
    assert ("Service", "qwen") in cluster.objects


@pytest.mark.parametrize(("apis", "address", "kind", "reason"), [
    (("keda.sh/v1alpha1",), "http://prometheus.monitoring.svc:9090", "ScaledObject", "KEDA"),
    (("custom.metrics.k8s.io/v1beta2",), "http://prometheus.monitoring.svc:9090", "HorizontalPodAutoscaler", "HPA"),
    ((), "http://prometheus.monitoring.svc:9090", None, "AutoscalerUnavailable"),
    (("keda.sh/v1alpha1",), None, None, "PrometheusAddressMissing"),
])
def test_the_autoscaler_follows_the_apis_the_cluster_has(apis, address, kind, reason):
    cluster = FakeCluster(apis=("monitoring.coreos.com/v1", *apis))
    scaling = {"minReplicas": 0, "maxReplicas": 3, "target": {"waitingRequests": 2}}
    body = cr({"monitoring": {"enabled": True}, "autoscaling": {**scaling, **({"prometheusAddress": address}
                                                                             if address else {})}})
    seen = reconcile(cluster, body, "img:1", now=NOW)
    assert seen.autoscaling[1] == reason
    scalers = {k for k, _ in cluster.objects} & {"ScaledObject", "HorizontalPodAutoscaler"}
    assert scalers == ({kind} if kind else set())
    if kind == "HorizontalPodAutoscaler":
        assert "scaling to zero needs KEDA" in seen.autoscaling[2]
    if reason == "PrometheusAddressMissing":  # KEDA is there; what it lacks is named, not "neither is installed"
        assert seen.autoscaling[2].startswith("KEDA is installed but has no Prometheus address to query: set "
                                              "spec.autoscaling.prometheusAddress or the operator's "
                                              "--prometheus-address")
    assert seen.monitoring == ("True", "ServiceMonitor", "ServiceMonitor qwen exposes the servers' /metrics to a "
                                                         "Prometheus that selects it (monitoring.labels)")


def test_pull_progress_comes_from_the_pull_pods_log():
    cluster = FakeCluster()
    body = cr()
    seen = reconcile(cluster, body, "img:1", now=NOW)
    assert seen.download is None  # no pod yet
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "pull-abc", "creationTimestamp": "t",
        "labels": {resource.LABEL_OWNER: "qwen", resource.LABEL_PULL_JOB: seen.job["metadata"]["name"]}}}
    cluster.objects[("Pod", "pull-abc")] = pod
    assert reconcile(cluster, body, "img:1", now=NOW).download is None  # a pod without a log (no kubelet here)
    dest = resource.model_dest(body["spec"], "draft")
    cluster.log = json.dumps({"dest": dest, "bytesDone": 5, "bytesTotal": 10, "remainingSeconds": 2.5, "done": False})
    assert reconcile(cluster, body, "img:1", now=NOW).download == {
        "draft": {"bytesDone": 5, "bytesTotal": 10, "remainingSeconds": 2.5, "done": False}}


def test_the_memory_request_follows_the_pulled_models():
    cluster = FakeCluster()
    body = cr()
    job = reconcile(cluster, body, "img:1", now=NOW).job
    cluster.objects[("Pod", "pull")] = {"metadata": {"name": "pull", "creationTimestamp": "t", "labels": {
        resource.LABEL_OWNER: "qwen", resource.LABEL_PULL_JOB: job["metadata"]["name"]}}}
    cluster.log = "\n".join(json.dumps({"dest": resource.model_dest(body["spec"], role), "bytesDone": size,
                                        "bytesTotal": size, "done": True})
                            for role, size in (("target", 16_400_000_000), ("draft", 2_000_000_000)))
    job["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    seen = reconcile(cluster, body, "img:1", now=NOW)
    assert seen.pulled == {"job": job["metadata"]["name"], "bytes": 18_400_000_000}
    requests = seen.deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert requests["memory"] == "23Gi"  # ceil(18.4e9 * 1.1 / 2**30) = 19, plus 4 for the runtime
    cluster.log = None  # later passes keep what was recorded, without reading the log again
    body["status"] = {"pulled": seen.pulled}
    assert reconcile(cluster, body, "img:1", now=NOW).pulled == seen.pulled
