"""Pure rendering: a DDTreeDeployment object in, the manifests of the objects it owns out.

Nothing here talks to the API server, so every storage mode and option is unit-testable and the
reconciler can apply the result idempotently (server-side apply) as often as it likes.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

Manifest = dict[str, Any]

GROUP = "ddtree.io"
VERSION = "v1alpha1"
KIND = "DDTreeDeployment"
DEFAULT_IMAGE = "ghcr.io/ddtree/ddtree-server:0.1.0"
MODELS_DIR = "/models"
DRAFT_VOCAB_DIR = "/etc/ddtree/draft-vocab"
PVC_SOURCES_DIR = "/mnt/pvc"  # where pvc:// source claims are mounted; `ddtree pull` resolves them here
RUN_AS = 1000
PROBE_PERIOD = 10
TARGET_TOKEN_ENV = "DDTREE_TARGET_HF_TOKEN"
DRAFT_TOKEN_ENV = "DDTREE_DRAFT_HF_TOKEN"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_OWNER = "ddtree.io/deployment"
LABEL_PULL_JOB = "ddtree.io/pull-job"
LABEL_PULL_IDENTITY = "ddtree.io/pull-identity"
LABEL_PULL_ATTEMPT = "ddtree.io/pull-attempt"
LABEL_MODELS_CLAIM = "ddtree.io/models-claim"  # every pod that mounts a ReadWriteOnce models claim
ANNOTATION_RETRY_PULL = "ddtree.io/retry-pull"  # any new value re-runs a failed (or finished) pull now
ANNOTATION_TARGET = "ddtree.io/target"  # on server pods: what they serve (status.servingModel)
ANNOTATION_DRAFT = "ddtree.io/draft"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
GIB = 1024**3
# Autoscaling targets (spec.autoscaling.target keys) and the server gauges they read, per replica.
AUTOSCALING_METRICS = {"waitingRequests": "vllm:num_requests_waiting",
                       "runningRequests": "vllm:num_requests_running",
                       "tokensPerSecond": "ddtree_generation_tokens_per_second"}


@dataclass(frozen=True)
class Children:
    """Everything one DDTreeDeployment owns; None where the spec does not call for that object."""

    service: Manifest
    deployment: Manifest
    pvc: Manifest | None
    pull_job: Manifest | None
    monitor: Manifest | None
    pdb: Manifest | None
    autoscaler: Manifest | None = None

    def all(self) -> list[Manifest]:
        """The objects to apply, in dependency order (storage before its users)."""
        return [m for m in (self.pvc, self.pull_job, self.service, self.deployment, self.monitor, self.pdb,
                            self.autoscaler) if m]


def labels(name: str, component: str) -> dict[str, str]:
    """Labels on every child: the selector labels plus ownership and component markers."""
    return {"app.kubernetes.io/name": "ddtree", LABEL_INSTANCE: name, LABEL_COMPONENT: component,
            "app.kubernetes.io/managed-by": "ddtree-operator", LABEL_OWNER: name}


def selector(name: str) -> dict[str, str]:
    """The server pods' selector (kept small: a Deployment selector is immutable)."""
    return {"app.kubernetes.io/name": "ddtree", LABEL_INSTANCE: name, LABEL_COMPONENT: "server"}


def selector_string(name: str) -> str:
    """The selector as the scale subresource wants it (`status.selector`)."""
    return ",".join(f"{k}={v}" for k, v in selector(name).items())


def url(body: Manifest) -> str:
    """The in-cluster base URL of the OpenAI API."""
    meta = body["metadata"]
    return f"http://{meta['name']}.{meta['namespace']}.svc:{_server(body['spec'])['port']}/v1"


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:10]


def _model(spec: Manifest, role: str) -> Manifest:
    return spec[role]["model"]


def model_dest(spec: Manifest, role: str) -> str:
    """Where a model lands on the models volume; keyed by URI and revision so a model change never
    overwrites the directory a running server reads."""
    m = _model(spec, role)
    return f"{MODELS_DIR}/{role}-{_digest(m['uri'], m.get('revision', ''))}"


def pvc_name(body: Manifest) -> str:
    """The models claim: ours in pvc mode, the user's in existingClaim mode."""
    storage = _storage(body["spec"])
    if storage["mode"] == "existingClaim":
        return storage["claimName"]
    return f"{body['metadata']['name']}-models"


def _storage(spec: Manifest) -> Manifest:
    s = spec.get("storage", {})
    return {"mode": s.get("mode", "pvc"), "size": s.get("size", "100Gi"),
            "accessModes": s.get("accessModes", ["ReadWriteOnce"]), "claimName": s.get("claimName"),
            "storageClassName": s.get("storageClassName"), "pullTimeoutSeconds": s.get("pullTimeoutSeconds", 14400)}


def pulls_in_job(spec: Manifest) -> bool:
    """pvc and existingClaim modes fill the claim with a pull Job; emptyDir pods pull for themselves."""
    return _storage(spec)["mode"] != "emptyDir"


def single_node_volume(spec: Manifest) -> bool:
    """Whether the models claim can be mounted on one node at a time (ReadWriteOnce without a shared mode).

    Then every pod that mounts it (the pull Job's and the servers') is kept on one node: a re-pull while the
    old servers run, and a surge pod of a rollout, never need a second attachment from another node.
    """
    shared = {"ReadWriteMany", "ReadOnlyMany"} & set(_storage(spec)["accessModes"])
    return pulls_in_job(spec) and not shared


def _server(spec: Manifest) -> Manifest:
    s = spec.get("server", {})
    return {"port": s.get("port", 8000), "servedModelName": s.get("servedModelName"),
            "apiKeySecretRef": s.get("apiKeySecretRef"), "maxQueue": s.get("maxQueue", 256),
            "startupTimeoutSeconds": s.get("startupTimeoutSeconds", 1800),
            "drainSeconds": s.get("drainSeconds", 15),
            "terminationGracePeriodSeconds": s.get("terminationGracePeriodSeconds", 60),
            "shmSize": s.get("shmSize", "16Gi"), "extraArgs": s.get("extraArgs", []), "env": s.get("env", [])}


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
    name = _server(spec)["servedModelName"]
    return name or _model(spec, "target")["uri"].rstrip("/").rsplit("/", 1)[-1]


def _meta(body: Manifest, name: str, component: str) -> Manifest:
    meta = body["metadata"]
    owner = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"], "uid": meta["uid"],
             "controller": True, "blockOwnerDeletion": True}
    return {"name": name, "namespace": meta["namespace"], "labels": labels(meta["name"], component),
            "ownerReferences": [owner]}


def _pvc_sources(spec: Manifest) -> list[str]:
    """Claims named by pvc:// model URIs; mounted read-only wherever models are read."""
    claims = []
    for role in ("target", "draft"):
        uri = _model(spec, role)["uri"]
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
        ref = _model(spec, role).get("secretRef")
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
                 _pull_uri(_model(spec, "target")), model_dest(spec, "target"),
                 _pull_uri(_model(spec, "draft")), model_dest(spec, "draft"),
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
    storage = _storage(body["spec"])
    if storage["mode"] == "emptyDir":
        return {"name": "models", "emptyDir": {"sizeLimit": storage["size"]}}
    return {"name": "models", "persistentVolumeClaim": {"claimName": pvc_name(body)}}


def render_pvc(body: Manifest) -> Manifest | None:
    """Our models claim in pvc mode; nothing in the other modes."""
    storage = _storage(body["spec"])
    if storage["mode"] != "pvc":
        return None
    spec: Manifest = {"accessModes": storage["accessModes"], "resources": {"requests": {"storage": storage["size"]}}}
    if storage["storageClassName"]:
        spec["storageClassName"] = storage["storageClassName"]
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(body, pvc_name(body), "models"),
            "spec": spec}


def pull_identity(body: Manifest) -> str:
    """What a pull fetches, and where: the models (URI, revision, token reference), the claim, and the
    retry-pull annotation. Nothing else (image, placement, replicas) may start a new pull."""
    spec = body["spec"]
    parts = []
    for role in ("target", "draft"):
        model = _model(spec, role)
        ref = model.get("secretRef") or {}
        parts += [_pull_uri(model), ref.get("name", ""), ref.get("key", "")]
    retry = (body["metadata"].get("annotations") or {}).get(ANNOTATION_RETRY_PULL, "")
    return _digest(*parts, pvc_name(body), retry)


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
    meta = _meta(body, name, "pull")
    meta["labels"].update({LABEL_PULL_IDENTITY: pull_identity(body), LABEL_PULL_ATTEMPT: str(attempt)})
    pod_labels = {**meta["labels"], LABEL_PULL_JOB: name, **_claim_label(body)}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"backoffLimit": 3, "activeDeadlineSeconds": _storage(spec)["pullTimeoutSeconds"],
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
    server = _server(spec)
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
    server = _server(spec)
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
    return _server(spec)["startupTimeoutSeconds"] + 600


def model_annotations(spec: Manifest) -> dict[str, str]:
    """What a server pod serves, on the pod (read back into status.servingModel during a model change)."""
    return {ANNOTATION_TARGET: _pull_uri(_model(spec, "target")), ANNOTATION_DRAFT: _pull_uri(_model(spec, "draft"))}


def render_deployment(body: Manifest, image: str, model_bytes: int | None = None) -> Manifest:
    """The server Deployment: GPU placement, probes sized from the startup timeout, graceful drain,
    non-root with a read-only root filesystem."""
    spec = body["spec"]
    name = body["metadata"]["name"]
    server = _server(spec)
    storage_mode = _storage(spec)["mode"]
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
        pod_spec["initContainers"] = [pull_container(spec, image, timeout=_storage(spec)["pullTimeoutSeconds"])]
    meta = _meta(body, name, "server")
    template_meta = {"labels": {**meta["labels"], **_claim_label(body)}, "annotations": model_annotations(spec)}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": spec.get("replicas", 1), "selector": {"matchLabels": selector(name)},
                     "strategy": rollout_strategy(spec), "progressDeadlineSeconds": progress_deadline(spec),
                     "template": {"metadata": template_meta, "spec": pod_spec}}}


def render_service(body: Manifest) -> Manifest:
    """A ClusterIP Service in front of the server pods; the status URL points at it."""
    name = body["metadata"]["name"]
    port = _server(body["spec"])["port"]
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(body, name, "server"),
            "spec": {"type": "ClusterIP", "selector": selector(name),
                     "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]}}


def render_monitor(body: Manifest) -> Manifest | None:
    """A Prometheus Operator ServiceMonitor or PodMonitor for /metrics, when monitoring is enabled."""
    monitoring = body["spec"].get("monitoring", {})
    if not monitoring.get("enabled", False):
        return None
    name = body["metadata"]["name"]
    kind = monitoring.get("kind", "ServiceMonitor")
    meta = _meta(body, name, "server")
    meta["labels"].update(monitoring.get("labels", {}))
    # Dashboards select deployments by this label, whichever monitor kind scraped them.
    relabel = {"sourceLabels": ["__meta_kubernetes_pod_label_ddtree_io_deployment"], "targetLabel": "ddtree_deployment"}
    endpoint = {"port": "http", "path": "/metrics", "interval": monitoring.get("interval", "15s"),
                "relabelings": [relabel]}
    endpoints_key = "endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"
    return {"apiVersion": "monitoring.coreos.com/v1", "kind": kind, "metadata": meta,
            "spec": {"selector": {"matchLabels": selector(name)}, endpoints_key: [endpoint]}}


def render_pdb(body: Manifest) -> Manifest | None:
    """Keep all but one replica through voluntary disruptions; pointless (and blocking) for one replica."""
    if body["spec"].get("replicas", 1) <= 1:
        return None
    name = body["metadata"]["name"]
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(body, name, "server"),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector(name)}}}


def autoscaling_target(spec: Manifest) -> tuple[str, str, int]:
    """(target key, the server gauge it reads, the per-replica target value) of spec.autoscaling."""
    key, value = next(iter(spec["autoscaling"]["target"].items()))
    return key, AUTOSCALING_METRICS[key], value


def _scale_target(body: Manifest) -> Manifest:
    """Autoscalers scale the DDTreeDeployment through its scale subresource, never its Deployment, so the
    operator and the autoscaler do not fight over spec.replicas."""
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": body["metadata"]["name"]}


def prometheus_query(body: Manifest) -> str:
    """The sum over the server pods of the autoscaling gauge (KEDA divides it by the target per replica)."""
    meta = body["metadata"]
    _, metric, _ = autoscaling_target(body["spec"])
    return f'sum({metric}{{namespace="{meta["namespace"]}", ddtree_deployment="{meta["name"]}"}})'


def render_scaled_object(body: Manifest, prometheus_address: str) -> Manifest:
    """A KEDA ScaledObject: a Prometheus trigger on the serving gauge; minReplicas 0 scales to zero."""
    scaling = body["spec"]["autoscaling"]
    _, _, target = autoscaling_target(body["spec"])
    name = body["metadata"]["name"]
    delay = scaling.get("scaleDownDelaySeconds", 300)
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": _meta(body, name, "autoscaler"),
            "spec": {"scaleTargetRef": _scale_target(body),
                     "minReplicaCount": scaling.get("minReplicas", 1), "maxReplicaCount": scaling["maxReplicas"],
                     "pollingInterval": 15, "cooldownPeriod": delay,
                     "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                         "scaleDown": {"stabilizationWindowSeconds": delay}}}},
                     "triggers": [{"type": "prometheus", "metadata": {
                         "serverAddress": prometheus_address, "query": prometheus_query(body),
                         "threshold": str(target), "activationThreshold": "0", "ignoreNullValues": "true"}}]}}


def render_hpa(body: Manifest) -> Manifest:
    """A HorizontalPodAutoscaler on the same gauge, per pod, through the custom metrics API (for example
    prometheus-adapter). An HPA cannot scale to zero: minReplicas 0 becomes 1."""
    scaling = body["spec"]["autoscaling"]
    _, metric, target = autoscaling_target(body["spec"])
    name = body["metadata"]["name"]
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
            "metadata": _meta(body, name, "autoscaler"),
            "spec": {"scaleTargetRef": _scale_target(body), "minReplicas": max(1, scaling.get("minReplicas", 1)),
                     "maxReplicas": scaling["maxReplicas"],
                     "metrics": [{"type": "Pods", "pods": {"metric": {"name": metric},
                                                           "target": {"type": "AverageValue",
                                                                      "averageValue": str(target)}}}],
                     "behavior": {"scaleDown": {"stabilizationWindowSeconds":
                                                scaling.get("scaleDownDelaySeconds", 300)}}}}


def render(body: Manifest, default_image: str = DEFAULT_IMAGE, *, pull_attempt: int = 0,
           model_bytes: int | None = None, autoscaler: str | None = None, prometheus_address: str = "") -> Children:
    """All children of one DDTreeDeployment (the object must carry metadata.uid and namespace).

    What the cluster decides is passed in: the pull attempt, the pulled models' size (for the memory
    request) and the autoscaler available (`KEDA`, `HPA` or None) with KEDA's Prometheus address.
    """
    image = body["spec"].get("image") or default_image
    scaler = None
    if body["spec"].get("autoscaling") and autoscaler == "KEDA":
        scaler = render_scaled_object(body, prometheus_address)
    elif body["spec"].get("autoscaling") and autoscaler == "HPA":
        scaler = render_hpa(body)
    return Children(service=render_service(body), deployment=render_deployment(body, image, model_bytes),
                    pvc=render_pvc(body), pull_job=render_pull_job(body, image, pull_attempt),
                    monitor=render_monitor(body), pdb=render_pdb(body), autoscaler=scaler)
