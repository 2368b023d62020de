"""kopf handlers: every trigger (create, spec change, resume after a restart, a change of an owned Deployment,
Job or pod, periodic timer) runs the same level-based reconcile, so a missed event or an operator restart
loses nothing."""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from typing import Any

import kopf
import prometheus_client
from kubernetes import client, config

from ddtree_operator import __version__, resource, status
from ddtree_operator.reconcile import Cluster, reconcile

RESYNC_SECONDS = float(os.environ.get("DDTREE_OPERATOR_RESYNC_SECONDS", "15"))
RESOURCE = (resource.GROUP, resource.VERSION, "ddtreedeployments")
USER_AGENT = f"ddtree-operator/{__version__}"
# KEDA's Prometheus, for DDTreeDeployments whose spec.autoscaling names none (--prometheus-address).
PROMETHEUS_ADDRESS = os.environ.get("DDTREE_PROMETHEUS_ADDRESS", "")

RECONCILES = prometheus_client.Counter("ddtree_operator_reconciles", "Reconciles by trigger and result",
                                       ["trigger", "result"])
RECONCILE_SECONDS = prometheus_client.Histogram("ddtree_operator_reconcile_seconds", "Reconcile duration")
TRANSITIONS = prometheus_client.Counter("ddtree_operator_condition_transitions",
                                        "Condition changes by type and reason", ["type", "reason"])

_cluster: Cluster | None = None


def _api_client() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # read now, not at import
    api = client.ApiClient()
    api.user_agent = USER_AGENT  # audit logs (and the RBAC test) tell the operator's calls apart
    return api


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    """Own annotation/finalizer names, watch timeouts against stalled connections, metrics endpoint."""
    global _cluster
    settings.persistence.finalizer = f"{resource.GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=resource.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=resource.GROUP)
    settings.watching.server_timeout = int(os.environ.get("DDTREE_OPERATOR_WATCH_TIMEOUT", "240"))
    settings.watching.client_timeout = settings.watching.server_timeout + 30
    settings.watching.connect_timeout = 30
    settings.networking.request_timeout = 60
    # On deletion kopf waits for a running resync to finish: wait for it in place, re-check often (default 60 s).
    settings.background.instant_exit_timeout = 10
    settings.background.cancellation_polling = 2
    settings.posting.level = logging.WARNING  # our own Events carry the transitions; skip kopf's chatter
    # Namespace globs need kopf to watch Namespaces; exact namespaces do not (main.py decides).
    settings.scanning.disabled = os.environ.get("DDTREE_OPERATOR_SCANNING") == "off"
    _cluster = Cluster(_api_client(), discovery_ttl=max(RESYNC_SECONDS, 1))
    port = int(os.environ.get("DDTREE_OPERATOR_METRICS_PORT", "8081"))
    if port:
        prometheus_client.start_http_server(port)
        logger.info("metrics on :%d/metrics", port)


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """The pod's service account in a cluster, else $KUBECONFIG (read at login time, not import time)."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.probe(id="apiserver")
def apiserver_reachable(**_: Any) -> str:
    """Liveness: the API server answers us (kopf serves this on --liveness)."""
    assert _cluster is not None
    api = _cluster.api_client
    response = api.call_api(*api.param_serialize(method="GET", resource_path="/readyz",
                                                 auth_settings=["BearerToken"]), _request_timeout=5)
    response.read()
    if response.status != 200:
        raise kopf.TemporaryError(f"API server /readyz answered {response.status}", delay=5)
    return response.data.decode()


def _run(trigger: str, body: kopf.Body, memo: kopf.Memo, queued: threading.Semaphore | None = None) -> None:
    """Reconcile one object and write its status: serialized per object, so that Events are not doubled and
    status patches land in the order they were computed (they are sent here, not by kopf after the handler).
    `queued`: held by this pass until it starts; released then, so that later changes get a pass of their own."""
    with memo.setdefault("lock", threading.Lock()):  # memo is per object; setdefault is atomic
        if queued is not None:
            queued.release()
        assert _cluster is not None
        if body.metadata.get("deletionTimestamp"):
            return  # being deleted: garbage collection removes the children; do not re-create them
        started = time.monotonic()
        # The last written status wins over the (possibly older) snapshot this handler was given.
        current = {**dict(body.status), **memo.get("status", {})}
        manifest = {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": dict(body.metadata),
                    "spec": dict(body.spec), "status": current}
        try:
            seen = reconcile(_cluster, manifest, os.environ.get("DDTREE_SERVER_IMAGE", resource.DEFAULT_IMAGE),
                             PROMETHEUS_ADDRESS)
        except Exception:
            RECONCILES.labels(trigger, "error").inc()
            raise
        finally:
            RECONCILE_SECONDS.observe(time.monotonic() - started)
        RECONCILES.labels(trigger, "ok").inc()
        fields, conditions = status.compute(manifest, seen)
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        merged, transitions = status.merge_conditions(current.get("conditions") or [], conditions,
                                                      body.metadata.get("generation"), now)
        written = {**fields, "conditions": merged}
        changed = {key: value for key, value in written.items() if body.status.get(key) != value}
        if changed:
            _cluster.patch_status(manifest, changed)
        memo["status"] = written
        for t in transitions:
            TRANSITIONS.labels(t.type, t.reason).inc()
        for event in status.events(transitions):
            kopf.event(body, type=event.event_type, reason=event.reason,
                       message=f"{event.type}={event.status}: {event.message}")


@kopf.index(*RESOURCE)
def deployments_by_name(namespace: str, name: str, body: kopf.Body, memo: kopf.Memo,
                        **_: Any) -> dict[tuple[str, str], tuple[kopf.Body, kopf.Memo]]:
    """Each DDTreeDeployment's body (kopf keeps it current) and memo, for the events of the objects it owns."""
    return {(namespace, name): (body, memo)}


@kopf.on.resume(*RESOURCE, backoff=RESYNC_SECONDS)
@kopf.on.create(*RESOURCE, backoff=RESYNC_SECONDS)
@kopf.on.update(*RESOURCE, field="spec", backoff=RESYNC_SECONDS)
@kopf.on.update(*RESOURCE, field=("metadata", "annotations", resource.ANNOTATION_RETRY_PULL), backoff=RESYNC_SECONDS)
def on_change(body: kopf.Body, memo: kopf.Memo, reason: str, **_: Any) -> None:
    """React at once to creation, spec changes (rollout, re-pull), a retry-pull request and operator restarts."""
    _run(str(reason), body, memo)


@kopf.on.event("apps", "v1", "deployments", labels={resource.LABEL_OWNER: kopf.PRESENT})
@kopf.on.event("batch", "v1", "jobs", labels={resource.LABEL_OWNER: kopf.PRESENT})
@kopf.on.event("v1", "pods", labels={resource.LABEL_OWNER: kopf.PRESENT})
def on_child(namespace: str, labels: kopf.Labels, event: kopf.RawEvent,
             deployments_by_name: kopf.Index, **_: Any) -> None:
    """A finished pull, a pod that crashes or turns ready, a Deployment's new status: reconcile its owner now
    rather than at the next resync. Changes that arrive while a pass waits for the lock ride on that pass."""
    if event["type"] is None:
        return  # the initial listing: on.resume reconciles every DDTreeDeployment already
    owner = next(iter(deployments_by_name.get((namespace, labels[resource.LABEL_OWNER]), ())), None)
    if owner is None:
        return  # not (or no longer) a DDTreeDeployment's
    body, memo = owner
    queued = memo.setdefault("queued", threading.Semaphore(1))
    if queued.acquire(blocking=False):  # else a pass is waiting to start, and it will see this change too
        _run("child", body, memo, queued)


@kopf.timer(*RESOURCE, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS, backoff=RESYNC_SECONDS)
def resync(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Level-based safety net: follow Job/Deployment/pod progress and repair drifted children."""
    _run("timer", body, memo)
