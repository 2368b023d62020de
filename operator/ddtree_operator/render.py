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


@dataclass(frozen=True)
class Children:
    """Everything one DDTreeDeployment owns; None where the spec does not call for that object."""

    service: Manifest
    deployment: Manifest
    pvc: Manifest | None
    pull_job: Manifest | None
    monitor: Manifest | None
    pdb: Manifest | None

    def all(self) -> list[Manifest]:
        """The objects to apply, in dependency order (storage before its users)."""
        return [m for m in (self.pvc, self.pull_job, self.service, self.deployment, self.monitor, self.pdb) if m]


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
            "storageClassName": s.get("storageClassName")}


def _server(spec: Manifest) -> Manifest:
    s = spec.get("server", {})
    return {"port": s.get("port", 8000), "servedModelName": s.get("servedModelName"),
            "apiKeySecretRef": s.get("apiKeySecretRef"), "maxQueue": s.get("maxQueue", 256),
            "startupTimeoutSeconds": s.get("startupTimeoutSeconds", 1800),
            "drainSeconds": s.get("drainSeconds", 15),
            "terminationGracePeriodSeconds": s.get("terminationGracePeriodSeconds", 60),
            "shmSize": s.get("shmSize", "16Gi"), "extraArgs": s.get("extraArgs", []), "env": s.get("env", [])}


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


def pull_container(spec: Manifest, image: str) -> Manifest:
    """`ddtree pull` for target and draft in one process (concurrently), printing JSON progress lines
    that the operator reads back from the pod log."""
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
                 "--token-env", TARGET_TOKEN_ENV, "--token-env", DRAFT_TOKEN_ENV, "--progress", "json"],
        "env": env,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
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


def render_pull_job(body: Manifest, image: str) -> Manifest | None:
    """The Job that fills the models claim once; emptyDir mode pulls in each pod instead."""
    spec = body["spec"]
    if _storage(spec)["mode"] == "emptyDir":
        return None
    source_volumes, _ = _source_volumes(spec)
    pod_spec: Manifest = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "securityContext": _pod_security(),
        "containers": [pull_container(spec, image)],
        "volumes": [_models_volume(body), {"name": "tmp", "emptyDir": {}}, *source_volumes],
        **_placement(spec, gpu=False),
    }
    # A Job's pod template is immutable: name the Job after it, so a model (or image...) change is a new
    # Job, i.e. a re-pull, and an unchanged spec is the same Job.
    name = f"{body['metadata']['name']}-pull-{_digest(json.dumps(pod_spec, sort_keys=True))}"
    meta = _meta(body, name, "pull")
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"backoffLimit": 3,
                     "template": {"metadata": {"labels": {**meta["labels"], "ddtree.io/pull-job": name}},
                                  "spec": pod_spec}}}


def _placement(spec: Manifest, gpu: bool) -> Manifest:
    """Scheduling fields passed through from the spec; GPU pods also get the product affinity."""
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
        if g["runtimeClassName"]:
            out["runtimeClassName"] = g["runtimeClassName"]
    if tolerations:
        out["tolerations"] = tolerations
    if affinity:
        out["affinity"] = affinity
    if spec.get("priorityClassName"):
        out["priorityClassName"] = spec["priorityClassName"]
    if spec.get("imagePullSecrets"):
        out["imagePullSecrets"] = spec["imagePullSecrets"]
    return out


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
    args = ["serve", "--target", model_dest(spec, "target"), "--draft", model_dest(spec, "draft"),
            "--host", "0.0.0.0", "--port", str(server["port"]),
            "--served-model-name", served_model_name(spec),
            "--method", decoding.get("method", "ddtree"), "--budget", str(decoding.get("budget", 32)),
            "--max-queue", str(server["maxQueue"]), "--drain-timeout", str(drain_timeout(spec))]
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
    if _gpu(spec)["count"] > 0:  # explicit both ways (the server's default depends on what it finds)
        args.append("--fast" if decoding.get("fastPath", True) else "--no-fast")
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


def _server_resources(spec: Manifest) -> Manifest:
    resources = {k: dict(v) for k, v in spec.get("resources", {}).items() if k in ("requests", "limits")}
    g = _gpu(spec)
    if g["count"] > 0:
        for kind in ("requests", "limits"):
            resources.setdefault(kind, {})[g["resourceName"]] = str(g["count"])
    return resources


def render_deployment(body: Manifest, image: str) -> Manifest:
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
        "startupProbe": {"httpGet": http, "periodSeconds": PROBE_PERIOD, "timeoutSeconds": 5,
                         "failureThreshold": math.ceil(server["startupTimeoutSeconds"] / PROBE_PERIOD)},
        "readinessProbe": {"httpGet": http, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                          "timeoutSeconds": 5, "failureThreshold": 3},
        "securityContext": _container_security(),
        "volumeMounts": [{"name": "models", "mountPath": MODELS_DIR, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}, {"name": "tmp", "mountPath": "/tmp"},
                         {"name": "cache", "mountPath": "/cache"}, *source_mounts, *vocab_mounts],
    }
    resources = _server_resources(spec)
    if resources:
        container["resources"] = resources
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
        **_placement(spec, gpu=True),
    }
    if storage_mode == "emptyDir":
        pod_spec["initContainers"] = [pull_container(spec, image)]
    scarce = _gpu(spec)["count"] > 0  # no spare GPU for a surge pod: replace in place
    strategy = {"type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 0 if scarce else 1, "maxUnavailable": 1}}
    meta = _meta(body, name, "server")
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
            "spec": {"replicas": spec.get("replicas", 1), "selector": {"matchLabels": selector(name)},
                     "strategy": strategy,
                     "template": {"metadata": {"labels": meta["labels"]}, "spec": pod_spec}}}


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


def render(body: Manifest, default_image: str = DEFAULT_IMAGE) -> Children:
    """All children of one DDTreeDeployment (the object must carry metadata.uid and namespace)."""
    image = body["spec"].get("image") or default_image
    return Children(service=render_service(body), deployment=render_deployment(body, image),
                    pvc=render_pvc(body), pull_job=render_pull_job(body, image),
                    monitor=render_monitor(body), pdb=render_pdb(body))
