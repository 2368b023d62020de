"""The operator against a real API server: children and their shape, the lifecycle driven by patching
Job/Deployment/Pod status (there are no controllers), spec and model changes, deletion, rejected specs."""

from __future__ import annotations

import sys
import time
import urllib.request
from collections import Counter
from typing import Any

import pytest
import yaml
from k8s_testing import DDT, EXAMPLE, free_port, new_namespace, running, wait_for

pytestmark = pytest.mark.cluster

SPEC: dict[str, Any] = {
    "target": {"model": {"uri": "hf://Qwen/Qwen3.6-27B", "revision": "main", "secretRef": {"name": "hf"}}},
    "draft": {"model": {"uri": "hf://z-lab/Qwen3.6-27B-DFlash"}},
    "replicas": 2,
    "gpu": {"count": 1, "products": ["NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition"]},
    "server": {"apiKeySecretRef": {"name": "api"}},
    "monitoring": {"enabled": True},
}


def create(cluster, ns: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    res = cluster.dynamic.resources.get(api_version=DDT[0], kind=DDT[1])
    body = {"apiVersion": DDT[0], "kind": DDT[1], "metadata": {"name": name, "namespace": ns}, "spec": spec}
    return res.create(body=body, namespace=ns).to_dict()


def ddt(cluster, ns: str, name: str) -> dict[str, Any]:
    return cluster.get(*DDT, ns, name)


def ready(obj: dict[str, Any] | None) -> tuple[str, str] | None:
    """(status, reason) of the Ready condition."""
    return condition(obj, "Ready")


def condition(obj: dict[str, Any] | None, type_: str) -> tuple[str, str] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c["status"], c["reason"]
    return None


def patch(cluster, api_version: str, kind: str, ns: str, name: str, body: dict[str, Any],
          subresource: str | None = None) -> None:
    res = cluster.dynamic.resources.get(api_version=api_version, kind=kind)
    if subresource:
        res = res.subresources[subresource]
    res.patch(name=name, namespace=ns, body=body, content_type="application/merge-patch+json")


def pull_jobs(cluster, ns: str, name: str) -> list[dict[str, Any]]:
    return cluster.list("batch/v1", "Job", ns, f"ddtree.io/deployment={name},app.kubernetes.io/component=pull")


def complete(cluster, ns: str, job: str) -> None:
    now = "2026-01-01T00:00:00Z"
    patch(cluster, "batch/v1", "Job", ns, job, {"status": {
        "startTime": now, "completionTime": now, "succeeded": 1,
        "conditions": [{"type": "SuccessCriteriaMet", "status": "True", "lastTransitionTime": now},
                       {"type": "Complete", "status": "True", "lastTransitionTime": now}]}}, "status")


def deployment_ready(cluster, ns: str, name: str, replicas: int) -> None:
    dep = cluster.get("apps/v1", "Deployment", ns, name)
    patch(cluster, "apps/v1", "Deployment", ns, name, {"status": {
        "observedGeneration": dep["metadata"]["generation"], "replicas": replicas, "readyReplicas": replicas,
        "updatedReplicas": replicas, "availableReplicas": replicas}}, "status")


def event_reasons(cluster, ns: str, name: str) -> Counter[str]:
    return Counter(e.get("reason") for e in cluster.list("v1", "Event", ns, "")
                   if e["involvedObject"]["name"] == name)


def table_row(cluster, ns: str, name: str) -> dict[str, Any]:
    res = cluster.dynamic.resources.get(api_version=DDT[0], kind=DDT[1])
    table = res.get(name=name, namespace=ns,
                    header_params={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}).to_dict()
    columns = [c["name"] for c in table["columnDefinitions"]]
    return dict(zip(columns, table["rows"][0]["cells"], strict=True))


def test_pvc_lifecycle(cluster, operator, namespace):
    ns, name = namespace, "qwen"
    create(cluster, ns, name, SPEC)

    # Pulling: storage, pull Job, Service, PDB and ServiceMonitor exist; the server waits for the models.
    job = wait_for(lambda: pull_jobs(cluster, ns, name), what="pull Job")[0]
    wait_for(lambda: ready(ddt(cluster, ns, name)) == ("False", "Pulling"), what="Ready=False/Pulling")
    assert cluster.get("v1", "PersistentVolumeClaim", ns, f"{name}-models")["spec"]["resources"] == {
        "requests": {"storage": "100Gi"}}
    pull = job["spec"]["template"]["spec"]["containers"][0]
    assert pull["args"][:2] == ["pull", "hf://Qwen/Qwen3.6-27B@main"]
    assert "hf://z-lab/Qwen3.6-27B-DFlash" in pull["args"]
    assert {"name": "DDTREE_TARGET_HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "HF_TOKEN"}}} \
        in pull["env"]
    assert job["metadata"]["ownerReferences"][0]["kind"] == "DDTreeDeployment"
    assert job["spec"]["activeDeadlineSeconds"] == 14400  # storage.pullTimeoutSeconds, defaulted by the CRD
    assert cluster.get("v1", "Service", ns, name)["spec"]["ports"][0]["port"] == 8000
    assert cluster.get("policy/v1", "PodDisruptionBudget", ns, name)["spec"]["maxUnavailable"] == 1
    monitor = cluster.get("monitoring.coreos.com/v1", "ServiceMonitor", ns, name)
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"
    assert cluster.get("apps/v1", "Deployment", ns, name) is None
    status = ddt(cluster, ns, name)["status"]
    assert status["phase"] == "Downloading"
    assert status["url"] == f"http://{name}.{ns}.svc:8000/v1"
    assert condition(ddt(cluster, ns, name), "ModelsReady") == ("False", "Pulling")

    # The pull succeeds: the Deployment appears with the GPU, affinity, probes and drain settings.
    complete(cluster, ns, job["metadata"]["name"])
    dep = wait_for(lambda: cluster.get("apps/v1", "Deployment", ns, name), what="Deployment after the pull")
    pod = dep["spec"]["template"]["spec"]
    server = pod["containers"][0]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == ["NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition"]
    assert server["startupProbe"]["failureThreshold"] * server["startupProbe"]["periodSeconds"] >= 1800
    assert server["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "15"]
    assert pod["terminationGracePeriodSeconds"] == 60
    assert server["securityContext"]["readOnlyRootFilesystem"] is True
    assert server["resources"]["requests"]["cpu"] and server["resources"]["requests"]["memory"]  # not BestEffort
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}  # keeps serving
    assert dep["spec"]["progressDeadlineSeconds"] == 1800 + 600  # a model load is not a stuck rollout
    assert pull["args"][2] in server["args"]  # the server reads exactly what the Job pulled
    wait_for(lambda: condition(ddt(cluster, ns, name), "ModelsReady") == ("True", "Pulled"), what="ModelsReady")
    wait_for(lambda: ready(ddt(cluster, ns, name)) == ("False", "Starting"), what="Ready=False/Starting")

    # A pod the scheduler cannot place surfaces as InsufficientCapacity.
    pods = cluster.dynamic.resources.get(api_version="v1", kind="Pod")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    pods.create(namespace=ns, body={"apiVersion": "v1", "kind": "Pod",
                                    "metadata": {"name": f"{name}-0", "labels": labels},
                                    "spec": {"containers": [{"name": "server", "image": "x"}]}})
    patch(cluster, "v1", "Pod", ns, f"{name}-0", {"status": {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}}, "status")
    wait_for(lambda: ready(ddt(cluster, ns, name)) == ("False", "InsufficientCapacity"), what="InsufficientCapacity")
    assert ddt(cluster, ns, name)["status"]["phase"] == "Pending"
    cluster.delete("v1", "Pod", ns, f"{name}-0")
    wait_for(lambda: ready(ddt(cluster, ns, name)) == ("False", "Starting"), what="Starting again")

    # All replicas ready: Ready=True, and the printer columns say so.
    deployment_ready(cluster, ns, name, 2)
    wait_for(lambda: ready(ddt(cluster, ns, name)) == ("True", "Ready"), what="Ready=True")
    row = table_row(cluster, ns, name)
    assert (row["Ready"], row["Reason"], row["Replicas"], row["GPU"]) == ("True", "Ready", "2/2", 1)
    assert row["Target"] == "hf://Qwen/Qwen3.6-27B" and row["URL"].startswith(f"http://{name}.{ns}.svc")
    assert ddt(cluster, ns, name)["status"]["observedGeneration"] == 1
    assert ddt(cluster, ns, name)["metadata"]["finalizers"] == ["ddtree.io/finalizer"]
    scale = cluster.dynamic.resources.get(api_version=DDT[0], kind=DDT[1]).subresources["scale"].get(
        name=name, namespace=ns).to_dict()  # what kubectl scale and HPA/KEDA use
    assert scale["spec"]["replicas"] == 2 and scale["status"]["replicas"] == 2
    assert scale["status"]["selector"] == "app.kubernetes.io/name=ddtree,app.kubernetes.io/instance=qwen," \
        "app.kubernetes.io/component=server"
    # One Event per transition: Pulling, Starting, InsufficientCapacity, Starting again, Ready; and Monitoring's.
    expected = Counter({"Pulling": 1, "Starting": 2, "InsufficientCapacity": 1, "Ready": 1, "ServiceMonitor": 1})
    wait_for(lambda: event_reasons(cluster, ns, name) == expected, what=f"exactly the events {expected}")

    # Spec change rolls out; one replica needs no PDB and the PodMonitor replaces the ServiceMonitor.
    patch(cluster, *DDT, ns, name, {"spec": {"decoding": {"budget": 64}, "replicas": 1,
                                             "monitoring": {"kind": "PodMonitor"}}})
    wait_for(lambda: "64" in cluster.get("apps/v1", "Deployment", ns, name)["spec"]["template"]["spec"][
        "containers"][0]["args"], what="new budget in the Deployment")
    wait_for(lambda: cluster.get("policy/v1", "PodDisruptionBudget", ns, name) is None, what="PDB removed")
    wait_for(lambda: cluster.get("monitoring.coreos.com/v1", "ServiceMonitor", ns, name) is None,
             what="ServiceMonitor removed")
    assert cluster.get("monitoring.coreos.com/v1", "PodMonitor", ns, name)["spec"]["podMetricsEndpoints"]
    wait_for(lambda: ddt(cluster, ns, name)["status"].get("observedGeneration") == 2, what="observedGeneration 2")
    assert cluster.get("apps/v1", "Deployment", ns, name)["spec"]["replicas"] == 1

    # A model change re-pulls into a new directory; the running server keeps its models until then.
    old_args = cluster.get("apps/v1", "Deployment", ns, name)["spec"]["template"]["spec"]["containers"][0]["args"]
    patch(cluster, *DDT, ns, name, {"spec": {"draft": {"model": {"uri": "hf://z-lab/Qwen3.6-27B-DFlash-b8"}}}})
    new_job = wait_for(lambda: [j for j in pull_jobs(cluster, ns, name)
                                if j["metadata"]["name"] != job["metadata"]["name"]], what="new pull Job")[0]
    wait_for(lambda: cluster.get("batch/v1", "Job", ns, job["metadata"]["name"]) is None, what="old Job pruned")
    wait_for(lambda: condition(ddt(cluster, ns, name), "Progressing") == ("True", "Pulling"), what="re-pull")
    assert cluster.get("apps/v1", "Deployment", ns, name)["spec"]["template"]["spec"]["containers"][0][
        "args"] == old_args
    complete(cluster, ns, new_job["metadata"]["name"])
    new_draft = new_job["spec"]["template"]["spec"]["containers"][0]["args"][4]
    wait_for(lambda: new_draft in cluster.get("apps/v1", "Deployment", ns, name)["spec"]["template"]["spec"][
        "containers"][0]["args"], what="the Deployment switched to the new draft")

    # Deletion removes the CR (the operator drops its finalizer) and, by ownership, everything it owned.
    cluster.delete(*DDT, ns, name)
    wait_for(lambda: ddt(cluster, ns, name) is None, timeout=60, what="CR deleted")
    wait_for(lambda: not cluster.list("apps/v1", "Deployment", ns, "") and not cluster.list("batch/v1", "Job", ns, "")
             and not cluster.list("v1", "Service", ns, ""), timeout=30, what="children garbage-collected")


def rollout_status(cluster, ns: str, name: str, replicas: int, updated: int, ready: int) -> None:
    """The Deployment's status as its controller reports it, for the spec it has now."""
    dep = cluster.get("apps/v1", "Deployment", ns, name)
    patch(cluster, "apps/v1", "Deployment", ns, name, {"status": {
        "observedGeneration": dep["metadata"]["generation"], "replicas": replicas, "updatedReplicas": updated,
        "readyReplicas": ready, "availableReplicas": ready}}, "status")


def progressing(obj: dict[str, Any] | None) -> tuple[str, str, str] | None:
    return next(((c["status"], c["reason"], c["message"]) for c in (obj or {}).get("status", {}).get("conditions", [])
                 if c["type"] == "Progressing"), None)


def test_a_rollout_is_not_complete_while_an_old_replica_serves(cluster, operator, namespace):
    """One replica under the default surge: the new pod loads for minutes while the old one serves. The
    Deployment then says replicas 2, updated 1, ready 1; that is a rollout in progress, not a finished one."""
    ns, name = namespace, "surge"
    create(cluster, ns, name, {**SPEC, "replicas": 1, "monitoring": {"enabled": False}})
    complete(cluster, ns, wait_for(lambda: pull_jobs(cluster, ns, name), what="pull Job")[0]["metadata"]["name"])
    wait_for(lambda: cluster.get("apps/v1", "Deployment", ns, name), what="Deployment")
    rollout_status(cluster, ns, name, replicas=1, updated=1, ready=1)
    wait_for(lambda: progressing(ddt(cluster, ns, name))[:2] == ("False", "Complete"), what="Complete")

    patch(cluster, *DDT, ns, name, {"spec": {"decoding": {"budget": 64}}})
    wait_for(lambda: cluster.get("apps/v1", "Deployment", ns, name)["metadata"]["generation"] == 2,
             what="the new spec applied")
    rollout_status(cluster, ns, name, replicas=2, updated=1, ready=1)  # the surge pod loads
    surge = ("True", "RollingOut", "1 old replica(s) still serving until the updated ones are ready")
    wait_for(lambda: progressing(ddt(cluster, ns, name)) == surge, what="RollingOut while the old pod serves")
    time.sleep(2)  # a few resyncs later, still not complete
    assert progressing(ddt(cluster, ns, name)) == surge
    assert ready(ddt(cluster, ns, name)) == ("True", "Ready")  # it serves meanwhile

    rollout_status(cluster, ns, name, replicas=2, updated=1, ready=2)  # the new pod is ready, the old one ends
    time.sleep(2)
    assert progressing(ddt(cluster, ns, name)) == surge
    rollout_status(cluster, ns, name, replicas=1, updated=1, ready=1)
    wait_for(lambda: progressing(ddt(cluster, ns, name))[:2] == ("False", "Complete"), what="Complete again")


def make_pod(cluster, ns: str, name: str, labels: dict[str, str], status: dict[str, Any],
             annotations: dict[str, str] | None = None) -> None:
    """A pod as a kubelet would report it (there is none: create it, then write its status)."""
    pods = cluster.dynamic.resources.get(api_version="v1", kind="Pod")
    pods.create(namespace=ns, body={"apiVersion": "v1", "kind": "Pod",
                                    "metadata": {"name": name, "labels": labels, "annotations": annotations or {}},
                                    "spec": {"containers": [{"name": "pull", "image": "x"}]}})
    patch(cluster, "v1", "Pod", ns, name, {"status": status}, "status")


def fail_job(cluster, ns: str, job: str, at: str) -> None:
    patch(cluster, "batch/v1", "Job", ns, job, {"status": {"startTime": at, "failed": 4, "conditions": [
        {"type": "FailureTarget", "status": "True", "reason": "BackoffLimitExceeded", "lastTransitionTime": at},
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
         "message": "Job has reached the specified backoff limit", "lastTransitionTime": at}]}}, "status")


def ready_message(obj: dict[str, Any] | None) -> str:
    return next(c["message"] for c in obj["status"]["conditions"] if c["type"] == "Ready")


def test_pull_failure_is_reported_and_retried(cluster, operator, namespace):
    ns, name = namespace, "broken"
    create(cluster, ns, name, {**SPEC, "replicas": 1})
    job = wait_for(lambda: pull_jobs(cluster, ns, name), what="pull Job")[0]
    job_name = job["metadata"]["name"]
    labels = job["spec"]["template"]["metadata"]["labels"]

    # The pull pod cannot start: its token Secret is missing. Named at once, not "Pulling" forever.
    make_pod(cluster, ns, f"{job_name}-a", labels, {"phase": "Pending", "containerStatuses": [
        {"name": "pull", "image": "x", "imageID": "", "ready": False, "restartCount": 0,
         "state": {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'}}}]})
    wait_for(lambda: ready(ddt(cluster, ns, name)) == ("False", "ConfigError"), what="ConfigError")
    assert ready_message(ddt(cluster, ns, name)) == f'pull pod {job_name}-a: container pull: secret "hf" not found'

    # It fails with the Hub's answer: PullFailed quotes the pod's last error and says when it retries.
    make_pod(cluster, ns, f"{job_name}-b", labels, {"phase": "Failed", "containerStatuses": [
        {"name": "pull", "image": "x", "imageID": "", "ready": False, "restartCount": 0, "state": {"terminated": {
            "exitCode": 1, "reason": "Error",
            "message": '{"dest": "/models/t", "bytesDone": 0}\nddtree pull: hf://Qwen/Qwen3.6-27B: 403 gated\n'}}}]})
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    fail_job(cluster, ns, job_name, now)
    wait_for(lambda: ready(ddt(cluster, ns, name)) == ("False", "PullFailed"), what="PullFailed")
    obj = ddt(cluster, ns, name)
    assert obj["status"]["phase"] == "Failed"
    message = ready_message(obj)
    assert f"Job {job_name} (attempt 1) failed: ddtree pull: hf://Qwen/Qwen3.6-27B: 403 gated; retrying at " in message
    assert "kubectl annotate ddt broken ddtree.io/retry-pull=$(date +%s) --overwrite" in message
    warning = wait_for(lambda: [e for e in cluster.list("v1", "Event", ns, "")
                                if e["reason"] == "PullFailed" and e["involvedObject"]["name"] == name], what="event")
    assert warning[0]["type"] == "Warning" and "403 gated" in warning[0]["message"]
    assert cluster.get("apps/v1", "Deployment", ns, name) is None
    time.sleep(2)
    assert [j["metadata"]["name"] for j in pull_jobs(cluster, ns, name)] == [job_name]  # backoff: not yet

    # Retried on demand: a new Job at once, the failed one removed.
    patch(cluster, *DDT, ns, name, {"metadata": {"annotations": {"ddtree.io/retry-pull": "1"}}})
    retry = wait_for(lambda: [j for j in pull_jobs(cluster, ns, name) if j["metadata"]["name"] != job_name],
                     what="a new pull Job")[0]
    wait_for(lambda: cluster.get("batch/v1", "Job", ns, job_name) is None, what="the failed Job pruned")
    wait_for(lambda: ready(ddt(cluster, ns, name)) == ("False", "Pulling"), what="Pulling again")

    # Retried by itself once the backoff has passed.
    fail_job(cluster, ns, retry["metadata"]["name"], "2026-01-01T00:00:00Z")
    wait_for(lambda: [j for j in pull_jobs(cluster, ns, name)
                      if j["metadata"]["name"] == retry["metadata"]["name"] + "-1"], what="the automatic retry")


def test_empty_dir_pulls_in_each_pod(cluster, operator, namespace):
    ns, name = namespace, "demo"
    spec = {"target": {"model": {"uri": "/opt/models/tiny"}}, "draft": {"model": {"uri": "pvc://weights/draft"}},
            "gpu": {"count": 0}, "storage": {"mode": "emptyDir", "size": "5Gi"}}
    create(cluster, ns, name, spec)
    dep = wait_for(lambda: cluster.get("apps/v1", "Deployment", ns, name), what="Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["initContainers"]] == ["pull"]
    assert pod["initContainers"][0]["args"][-2:] == ["--timeout", "14400"]  # pullTimeoutSeconds, defaulted
    assert {"name": "models", "emptyDir": {"sizeLimit": "5Gi"}} in pod["volumes"]
    assert "nvidia.com/gpu" not in str(pod["containers"][0]["resources"])  # CPU-only: no GPU request
    assert pull_jobs(cluster, ns, name) == []
    assert cluster.get("v1", "PersistentVolumeClaim", ns, f"{name}-models") is None
    wait_for(lambda: ready(ddt(cluster, ns, name)) == ("False", "Starting"), what="Starting")
    assert condition(ddt(cluster, ns, name), "ModelsReady") is None  # does not apply: each pod pulls


def test_owned_objects_reach_the_status_without_waiting_for_a_resync(cluster, crd, kubeconfig, tmp_path):
    """With the next resync ten minutes away, a finished pull, a crashing pod and a ready Deployment still show
    on the DDTreeDeployment within seconds: the operator watches the Jobs, pods and Deployments it owns."""
    soon = 5
    with new_namespace(cluster, "w") as ns:
        health = free_port()
        argv = [sys.executable, "-m", "ddtree_operator.main", f"--namespace={ns}", "--standalone",
                "--resync-seconds=600", "--metrics-port=0", f"--liveness=http://127.0.0.1:{health}/healthz"]
        with running(argv, f"http://127.0.0.1:{health}/healthz", env={"KUBECONFIG": kubeconfig},
                     log=tmp_path / "operator.log"):
            create(cluster, ns, "w", {**SPEC, "replicas": 1, "monitoring": {"enabled": False}})
            job = wait_for(lambda: pull_jobs(cluster, ns, "w"), what="pull Job")[0]
            wait_for(lambda: ready(ddt(cluster, ns, "w")) == ("False", "Pulling"), what="Pulling")

            complete(cluster, ns, job["metadata"]["name"])
            dep = wait_for(lambda: cluster.get("apps/v1", "Deployment", ns, "w"), timeout=soon,
                           what="the Deployment, once the pull Job completed")
            wait_for(lambda: condition(ddt(cluster, ns, "w"), "ModelsReady") == ("True", "Pulled"), timeout=soon,
                     what="ModelsReady")

            labels = dep["spec"]["template"]["metadata"]["labels"]
            make_pod(cluster, ns, "w-1", labels, {"phase": "Running", "containerStatuses": [
                {"name": "server", "image": "x", "imageID": "", "ready": False, "restartCount": 3,
                 "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                 "lastState": {"terminated": {"exitCode": 1, "reason": "Error",
                                              "message": "ddtree serve: CUDA out of memory"}}}]})
            wait_for(lambda: ready(ddt(cluster, ns, "w")) == ("False", "CrashLooping"), timeout=soon,
                     what="a crashing pod")

            cluster.delete("v1", "Pod", ns, "w-1")
            deployment_ready(cluster, ns, "w", 1)
            wait_for(lambda: ready(ddt(cluster, ns, "w")) == ("True", "Ready"), timeout=soon,
                     what="Ready, once the Deployment says so")
            cluster.delete(*DDT, ns, "w")
            wait_for(lambda: ddt(cluster, ns, "w") is None, timeout=60, what="CR deleted")


def test_operator_serves_metrics_and_liveness(cluster, operator, namespace):
    create(cluster, namespace, "m", {**SPEC, "replicas": 1, "monitoring": {"enabled": False}})
    wait_for(lambda: ready(ddt(cluster, namespace, "m")), what="a status")
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{operator['metrics_port']}/metrics").read().decode()
    assert 'ddtree_operator_reconciles_total{result="ok",trigger="create"}' in metrics
    assert "ddtree_operator_reconcile_seconds_count" in metrics
    health = urllib.request.urlopen(f"http://127.0.0.1:{operator['liveness_port']}/healthz").read().decode()
    assert "apiserver" in health


@pytest.mark.parametrize("path", sorted(EXAMPLE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_accepted(cluster, crd, namespace, path):
    example = yaml.safe_load(path.read_text())
    res = cluster.dynamic.resources.get(api_version=DDT[0], kind=DDT[1])
    created = res.create(body=example, namespace=namespace, query_params=[("dryRun", "All")]).to_dict()
    decoding = created["spec"]["decoding"]
    assert (decoding["method"], decoding["budget"]) == ("ddtree", 32)  # given or defaulted
    assert decoding.get("temperature") == example["spec"].get("decoding", {}).get("temperature")
    assert decoding["fastPath"] is example["spec"].get("decoding", {}).get("fastPath", True)


def test_restart_loses_nothing(cluster, operator, monkeypatch):
    """What happens while the operator is down is picked up when it comes back (state lives in the API)."""
    from kopf.testing import KopfRunner

    monkeypatch.setenv("DDTREE_OPERATOR_METRICS_PORT", "0")  # the session's operator holds the metrics port
    with new_namespace(cluster, "r") as ns:
        args = ["run", "--standalone", "-m", "ddtree_operator.handlers", f"--namespace={ns}"]
        with KopfRunner(args, timeout=60) as first:
            create(cluster, ns, "qwen", {**SPEC, "replicas": 1})
            job = wait_for(lambda: pull_jobs(cluster, ns, "qwen"), what="pull Job")[0]
            wait_for(lambda: ready(ddt(cluster, ns, "qwen")) == ("False", "Pulling"), what="Pulling")
        assert first.exception is None, first.output
        complete(cluster, ns, job["metadata"]["name"])  # the pull finishes while nobody watches
        time.sleep(2)
        assert cluster.get("apps/v1", "Deployment", ns, "qwen") is None
        with KopfRunner(args, timeout=60) as second:
            wait_for(lambda: cluster.get("apps/v1", "Deployment", ns, "qwen"), what="Deployment after restart")
            wait_for(lambda: ready(ddt(cluster, ns, "qwen")) == ("False", "Starting"), what="Starting")
            assert pull_jobs(cluster, ns, "qwen")[0]["metadata"]["name"] == job["metadata"]["name"]  # no re-pull
            cluster.delete(*DDT, ns, "qwen")
            wait_for(lambda: ddt(cluster, ns, "qwen") is None, timeout=60, what="CR deleted")
        assert second.exception is None, second.output
