"""Autoscaling on serving signals: the server exports the gauges, and the operator renders a KEDA ScaledObject when
KEDA's API exists, else an HPA through the custom metrics API, else warns. kubelite runs no controllers, so
"the API exists" is made true by installing a CRD in that API group."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ddtree.api.metrics import ServerMetrics, TokenThroughput
from ddtree_operator import fleet
from k8s_testing import DDT, MONITOR_CRDS, delete_crd, install_crd, wait_for
from prometheus_client import CollectorRegistry, Counter
from test_cluster import SPEC, complete, condition, create, ddt, event_reasons, patch, pull_jobs, ready


def test_the_server_exports_every_gauge_the_operator_scales_on():
    text = ServerMetrics("m", method="ddtree", budget=32, block_size=16, max_model_len=4096).exposition().decode()
    exported = {line.split("{")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert set(fleet.AUTOSCALING_METRICS.values()) <= exported


def test_tokens_per_second_is_a_sliding_window():
    now = [1000.0]
    counter = Counter("tokens", "t", registry=CollectorRegistry())
    throughput = TokenThroughput(counter, window=30, clock=lambda: now[0])
    for _ in range(30):  # 100 tokens a second for 30 s
        throughput.inc(100)
        now[0] += 1
    assert throughput.rate() == pytest.approx(100 * 29 / 30)  # the oldest second has just left the window
    assert counter._value.get() == 3000  # the counter behind it still counts everything
    now[0] += 30
    assert throughput.rate() == 0  # idle: the gauge falls back, so the autoscaler scales in


def api_group_crd(group: str, version: str, kind: str) -> dict:
    """A CRD that makes `group/version` appear in discovery, standing in for KEDA or a metrics adapter."""
    plural = kind.lower() + "s"
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            # *.k8s.io groups are protected: a CRD in one needs this annotation
            "metadata": {"name": f"{plural}.{group}",
                         "annotations": {"api-approved.kubernetes.io": "unapproved, a test stand-in"}},
            "spec": {"group": group, "scope": "Namespaced",
                     "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
                     "versions": [{"name": version, "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                         "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]}}


KEDA = api_group_crd("keda.sh", "v1alpha1", "ScaledObject")
CUSTOM_METRICS = api_group_crd("custom.metrics.k8s.io", "v1beta2", "MetricStandIn")


@pytest.fixture
def stand_in_apis(cluster, crd) -> Iterator[None]:
    """Removes the stand-in CRDs afterwards: other tests on this API server expect neither API."""
    try:
        yield
    finally:
        for manifest in (KEDA, CUSTOM_METRICS):
            delete_crd(cluster, manifest["metadata"]["name"])


@pytest.mark.cluster
def test_keda_else_hpa_else_a_warning(cluster, operator, namespace, stand_in_apis):
    ns, name = namespace, "auto"
    spec = {**SPEC, "replicas": 1,
            "autoscaling": {"minReplicas": 0, "maxReplicas": 4, "target": {"waitingRequests": 3}}}
    create(cluster, ns, name, spec)
    complete(cluster, ns, wait_for(lambda: pull_jobs(cluster, ns, name), what="pull Job")[0]["metadata"]["name"])
    wait_for(lambda: cluster.get("apps/v1", "Deployment", ns, name), what="Deployment")
    wait_for(lambda: condition(ddt(cluster, ns, name), "Autoscaling") == ("False", "AutoscalerUnavailable"),
             what="AutoscalerUnavailable")
    warning = wait_for(lambda: [e for e in cluster.list("v1", "Event", ns, "")
                                if e["reason"] == "AutoscalerUnavailable"], what="a Warning event")[0]
    assert warning["type"] == "Warning" and "neither KEDA" in warning["message"]
    assert cluster.get("autoscaling/v2", "HorizontalPodAutoscaler", ns, name) is None

    # A custom metrics API appears (prometheus-adapter): an HPA on the same gauge, per pod.
    install_crd(cluster, CUSTOM_METRICS)
    hpa = wait_for(lambda: cluster.get("autoscaling/v2", "HorizontalPodAutoscaler", ns, name), what="HPA")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "ddtree.io/v1alpha1", "kind": "DDTreeDeployment",
                                             "name": name}
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm:num_requests_waiting"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)
    # the HPA is applied before the status that reports it is patched
    wait_for(lambda: condition(ddt(cluster, ns, name), "Autoscaling") == ("True", "HPA"), what="Autoscaling HPA")
    assert "scaling to zero needs KEDA" in next(
        c["message"] for c in ddt(cluster, ns, name)["status"]["conditions"] if c["type"] == "Autoscaling")

    # KEDA appears, and with a Prometheus to query it takes over (scale to zero); the HPA goes.
    install_crd(cluster, KEDA)
    wait_for(lambda: "no Prometheus address" in next(
        c["message"] for c in ddt(cluster, ns, name)["status"]["conditions"] if c["type"] == "Autoscaling"),
        what="KEDA noticed, its address missing")
    patch(cluster, *DDT, ns, name, {"spec": {"autoscaling": {
        "prometheusAddress": "http://prometheus-operated.monitoring.svc:9090"}}})
    scaled = wait_for(lambda: cluster.get("keda.sh/v1alpha1", "ScaledObject", ns, name), what="ScaledObject")
    assert scaled["spec"]["minReplicaCount"] == 0 and scaled["spec"]["scaleTargetRef"]["kind"] == "DDTreeDeployment"
    assert scaled["spec"]["triggers"][0]["metadata"]["query"] == (
        f'sum(vllm:num_requests_waiting{{namespace="{ns}", ddtree_deployment="{name}"}})')
    assert scaled["spec"]["triggers"][0]["metadata"]["threshold"] == "3"
    wait_for(lambda: cluster.get("autoscaling/v2", "HorizontalPodAutoscaler", ns, name) is None, what="HPA pruned")
    wait_for(lambda: condition(ddt(cluster, ns, name), "Autoscaling") == ("True", "KEDA"), what="Autoscaling KEDA")

    # KEDA scales through the scale subresource, as `kubectl scale` does: to zero, the operator follows.
    scale = cluster.dynamic.resources.get(api_version=DDT[0], kind=DDT[1]).subresources["scale"]
    scale.patch(name=name, namespace=ns, body={"spec": {"replicas": 0}},
                content_type="application/merge-patch+json")
    wait_for(lambda: ready(ddt(cluster, ns, name)) == ("False", "ScaledToZero"), what="ScaledToZero")
    assert cluster.get("apps/v1", "Deployment", ns, name)["spec"]["replicas"] == 0

    # Autoscaling turned off: the ScaledObject goes, and so does the condition.
    patch(cluster, *DDT, ns, name, {"spec": {"autoscaling": None}})
    wait_for(lambda: cluster.get("keda.sh/v1alpha1", "ScaledObject", ns, name) is None, what="ScaledObject pruned")
    wait_for(lambda: condition(ddt(cluster, ns, name), "Autoscaling") is None, what="no Autoscaling condition")
    assert event_reasons(cluster, ns, name)["AutoscalerUnavailable"] == 1


def message(obj: dict | None, type_: str) -> str:
    return next(c["message"] for c in obj["status"]["conditions"] if c["type"] == type_)


@pytest.mark.cluster
def test_keda_without_a_prometheus_address_says_so(cluster, operator, namespace, stand_in_apis):
    ns, name = namespace, "noaddr"
    install_crd(cluster, KEDA)
    create(cluster, ns, name, {**SPEC, "replicas": 1,
                               "autoscaling": {"maxReplicas": 4, "target": {"waitingRequests": 3}}})
    wait_for(lambda: condition(ddt(cluster, ns, name), "Autoscaling") == ("False", "PrometheusAddressMissing"),
             what="PrometheusAddressMissing")
    assert message(ddt(cluster, ns, name), "Autoscaling") == (
        "KEDA is installed but has no Prometheus address to query: set spec.autoscaling.prometheusAddress or the "
        "operator's --prometheus-address: replicas stay at spec.replicas")
    warning = wait_for(lambda: [e for e in cluster.list("v1", "Event", ns, "")
                                if e["reason"] == "PrometheusAddressMissing"], what="a Warning event")[0]
    assert warning["type"] == "Warning"
    assert cluster.get("keda.sh/v1alpha1", "ScaledObject", ns, name) is None


@pytest.fixture
def pod_monitor_crd(cluster, crd) -> Iterator[dict]:
    """The PodMonitor CRD, reinstalled afterwards if a test removed it (other tests apply PodMonitors)."""
    manifest = next(m for m in MONITOR_CRDS if m["spec"]["names"]["kind"] == "PodMonitor")
    try:
        yield manifest
    finally:
        install_crd(cluster, manifest)


@pytest.mark.cluster
def test_monitoring_is_a_condition_and_autoscaling_needs_its_scrape(cluster, operator, namespace, stand_in_apis,
                                                                     pod_monitor_crd):
    ns, name = namespace, "scraped"
    install_crd(cluster, KEDA)
    create(cluster, ns, name, {**SPEC, "replicas": 1, "monitoring": {"enabled": True, "kind": "PodMonitor"},
                               "autoscaling": {"maxReplicas": 4, "target": {"waitingRequests": 3},
                                               "prometheusAddress": "http://prometheus:9090"}})
    wait_for(lambda: condition(ddt(cluster, ns, name), "Monitoring") == ("True", "PodMonitor"), what="Monitoring")
    wait_for(lambda: condition(ddt(cluster, ns, name), "Autoscaling") == ("True", "KEDA"), what="Autoscaling KEDA")

    # The Prometheus Operator goes away: nothing scrapes the gauge the ScaledObject's trigger reads.
    delete_crd(cluster, pod_monitor_crd["metadata"]["name"])
    wait_for(lambda: condition(ddt(cluster, ns, name), "Monitoring") == ("False", "MonitorUnavailable"),
             what="MonitorUnavailable")
    wait_for(lambda: condition(ddt(cluster, ns, name), "Autoscaling") == ("False", "NoMetricsSource"),
             what="NoMetricsSource")
    obj = ddt(cluster, ns, name)
    assert "PodMonitor CRD (Prometheus Operator) is not installed" in message(obj, "Monitoring")
    assert message(obj, "Autoscaling").startswith(f"KEDA ScaledObject {name} scales 1-4 replicas on "
                                                  "vllm:num_requests_waiting")
    assert "but nothing scrapes the metric it reads" in message(obj, "Autoscaling")
    assert condition(obj, "Ready") == ("False", "Pulling")  # neither is rolled into Ready
    wait_for(lambda: event_reasons(cluster, ns, name)["MonitorUnavailable"] == 1
             and event_reasons(cluster, ns, name)["NoMetricsSource"] == 1, what="one event each")
    assert {e["type"] for e in cluster.list("v1", "Event", ns, "")
            if e["reason"] in ("MonitorUnavailable", "NoMetricsSource")} == {"Warning"}

    # Installed again: found again, and autoscaling has its signal back.
    install_crd(cluster, pod_monitor_crd)
    wait_for(lambda: condition(ddt(cluster, ns, name), "Monitoring") == ("True", "PodMonitor"), what="Monitoring back")
    wait_for(lambda: condition(ddt(cluster, ns, name), "Autoscaling") == ("True", "KEDA"), what="KEDA back")
    assert cluster.get("monitoring.coreos.com/v1", "PodMonitor", ns, name)
