"""Admission: what the API server refuses at `kubectl apply`, with a message a person understands, and what it
accepts. The pass-through Kubernetes fields carry the upstream schemas (operator/crd/generate.py)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from k8s_testing import DDT
from kubernetes.client import ApiException
from test_cluster import SPEC, create, patch

pytestmark = pytest.mark.cluster


def create_strictly(cluster, ns: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """A server-side dry-run create with strict field validation, as kubectl sends it."""
    res = cluster.dynamic.resources.get(api_version=DDT[0], kind=DDT[1])
    body = {"apiVersion": DDT[0], "kind": DDT[1], "metadata": {"name": name, "namespace": ns}, "spec": spec}
    return res.create(body=body, namespace=ns,
                      query_params=[("dryRun", "All"), ("fieldValidation", "Strict")]).to_dict()


@pytest.mark.parametrize(("change", "message"), [
    ({"target": {"model": {"uri": "s3://bucket/model"}}}, "uri must be hf://org/name, pvc://claim/path"),
    ({"draft": {"model": {"uri": "/x", "revision": "main"}}}, "revision only applies to hf:// models"),
    ({"decoding": {"method": "beam"}}, 'Unsupported value: "beam"'),
    ({"decoding": {"temperature": 3}}, "should be less than or equal to 2"),
    ({"decoding": {"generationConfig": "hf"}}, 'Unsupported value: "hf"'),
    ({"server": {"extraArgs": ["--generation-config=none"]}}, "must not set flags that have spec fields"),
    ({"storage": {"mode": "existingClaim"}}, "storage.claimName is required when storage.mode is existingClaim"),
    ({"gpu": {"count": 0, "products": ["NVIDIA-H100"]}}, "gpu.products needs gpu.count > 0"),
    ({"server": {"extraArgs": ["--port=9000"]}}, "server.extraArgs must not set flags that have spec fields"),
    ({"server": {"extraArgs": ["--fast"]}}, "server.extraArgs must not set flags that have spec fields"),
    ({"server": {"extraArgs": ["--no-fast"]}}, "server.extraArgs must not set flags that have spec fields"),
    ({"decoding": {"fastPath": "yes"}}, "must be of type boolean"),
    ({"decoding": {"thinking": "off"}}, "must be of type boolean"),
    ({"decoding": {"draftVocab": {"configMapRef": {"name": "hot", "key": "../x"}}}}, "should match"),
    ({"decoding": {"draftVocab": {}}}, "configMapRef: Required value"),
    ({"server": {"extraArgs": ["--draft-vocab=/x.json"]}}, "server.extraArgs must not set flags that have spec fields"),
    ({"decoding": {"draftQuantization": "int4"}}, 'Unsupported value: "int4"'),
    ({"server": {"extraArgs": ["--draft-quantization", "fp8"]}},
     "server.extraArgs must not set flags that have spec fields"),
    ({"server": {"extraArgs": ["--default-chat-template-kwargs={}"]}},
     "server.extraArgs must not set flags that have spec fields"),
    ({"server": {"drainSeconds": 90}}, "must be greater than server.drainSeconds"),
    ({"server": {"batching": {"maxNumSeqs": 256, "maxNumBatchedTokens": 128}}},
     "server.batching.maxNumBatchedTokens must be at least server.batching.maxNumSeqs"),
    ({"server": {"batching": {"maxNumSeqs": 4096}}},  # above the default 2048 tokens a step
     "server.batching.maxNumBatchedTokens must be at least server.batching.maxNumSeqs"),
    ({"server": {"batching": {"maxNumSeqs": 0}}}, "spec.server.batching.maxNumSeqs in body should be greater than or"),
    ({"server": {"batching": {"gpuMemoryUtilization": 0}}},
     "spec.server.batching.gpuMemoryUtilization in body should be greater than 0"),
    ({"server": {"batching": {"gpuMemoryUtilization": 1.5}}},
     "spec.server.batching.gpuMemoryUtilization in body should be less than or equal to 1"),
    ({"server": {"batching": {"blockSize": 12}}}, "spec.server.batching.blockSize: Unsupported value: 12"),
    ({"server": {"batching": {"batchBudget": "auto"}}}, "must be of type boolean"),
    ({"server": {"batching": {"enablePrefixCaching": "yes"}}}, "must be of type boolean"),
    ({"target": {"model": {"uri": "hf://Qwen/Qwen3-8B"}, "quantization": "int4"}},
     'spec.target.quantization: Unsupported value: "int4"'),
    ({"server": {"extraArgs": ["--max-num-seqs=8"]}}, "server.extraArgs must not set flags that have spec fields"),
    ({"server": {"extraArgs": ["--gpu-memory-utilization", "0.5"]}},
     "server.extraArgs must not set flags that have spec fields"),
    ({"server": {"extraArgs": ["--no-batch-budget"]}}, "server.extraArgs must not set flags that have spec fields"),
    ({"server": {"extraArgs": ["--quantization=fp8"]}}, "server.extraArgs must not set flags that have spec fields"),
    ({"autoscaling": {"maxReplicas": 4, "target": {"runningRequests": 64}}},  # maxNumSeqs' default
     "autoscaling.target.runningRequests must be below server.batching.maxNumSeqs"),
    ({"replicas": -1}, "should be greater than or equal to 0"),
    # What reached the silent apply-failure path before: now refused at admission, with Kubernetes' own schemas.
    ({"resources": {"requests": {"memory": "lots"}}}, "should match '^(\\+|-)?"),
    ({"resources": {"claims": [{"name": "gpu"}]}}, 'unknown field "spec.resources.claims"'),
    ({"tolerations": [{"key": "gpu", "operator": "Sometimes"}]}, 'Unsupported value: "Sometimes"'),
    ({"tolerations": [{"key": "gpu", "operator": "Exists", "effect": "Never"}]}, 'Unsupported value: "Never"'),
    ({"nodeSelector": {"gpu!": "yes"}}, "nodeSelector keys must be label keys"),
    ({"nodeSelector": {"pool": "a b"}}, "spec.nodeSelector.pool: Invalid value"),
    ({"priorityClassName": "high!"}, "spec.priorityClassName: Invalid value"),
    ({"gpu": {"runtimeClassName": "nvidia!"}}, "spec.gpu.runtimeClassName: Invalid value"),
    ({"storage": {"storageClassName": "fast!"}}, "spec.storage.storageClassName: Invalid value"),
    ({"server": {"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s"}}}]}},
     "spec.server.env[0].valueFrom.secretKeyRef.key: Required value"),
    ({"server": {"env": [{"name": "A", "valueFrom": {}}]}}, "valueFrom takes exactly one of"),
    ({"server": {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]}},
     "an env entry takes value or valueFrom, not both"),
    ({"server": {"env": [{"name": "A", "valueFrom": "secret"}]}}, "must be of type object"),
    ({"gpu": {"products": ["NVIDIA H100 80GB HBM3"]}}, "spec.gpu.products[0]: Invalid value"),
    ({"target": {"model": {"uri": "/models/../etc/passwd"}}}, "uri must not contain '..' path segments"),
    ({"draft": {"model": {"uri": "pvc://weights/../other"}}}, "uri must not contain '..' path segments"),
    ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": "x"}}}},
     "must be of type array"),
    ({"monitoring": {"labels": {"a b": "c"}}}, "monitoring.labels keys must be label keys"),
    ({"imagePullSecrets": [{"name": "Registry_Key"}]}, "spec.imagePullSecrets[0].name: Invalid value"),
    ({"target": {"model": {"uri": "hf://Qwen/Qwen3-8B", "secretRef": {"name": "HF Token"}}}},
     "spec.target.model.secretRef.name: Invalid value"),
    # What the operator cannot do (yet) or would do badly: refused with the reason.
    ({"gpu": {"count": 2}}, "gpu.count > 1 is refused until ddtree serve has tensor parallelism"),
    ({"storage": {"accessModes": ["ReadWriteOncePod"]}}, "ReadWriteOncePod lets one pod mount the models volume"),
    ({"storage": {"pullTimeoutSeconds": 10}}, "should be greater than or equal to 60"),
    ({"rollout": {"maxSurge": 0, "maxUnavailable": "0%"}},
     "rollout.maxSurge and rollout.maxUnavailable cannot both be 0"),
    ({"autoscaling": {"maxReplicas": 4, "target": {"waitingRequests": 4}}, "monitoring": {"enabled": False}},
     "autoscaling reads the servers' metrics from Prometheus; set monitoring.enabled to true"),
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 4, "target": {"waitingRequests": 4}}},
     "autoscaling.minReplicas must not exceed autoscaling.maxReplicas"),
    ({"autoscaling": {"maxReplicas": 4, "target": {"waitingRequests": 4, "runningRequests": 8}}},
     "autoscaling.target takes exactly one of waitingRequests, runningRequests or tokensPerSecond"),
    ({"autoscaling": {"maxReplicas": 4, "target": {}}}, "autoscaling.target takes exactly one of"),
    ({"autoscaling": {"maxReplicas": 4, "target": {"tokensPerSecond": 100},
                      "prometheusAddress": "prometheus:9090"}}, "spec.autoscaling.prometheusAddress: Invalid value"),
])
def test_invalid_specs_are_rejected(cluster, crd, namespace, change, message):
    spec = copy.deepcopy(SPEC)
    for key, value in change.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    with pytest.raises(ApiException) as err:
        create_strictly(cluster, namespace, "bad", spec)
    assert err.value.status in (400, 422)  # 400: an unknown field under kubectl's strict field validation
    assert message in json.loads(err.value.body)["message"]


@pytest.mark.parametrize(("name", "message"), [
    ("n" * 41, "metadata.name must be at most 40 characters"),
    ("qwen3.6-27b", "metadata.name must be a DNS-1035 label"),  # the Service could not be created
    ("7b", "metadata.name must be a DNS-1035 label"),
])
def test_names_that_cannot_name_the_children_are_rejected(cluster, crd, namespace, name, message):
    with pytest.raises(ApiException) as err:
        create(cluster, namespace, name, SPEC)
    assert message in json.loads(err.value.body)["message"]


def test_the_kubernetes_fields_accept_what_kubernetes_accepts(cluster, crd, namespace):
    spec = {**copy.deepcopy(SPEC),
            "resources": {"requests": {"cpu": "500m", "memory": "64Gi", "ephemeral-storage": 1e10},
                          "limits": {"memory": "96Gi"}},
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"},
                            {"operator": "Exists"}],
            "nodeSelector": {"topology.kubernetes.io/zone": "us-east-1a", "pool": ""},
            "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 50, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                                   "labelSelector": {"matchLabels": {"app": "x"}}}}]}},
            "priorityClassName": "system-cluster-critical.ml",
            "rollout": {"maxSurge": "25%", "maxUnavailable": 0},
            "imagePullSecrets": [{"name": "registry"}],
            "monitoring": {"enabled": True, "labels": {"release": "kps", "example.com/team": "ml"}},
            "autoscaling": {"minReplicas": 0, "maxReplicas": 8, "target": {"tokensPerSecond": 2500}}}
    spec["server"] = {**spec["server"], "env": [
        {"name": "NCCL_DEBUG", "value": "WARN"},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "tok", "key": "t", "optional": True}}}]}
    spec["server"] = {**spec["server"], "batching": {"maxNumSeqs": 256, "maxNumBatchedTokens": 8192,
                                                     "gpuMemoryUtilization": 1, "blockSize": 128, "batchBudget": False,
                                                     "enablePrefixCaching": False}}
    spec["target"] = {**spec["target"], "quantization": "fp8"}
    created = create_strictly(cluster, namespace, "good", spec)
    assert created["spec"]["autoscaling"]["scaleDownDelaySeconds"] == 300  # defaulted
    assert created["spec"]["rollout"] == {"maxSurge": "25%", "maxUnavailable": 0}
    assert created["spec"]["storage"]["pullTimeoutSeconds"] == 14400
    assert created["spec"]["resources"]["requests"]["ephemeral-storage"] == 1e10
    assert created["spec"]["server"]["batching"]["gpuMemoryUtilization"] == 1  # the whole GPU is allowed


def test_batching_defaults_are_the_servers(cluster, crd, namespace):
    created = create_strictly(cluster, namespace, "defaults", copy.deepcopy(SPEC))
    assert created["spec"]["server"]["batching"] == {"maxNumSeqs": 64, "maxNumBatchedTokens": 2048,
                                                     "gpuMemoryUtilization": 0.9, "blockSize": 16, "batchBudget": True,
                                                     "enablePrefixCaching": True}
    assert created["spec"]["target"]["quantization"] == "none"


@pytest.mark.parametrize(("storage", "message"), [
    ({"mode": "emptyDir"}, "storage.mode cannot change"),
    ({"storageClassName": "other"}, "storageClassName and storage.accessModes of a PVC cannot change"),
    ({"size": "50Gi"}, "storage.size of a PVC can only grow"),
])
def test_storage_changes_a_pvc_cannot_take_are_rejected(cluster, crd, namespace, storage, message):
    create(cluster, namespace, "s", {**SPEC, "storage": {"mode": "pvc", "size": "100Gi"}})
    patch(cluster, *DDT, namespace, "s", {"spec": {"storage": {"size": "200Gi"}}})  # growing is fine
    with pytest.raises(ApiException) as err:
        patch(cluster, *DDT, namespace, "s", {"spec": {"storage": storage}})
    assert message in json.loads(err.value.body)["message"]
