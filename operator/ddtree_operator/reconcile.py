"""One level-based reconcile: render, check ownership, apply (server-side), prune, observe. Safe to run any
number of times; everything it decides is derived from the cluster, not remembered."""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import tempfile
import time
from typing import Any

from kubernetes import client
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

from ddtree_operator import fleet, render, resource, workload
from ddtree_operator.status import Condition, Observed, job_condition, parse_time

Manifest = dict[str, Any]
FIELD_MANAGER = "ddtree-operator"
log = logging.getLogger(__name__)

KEDA_API = "keda.sh/v1alpha1"
CUSTOM_METRICS_API = "custom.metrics.k8s.io"
# Kinds that may be left over from an earlier spec and are deleted when no longer rendered.
PRUNABLE = (("batch/v1", "Job"), ("policy/v1", "PodDisruptionBudget"),
            ("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PodMonitor"),
            ("autoscaling/v2", "HorizontalPodAutoscaler"), (KEDA_API, "ScaledObject"))
# A failed pull Job is re-run after 1, 2, 4 ... minutes, at most every 30 minutes.
PULL_RETRY_FIRST_SECONDS = 60
PULL_RETRY_MAX_SECONDS = 1800


class Cluster:
    """The few API calls the reconciler needs, on dicts, through the dynamic client."""

    def __init__(self, api_client: client.ApiClient, discovery_ttl: float = 30) -> None:
        self.api_client = api_client
        # A private discovery cache file: a shared one is corrupted by concurrent writers.
        cache = os.path.join(tempfile.gettempdir(), f"ddtree-discovery-{os.getpid()}-{id(self)}.json")
        self.dynamic = DynamicClient(api_client, cache_file=cache)
        self.discovery_ttl = discovery_ttl
        self._apis: dict[str, tuple[float, bool]] = {}

    def _resource(self, api_version: str, kind: str):
        return self.dynamic.resources.get(api_version=api_version, kind=kind)

    def apply(self, manifest: Manifest, uid: str | None = None) -> Manifest:
        """Server-side apply with force: the operator owns every field it renders. `uid`: the object the
        caller checked is ours; the apply fails if it was replaced meanwhile."""
        res = self._resource(manifest["apiVersion"], manifest["kind"])
        meta = manifest["metadata"]
        body = {**manifest, "metadata": {**meta, "uid": uid}} if uid else manifest
        try:
            return res.server_side_apply(body=body, name=meta["name"], namespace=meta["namespace"],
                                         field_manager=FIELD_MANAGER, force_conflicts=True).to_dict()
        except NotFoundError:
            if uid:
                raise
            # An apply creates a missing object, so the kind is what is missing: its CRD was removed after
            # discovery was cached. Forget the cache, so that a reinstalled CRD is found again.
            self.dynamic.resources.invalidate_cache()
            raise ResourceNotFoundError(f"{manifest['apiVersion']} {manifest['kind']} is not served") from None

    def create(self, manifest: Manifest) -> Manifest:
        """Create, failing (409) if the name is taken: for objects the operator never changes."""
        res = self._resource(manifest["apiVersion"], manifest["kind"])
        return res.create(body=manifest, namespace=manifest["metadata"]["namespace"],
                          field_manager=FIELD_MANAGER).to_dict()

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

    def patch_status(self, obj: Manifest, fields: Manifest) -> None:
        """Merge `fields` into the object's status (its status subresource); nothing when it is gone."""
        meta = obj["metadata"]
        with contextlib.suppress(NotFoundError):
            self._resource(obj["apiVersion"], obj["kind"]).subresources["status"].patch(
                name=meta["name"], namespace=meta["namespace"], body={"status": fields},
                content_type="application/merge-patch+json")

    def pod_log_tail(self, namespace: str, pod: str, container: str, lines: int = 40) -> str:
        return client.CoreV1Api(self.api_client).read_namespaced_pod_log(
            pod, namespace, container=container, tail_lines=lines)

    def api_available(self, group_version: str) -> bool:
        """Whether the API server serves a group (or group/version); rechecked every `discovery_ttl` seconds
        so that installing KEDA or a metrics adapter later is noticed."""
        now = time.monotonic()
        cached = self._apis.get(group_version)
        if cached and now - cached[0] < self.discovery_ttl:
            return cached[1]
        api = self.api_client
        try:
            response = api.call_api(*api.param_serialize(method="GET", resource_path=f"/apis/{group_version}",
                                                         auth_settings=["BearerToken"]), _request_timeout=10)
            response.read()
            available = response.status == 200
        except client.ApiException as err:
            if err.status not in (403, 404, 503):
                raise
            available = False
        self._apis[group_version] = (now, available)
        return available


def owned_by(obj: Manifest, uid: str) -> bool:
    """Ours: the object's controller reference is this DDTreeDeployment (what garbage collection follows)."""
    return any(ref.get("uid") == uid and ref.get("controller")
               for ref in obj["metadata"].get("ownerReferences") or [])


def api_message(err: client.ApiException) -> str:
    """The API server's own sentence for a rejected request."""
    try:
        return json.loads(err.body)["message"]
    except (TypeError, ValueError, KeyError):
        return f"{err.status} {err.reason}"


def download_progress(cluster: Cluster, body: Manifest, pod: Manifest | None) -> Manifest | None:
    """Byte progress of the pull, from the last JSON lines `ddtree pull --progress json` printed.

    Best effort: without a kubelet (or before the pod starts) there is no log, and that is not an error.
    """
    if pod is None:
        return None
    try:
        text = cluster.pod_log_tail(body["metadata"]["namespace"], pod["metadata"]["name"], "pull")
    except client.ApiException:
        return None
    return parse_progress(text, body["spec"])


def parse_progress(text: str, spec: Manifest) -> Manifest | None:
    """Latest progress per model from `ddtree pull --progress json` output, keyed target/draft."""
    roles = {resource.model_dest(spec, role): role for role in ("target", "draft")}
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


def pulled_bytes(download: Manifest | None) -> int:
    """Bytes on the models volume after a finished pull (0 when unknown: linked models, no log)."""
    return sum(max(p.get("bytesDone", 0), p.get("bytesTotal", 0)) for p in (download or {}).values()
               if p.get("done"))


def pull_retry_delay(attempt: int) -> int:
    """Seconds before re-running a pull whose attempt `attempt` (0-based) failed."""
    return min(PULL_RETRY_FIRST_SECONDS * 2**attempt, PULL_RETRY_MAX_SECONDS)


def _attempt(job: Manifest) -> int:
    return int(job["metadata"].get("labels", {}).get(resource.LABEL_PULL_ATTEMPT, "0"))


def _newest(pods: list[Manifest]) -> Manifest | None:
    return max(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", default=None)


def pull_error(cluster: Cluster, namespace: str, pods: list[Manifest]) -> str | None:
    """The failed pull pod's own last words: its termination message (the log tail, kept by
    FallbackToLogsOnError), else the log, else its exit code."""
    for pod in sorted(pods, key=lambda p: p["metadata"].get("creationTimestamp") or "", reverse=True):
        for s in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (s.get("state") or {}).get("terminated") or (s.get("lastState") or {}).get("terminated")
            if not terminated or terminated.get("exitCode", 0) == 0:
                continue
            text = terminated.get("message") or ""
            if not text:
                with contextlib.suppress(client.ApiException):
                    text = cluster.pod_log_tail(namespace, pod["metadata"]["name"], s["name"], lines=20)
            line = last_error_line(text)
            return line or f"exit code {terminated['exitCode']} ({terminated.get('reason', 'Error')})"
    return None


def last_error_line(text: str) -> str | None:
    """The last line of a log that is not a JSON progress record."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line and not line.startswith("{"):
            return line
    return None


def choose_autoscaler(cluster: Cluster, body: Manifest, prometheus_address: str) -> tuple[
        str | None, str, tuple[str, str, str] | None]:
    """(KEDA | HPA | None, KEDA's Prometheus address, the Autoscaling condition) for spec.autoscaling."""
    scaling = body["spec"].get("autoscaling")
    if not scaling:
        return None, "", None
    name = body["metadata"]["name"]
    _, metric, target = fleet.autoscaling_target(body["spec"])
    what = (f"{scaling.get('minReplicas', 1)}-{scaling['maxReplicas']} replicas on {metric} "
            f"(target {target} per replica)")
    address = scaling.get("prometheusAddress") or prometheus_address
    keda = cluster.api_available(KEDA_API)
    if keda and address:
        return "KEDA", address, ("True", "KEDA", f"KEDA ScaledObject {name} scales {what} from {address}")
    no_address = ("KEDA is installed but has no Prometheus address to query: set spec.autoscaling.prometheusAddress "
                  "or the operator's --prometheus-address")
    if cluster.api_available(CUSTOM_METRICS_API):
        notes = [no_address] if keda else []
        if scaling.get("minReplicas", 1) == 0:
            notes.append("an HPA keeps at least 1 replica; scaling to zero needs KEDA")
        note = f" ({'; '.join(notes)})" if notes else ""
        return "HPA", "", ("True", "HPA", f"HorizontalPodAutoscaler {name} scales {what} through the custom "
                                          f"metrics API{note}")
    if keda:
        return None, "", ("False", "PrometheusAddressMissing", f"{no_address}: replicas stay at spec.replicas")
    return None, "", ("False", "AutoscalerUnavailable",
                      "neither KEDA (keda.sh/v1alpha1) nor a custom metrics API (custom.metrics.k8s.io, e.g. "
                      "prometheus-adapter) is installed: replicas stay at spec.replicas")


def reconcile(cluster: Cluster, body: Manifest, default_image: str, prometheus_address: str = "",
              now: datetime.datetime | None = None) -> Observed:
    """Bring the children in line with the spec and return what was observed. Objects of the children's
    names that this DDTreeDeployment does not own are never changed: the reconcile stops at a NameConflict."""
    meta = body["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
    now = now or datetime.datetime.now(datetime.UTC)
    previous = body.get("status") or {}
    autoscaler, address, autoscaling = choose_autoscaler(cluster, body, prometheus_address)

    # The pull: the newest attempt for what the spec asks to fetch, re-run after a backoff when it failed.
    job, attempt, retry_at = None, 0, None
    if resource.pulls_in_job(body["spec"]):
        selector = f"{resource.LABEL_OWNER}={name},{resource.LABEL_PULL_IDENTITY}={workload.pull_identity(body)}"
        jobs = [j for j in cluster.list("batch/v1", "Job", ns, selector) if owned_by(j, uid)]
        job = max(jobs, key=_attempt, default=None)
        attempt = _attempt(job) if job else 0
        failed = job_condition(job, "Failed")
        if failed:
            retry_at = parse_time(failed.get("lastTransitionTime")) + datetime.timedelta(
                seconds=pull_retry_delay(attempt))
            if now >= retry_at:
                job, attempt, retry_at = None, attempt + 1, None
    models_ready = job is not None and job_condition(job, "Complete") is not None

    pods = cluster.list("v1", "Pod", ns, f"{resource.LABEL_OWNER}={name}")
    pull_pods = [p for p in pods if job and p["metadata"].get("labels", {}).get(resource.LABEL_PULL_JOB)
                 == job["metadata"]["name"]]
    server_pods = tuple(p for p in pods if p["metadata"].get("labels", {}).get(resource.LABEL_COMPONENT) == "server")
    pulled = previous.get("pulled")
    if models_ready and (pulled or {}).get("job") != job["metadata"]["name"]:
        pulled = {"job": job["metadata"]["name"],
                  "bytes": pulled_bytes(download_progress(cluster, body, _newest(pull_pods)))}
    children = render.render(body, default_image, pull_attempt=attempt,
                             model_bytes=(pulled or {}).get("bytes") or None, autoscaler=autoscaler,
                             prometheus_address=address)

    # Ownership first: a foreign object of a child's name is reported, never adopted or changed.
    existing: dict[tuple[str, str], Manifest] = {}
    for child in children.all():
        if child is children.pull_job and job is not None:
            continue
        try:
            found = cluster.get(child["apiVersion"], child["kind"], ns, child["metadata"]["name"])
        except ResourceNotFoundError:
            found = None  # the kind's API is not installed: the apply below reports it
        if found and not owned_by(found, uid):
            conflict = (f"{child['kind']} {child['metadata']['name']} already exists and is not owned by this "
                        "DDTreeDeployment: delete or rename it, or give the DDTreeDeployment another name")
            deployment = existing.get(("Deployment", name)) or _owned(cluster, "apps/v1", "Deployment", ns, name, uid)
            return Observed(job=job, deployment=deployment, pods=server_pods, conflict=conflict,
                            autoscaling=autoscaling, pulled=pulled)
        if found:
            existing[(child["kind"], child["metadata"]["name"])] = found

    apply_errors: list[str] = []
    monitoring: Condition | None = None

    def apply(child: Manifest) -> Manifest | None:
        nonlocal monitoring
        key = (child["kind"], child["metadata"]["name"])
        try:
            return cluster.apply(child, uid=existing[key]["metadata"]["uid"] if key in existing else None)
        except ResourceNotFoundError:
            if child is children.monitor:
                monitoring = ("False", "MonitorUnavailable",
                              f"monitoring is enabled but the {child['kind']} CRD (Prometheus Operator) is not "
                              "installed: nothing scrapes the servers' /metrics")
            else:
                apply_errors.append(f"{child['kind']} {key[1]}: the {child['apiVersion']} API is not installed")
        except client.ApiException as err:
            log.warning("%s %s/%s rejected: %s", child["kind"], ns, key[1], api_message(err))
            apply_errors.append(f"{child['kind']} {key[1]}: {api_message(err)}")
            if child is children.monitor:
                monitoring = ("False", "ApplyFailed", apply_errors[-1])
        return None

    if children.pvc:
        apply(children.pvc)
    if children.pull_job and job is None:
        try:
            job = cluster.create(children.pull_job)
        except client.ApiException as err:
            if err.status != 409:  # 409: created meanwhile (by us: the next pass sees it)
                apply_errors.append(f"Job {children.pull_job['metadata']['name']}: {api_message(err)}")
    apply(children.service)
    deployment = existing.get(("Deployment", name))
    if models_ready or children.pull_job is None:
        deployment = apply(children.deployment) or deployment
    # else: gate the server on the pull; a Deployment of the previous models keeps serving meanwhile.
    for child in (children.pdb, children.monitor, children.autoscaler):
        if child and apply(child) and child is children.monitor:
            monitoring = ("True", child["kind"], f"{child['kind']} {name} exposes the servers' /metrics to a "
                                                 "Prometheus that selects it (monitoring.labels)")

    keep = {(m["kind"], m["metadata"]["name"]) for m in children.all()}
    for api_version, kind in PRUNABLE:
        try:
            leftovers = cluster.list(api_version, kind, ns, f"{resource.LABEL_OWNER}={name}")
        except (ResourceNotFoundError, NotFoundError):
            continue
        for obj in leftovers:
            if (kind, obj["metadata"]["name"]) not in keep and owned_by(obj, uid):
                log.info("deleting %s %s/%s: no longer in the spec", kind, ns, obj["metadata"]["name"])
                cluster.delete(api_version, kind, ns, obj["metadata"]["name"])

    download = None
    if job is not None and not models_ready:
        download = download_progress(cluster, body, _newest(pull_pods))
    error = pull_error(cluster, ns, pull_pods) if job_condition(job, "Failed") else None
    return Observed(job=job, deployment=deployment, pods=server_pods, pull_pods=tuple(pull_pods),
                    download=download, apply_errors=tuple(apply_errors), monitoring=monitoring,
                    autoscaling=autoscaling, pull_attempt=attempt, pull_retry_at=retry_at, pull_error=error,
                    pulled=pulled)


def _owned(cluster: Cluster, api_version: str, kind: str, ns: str, name: str, uid: str) -> Manifest | None:
    found = cluster.get(api_version, kind, ns, name)
    return found if found and owned_by(found, uid) else None
