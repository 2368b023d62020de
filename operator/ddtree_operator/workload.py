"""Pure rendering of the objects that run pods: the models claim, the pull Job and the server Deployment.

Everything about those pods lives here (the `ddtree pull` and `ddtree serve` command lines, volumes, security,
placement, resources, probes), so the Job and the Deployment place and secure their pods the same way.
"""

from __future__ import annotations

import json
import math

from ddtree_operator.resource import (
    ANNOTATION_DRAFT,
    ANNOTATION_RETRY_PULL,
    ANNOTATION_TARGET,
    LABEL_MODELS_CLAIM,
    LABEL_PULL_ATTEMPT,
    LABEL_PULL_IDENTITY,
    LABEL_PULL_JOB,
    MODELS_DIR,
    Manifest,
    child_meta,
    digest,
    model_dest,
    model_source,
    pulls_in_job,
    pvc_name,
    selector,
    server_settings,
    single_node_volume,
    storage_settings,
)

DRAFT_VOCAB_DIR = "/etc/ddtree/draft-vocab"
PVC_SOURCES_DIR = "/mnt/pvc"  # where pvc:// source claims are mounted; `ddtree pull` resolves them here
RUN_AS = 1000
PROBE_PERIOD = 10
TARGET_TOKEN_ENV = "DDTREE_TARGET_HF_TOKEN"
DRAFT_TOKEN_ENV = "DDTREE_DRAFT_HF_TOKEN"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
GIB = 1024**3


def _batching(spec: Manifest) -> Manifest:
    """server.batching with the CRD's defaults (the server's own), so an object read without them renders the same."""
    b = spec.get("server", {}).get("batching", {})
    return {"maxNumSeqs": b.get("maxNumSeqs", 64), "maxNumBatchedTokens": b.get("maxNumBatchedTokens", 2048),
            "gpuMemoryUtilization": b.get("gpuMemoryUtilization", 0.9), "blockSize": b.get("blockSize", 16),
            "batchBudget": b.get("batchBudget", True), "enablePrefixCaching": b.get("enablePrefixCaching", True)}


def _gpu(spec: Manifest) -> Manifest:
    g = spec.get("gpu", {})
    return {"count": g.get("count", 1), "products": g.get("products", []),
            "resourceName": g.get("resourceName", "nvidia.com/gpu"), "runtimeClassName": g.get("runtimeClassName")}


def served_model_name(spec: Manifest) -> str:
    """What clients put in `model`: explicit, else the last part of the target URI."""
    name = server_settings(spec)["servedModelName"]
    return name or model_source(spec, "target")["uri"].rstrip("/").rsplit("/", 1)[-1]


def _pvc_sources(spec: Manifest) -> list[str]:
    """Claims named by pvc:// model URIs; mounted read-only wherever models are read."""
    claims = []
    for role in ("target", "draft"):
        uri = model_source(spec, role)["uri"]
        if uri.startswith("pvc://"):
            claim = uri[len("pvc://"):].split("/", 1)[0]
            if claim not in claims:
                claims.append(claim)
    return claims


def _source_volumes(spec: Manifest) -> tuple[list[Manifest], list[Manifest]]:
    volumes, mounts = [], []
    for i, claim in enumerate(_pvc_sources(spec)):
        volumes.append({"name": f"source-{i}", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": f"source-{i}", "mountPath": f"{PVC_SOURCES_DIR}/{claim}", "readOnly": True})
    return volumes, mounts


def _pod_security() -> Manifest:
    return {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
            "seccompProfile": {"type": "RuntimeDefault"}}


def _container_security() -> Manifest:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def _pull_uri(model: Manifest) -> str:
    revision = model.get("revision")
    return f"{model['uri']}@{revision}" if revision else model["uri"]


def pull_container(spec: Manifest, image: str, timeout: int | None = None) -> Manifest:
    """`ddtree pull` for target and draft in one process (concurrently), printing JSON progress lines
    that the operator reads back from the pod log; `timeout`: seconds after which it gives up (exit 2)."""
    env: list[Manifest] = [{"name": "HOME", "value": "/tmp"},
                           {"name": "HF_HOME", "value": f"{MODELS_DIR}/.cache/huggingface"},
                           {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"}]
    for role, var in (("target", TARGET_TOKEN_ENV), ("draft", DRAFT_TOKEN_ENV)):
        ref = model_source(spec, role).get("secretRef")
        if ref:
            env.append({"name": var, "valueFrom": {"secretKeyRef": {"name": ref["name"],
                                                                    "key": ref.get("key", "HF_TOKEN")}}})
    _, source_mounts = _source_volumes(spec)
    return {
        "name": "pull",
        "image": image,
        **_pull_policy(spec),
        "command": ["ddtree"],
        "args": ["pull",
                 _pull_uri(model_source(spec, "target")), model_dest(spec, "target"),
                 _pull_uri(model_source(spec, "draft")), model_dest(spec, "draft"),
                 "--token-env", TARGET_TOKEN_ENV, "--token-env", DRAFT_TOKEN_ENV, "--progress", "json",
                 *(["--timeout", str(timeout)] if timeout else [])],
        "env": env,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        # A failed pull's last log lines (its one-line error) become the termination message: PullFailed shows it.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
        "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR}, {"name": "tmp", "mountPath": "/tmp"},
                         *source_mounts],
    }


def _pull_policy(spec: Manifest) -> Manifest:
    return {"imagePullPolicy": spec["imagePullPolicy"]} if spec.get("imagePullPolicy") else {}


def _models_volume(body: Manifest) -> Manifest:
    storage = storage_settings(body["spec"])
    if storage["mode"] == "emptyDir":
        return {"name": "models", "emptyDir": {"sizeLimit": storage["size"]}}
    return {"name": "models", "persistentVolumeClaim": {"claimName": pvc_name(body)}}


def render_pvc(body: Manifest) -> Manifest | None:
    """Our models claim in pvc mode; nothing in the other modes."""
    storage = storage_settings(body["spec"])
    if storage["mode"] != "pvc":
        return None
    spec: Manifest = {"accessModes": storage["accessModes"], "resources": {"requests": {"storage": storage["size"]}}}
    if storage["storageClassName"]:
        spec["storageClassName"] = storage["storageClassName"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": child_meta(body, pvc_name(body), "models"),
            "spec": spec}


def pull_identity(body: Manifest) -> str:
    """What a pull fetches, and where: the models (URI, revision, token reference), the claim, and the
    retry-pull annotation. Nothing else (image, placement, replicas) may start a new pull."""
    spec = body["spec"]
    parts = []
    for role in ("target", "draft"):
        model = model_source(spec, role)
        ref = model.get("secretRef") or {}
        parts += [_pull_uri(model), ref.get("name", ""), ref.get("key", "")]
    retry = (body["metadata"].get("annotations") or {}).get(ANNOTATION_RETRY_PULL, "")
    return digest(*parts, pvc_name(body), retry)


def pull_job_name(body: Manifest, attempt: int = 0) -> str:
    """`<name>-pull-<identity>`, with `-<attempt>` for automatic retries (at most 40 + 20 characters)."""
    base = f"{body['metadata']['name']}-pull-{pull_identity(body)}"
    return f"{base}-{attempt}" if attempt else base


def render_pull_job(body: Manifest, image: str, attempt: int = 0) -> Manifest | None:
    """The Job that fills the models claim once; emptyDir mode pulls in each pod instead.

    Its name is its identity (`pull_identity`) and attempt: the operator creates it once and never changes
    it (a Job's pod template is immutable), so a new server image or node selector does not re-pull.
    """
    spec = body["spec"]
    if not pulls_in_job(spec):
        return None
    source_volumes, _ = _source_volumes(spec)
    pod_spec: Manifest = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(),
        "containers": [pull_container(spec, image)],
        "volumes": [_models_volume(body), {"name": "tmp", "emptyDir": {}}, *source_volumes],
        # A single-node volume binds where its first user runs (WaitForFirstConsumer, local volumes): pull
        # where the servers can run, i.e. with their GPU product affinity, and next to them.
        **_placement(body, gpu=single_node_volume(spec), gpu_resources=False),
    }
    name = pull_job_name(body, attempt)
    meta = child_meta(body, name, "pull")
    meta["labels"].update({LABEL_PULL_IDENTITY: pull_identity(body), LABEL_PULL_ATTEMPT: str(attempt)})
    pod_labels = {**meta["labels"], LABEL_PULL_JOB: name, **_claim_label(body)}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"backoffLimit": 3, "activeDeadlineSeconds": storage_settings(spec)["pullTimeoutSeconds"],
                     "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec}}}


def _claim_label(body: Manifest) -> dict[str, str]:
    """The co-location label of pods that mount a single-node models claim (none otherwise)."""
    return {LABEL_MODELS_CLAIM: pvc_name(body)} if single_node_volume(body["spec"]) else {}


def _placement(body: Manifest, gpu: bool, gpu_resources: bool = True) -> Manifest:
    """Scheduling fields passed through from the spec; `gpu` adds the GPU product affinity and toleration
    (`gpu_resources`: and the runtime class of pods that use the GPU), and pods of a single-node models
    claim get a required affinity to each other's node."""
    spec = body["spec"]
    out: Manifest = {}
    if spec.get("nodeSelector"):
        out["nodeSelector"] = spec["nodeSelector"]
    tolerations = list(spec.get("tolerations", []))
    affinity = spec.get("affinity")
    g = _gpu(spec)
    if gpu and g["count"] > 0:
        tolerations.append({"key": g["resourceName"], "operator": "Exists", "effect": "NoSchedule"})
        if g["products"]:
            affinity = _with_gpu_products(affinity, g["products"])
        if g["runtimeClassName"] and gpu_resources:
            out["runtimeClassName"] = g["runtimeClassName"]
    if claim := _claim_label(body):
        affinity = _with_colocation(affinity, claim)
    if tolerations:
        out["tolerations"] = tolerations
    if affinity:
        out["affinity"] = affinity
    if spec.get("priorityClassName"):
        out["priorityClassName"] = spec["priorityClassName"]
    if spec.get("imagePullSecrets"):
        out["imagePullSecrets"] = spec["imagePullSecrets"]
    return out


def _with_colocation(affinity: Manifest | None, claim_label: dict[str, str]) -> Manifest:
    """Require the node of the other pods that mount the claim. The first such pod may go anywhere (a pod
    matching its own affinity term is exempt while no other pod matches), later ones follow it."""
    term = {"labelSelector": {"matchLabels": claim_label}, "topologyKey": HOSTNAME_TOPOLOGY}
    affinity = dict(affinity or {})
    pod = dict(affinity.get("podAffinity", {}))
    pod["requiredDuringSchedulingIgnoredDuringExecution"] = [
        *pod.get("requiredDuringSchedulingIgnoredDuringExecution", []), term]
    affinity["podAffinity"] = pod
    return affinity


def _with_gpu_products(affinity: Manifest | None, products: list[str]) -> Manifest:
    """AND the product requirement into every required node selector term (terms are ORed)."""
    expr = {"key": "nvidia.com/gpu.product", "operator": "In", "values": list(products)}
    affinity = dict(affinity or {})
    node = dict(affinity.get("nodeAffinity", {}))
    required = dict(node.get("requiredDuringSchedulingIgnoredDuringExecution", {}))
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [
        {**t, "matchExpressions": [*t.get("matchExpressions", []), expr]} for t in terms]
    node["requiredDuringSchedulingIgnoredDuringExecution"] = required
    affinity["nodeAffinity"] = node
    return affinity


def server_args(spec: Manifest) -> list[str]:
    """The `ddtree serve` command line: the contract between the operator and the server."""
    server = server_settings(spec)
    decoding = spec.get("decoding", {})
    batching = _batching(spec)
    args = ["serve", "--target", model_dest(spec, "target"), "--draft", model_dest(spec, "draft"),
            "--host", "0.0.0.0", "--port", str(server["port"]),
            "--served-model-name", served_model_name(spec),
            "--method", decoding.get("method", "ddtree"), "--budget", str(decoding.get("budget", 32)),
            "--max-queue", str(server["maxQueue"]), "--drain-timeout", str(drain_timeout(spec)),
            "--max-num-seqs", str(batching["maxNumSeqs"]),
            "--max-num-batched-tokens", str(batching["maxNumBatchedTokens"]),
            "--block-size", str(batching["blockSize"])]
    if not batching["enablePrefixCaching"]:  # only off is passed: on is the server's default, and images that
        # predate the flag still start
        args += ["--no-enable-prefix-caching"]
    if spec["target"].get("quantization", "none") != "none":  # only fp8 is passed: none is the server's default
        # and images that predate --quantization still start
        args += ["--quantization", spec["target"]["quantization"]]
    if "temperature" in decoding:
        args += ["--default-temperature", str(decoding["temperature"])]
    if "generationConfig" in decoding:
        args += ["--generation-config", decoding["generationConfig"]]
    if vocab := draft_vocab_file(spec):
        args += ["--draft-vocab", vocab]
    if decoding.get("draftQuantization", "none") != "none":
        args += ["--draft-quantization", decoding["draftQuantization"]]
    if "thinking" in decoding:
        args += ["--default-chat-template-kwargs", json.dumps({"enable_thinking": decoding["thinking"]})]
    if _gpu(spec)["count"] > 0:  # GPU-only settings; the booleans explicit both ways (the server's defaults
        # depend on what it finds)
        args += ["--gpu-memory-utilization", str(batching["gpuMemoryUtilization"]),
                 "--batch-budget" if batching["batchBudget"] else "--no-batch-budget",
                 "--fast" if decoding.get("fastPath", True) else "--no-fast"]
    return args + list(server["extraArgs"])


def _draft_vocab_ref(spec: Manifest) -> tuple[str, str] | None:
    """decoding.draftVocab's ConfigMap (name, key), the key defaulted as the CRD does; None without one."""
    ref = spec.get("decoding", {}).get("draftVocab", {}).get("configMapRef")
    return (ref["name"], ref.get("key", "draft_vocab.json")) if ref else None


def draft_vocab_file(spec: Manifest) -> str | None:
    """Where the server finds the draft vocabulary of decoding.draftVocab (its ConfigMap's key, mounted)."""
    ref = _draft_vocab_ref(spec)
    return f"{DRAFT_VOCAB_DIR}/{ref[1]}" if ref else None


def _draft_vocab_volumes(spec: Manifest) -> tuple[list[Manifest], list[Manifest]]:
    """The ConfigMap of decoding.draftVocab as a read-only volume of the server (none without one)."""
    ref = _draft_vocab_ref(spec)
    if not ref:
        return [], []
    name, key = ref
    volume = {"name": "draft-vocab", "configMap": {"name": name, "items": [{"key": key, "path": key}]}}
    return [volume], [{"name": "draft-vocab", "mountPath": DRAFT_VOCAB_DIR, "readOnly": True}]


def drain_timeout(spec: Manifest) -> int:
    """What the grace period leaves the server after the preStop pause, with 5 s to spare for exit."""
    server = server_settings(spec)
    return max(1, server["terminationGracePeriodSeconds"] - server["drainSeconds"] - 5)


def default_memory_request(spec: Manifest, model_bytes: int | None) -> str:
    """Host memory for the server: the target loads into host memory before it moves to the GPU, so the
    weights (target + draft, as pulled) plus room for the runtime; a floor when their size is unknown."""
    gpu = _gpu(spec)["count"] > 0
    if model_bytes:
        return f"{math.ceil(model_bytes * 1.1 / GIB) + (4 if gpu else 1)}Gi"
    return "16Gi" if gpu else "2Gi"


def _server_resources(spec: Manifest, model_bytes: int | None) -> Manifest:
    """The spec's requests/limits, GPUs from gpu.count, and default CPU and memory requests where the spec
    sets neither a request nor a limit for them (so server pods are never BestEffort)."""
    resources = {k: dict(v) for k, v in spec.get("resources", {}).items() if k in ("requests", "limits")}
    g = _gpu(spec)
    defaults = {"cpu": "4" if g["count"] > 0 else "1", "memory": default_memory_request(spec, model_bytes)}
    for resource, amount in defaults.items():
        if resource not in resources.get("requests", {}) and resource not in resources.get("limits", {}):
            resources.setdefault("requests", {})[resource] = amount
    if g["count"] > 0:
        for kind in ("requests", "limits"):
            resources.setdefault(kind, {})[g["resourceName"]] = str(g["count"])
    return resources


def rollout_strategy(spec: Manifest) -> Manifest:
    """spec.rollout as a RollingUpdate: by default one extra pod loads the new spec while every old pod
    keeps serving (maxSurge 1, maxUnavailable 0); without a spare GPU set maxSurge 0, maxUnavailable 1."""
    rollout = spec.get("rollout", {})
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": rollout.get("maxSurge", 1),
                                                       "maxUnavailable": rollout.get("maxUnavailable", 0)}}


def progress_deadline(spec: Manifest) -> int:
    """A rollout may go without progress for a whole model load plus 10 minutes to schedule and pull the
    image, before the Deployment (kubectl rollout status, Argo CD) calls it failed."""
    return server_settings(spec)["startupTimeoutSeconds"] + 600


def model_annotations(spec: Manifest) -> dict[str, str]:
    """What a server pod serves, on the pod (read back into status.servingModel during a model change)."""
    return {ANNOTATION_TARGET: _pull_uri(model_source(spec, "target")),
            ANNOTATION_DRAFT: _pull_uri(model_source(spec, "draft"))}


def render_deployment(body: Manifest, image: str, model_bytes: int | None = None) -> Manifest:
    """The server Deployment: GPU placement, probes sized from the startup timeout, graceful drain,
    non-root with a read-only root filesystem."""
    spec = body["spec"]
    name = body["metadata"]["name"]
    server = server_settings(spec)
    storage_mode = storage_settings(spec)["mode"]
    source_volumes, source_mounts = _source_volumes(spec)
    vocab_volumes, vocab_mounts = _draft_vocab_volumes(spec)
    env: list[Manifest] = [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HUB_OFFLINE", "value": "1"},
                           {"name": "XDG_CACHE_HOME", "value": "/cache"},
                           {"name": "TRITON_CACHE_DIR", "value": "/cache/triton"},
                           {"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/cache/inductor"}]
    if server["apiKeySecretRef"]:
        ref = server["apiKeySecretRef"]
        env.append({"name": "DDTREE_API_KEY",
                    "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref.get("key", "api-key")}}})
    env += server["env"]
    http = {"path": "/ready", "port": "http"}
    container: Manifest = {
        "name": "server",
        "image": image,
        **_pull_policy(spec),
        "command": ["ddtree"],
        "args": server_args(spec),
        "ports": [{"name": "http", "containerPort": server["port"], "protocol": "TCP"}],
        "env": env,
        "resources": _server_resources(spec, model_bytes),
        "startupProbe": {"httpGet": http, "periodSeconds": PROBE_PERIOD, "timeoutSeconds": 5,
                         "failureThreshold": math.ceil(server["startupTimeoutSeconds"] / PROBE_PERIOD)},
        "readinessProbe": {"httpGet": http, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                          "timeoutSeconds": 5, "failureThreshold": 3},
        # A crash's last log lines become the termination message, which CrashLooping shows.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _container_security(),
        "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "cache", "mountPath": "/cache"}, *source_mounts, *vocab_mounts],
    }
    if server["drainSeconds"] > 0:
        # exec sleep rather than preStop.sleep: works on clusters older than 1.30 as well
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(server["drainSeconds"])]}}}
    pod_spec: Manifest = {
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": server["terminationGracePeriodSeconds"],
        "securityContext": _pod_security(),
        "containers": [container],
        "volumes": [_models_volume(body),
                    {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": server["shmSize"]}},
                    {"name": "tmp", "emptyDir": {}}, {"name": "cache", "emptyDir": {}}, *source_volumes,
                    *vocab_volumes],
        **_placement(body, gpu=True),
    }
    if storage_mode == "emptyDir":
        # No Job deadline here: the pull stops itself after pullTimeoutSeconds, and the kubelet restarts it.
        pod_spec["initContainers"] = [pull_container(spec, image, timeout=storage_settings(spec)["pullTimeoutSeconds"])]
    meta = child_meta(body, name, "server")
    template_meta = {"labels": {**meta["labels"], **_claim_label(body)}, "annotations": model_annotations(spec)}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": spec.get("replicas", 1), "selector": {"matchLabels": selector(name)},
                     "strategy": rollout_strategy(spec), "progressDeadlineSeconds": progress_deadline(spec),
                     "template": {"metadata": template_meta, "spec": pod_spec}}}
