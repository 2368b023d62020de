"""What a real cluster throws at the operator, against the API server: objects it did not create, children the API
server rejects, pods that cannot start, spec changes that must not re-pull, a model change mid-rollout."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
from k8s_testing import DDT, MONITOR_CRDS, install_crd, wait_for
from test_cluster import (
    SPEC,
    complete,
    condition,
    create,
    ddt,
    deployment_ready,
    event_reasons,
    make_pod,
    patch,
    pull_jobs,
    ready,
    ready_message,
)

pytestmark = pytest.mark.cluster


def snapshot(cluster, api_version: str, kind: str, ns: str, name: str) -> dict[str, Any]:
    return cluster.get(api_version, kind, ns, name)


def test_objects_it_did_not_create_are_refused_never_adopted(cluster, operator, namespace):
    ns = namespace
    services = cluster.dynamic.resources.get(api_version="v1", kind="Service")
    services.create(namespace=ns, body={"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
                                        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80}]}})
    claims = cluster.dynamic.resources.get(api_version="v1", kind="PersistentVolumeClaim")
    claims.create(namespace=ns, body={"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                                      "metadata": {"name": "web-models"},
                                      "spec": {"accessModes": ["ReadWriteOnce"],
                                               "resources": {"requests": {"storage": "100Gi"}}}})
    before = {kind: snapshot(cluster, "v1", kind, ns, name)
              for kind, name in (("Service", "web"), ("PersistentVolumeClaim", "web-models"))}

    create(cluster, ns, "web", {**SPEC, "replicas": 1})
    wait_for(lambda: ready(ddt(cluster, ns, "web")) == ("False", "NameConflict"), what="NameConflict")
    assert ready_message(ddt(cluster, ns, "web")).startswith(
        "PersistentVolumeClaim web-models already exists and is not owned by this DDTreeDeployment")
    time.sleep(3)  # several reconciles later
    for kind, obj in before.items():
        assert snapshot(cluster, "v1", kind, ns, obj["metadata"]["name"]) == obj  # byte for byte
    assert pull_jobs(cluster, ns, "web") == [] and cluster.get("apps/v1", "Deployment", ns, "web") is None
    assert event_reasons(cluster, ns, "web") == {"NameConflict": 1}
    warning = next(e for e in cluster.list("v1", "Event", ns, "") if e["reason"] == "NameConflict")
    assert warning["type"] == "Warning"

    # Deleting the DDTreeDeployment leaves them alone (garbage collection sweeps every second).
    cluster.delete(*DDT, ns, "web")
    wait_for(lambda: ddt(cluster, ns, "web") is None, timeout=60, what="CR deleted")
    time.sleep(3)
    for kind, obj in before.items():
        assert snapshot(cluster, "v1", kind, ns, obj["metadata"]["name"]) == obj

    # Once the names are free, the same object proceeds.
    create(cluster, ns, "web", {**SPEC, "replicas": 1})
    wait_for(lambda: ready(ddt(cluster, ns, "web")) == ("False", "NameConflict"), what="NameConflict again")
    cluster.delete("v1", "Service", ns, "web")
    cluster.delete("v1", "PersistentVolumeClaim", ns, "web-models")
    wait_for(lambda: ready(ddt(cluster, ns, "web")) == ("False", "Pulling"), what="Pulling once the names are free")


@pytest.fixture
def strict_service_monitors(cluster, crd):
    """A ServiceMonitor CRD that rejects what the operator renders (422), as a stricter real one could."""
    stock = next(c for c in MONITOR_CRDS if c["spec"]["names"]["kind"] == "ServiceMonitor")
    strict = copy.deepcopy(stock)
    strict["spec"]["versions"][0]["schema"]["openAPIV3Schema"] = {
        "type": "object", "x-kubernetes-preserve-unknown-fields": True,
        "properties": {"spec": {"type": "object", "required": ["jobLabel"],
                                "properties": {"jobLabel": {"type": "string"}},
                                "x-kubernetes-preserve-unknown-fields": True}}}
    install_crd(cluster, strict)
    try:
        yield
    finally:
        install_crd(cluster, stock)


def test_a_rejected_child_is_reported_once_with_the_api_servers_message(cluster, operator, namespace,
                                                                        strict_service_monitors):
    ns = namespace
    create(cluster, ns, "mon", {**SPEC, "replicas": 1})
    wait_for(lambda: ready(ddt(cluster, ns, "mon")) == ("False", "ApplyFailed"), what="ApplyFailed")
    message = ready_message(ddt(cluster, ns, "mon"))
    assert message.startswith("ServiceMonitor mon: ") and "spec.jobLabel: Required value" in message
    assert condition(ddt(cluster, ns, "mon"), "Progressing") == ("False", "ApplyFailed")
    assert cluster.get("v1", "Service", ns, "mon")  # the other children were applied
    time.sleep(3)  # retried on every reconcile, reported once
    assert event_reasons(cluster, ns, "mon")["ApplyFailed"] == 1


def test_placement_and_image_changes_do_not_re_pull(cluster, operator, namespace):
    ns = namespace
    create(cluster, ns, "q", {**SPEC, "replicas": 1})
    job = wait_for(lambda: pull_jobs(cluster, ns, "q"), what="pull Job")[0]
    patch(cluster, *DDT, ns, "q", {"spec": {"nodeSelector": {"pool": "h200"}, "image": "ddtree-server:0.2.0",
                                            "tolerations": [{"key": "spot", "operator": "Exists"}]}})
    wait_for(lambda: (ddt(cluster, ns, "q").get("status") or {}).get("observedGeneration") == 2, what="the change seen")
    time.sleep(2)
    assert [j["metadata"]["name"] for j in pull_jobs(cluster, ns, "q")] == [job["metadata"]["name"]]
    assert ready(ddt(cluster, ns, "q")) == ("False", "Pulling")  # no 422 on the Job's immutable template
    complete(cluster, ns, job["metadata"]["name"])
    dep = wait_for(lambda: cluster.get("apps/v1", "Deployment", ns, "q"), what="Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "ddtree-server:0.2.0" and pod["nodeSelector"] == {"pool": "h200"}


def server_pod_status(state: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"phase": "Pending", "containerStatuses": [
        {"name": "server", "image": "x", "imageID": "", "ready": False, "restartCount": 0, "state": state, **extra}]}


def test_pods_that_cannot_start_say_why(cluster, operator, namespace):
    ns, name = namespace, "pods"
    create(cluster, ns, name, {**SPEC, "replicas": 1})
    complete(cluster, ns, wait_for(lambda: pull_jobs(cluster, ns, name), what="pull Job")[0]["metadata"]["name"])
    dep = wait_for(lambda: cluster.get("apps/v1", "Deployment", ns, name), what="Deployment")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    wait_for(lambda: ready(ddt(cluster, ns, name)) == ("False", "Starting"), what="Starting")

    make_pod(cluster, ns, f"{name}-a", labels, server_pod_status(
        {"waiting": {"reason": "ImagePullBackOff", "message": 'Back-off pulling image "ddtree-server:tset"'}}))
    wait_for(lambda: ready(ddt(cluster, ns, name)) == ("False", "ImagePullFailed"), what="ImagePullFailed")
    assert 'Back-off pulling image "ddtree-server:tset"' in ready_message(ddt(cluster, ns, name))

    patch(cluster, "v1", "Pod", ns, f"{name}-a", {"status": server_pod_status(
        {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "api" not found'}})}, "status")
    wait_for(lambda: ready(ddt(cluster, ns, name)) == ("False", "ConfigError"), what="ConfigError")
    assert ready_message(ddt(cluster, ns, name)) == f'pod {name}-a: container server: secret "api" not found'

    patch(cluster, "v1", "Pod", ns, f"{name}-a", {"status": server_pod_status(
        {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}}, restartCount=3,
        lastState={"terminated": {"exitCode": 1, "reason": "Error",
                                  "message": "ddtree serve: /models/target-x has no config.json\n"}})}, "status")
    wait_for(lambda: ready(ddt(cluster, ns, name)) == ("False", "CrashLooping"), what="CrashLooping")
    assert ready_message(ddt(cluster, ns, name)).endswith(
        "restarted 3 times, last exit code 1 (Error): ddtree serve: /models/target-x has no config.json")
    assert ddt(cluster, ns, name)["status"]["phase"] == "Failed"
    assert {"ImagePullFailed", "ConfigError", "CrashLooping"} <= set(event_reasons(cluster, ns, name))


def test_serving_model_during_a_model_change(cluster, operator, namespace):
    ns, name = namespace, "swap"
    create(cluster, ns, name, {**SPEC, "replicas": 2})
    first_job = wait_for(lambda: pull_jobs(cluster, ns, name), what="pull Job")[0]["metadata"]["name"]
    complete(cluster, ns, first_job)
    dep = wait_for(lambda: cluster.get("apps/v1", "Deployment", ns, name), what="Deployment")
    template = dep["spec"]["template"]["metadata"]
    ready_status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    for i in range(2):
        make_pod(cluster, ns, f"{name}-{i}", template["labels"], ready_status, template["annotations"])
    deployment_ready(cluster, ns, name, 2)
    serving = {"target": "hf://Qwen/Qwen3.6-27B@main", "draft": "hf://z-lab/Qwen3.6-27B-DFlash", "readyReplicas": 2}
    wait_for(lambda: ddt(cluster, ns, name)["status"].get("servingModel") == serving, what="servingModel")

    # A new draft is pulled, then rolled out: until a new pod is ready, the old model is what is served.
    patch(cluster, *DDT, ns, name, {"spec": {"draft": {"model": {"uri": "hf://z-lab/Qwen3.6-27B-DFlash-b8"}}}})
    new_job = wait_for(lambda: [j for j in pull_jobs(cluster, ns, name) if j["metadata"]["name"] != first_job],
                       what="the new pull Job")[0]
    complete(cluster, ns, new_job["metadata"]["name"])
    new = wait_for(lambda: (d := cluster.get("apps/v1", "Deployment", ns, name))["spec"]["template"]["metadata"][
        "annotations"]["ddtree.io/draft"] == "hf://z-lab/Qwen3.6-27B-DFlash-b8" and d, what="the new template")
    assert ddt(cluster, ns, name)["status"]["servingModel"] == serving
    make_pod(cluster, ns, f"{name}-new", new["spec"]["template"]["metadata"]["labels"], ready_status,
             new["spec"]["template"]["metadata"]["annotations"])
    cluster.delete("v1", "Pod", ns, f"{name}-0")
    cluster.delete("v1", "Pod", ns, f"{name}-1")
    wait_for(lambda: ddt(cluster, ns, name)["status"].get("servingModel", {}).get("draft")
             == "hf://z-lab/Qwen3.6-27B-DFlash-b8", what="servingModel follows the ready pods")

