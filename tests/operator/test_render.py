"""Pure rendering and status: every storage mode and option, without an API server."""

from __future__ import annotations

import copy
import datetime
import json
import re
from typing import Any

import pytest
import yaml
from ddtree.cli import build_parser
from ddtree_operator import fleet, render, resource, status, workload
from ddtree_operator.reconcile import parse_progress
from k8s_testing import CRD_FILE, EXAMPLE, cr

# Every server.batching field away from its default.
BATCHING = {"maxNumSeqs": 16, "maxNumBatchedTokens": 512, "gpuMemoryUtilization": 0.85, "blockSize": 32,
            "batchBudget": False}


def pod_spec(children: render.Children) -> dict[str, Any]:
    return children.deployment["spec"]["template"]["spec"]


def test_example_renders_for_one_rtx_pro_6000():
    example = yaml.safe_load(EXAMPLE.read_text())
    example["metadata"].update(namespace="default", uid="u")
    children = render.render(example)
    server = pod_spec(children)["containers"][0]
    assert server["resources"]["limits"] == {"memory": "96Gi", "nvidia.com/gpu": "1"}
    assert server["args"][server["args"].index("--served-model-name") + 1] == "qwen3.6-27b"
    assert server["args"][server["args"].index("--max-num-seqs") + 1] == "64"
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
    assert pull["args"] == ["pull", "hf://Qwen/Qwen3-8B", resource.model_dest(cr()["spec"], "target"),
                            "hf://z-lab/Qwen3-8B-DFlash-b16", resource.model_dest(cr()["spec"], "draft"),
                            "--token-env", "DDTREE_TARGET_HF_TOKEN", "--token-env", "DDTREE_DRAFT_HF_TOKEN",
                            "--progress", "json"]
    assert job_pod["restartPolicy"] == "Never"
    assert children.pull_job["spec"]["activeDeadlineSeconds"] == 14400  # storage.pullTimeoutSeconds
    assert pull["terminationMessagePolicy"] == "FallbackToLogsOnError"  # PullFailed quotes the pod's error
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "qwen-models"}} in job_pod["volumes"]
    server = pod_spec(children)["containers"][0]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in server["volumeMounts"]
    assert "initContainers" not in pod_spec(children)


def test_job_name_follows_what_it_fetches_only():
    job = render.render(cr()).pull_job
    for unrelated in ({"replicas": 3}, {"nodeSelector": {"pool": "b"}}, {"image": "other:2"},
                      {"storage": {"pullTimeoutSeconds": 60}}, {"tolerations": [{"operator": "Exists"}]}):
        assert render.render(cr(unrelated), "newer:1").pull_job["metadata"]["name"] == job["metadata"]["name"]
    other = cr()
    other["spec"]["draft"]["model"]["revision"] = "v2"
    changed = render.render(other).pull_job
    assert job["metadata"]["name"] != changed["metadata"]["name"]  # a model change re-pulls
    token = cr()
    token["spec"]["target"]["model"]["secretRef"] = {"name": "hf"}
    retry = cr()
    retry["metadata"]["annotations"] = {"ddtree.io/retry-pull": "1"}
    claim = cr({"storage": {"mode": "existingClaim", "claimName": "mine"}})
    names = {render.render(b).pull_job["metadata"]["name"] for b in (token, retry, claim)}
    assert len(names) == 3 and job["metadata"]["name"] not in names
    assert render.render(cr(), pull_attempt=2).pull_job["metadata"]["name"] == job["metadata"]["name"] + "-2"
    assert resource.model_dest(cr()["spec"], "draft") != resource.model_dest(other["spec"], "draft")
    assert resource.model_dest(cr()["spec"], "target") == resource.model_dest(other["spec"], "target")


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
    # No Job, so no activeDeadlineSeconds: the pull itself stops after storage.pullTimeoutSeconds.
    assert pod["initContainers"][0]["args"][-2:] == ["--timeout", "14400"]
    timed = pod_spec(render.render(cr({"storage": {"mode": "emptyDir", "pullTimeoutSeconds": 600}})))
    assert timed["initContainers"][0]["args"][-2:] == ["--timeout", "600"]


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
    spec = {"gpu": {"count": 1, "products": ["NVIDIA-H200"], "resourceName": "nvidia.com/gpu",
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
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "8", "memory": "16Gi", "nvidia.com/gpu": "1"},
                                                 "limits": {"nvidia.com/gpu": "1"}}


def test_cpu_only_has_no_gpu_request_or_placement():
    pod = pod_spec(render.render(cr({"gpu": {"count": 0}, "storage": {"accessModes": ["ReadWriteMany"]}})))
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}
    assert "tolerations" not in pod and "affinity" not in pod


def test_rollouts_keep_serving_and_wait_for_a_whole_model_load():
    dep = render.render(cr({"server": {"startupTimeoutSeconds": 2400}})).deployment["spec"]
    assert dep["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert dep["progressDeadlineSeconds"] == 2400 + 600  # a slow load is not a failed rollout
    scarce = render.render(cr({"rollout": {"maxSurge": 0, "maxUnavailable": 1}})).deployment["spec"]["strategy"]
    assert scarce["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


@pytest.mark.parametrize(("spec", "model_bytes", "requests", "limits"), [
    ({}, None, {"cpu": "4", "memory": "16Gi"}, {}),  # size unknown: a floor, never BestEffort
    ({}, 54_000_000_000, {"cpu": "4", "memory": "60Gi"}, {}),  # 27B in bf16: the weights pass through host memory
    ({"gpu": {"count": 0}}, 300_000_000, {"cpu": "1", "memory": "2Gi"}, {}),
    ({"resources": {"limits": {"memory": "8Gi"}}}, 54_000_000_000, {"cpu": "4"}, {"memory": "8Gi"}),  # theirs wins
    ({"resources": {"requests": {"cpu": "2", "memory": "1Gi"}}}, None, {"cpu": "2", "memory": "1Gi"}, {}),
])
def test_default_requests_are_sized_for_the_models(spec, model_bytes, requests, limits):
    server = workload.render_deployment(cr(spec), "img", model_bytes)["spec"]["template"]["spec"]["containers"][0]
    gpu = {} if spec.get("gpu", {}).get("count") == 0 else {"nvidia.com/gpu": "1"}
    assert server["resources"] == {"requests": {**requests, **gpu}, **({"limits": {**limits, **gpu}}
                                                                        if limits or gpu else {})}


def test_server_pods_say_what_they_serve():
    spec = {"target": {"model": {"uri": "hf://Qwen/Qwen3-8B", "revision": "abc"}}}
    template = render.render(cr(spec)).deployment["spec"]["template"]["metadata"]
    assert template["annotations"] == {"ddtree.io/target": "hf://Qwen/Qwen3-8B@abc",
                                       "ddtree.io/draft": "hf://z-lab/Qwen3-8B-DFlash-b16"}


def test_single_node_storage_keeps_every_pod_of_the_claim_on_one_node():
    spec = {"gpu": {"count": 1, "products": ["NVIDIA-H200"], "runtimeClassName": "nvidia"},
            "nodeSelector": {"zone": "a"}}
    children = render.render(cr(spec))  # ReadWriteOnce, the default
    job_pod = children.pull_job["spec"]["template"]["spec"]
    server_pod = pod_spec(children)
    colocate = {"labelSelector": {"matchLabels": {"ddtree.io/models-claim": "qwen-models"}},
                "topologyKey": "kubernetes.io/hostname"}
    for pod, labels in ((job_pod, children.pull_job["spec"]["template"]["metadata"]["labels"]),
                        (server_pod, children.deployment["spec"]["template"]["metadata"]["labels"])):
        assert labels["ddtree.io/models-claim"] == "qwen-models"
        assert pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == [colocate]
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms[0]["matchExpressions"][-1]["values"] == ["NVIDIA-H200"]  # pull where the servers can run
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert pod["nodeSelector"] == {"zone": "a"}
    assert "nvidia.com/gpu" not in str(job_pod["containers"][0]["resources"])  # the pull takes no GPU
    assert "runtimeClassName" not in job_pod and server_pod["runtimeClassName"] == "nvidia"

    shared = render.render(cr({**spec, "storage": {"accessModes": ["ReadWriteMany"]}}))
    job_pod = shared.pull_job["spec"]["template"]["spec"]
    assert "affinity" not in job_pod and "tolerations" not in job_pod  # any node, e.g. a CPU one
    assert "podAffinity" not in pod_spec(shared)["affinity"]
    assert "ddtree.io/models-claim" not in shared.deployment["spec"]["template"]["metadata"]["labels"]


def test_autoscaling_renders_keda_or_an_hpa_on_the_serving_gauge():
    body = cr({"autoscaling": {"minReplicas": 0, "maxReplicas": 4, "target": {"tokensPerSecond": 1500},
                               "scaleDownDelaySeconds": 600}})
    assert render.render(body).autoscaler is None  # no autoscaler available
    keda = render.render(body, autoscaler="KEDA", prometheus_address="http://prom:9090").autoscaler
    assert keda["apiVersion"] == "keda.sh/v1alpha1" and keda["kind"] == "ScaledObject"
    assert keda["spec"]["scaleTargetRef"] == {"apiVersion": "ddtree.io/v1alpha1", "kind": "DDTreeDeployment",
                                              "name": "qwen"}
    assert (keda["spec"]["minReplicaCount"], keda["spec"]["maxReplicaCount"]) == (0, 4)  # scale to zero
    assert keda["spec"]["cooldownPeriod"] == 600
    assert keda["spec"]["triggers"] == [{"type": "prometheus", "metadata": {
        "serverAddress": "http://prom:9090",
        "query": 'sum(ddtree_generation_tokens_per_second{namespace="ml", ddtree_deployment="qwen"})',
        "threshold": "1500", "activationThreshold": "0", "ignoreNullValues": "true"}}]
    hpa = render.render(body, autoscaler="HPA").autoscaler
    assert hpa["apiVersion"] == "autoscaling/v2" and hpa["spec"]["minReplicas"] == 1  # an HPA cannot reach zero
    assert hpa["spec"]["metrics"] == [{"type": "Pods", "pods": {
        "metric": {"name": "ddtree_generation_tokens_per_second"},
        "target": {"type": "AverageValue", "averageValue": "1500"}}}]
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 600
    waiting = cr({"autoscaling": {"maxReplicas": 2, "target": {"waitingRequests": 4}}})
    assert "vllm:num_requests_waiting" in fleet.prometheus_query(waiting)


def test_server_contract_probes_and_drain():
    spec = {"target": {"model": {"uri": "hf://Qwen/Qwen3-8B"}, "quantization": "fp8"},
            "server": {"port": 9000, "startupTimeoutSeconds": 3605, "drainSeconds": 20,
                       "terminationGracePeriodSeconds": 90, "maxQueue": 64, "extraArgs": ["--log-level", "debug"],
                       "apiKeySecretRef": {"name": "keys"}, "shmSize": "32Gi", "batching": BATCHING},
            "decoding": {"method": "dflash", "budget": 48, "temperature": 0.6, "thinking": False,
                         "generationConfig": "none", "draftQuantization": "fp8",
                         "draftVocab": {"configMapRef": {"name": "qwen3-hot", "key": "hot.json"}}}}
    children = render.render(cr(spec))
    pod = pod_spec(children)
    server = pod["containers"][0]
    args = server["args"]
    # on a GPU: the batch budget's and the fast path's switches, explicit
    assert args[0] == "serve" and args[-4:] == ["--no-batch-budget", "--fast", "--log-level", "debug"]
    flags = dict(zip(args[1:-4:2], args[2:-4:2], strict=True))
    assert flags == {"--target": resource.model_dest(cr()["spec"], "target"),
                     "--draft": resource.model_dest(cr()["spec"], "draft"), "--host": "0.0.0.0", "--port": "9000",
                     "--served-model-name": "Qwen3-8B", "--method": "dflash", "--budget": "48", "--max-queue": "64",
                     "--drain-timeout": "65", "--default-temperature": "0.6", "--generation-config": "none",
                     "--default-chat-template-kwargs": '{"enable_thinking": false}',
                     "--draft-vocab": "/etc/ddtree/draft-vocab/hot.json", "--draft-quantization": "fp8",
                     "--quantization": "fp8", "--max-num-seqs": "16", "--max-num-batched-tokens": "512",
                     "--gpu-memory-utilization": "0.85", "--block-size": "32"}
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
    assert resource.url(cr(spec)) == "http://qwen.ml.svc:9000/v1"


def test_extra_args_may_not_repeat_a_flag_the_spec_renders():
    crd = yaml.safe_load(CRD_FILE.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    rule = spec["server"]["properties"]["extraArgs"]["x-kubernetes-validations"][0]["rule"]
    refused = re.compile(re.search(r"matches\('(.+)'\)", rule).group(1))
    decoding = {"method": "ar", "budget": 8, "temperature": 0.5, "generationConfig": "none", "thinking": True,
                "draftVocab": {"configMapRef": {"name": "hot"}}, "draftQuantization": "fp8"}
    target = {"model": {"uri": "hf://Qwen/Qwen3-8B"}, "quantization": "fp8"}
    flags = [a for on in (True, False)
             for a in workload.server_args(cr({"decoding": decoding, "target": target, "server": {"batching": {
                 "batchBudget": on, "enablePrefixCaching": on}}})["spec"])[1:]
             if a.startswith("--")]
    assert {"--generation-config", "--draft-vocab", "--draft-quantization", "--quantization", "--max-num-seqs",
            "--max-num-batched-tokens", "--gpu-memory-utilization", "--block-size", "--batch-budget",
            "--no-batch-budget", "--no-enable-prefix-caching"} <= set(flags), flags
    assert all(refused.match(f) for f in flags), flags


def test_prefix_caching_is_the_servers_default_and_turned_off_by_name():
    def args(batching: dict) -> list[str]:
        return workload.server_args(cr({"server": {"batching": batching}})["spec"])

    assert not [a for a in args({}) + args({"enablePrefixCaching": True}) if "prefix-caching" in a]
    assert "--no-enable-prefix-caching" in args({"enablePrefixCaching": False})


def test_the_draft_keeps_its_dtype_unless_fp8_is_asked_for():
    def args(decoding: dict) -> list[str]:
        return workload.server_args(cr({"decoding": decoding})["spec"])

    assert "--draft-quantization" not in args({}) and "--draft-quantization" not in args({"draftQuantization": "none"})
    rendered = args({"draftQuantization": "fp8"})
    assert rendered[rendered.index("--draft-quantization") + 1] == "fp8"


def test_batching_flags_parse_as_the_servers_own_with_the_specs_values():
    spec = cr({"target": {"model": {"uri": "hf://Qwen/Qwen3-8B"}, "quantization": "fp8"},
               "server": {"batching": BATCHING}})["spec"]
    parsed, unknown = build_parser().parse_known_args(workload.server_args(spec))
    assert (parsed.max_num_seqs, parsed.max_num_batched_tokens, parsed.gpu_memory_utilization, parsed.block_size,
            parsed.batch_budget) == (16, 512, 0.85, 32, False)
    # --quantization comes to `ddtree serve` with FP8 targets (issue 46); from then on it must parse as fp8
    assert unknown in ([], ["--quantization", "fp8"]), unknown
    assert getattr(parsed, "quantization", "fp8") == "fp8"


def test_batching_defaults_are_the_servers_in_the_crd_and_the_renderer():
    crd = yaml.safe_load(CRD_FILE.read_text())
    server = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["server"]
    crd_defaults = {k: v["default"] for k, v in server["properties"]["batching"]["properties"].items()}
    # an object with the API server's defaults filled in renders as one without them (unit tests, old objects)
    with_defaults = cr({"server": {"batching": crd_defaults}})["spec"]
    assert workload.server_args(with_defaults) == workload.server_args(cr()["spec"])
    parser = build_parser()
    rendered, server_defaults = parser.parse_args(workload.server_args(cr()["spec"])), parser.parse_args(["serve"])
    for flag in ("max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "block_size", "batch_budget"):
        assert getattr(rendered, flag) == getattr(server_defaults, flag), flag


def test_gpu_only_batching_flags_stay_off_cpu_pods():
    args = workload.server_args(cr({"gpu": {"count": 0}, "server": {"batching": BATCHING}})["spec"])
    assert args[args.index("--max-num-seqs") + 1] == "16"  # the CPU's KV pool is sized by it too
    assert not {"--gpu-memory-utilization", "--batch-budget", "--no-batch-budget"} & set(args)


def test_the_target_keeps_its_dtype_unless_fp8_is_asked_for():
    def args(target: dict) -> list[str]:
        return workload.server_args(cr({"target": {"model": {"uri": "hf://Qwen/Qwen3-8B"}, **target}})["spec"])

    assert "--quantization" not in args({}) and "--quantization" not in args({"quantization": "none"})
    rendered = args({"quantization": "fp8"})
    assert rendered[rendered.index("--quantization") + 1] == "fp8"


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
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": resource.selector("qwen")}}


def job(condition: str | None, message: str = "") -> dict[str, Any]:
    conditions = [{"type": condition, "status": "True", "message": message}] if condition else []
    return {"metadata": {"name": "qwen-pull-1"}, "status": {"conditions": conditions}}


def deployment(ready: int, replicas: int = 2) -> dict[str, Any]:
    return {"metadata": {"generation": 1}, "status": {"observedGeneration": 1, "replicas": replicas,
                                                      "readyReplicas": ready, "updatedReplicas": replicas}}


UNSCHEDULABLE = {"metadata": {"name": "qwen-1"}, "status": {"conditions": [
    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
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


def rollout(generation: int, observed: int, replicas: int, updated: int, ready: int) -> dict[str, Any]:
    """A Deployment's status as its controller reports it during a rollout."""
    return {"metadata": {"generation": generation}, "status": {
        "observedGeneration": observed, "replicas": replicas, "updatedReplicas": updated, "readyReplicas": ready,
        "availableReplicas": ready}}


@pytest.mark.parametrize(("dep", "progressing"), [
    (rollout(2, 1, 1, 1, 1), ("True", "RollingOut", "the Deployment controller has not seen the latest spec yet")),
    (rollout(2, 2, 1, 0, 1), ("True", "RollingOut", "0/1 replicas run the latest spec, 1 ready")),
    # One replica under the default surge: the old pod serves while the new one loads the model.
    (rollout(2, 2, 2, 1, 1), ("True", "RollingOut", "1 old replica(s) still serving until the updated ones are "
                                                    "ready")),
    (rollout(2, 2, 2, 1, 2), ("True", "RollingOut", "1 old replica(s) still serving until the updated ones are "
                                                    "ready")),
    (rollout(2, 2, 1, 1, 1), ("False", "Complete", "the latest spec is rolled out")),
])
def test_a_rollout_is_complete_only_when_only_updated_replicas_remain(dep, progressing):
    _, conditions = status.compute(cr({"replicas": 1}), status.Observed(job=job("Complete"), deployment=dep))
    assert conditions["Progressing"] == progressing
    assert conditions["Ready"][:2] == ("True", "Ready")  # the old pod serves meanwhile


def test_monitoring_is_a_condition_and_autoscaling_says_when_its_metric_has_no_scrape():
    keda = ("True", "KEDA", "KEDA ScaledObject qwen scales 1-4 replicas on vllm:num_requests_waiting")
    missing = ("False", "MonitorUnavailable", "monitoring is enabled but the ServiceMonitor CRD (Prometheus "
                                              "Operator) is not installed: nothing scrapes the servers' /metrics")
    _, conditions = status.compute(cr(), status.Observed(job=job(None), autoscaling=keda, monitoring=missing))
    assert conditions["Monitoring"] == missing
    assert conditions["Autoscaling"] == ("False", "NoMetricsSource", f"{keda[2]}, but nothing scrapes the metric "
                                                                     f"it reads: {missing[2]}")
    assert conditions["Ready"][:2] == ("False", "Pulling")  # neither is rolled into Ready
    scraped = ("True", "ServiceMonitor", "ServiceMonitor qwen exposes the servers' /metrics")
    _, conditions = status.compute(cr(), status.Observed(job=job(None), autoscaling=keda, monitoring=scraped))
    assert conditions["Autoscaling"] == keda and conditions["Monitoring"] == scraped
    _, transitions = status.merge_conditions([], {"Ready": ("False", "Pulling", "m"), "Monitoring": missing}, 1, "T")
    assert [(t.type, t.reason, t.event_type) for t in status.events(transitions)] == [
        ("Ready", "Pulling", "Normal"), ("Monitoring", "MonitorUnavailable", "Warning")]
    rejected = {"Ready": ("False", "ApplyFailed", "ServiceMonitor qwen: invalid"),
                "Monitoring": ("False", "ApplyFailed", "ServiceMonitor qwen: invalid")}
    _, transitions = status.merge_conditions([], rejected, 1, "T")
    assert [(t.type, t.reason) for t in status.events(transitions)] == [("Ready", "ApplyFailed")]  # told once


def test_status_empty_dir_has_no_models_condition_and_sees_pulling_pods():
    pulling = {"metadata": {"name": "qwen-1"},
               "status": {"initContainerStatuses": [{"name": "pull", "state": {"running": {}}}]}}
    body = cr({"storage": {"mode": "emptyDir"}})
    _, conditions = status.compute(body, status.Observed(deployment=deployment(0, 1), pods=(pulling,)))
    assert "ModelsReady" not in conditions
    assert conditions["Ready"][:2] == ("False", "Pulling")


def waiting_pod(name: str, reason: str, message: str = "", **extra: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "status": {"containerStatuses": [
        {"name": "server", "state": {"waiting": {"reason": reason, "message": message}}, **extra}]}}


@pytest.mark.parametrize(("pod", "reason", "message"), [
    (waiting_pod("qwen-1", "ImagePullBackOff", 'Back-off pulling image "ddtree-server:typo"'), "ImagePullFailed",
     'pod qwen-1: container server: Back-off pulling image "ddtree-server:typo"'),
    (waiting_pod("qwen-1", "CreateContainerConfigError", 'secret "api" not found'), "ConfigError",
     'pod qwen-1: container server: secret "api" not found'),
    (waiting_pod("qwen-1", "CrashLoopBackOff", "back-off 5m0s", restartCount=4, lastState={"terminated": {
        "exitCode": 1, "reason": "Error", "message": "loading\nddtree serve: CUDA out of memory\n"}}),
     "CrashLooping", "pod qwen-1: container server: restarted 4 times, last exit code 1 (Error): "
                     "ddtree serve: CUDA out of memory"),
])
def test_pod_problems_have_their_own_reasons(pod, reason, message):
    seen = status.Observed(job=job("Complete"), deployment=deployment(0), pods=(pod, UNSCHEDULABLE))
    fields, conditions = status.compute(cr({"replicas": 2}), seen)
    assert conditions["Ready"] == ("False", reason, message)  # rather than Starting or InsufficientCapacity
    assert fields["phase"] == "Failed" and reason in status.WARNING_REASONS


def test_a_pull_pod_that_cannot_start_is_not_pulling_forever():
    pod = waiting_pod("qwen-pull-1-x", "CreateContainerConfigError", 'secret "hf" not found')
    _, conditions = status.compute(cr(), status.Observed(job=job(None), pull_pods=(pod,)))
    assert conditions["Ready"] == ("False", "ConfigError",
                                   'pull pod qwen-pull-1-x: container server: secret "hf" not found')
    assert conditions["ModelsReady"][1] == "ConfigError"


def test_pull_failed_quotes_the_pod_and_says_how_to_retry():
    retry_at = datetime.datetime(2026, 6, 1, 12, 2, tzinfo=datetime.UTC)
    seen = status.Observed(job=job("Failed", "Job has reached the specified backoff limit"), pull_attempt=1,
                           pull_error="ddtree pull: hf://Qwen/Qwen3-8B: 401 gated repo", pull_retry_at=retry_at)
    _, conditions = status.compute(cr(), seen)
    assert conditions["Ready"][:2] == ("False", "PullFailed")
    assert conditions["Ready"][2] == ("Job qwen-pull-1 (attempt 2) failed: ddtree pull: hf://Qwen/Qwen3-8B: 401 gated "
                                      "repo; retrying at 2026-06-01T12:02:00Z; retry now with `kubectl annotate ddt "
                                      "qwen ddtree.io/retry-pull=$(date +%s) --overwrite`")
    deadline = job("Failed")
    deadline["status"]["conditions"][0]["reason"] = "DeadlineExceeded"
    deadline["spec"] = {"activeDeadlineSeconds": 600}
    message = status.compute(cr(), status.Observed(job=deadline))[1]["Ready"][2]
    assert "it ran longer than storage.pullTimeoutSeconds (600 s)" in message


@pytest.mark.parametrize(("seen", "reason", "phase"), [
    (status.Observed(conflict="Service qwen already exists and is not owned by this DDTreeDeployment"),
     "NameConflict", "Failed"),
    (status.Observed(job=job("Complete"), deployment=deployment(2), apply_errors=("ServiceMonitor qwen: invalid",)),
     "ApplyFailed", "Degraded"),
])
def test_refusals_and_rejections_are_on_the_object(seen, reason, phase):
    fields, conditions = status.compute(cr({"replicas": 2}), seen)
    assert conditions["Ready"][:2] == ("False", reason) and fields["phase"] == phase
    assert conditions["Progressing"][:2] == ("False", reason)


def test_serving_model_during_a_model_change():
    body = cr({"replicas": 3})
    new = workload.model_annotations(body["spec"])
    old = {"ddtree.io/target": "hf://Qwen/Qwen3-8B", "ddtree.io/draft": "hf://z-lab/old"}

    def pod(name: str, annotations: dict[str, str], ready: bool = True) -> dict[str, Any]:
        return {"metadata": {"name": name, "annotations": annotations},
                "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}

    pods = (pod("a", old), pod("b", old), pod("c", new), pod("d", new, ready=False))
    assert status.serving_model(body, pods) == {"target": "hf://Qwen/Qwen3-8B", "draft": "hf://z-lab/old",
                                                "readyReplicas": 2}
    assert status.serving_model(body, (pod("a", old), pod("c", new)))["draft"] == new["ddtree.io/draft"]
    assert status.serving_model(body, (pod("d", new, ready=False),)) is None


def test_one_event_per_transition():
    _, transitions = status.merge_conditions([], {"ModelsReady": ("False", "Pulling", "m"),
                                                  "Available": ("False", "Pulling", "m"),
                                                  "Progressing": ("True", "Pulling", "m"),
                                                  "Autoscaling": ("False", "AutoscalerUnavailable", "a"),
                                                  "Ready": ("False", "Pulling", "m")}, 1, "T")
    assert [(t.type, t.reason) for t in status.events(transitions)] == [
        ("Ready", "Pulling"), ("Autoscaling", "AutoscalerUnavailable")]
    assert status.events(transitions)[1].event_type == "Warning"
    sub_only = [status.Transition("ModelsReady", "True", "Pulled", "m")]
    assert status.events(sub_only) == sub_only


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
    target = resource.model_dest(spec, "target")
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
    {"storage": {"mode": "pvc", "storageClassName": "fast"}, "replicas": 3, "gpu": {"count": 1, "products": ["A"]},
     "autoscaling": {"maxReplicas": 3, "target": {"runningRequests": 8}}},
    {"storage": {"mode": "existingClaim", "claimName": "mine"}, "server": {"apiKeySecretRef": {"name": "k"}}},
    {"storage": {"mode": "emptyDir"}, "gpu": {"count": 0}, "draft": {"model": {"uri": "pvc://w/d"}}},
], ids=["pvc", "existingClaim", "emptyDir"])
def test_children_validate_against_the_kubernetes_schemas(spec):
    import kubernetes_validate

    for child in render.render(cr(spec), autoscaler="HPA").all():
        if child["apiVersion"] != "monitoring.coreos.com/v1":
            kubernetes_validate.validate(child, "1.30.0", strict=True)


def test_pull_progress_shows_in_the_models_condition():
    download = {"target": {"bytesDone": 12_000_000_000, "bytesTotal": 54_000_000_000, "done": False},
                "draft": {"bytesDone": 3_000_000_000, "done": True}}
    fields, conditions = status.compute(cr(), status.Observed(job=job(None), download=download))
    assert conditions["ModelsReady"][2].endswith(": target 12.0/54.0 GB, draft done")
    assert fields["download"] == download
