"""Pure rendering and status: every storage mode and option, without an API server."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest
import yaml
from ddtree_operator import render, status
from ddtree_operator.reconcile import parse_progress
from k8s_testing import CRD_FILE, EXAMPLE, cr


def pod_spec(children: render.Children) -> dict[str, Any]:
    return children.deployment["spec"]["template"]["spec"]


def test_example_renders_for_one_rtx_pro_6000():
    example = yaml.safe_load(EXAMPLE.read_text())
    example["metadata"].update(namespace="default", uid="u")
    children = render.render(example)
    server = pod_spec(children)["containers"][0]
    assert server["resources"]["limits"] == {"memory": "96Gi", "nvidia.com/gpu": "1"}
    assert server["args"][server["args"].index("--served-model-name") + 1] == "qwen3.6-27b"
    assert children.pull_job["spec"]["template"]["spec"]["containers"][0]["args"][1] == "hf://Qwen/Qwen3.6-27B@main"
    assert children.pdb is None and children.monitor is None


def test_pvc_mode_pulls_once_in_a_job_and_mounts_read_only():
    children = render.render(cr({"storage": {"mode": "pvc", "size": "80Gi", "storageClassName": "fast"}}), "img:1")
    assert children.pvc["metadata"]["name"] == "qwen-models"
    assert children.pvc["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "80Gi"}},
                                    "storageClassName": "fast"}
    job_pod = children.pull_job["spec"]["template"]["spec"]
    pull = job_pod["containers"][0]
    assert pull["command"] == ["ddtree"] and pull["image"] == "img:1"
    assert pull["args"] == ["pull", "hf://Qwen/Qwen3-8B", render.model_dest(cr()["spec"], "target"),
                            "hf://z-lab/Qwen3-8B-DFlash-b16", render.model_dest(cr()["spec"], "draft"),
                            "--token-env", "DDTREE_TARGET_HF_TOKEN", "--token-env", "DDTREE_DRAFT_HF_TOKEN",
                            "--progress", "json"]
    assert job_pod["restartPolicy"] == "Never"
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "qwen-models"}} in job_pod["volumes"]
    server = pod_spec(children)["containers"][0]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in server["volumeMounts"]
    assert "initContainers" not in pod_spec(children)


def test_job_name_follows_the_models():
    job = render.render(cr()).pull_job
    same = render.render(cr({"replicas": 3})).pull_job
    other = cr()
    other["spec"]["draft"]["model"]["revision"] = "v2"
    changed = render.render(other).pull_job
    assert job["metadata"]["name"] == same["metadata"]["name"]  # scaling does not re-pull
    assert job["metadata"]["name"] != changed["metadata"]["name"]  # a model change does
    assert render.model_dest(cr()["spec"], "draft") != render.model_dest(other["spec"], "draft")
    assert render.model_dest(cr()["spec"], "target") == render.model_dest(other["spec"], "target")


def test_existing_claim_mode_uses_the_users_claim():
    children = render.render(cr({"storage": {"mode": "existingClaim", "claimName": "shared-models"}}))
    assert children.pvc is None
    volume = {"name": "models", "persistentVolumeClaim": {"claimName": "shared-models"}}
    assert volume in children.pull_job["spec"]["template"]["spec"]["volumes"]
    assert volume in pod_spec(children)["volumes"]


def test_empty_dir_mode_pulls_in_an_init_container():
    children = render.render(cr({"storage": {"mode": "emptyDir", "size": "60Gi"}}))
    assert children.pvc is None and children.pull_job is None
    pod = pod_spec(children)
    assert [c["name"] for c in pod["initContainers"]] == ["pull"]
    assert pod["initContainers"][0]["args"][0] == "pull"
    assert {"name": "models", "emptyDir": {"sizeLimit": "60Gi"}} in pod["volumes"]


def test_pvc_and_local_sources_and_tokens():
    spec = {"target": {"model": {"uri": "pvc://weights/qwen3-8b", "secretRef": {"name": "hf", "key": "token"}}},
            "draft": {"model": {"uri": "/opt/models/draft"}}}
    children = render.render(cr(spec))
    pull = children.pull_job["spec"]["template"]["spec"]["containers"][0]
    assert pull["args"][1] == "pvc://weights/qwen3-8b" and pull["args"][3] == "/opt/models/draft"
    mount = {"name": "source-0", "mountPath": "/mnt/pvc/weights", "readOnly": True}
    assert mount in pull["volumeMounts"] and mount in pod_spec(children)["containers"][0]["volumeMounts"]
    assert {"name": "source-0", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in \
        pod_spec(children)["volumes"]
    token = {"name": "DDTREE_TARGET_HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    assert token in pull["env"]
    assert not any(e["name"] == "DDTREE_DRAFT_HF_TOKEN" for e in pull["env"])


def test_gpu_placement_merges_with_user_affinity_and_tolerations():
    user_affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}}}
    spec = {"gpu": {"count": 2, "products": ["NVIDIA-H200"], "resourceName": "nvidia.com/gpu",
                    "runtimeClassName": "nvidia"},
            "affinity": user_affinity, "tolerations": [{"key": "dedicated", "operator": "Exists"}],
            "nodeSelector": {"pool": "gpu"}, "priorityClassName": "inference",
            "resources": {"requests": {"cpu": "8"}}}
    before = copy.deepcopy(spec)
    pod = pod_spec(render.render(cr(spec)))
    assert spec == before  # rendering does not mutate the CR
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    gpu_expr = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-H200"]}
    assert all(t["matchExpressions"][-1] == gpu_expr for t in terms) and len(terms) == 2
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Exists"},
                                  {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["nodeSelector"] == {"pool": "gpu"} and pod["priorityClassName"] == "inference"
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "8", "nvidia.com/gpu": "2"},
                                                 "limits": {"nvidia.com/gpu": "2"}}


def test_cpu_only_has_no_gpu_request_and_surges():
    children = render.render(cr({"gpu": {"count": 0}}))
    pod = pod_spec(children)
    assert "resources" not in pod["containers"][0] and "tolerations" not in pod and "affinity" not in pod
    assert children.deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 1}
    gpu = render.render(cr()).deployment["spec"]["strategy"]["rollingUpdate"]
    assert gpu == {"maxSurge": 0, "maxUnavailable": 1}  # no spare GPU for a surge pod


def test_server_contract_probes_and_drain():
    spec = {"server": {"port": 9000, "startupTimeoutSeconds": 3605, "drainSeconds": 20,
                       "terminationGracePeriodSeconds": 90, "maxQueue": 64, "extraArgs": ["--log-level", "debug"],
                       "apiKeySecretRef": {"name": "keys"}, "shmSize": "32Gi"},
            "decoding": {"method": "dflash", "budget": 48, "temperature": 0.6, "thinking": False,
                         "generationConfig": "none", "draftQuantization": "fp8",
                         "draftVocab": {"configMapRef": {"name": "qwen3-hot", "key": "hot.json"}}}}
    children = render.render(cr(spec))
    pod = pod_spec(children)
    server = pod["containers"][0]
    args = server["args"]
    assert args[0] == "serve" and args[-3:] == ["--fast", "--log-level", "debug"]  # on a GPU: the fast path
    flags = dict(zip(args[1:-3:2], args[2:-3:2], strict=True))
    assert flags == {"--target": render.model_dest(cr()["spec"], "target"),
                     "--draft": render.model_dest(cr()["spec"], "draft"), "--host": "0.0.0.0", "--port": "9000",
                     "--served-model-name": "Qwen3-8B", "--method": "dflash", "--budget": "48", "--max-queue": "64",
                     "--drain-timeout": "65", "--default-temperature": "0.6", "--generation-config": "none",
                     "--default-chat-template-kwargs": '{"enable_thinking": false}',
                     "--draft-vocab": "/etc/ddtree/draft-vocab/hot.json", "--draft-quantization": "fp8"}
    assert server["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    assert server["startupProbe"]["httpGet"]["path"] == "/ready"
    assert server["startupProbe"]["failureThreshold"] == 361  # ceil(3605 / 10)
    assert server["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert server["livenessProbe"]["httpGet"]["path"] == "/health"
    assert server["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "20"]
    assert pod["terminationGracePeriodSeconds"] == 90
    api_key = {"name": "DDTREE_API_KEY", "valueFrom": {"secretKeyRef": {"name": "keys", "key": "api-key"}}}
    assert api_key in server["env"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}} in pod["volumes"]
    vocab = {"name": "draft-vocab",
             "configMap": {"name": "qwen3-hot", "items": [{"key": "hot.json", "path": "hot.json"}]}}
    assert vocab in pod["volumes"]
    assert {"name": "draft-vocab", "mountPath": "/etc/ddtree/draft-vocab", "readOnly": True} in server["volumeMounts"]
    assert children.service["spec"]["ports"] == [
        {"name": "http", "port": 9000, "targetPort": "http", "protocol": "TCP"}]
    assert render.url(cr(spec)) == "http://qwen.ml.svc:9000/v1"


def test_extra_args_may_not_repeat_a_flag_the_spec_renders():
    crd = yaml.safe_load(CRD_FILE.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    rule = spec["server"]["properties"]["extraArgs"]["x-kubernetes-validations"][0]["rule"]
    refused = re.compile(re.search(r"matches\('(.+)'\)", rule).group(1))
    decoding = {"method": "ar", "budget": 8, "temperature": 0.5, "generationConfig": "none", "thinking": True,
                "draftVocab": {"configMapRef": {"name": "hot"}}, "draftQuantization": "fp8"}
    flags = [a for a in render.server_args(cr({"decoding": decoding})["spec"])[1:] if a.startswith("--")]
    assert {"--generation-config", "--draft-vocab", "--draft-quantization"} <= set(flags), flags
    assert all(refused.match(f) for f in flags), flags


def test_the_draft_keeps_its_dtype_unless_fp8_is_asked_for():
    def args(decoding: dict) -> list[str]:
        return render.server_args(cr({"decoding": decoding})["spec"])

    assert "--draft-quantization" not in args({}) and "--draft-quantization" not in args({"draftQuantization": "none"})
    rendered = args({"draftQuantization": "fp8"})
    assert rendered[rendered.index("--draft-quantization") + 1] == "fp8"


def test_the_fast_path_needs_a_gpu_and_can_be_turned_off():
    def flags(spec: dict) -> set[str]:
        return {"--fast", "--no-fast"} & set(pod_spec(render.render(cr(spec)))["containers"][0]["args"])

    assert flags({}) == {"--fast"} and flags({"decoding": {"fastPath": False}}) == {"--no-fast"}
    assert flags({"gpu": {"count": 0}}) == set()  # a CPU pod: the server's default (off without CUDA)


def test_secure_defaults_and_ownership():
    children = render.render(cr())
    pod = pod_spec(children)
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    for container in [pod["containers"][0], children.pull_job["spec"]["template"]["spec"]["containers"][0]]:
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                "capabilities": {"drop": ["ALL"]}}
    for child in children.all():
        assert child["metadata"]["ownerReferences"] == [{"apiVersion": "ddtree.io/v1alpha1", "kind": "DDTreeDeployment",
                                                         "name": "qwen", "uid": "u-1", "controller": True,
                                                         "blockOwnerDeletion": True}]
        assert child["metadata"]["namespace"] == "ml"
    assert render.render(cr({"image": "mine:2"})).deployment["spec"]["template"]["spec"]["containers"][0][
        "image"] == "mine:2"


@pytest.mark.parametrize(("monitoring", "kind", "key"), [
    ({"enabled": True}, "ServiceMonitor", "endpoints"),
    ({"enabled": True, "kind": "PodMonitor", "labels": {"release": "kps"}}, "PodMonitor", "podMetricsEndpoints"),
])
def test_monitors(monitoring, kind, key):
    monitor = render.render(cr({"monitoring": monitoring})).monitor
    assert monitor["kind"] == kind
    relabel = {"sourceLabels": ["__meta_kubernetes_pod_label_ddtree_io_deployment"], "targetLabel": "ddtree_deployment"}
    assert monitor["spec"][key] == [{"port": "http", "path": "/metrics", "interval": "15s", "relabelings": [relabel]}]
    assert monitor["metadata"]["labels"].get("release") == monitoring.get("labels", {}).get("release")
    assert render.render(cr({"monitoring": {"enabled": False}})).monitor is None


def test_pdb_only_for_several_replicas():
    assert render.render(cr({"replicas": 1})).pdb is None
    pdb = render.render(cr({"replicas": 3})).pdb
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": render.selector("qwen")}}


def job(condition: str | None, message: str = "") -> dict[str, Any]:
    conditions = [{"type": condition, "status": "True", "message": message}] if condition else []
    return {"metadata": {"name": "qwen-pull-1"}, "status": {"conditions": conditions}}


def deployment(ready: int, replicas: int = 2) -> dict[str, Any]:
    return {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "replicas": replicas,
                                                      "readyReplicas": ready, "updatedReplicas": replicas}}


UNSCHEDULABLE = {"status": {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                            "message": "0/4 nodes: Insufficient nvidia.com/gpu"}]}}


@pytest.mark.parametrize(("seen", "ready", "phase"), [
    (status.Observed(job=job(None)), ("False", "Pulling"), "Downloading"),
    (status.Observed(job=job("Failed", "BackoffLimitExceeded")), ("False", "PullFailed"), "Failed"),
    (status.Observed(job=job("Complete"), deployment=deployment(0)), ("False", "Starting"), "Starting"),
    (status.Observed(job=job("Complete"), deployment=deployment(0), pods=(UNSCHEDULABLE,)),
     ("False", "InsufficientCapacity"), "Pending"),
    (status.Observed(job=job("Complete"), deployment=deployment(1)), ("False", "Degraded"), "Degraded"),
    (status.Observed(job=job("Complete"), deployment=deployment(2)), ("True", "Ready"), "Ready"),
])
def test_status_reasons(seen, ready, phase):
    fields, conditions = status.compute(cr({"replicas": 2}), seen)
    assert conditions["Ready"][:2] == ready
    assert fields["phase"] == phase
    assert fields["replicasReady"] == f"{(seen.deployment or {}).get('status', {}).get('readyReplicas', 0)}/2"
    assert fields["observedGeneration"] == 3


def test_status_while_a_new_model_pulls_keeps_serving():
    _, conditions = status.compute(cr({"replicas": 2}), status.Observed(job=job(None), deployment=deployment(2)))
    assert conditions["Ready"][:2] == ("True", "Ready")
    assert conditions["Progressing"][:2] == ("True", "Pulling")
    assert conditions["ModelsReady"][:2] == ("False", "Pulling")


def test_status_empty_dir_has_no_models_condition_and_sees_pulling_pods():
    pulling = {"status": {"initContainerStatuses": [{"name": "pull", "state": {"running": {}}}]}}
    body = cr({"storage": {"mode": "emptyDir"}})
    _, conditions = status.compute(body, status.Observed(deployment=deployment(0, 1), pods=(pulling,)))
    assert "ModelsReady" not in conditions
    assert conditions["Ready"][:2] == ("False", "Pulling")


def test_merge_conditions_keeps_transition_times_and_reports_changes():
    first, transitions = status.merge_conditions([], {"Ready": ("False", "Pulling", "m")}, 1, "T1")
    assert [t.reason for t in transitions] == ["Pulling"]
    same, transitions = status.merge_conditions(first, {"Ready": ("False", "Pulling", "m2")}, 1, "T2")
    assert transitions == [] and same[0]["lastTransitionTime"] == "T1" and same[0]["message"] == "m2"
    reason, transitions = status.merge_conditions(same, {"Ready": ("False", "PullFailed", "x")}, 2, "T3")
    assert reason[0]["lastTransitionTime"] == "T1"  # the status did not change, only the reason
    assert transitions[0].event_type == "Warning"
    ready, _ = status.merge_conditions(reason, {"Ready": ("True", "Ready", "ok")}, 2, "T4")
    assert ready[0]["lastTransitionTime"] == "T4" and ready[0]["observedGeneration"] == 2


def test_parse_progress_maps_destinations_to_roles():
    spec = cr()["spec"]
    target = render.model_dest(spec, "target")
    text = "\n".join(["not json", *map(json.dumps, [
        {"dest": target, "bytesDone": 10, "bytesTotal": 100, "speedBytesPerSecond": 5.0, "remainingSeconds": 18.0,
         "done": False},
        {"dest": target, "bytesDone": 50, "bytesTotal": 100, "remainingSeconds": None, "done": False},
        {"dest": "/elsewhere", "bytesDone": 1}])])
    assert parse_progress(text, spec) == {"target": {"bytesDone": 50, "bytesTotal": 100, "done": False}}
    assert parse_progress("", spec) is None


def test_operator_cli_requires_a_scope(capsys):
    from ddtree_operator.main import main

    assert main([]) == 2
    assert "--namespace NS (repeatable) or --all-namespaces" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--namespace", "a", "--all-namespaces"])  # mutually exclusive


@pytest.mark.parametrize("spec", [
    {"storage": {"mode": "pvc", "storageClassName": "fast"}, "replicas": 3, "gpu": {"count": 2, "products": ["A"]}},
    {"storage": {"mode": "existingClaim", "claimName": "mine"}, "server": {"apiKeySecretRef": {"name": "k"}}},
    {"storage": {"mode": "emptyDir"}, "gpu": {"count": 0}, "draft": {"model": {"uri": "pvc://w/d"}}},
], ids=["pvc", "existingClaim", "emptyDir"])
def test_children_validate_against_the_kubernetes_schemas(spec):
    import kubernetes_validate

    for child in render.render(cr(spec)).all():
        if child["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(child, "1.30.0", strict=True)


def test_pull_progress_shows_in_the_models_condition():
    download = {"target": {"bytesDone": 12_000_000_000, "bytesTotal": 54_000_000_000, "done": False},
                "draft": {"bytesDone": 3_000_000_000, "done": True}}
    fields, conditions = status.compute(cr(), status.Observed(job=job(None), download=download))
    assert conditions["ModelsReady"][2].endswith(": target 12.0/54.0 GB, draft done")
    assert fields["download"] == download
