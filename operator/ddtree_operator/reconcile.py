"""One level-based reconcile: render, apply (server-side), prune, observe. Safe to run any number of times."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from typing import Any

from kubernetes import client
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

from ddtree_operator import render
from ddtree_operator.status import Observed

Manifest = dict[str, Any]
FIELD_MANAGER = "ddtree-operator"
log = logging.getLogger(__name__)

# Kinds that may be left over from an earlier spec and are deleted when no longer rendered.
PRUNABLE = (("batch/v1", "Job"), ("policy/v1", "PodDisruptionBudget"),
            ("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PodMonitor"))


class Cluster:
    """The few API calls the reconciler needs, on dicts, through the dynamic client."""

    def __init__(self, api_client: client.ApiClient) -> None:
        self.api_client = api_client
        # A private discovery cache file: a shared one is corrupted by concurrent writers.
        cache = os.path.join(tempfile.gettempdir(), f"ddtree-discovery-{os.getpid()}-{id(self)}.json")
        self.dynamic = DynamicClient(api_client, cache_file=cache)

    def _resource(self, api_version: str, kind: str):
        return self.dynamic.resources.get(api_version=api_version, kind=kind)

    def apply(self, manifest: Manifest) -> Manifest:
        """Server-side apply with force: the operator owns every field it renders."""
        res = self._resource(manifest["apiVersion"], manifest["kind"])
        meta = manifest["metadata"]
        return res.server_side_apply(body=manifest, name=meta["name"], namespace=meta["namespace"],
                                     field_manager=FIELD_MANAGER, force_conflicts=True).to_dict()

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        try:
            return self._resource(api_version, kind).get(name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None

    def list(self, api_version: str, kind: str, namespace: str, label_selector: str) -> list[Manifest]:
        items = self._resource(api_version, kind).get(namespace=namespace, label_selector=label_selector)
        return [i.to_dict() for i in items.items]

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        with contextlib.suppress(NotFoundError):
            self._resource(api_version, kind).delete(name=name, namespace=namespace,
                                                     body={"propagationPolicy": "Background"})

    def pod_log_tail(self, namespace: str, pod: str, container: str, lines: int = 40) -> str:
        return client.CoreV1Api(self.api_client).read_namespaced_pod_log(
            pod, namespace, container=container, tail_lines=lines)


def _owned_by(obj: Manifest, uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or [])


def download_progress(cluster: Cluster, body: Manifest, job: Manifest) -> Manifest | None:
    """Byte progress of the pull, from the last JSON lines `ddtree pull --progress json` printed.

    Best effort: without a kubelet (or before the pod starts) there is no log, and that is not an error.
    """
    ns = body["metadata"]["namespace"]
    pods = cluster.list("v1", "Pod", ns, f"ddtree.io/pull-job={job['metadata']['name']}")
    if not pods:
        return None
    newest = max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "")
    try:
        text = cluster.pod_log_tail(ns, newest["metadata"]["name"], "pull")
    except client.ApiException:
        return None
    return parse_progress(text, body["spec"])


def parse_progress(text: str, spec: Manifest) -> Manifest | None:
    """Latest progress per model from `ddtree pull --progress json` output, keyed target/draft."""
    roles = {render.model_dest(spec, role): role for role in ("target", "draft")}
    out: Manifest = {}
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        role = roles.get(record.get("dest")) if isinstance(record, dict) else None
        if role:
            out[role] = {k: record[k] for k in ("bytesDone", "bytesTotal", "speedBytesPerSecond",
                                                 "remainingSeconds", "done") if record.get(k) is not None}
    return out or None


def reconcile(cluster: Cluster, body: Manifest, default_image: str) -> tuple[Observed, str | None]:
    """Bring the children in line with the spec; returns what was observed and, when monitoring is on but
    cannot be set up, why (worth a Warning event, not a failure)."""
    meta = body["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
    children = render.render(body, default_image)
    monitoring_error = None

    if children.pvc:
        cluster.apply(children.pvc)
    job = cluster.apply(children.pull_job) if children.pull_job else None
    models_ready = job is None or any(
        c.get("type") == "Complete" and c.get("status") == "True"
        for c in (job.get("status") or {}).get("conditions") or [])

    cluster.apply(children.service)
    deployment = cluster.get("apps/v1", "Deployment", ns, name)
    if models_ready:
        deployment = cluster.apply(children.deployment)
    # else: gate the server on the pull; a Deployment of the previous models keeps serving meanwhile.
    if children.pdb:
        cluster.apply(children.pdb)
    if children.monitor:
        try:
            cluster.apply(children.monitor)
        except ResourceNotFoundError:
            monitoring_error = (f"monitoring is enabled but the {children.monitor['kind']} CRD (Prometheus "
                                "Operator) is not installed")

    keep = {(m["kind"], m["metadata"]["name"]) for m in children.all()}
    for api_version, kind in PRUNABLE:
        try:
            existing = cluster.list(api_version, kind, ns, f"{render.LABEL_OWNER}={name}")
        except ResourceNotFoundError:
            continue
        for obj in existing:
            if (kind, obj["metadata"]["name"]) not in keep and _owned_by(obj, uid):
                log.info("deleting %s %s/%s: no longer in the spec", kind, ns, obj["metadata"]["name"])
                cluster.delete(api_version, kind, ns, obj["metadata"]["name"])

    pods = tuple(cluster.list("v1", "Pod", ns, render.selector_string(name))) if deployment else ()
    download = download_progress(cluster, body, job) if job and not models_ready else None
    return Observed(job=job, deployment=deployment, pods=pods, download=download), monitoring_error
