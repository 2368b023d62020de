"""Least privilege, measured: the operator runs as the chart runs it through every path it has (creation, a failed
and retried pull, a pull pod's log, the rollout, pruning, a foreign object, KEDA and an HPA, deletion) while the
API server's audit log records each request; the verbs it used must be exactly the verbs the chart grants."""

from __future__ import annotations

import os
from typing import Any

import pytest
from k8s_testing import (
    DDT,
    audit_events,
    delete_crd,
    free_port,
    install_crd,
    new_namespace,
    operator_calls,
    running,
    wait_for,
)
from test_autoscaling import CUSTOM_METRICS, KEDA
from test_chart import HELM, template
from test_cluster import (
    SPEC,
    complete,
    condition,
    create,
    ddt,
    deployment_ready,
    fail_job,
    make_pod,
    patch,
    pull_jobs,
    ready,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow,
              pytest.mark.skipif(HELM is None, reason="no helm: run ../shared/tools/get-helm .tools/helm")]


def granted(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(group, resource, verb) for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]}


def drive_every_path(cluster, ns: str) -> None:
    """Everything the operator does, against one namespace."""
    # A foreign object: refused.
    services = cluster.dynamic.resources.get(api_version="v1", kind="Service")
    services.create(namespace=ns, body={"apiVersion": "v1", "kind": "Service", "metadata": {"name": "taken"},
                                        "spec": {"ports": [{"port": 80}]}})
    create(cluster, ns, "taken", {**SPEC, "replicas": 1})
    wait_for(lambda: ready(ddt(cluster, ns, "taken")) == ("False", "NameConflict"), what="NameConflict")

    # Monitoring, a PDB and autoscaling (no autoscaler API yet); a pull pod whose log is read; a failed pull retried.
    spec = {**SPEC, "autoscaling": {"maxReplicas": 3, "target": {"runningRequests": 4},
                                    "prometheusAddress": "http://prometheus:9090"}}
    create(cluster, ns, "m", spec)
    job = wait_for(lambda: pull_jobs(cluster, ns, "m"), what="pull Job")[0]
    labels = job["spec"]["template"]["metadata"]["labels"]
    make_pod(cluster, ns, "m-pull", labels, {"phase": "Pending", "containerStatuses": [
        {"name": "pull", "image": "x", "imageID": "", "ready": False, "restartCount": 0,
         "state": {"waiting": {"reason": "ErrImagePull", "message": "not found"}}}]})
    wait_for(lambda: ready(ddt(cluster, ns, "m")) == ("False", "ImagePullFailed"), what="the pull pod seen")
    fail_job(cluster, ns, job["metadata"]["name"], "2026-01-01T00:00:00Z")
    retry = wait_for(lambda: [j for j in pull_jobs(cluster, ns, "m") if j["metadata"]["name"].endswith("-1")],
                     what="the retried pull")[0]
    complete(cluster, ns, retry["metadata"]["name"])
    wait_for(lambda: cluster.get("apps/v1", "Deployment", ns, "m"), what="Deployment")
    deployment_ready(cluster, ns, "m", 2)

    # The autoscaler APIs come and go: an HPA, then a ScaledObject, each pruned in turn.
    install_crd(cluster, CUSTOM_METRICS)
    wait_for(lambda: cluster.get("autoscaling/v2", "HorizontalPodAutoscaler", ns, "m"), what="HPA")
    install_crd(cluster, KEDA)
    wait_for(lambda: cluster.get("keda.sh/v1alpha1", "ScaledObject", ns, "m"), what="ScaledObject")
    wait_for(lambda: cluster.get("autoscaling/v2", "HorizontalPodAutoscaler", ns, "m") is None, what="HPA pruned")
    patch(cluster, *DDT, ns, "m", {"spec": {"autoscaling": None, "replicas": 1, "monitoring": {"kind": "PodMonitor"}}})
    wait_for(lambda: cluster.get("keda.sh/v1alpha1", "ScaledObject", ns, "m") is None, what="ScaledObject pruned")
    wait_for(lambda: cluster.get("policy/v1", "PodDisruptionBudget", ns, "m") is None, what="PDB pruned")
    wait_for(lambda: condition(ddt(cluster, ns, "m"), "Autoscaling") is None, what="Autoscaling gone")
    patch(cluster, *DDT, ns, "m", {"spec": {"monitoring": {"enabled": False}}})
    wait_for(lambda: cluster.get("monitoring.coreos.com/v1", "PodMonitor", ns, "m") is None, what="PodMonitor pruned")

    # Deletion: the finalizer is dropped.
    for name in ("m", "taken"):
        cluster.delete(*DDT, ns, name)
        wait_for(lambda name=name: ddt(cluster, ns, name) is None, timeout=60, what=f"{name} deleted")


def test_the_chart_grants_exactly_the_verbs_the_operator_uses(cluster, crd, kubeconfig, audit_log, tmp_path):
    with new_namespace(cluster, "rbac") as ns:
        docs = template("rbac.cluster=false", f"watchNamespaces={{{ns}}}")
        role = next(d for d in docs if d["kind"] == "Role")
        args = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
        health = free_port()
        local = {"--liveness=http://0.0.0.0:8080/healthz": f"--liveness=http://127.0.0.1:{health}/healthz",
                 "--metrics-port=8081": "--metrics-port=0", "--resync-seconds=15": "--resync-seconds=1"}
        argv = ["ddtree-operator", *[local.get(a, a) for a in args]]
        offset = os.path.getsize(audit_log)
        try:
            with running(argv, f"http://127.0.0.1:{health}/healthz", env={"KUBECONFIG": kubeconfig},
                         log=tmp_path / "operator.log"):
                drive_every_path(cluster, ns)
        finally:
            for manifest in (KEDA, CUSTOM_METRICS):
                delete_crd(cluster, manifest["metadata"]["name"])
        used = operator_calls(audit_events(audit_log, offset))
    rules = granted(role["rules"])
    assert used - rules == set(), f"calls the chart does not grant (they fail with 403): {sorted(used - rules)}"
    assert rules - used == set(), f"grants the operator never uses (drop them): {sorted(rules - used)}"
    cluster_rules = granted(next(d for d in template() if d["kind"] == "ClusterRole")["rules"])
    assert cluster_rules == rules  # watching all namespaces needs nothing more
