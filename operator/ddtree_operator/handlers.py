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

from ddtree_operator import render, status
from ddtree_operator.reconcile import Cluster, reconcile

RESYNC_SECONDS = float(os.environ.get("DDTREE_OPERATOR_RESYNC_SECONDS", "15"))
RESOURCE = (render.GROUP, render.VERSION, "ddtreedeployments")

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
    return client.ApiClient()


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
    _cluster = Cluster(_api_client())
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
    manifest = {"apiVersion": body["apiVersion"], "kind": body["kind"], "metadata": dict(body.metadata),
                "spec": dict(body.spec)}
    started = time.monotonic()
    with memo.setdefault("lock", threading.Lock()):  # memo is per object; setdefault is atomic
        try:
            seen, monitoring_error = reconcile(_cluster, manifest, os.environ.get("DDTREE_SERVER_IMAGE",
                                                                          render.DEFAULT_IMAGE))
        except Exception:
            RECONCILES.labels(trigger, "error").inc()
            raise
        finally:
            RECONCILE_SECONDS.observe(time.monotonic() - started)
        RECONCILES.labels(trigger, "ok").inc()
        fields, conditions = status.compute(manifest, seen)
        # The last written conditions win over the (possibly older) snapshot this handler was given.
        old = memo.get("conditions", body.status.get("conditions") or [])
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        merged, transitions = status.merge_conditions(old, conditions, body.metadata.get("generation"), now)
        memo["conditions"] = merged
        current = dict(body.status)
        for key, value in {**fields, "conditions": merged}.items():
            if current.get(key) != value:
                patch.status[key] = value
        for t in transitions:
            TRANSITIONS.labels(t.type, t.reason).inc()
            kopf.event(body, type=t.event_type, reason=t.reason, message=f"{t.type}={t.status}: {t.message}")
        if monitoring_error and monitoring_error != memo.get("monitoring_error"):
            kopf.event(body, type="Warning", reason="MonitoringUnavailable", message=monitoring_error)
        memo["monitoring_error"] = monitoring_error


@kopf.on.resume(*RESOURCE, backoff=RESYNC_SECONDS)
@kopf.on.create(*RESOURCE, backoff=RESYNC_SECONDS)
@kopf.on.update(*RESOURCE, field="spec", backoff=RESYNC_SECONDS)
def on_change(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, reason: str, **_: Any) -> None:
    """React at once to creation, spec changes (rollout, re-pull) and operator restarts."""
    _run(str(reason), body, patch, memo)


@kopf.timer(*RESOURCE, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS, backoff=RESYNC_SECONDS)
def resync(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **_: Any) -> None:
    """Level-based safety net: follow Job/Deployment/pod progress and repair drifted children."""
    _run("timer", body, patch, memo)
