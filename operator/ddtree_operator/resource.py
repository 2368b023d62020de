"""The DDTreeDeployment as every renderer and the reconciler read it: its API coordinates, the labels and
annotations that tie children to it, its spec sections with the CRD's defaults, and the names derived from it.

The bottom of the rendering modules (`workload`, `fleet`, `render` import it; it imports none of them), so a
label or a default is spelled once for the objects that carry it and the code that selects them.
"""

from __future__ import annotations

import hashlib
from typing import Any

Manifest = dict[str, Any]

GROUP = "ddtree.io"
VERSION = "v1alpha1"
KIND = "DDTreeDeployment"
DEFAULT_IMAGE = "ghcr.io/ddtree/ddtree-server:0.1.0"
MODELS_DIR = "/models"
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
    return f"http://{meta['name']}.{meta['namespace']}.svc:{server_settings(body['spec'])['port']}/v1"


def digest(*parts: str) -> str:
    """A short stable hash of `parts`: names that change exactly when what they identify does."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:10]


def model_source(spec: Manifest, role: str) -> Manifest:
    """spec.<role>.model (`target` or `draft`): the URI, revision and token reference pulled and served."""
    return spec[role]["model"]


def model_dest(spec: Manifest, role: str) -> str:
    """Where a model lands on the models volume; keyed by URI and revision so a model change never
    overwrites the directory a running server reads."""
    m = model_source(spec, role)
    return f"{MODELS_DIR}/{role}-{digest(m['uri'], m.get('revision', ''))}"


def pvc_name(body: Manifest) -> str:
    """The models claim: ours in pvc mode, the user's in existingClaim mode."""
    storage = storage_settings(body["spec"])
    if storage["mode"] == "existingClaim":
        return storage["claimName"]
    return f"{body['metadata']['name']}-models"


def storage_settings(spec: Manifest) -> Manifest:
    """spec.storage with the CRD's defaults, so an object read without them renders the same."""
    s = spec.get("storage", {})
    return {"mode": s.get("mode", "pvc"), "size": s.get("size", "100Gi"),
            "accessModes": s.get("accessModes", ["ReadWriteOnce"]), "claimName": s.get("claimName"),
            "storageClassName": s.get("storageClassName"), "pullTimeoutSeconds": s.get("pullTimeoutSeconds", 14400)}


def pulls_in_job(spec: Manifest) -> bool:
    """pvc and existingClaim modes fill the claim with a pull Job; emptyDir pods pull for themselves."""
    return storage_settings(spec)["mode"] != "emptyDir"


def single_node_volume(spec: Manifest) -> bool:
    """Whether the models claim can be mounted on one node at a time (ReadWriteOnce without a shared mode).

    Then every pod that mounts it (the pull Job's and the servers') is kept on one node: a re-pull while the
    old servers run, and a surge pod of a rollout, never need a second attachment from another node.
    """
    shared = {"ReadWriteMany", "ReadOnlyMany"} & set(storage_settings(spec)["accessModes"])
    return pulls_in_job(spec) and not shared


def server_settings(spec: Manifest) -> Manifest:
    """spec.server with the CRD's defaults, so an object read without them renders the same."""
    s = spec.get("server", {})
    return {"port": s.get("port", 8000), "servedModelName": s.get("servedModelName"),
            "apiKeySecretRef": s.get("apiKeySecretRef"), "maxQueue": s.get("maxQueue", 256),
            "startupTimeoutSeconds": s.get("startupTimeoutSeconds", 1800),
            "drainSeconds": s.get("drainSeconds", 15),
            "terminationGracePeriodSeconds": s.get("terminationGracePeriodSeconds", 60),
            "shmSize": s.get("shmSize", "16Gi"), "extraArgs": s.get("extraArgs", []), "env": s.get("env", [])}


def child_meta(body: Manifest, name: str, component: str) -> Manifest:
    """A child's metadata: our labels and a controller owner reference, so it is garbage-collected with us."""
    meta = body["metadata"]
    owner = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": meta["name"], "uid": meta["uid"],
             "controller": True, "blockOwnerDeletion": True}
    return {"name": name, "namespace": meta["namespace"], "labels": labels(meta["name"], component),
            "ownerReferences": [owner]}
