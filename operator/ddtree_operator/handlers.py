"""kopf handlers: every trigger (create, spec change, resume after a restart, periodic timer) runs the same
level-based reconcile, so a missed event or an operator restart loses nothing."""

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

from ddtree_operator import __version__, render, status
from ddtree_operator.reconcile import Cluster, reconcile

RESYNC_SECONDS = float(os.environ.get("DDTREE_OPERATOR_RESYNC_SECONDS", "15"))
RESOURCE = (render.GROUP, render.VERSION, "ddtreedeployments")
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
    settings.persistence.finalizer = f"{render.GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=render.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=render.GROUP)
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


def _run(trigger: str, body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo) -> None:
    """Reconcile one object and write its status; serialized per object so Events are not doubled."""
    assert _cluster is not None
    if body.metadata.get("deletionTimestamp"):
        return  # being deleted: garbage collection removes the children; do not re-create them
    started = time.monotonic()
    with memo.setdefault("lock", threading.Lock()):  # memo is per object; setdefault is atomic
        # The last written status wins over the (possibly older) snapshot this handler was given.
        current = {**dict(body.status), **memo.get("status", {})}
        manifest = {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": dict(body.metadata),
                    "spec": dict(body.spec), "status": current}
        try:
            seen = reconcile(_cluster, manifest, os.environ.get("DDTREE_SERVER_IMAGE", render.DEFAULT_IMAGE),
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
        for key, value in written.items():
            if body.status.get(key) != value:
                patch.status[key] = value
        memo["status"] = written
        for t in transitions:
            TRANSITIONS.labels(t.type, t.reason).inc()
        for event in status.events(transitions):
            kopf.event(body, type=event.event_type, reason=event.reason,
                       message=f"{event.type}={event.status}: {event.message}")
        if seen.monitoring_error and seen.monitoring_error != memo.get("monitoring_error"):
            kopf.event(body, type="Warning", reason="MonitoringUnavailable", message=seen.monitoring_error)
        memo["monitoring_error"] = seen.monitoring_error


@kopf.on.resume(*RESOURCE, backoff=RESYNC_SECONDS)
@kopf.on.create(*RESOURCE, backoff=RESYNC_SECONDS)
@kopf.on.update(*RESOURCE, field="spec", backoff=RESYNC_SECONDS)
@kopf.on.update(*RESOURCE, field=("metadata", "annotations", render.ANNOTATION_RETRY_PULL), backoff=RESYNC_SECONDS)
def on_change(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, reason: str, **_: Any) -> None:
    """React at once to creation, spec changes (rollout, re-pull), a retry-pull request and operator restarts."""
    _run(str(reason), body, patch, memo)


@kopf.timer(*RESOURCE, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS, backoff=RESYNC_SECONDS)
def resync(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    """Level-based safety net: follow Job/Deployment/pod progress and repair drifted children."""
    _run("timer", body, patch, memo)
