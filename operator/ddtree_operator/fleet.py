"""Pure rendering of the objects that act on the server pods as a set, through their selector: the Service in
front of them, the Prometheus monitor, the disruption budget and the autoscaler.

None of them has a pod template, so none depends on how the pods are built (`workload`).
"""

from __future__ import annotations

from ddtree_operator.resource import GROUP, KIND, VERSION, Manifest, child_meta, selector, server_settings

# Autoscaling targets (spec.autoscaling.target keys) and the server gauges they read, per replica.
AUTOSCALING_METRICS = {"waitingRequests": "vllm:num_requests_waiting",
                       "runningRequests": "vllm:num_requests_running",
                       "tokensPerSecond": "ddtree_generation_tokens_per_second"}


def render_service(body: Manifest) -> Manifest:
    """A ClusterIP Service in front of the server pods; the status URL points at it."""
    name = body["metadata"]["name"]
    port = server_settings(body["spec"])["port"]
    return {"apiVersion": "v1", "kind": "Service", "metadata": child_meta(body, name, "server"),
            "spec": {"type": "ClusterIP", "selector": selector(name),
                     "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]}}


def render_monitor(body: Manifest) -> Manifest | None:
    """A Prometheus Operator ServiceMonitor or PodMonitor for /metrics, when monitoring is enabled."""
    monitoring = body["spec"].get("monitoring", {})
    if not monitoring.get("enabled", False):
        return None
    name = body["metadata"]["name"]
    kind = monitoring.get("kind", "ServiceMonitor")
    meta = child_meta(body, name, "server")
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
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": child_meta(body, name, "server"),
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
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": child_meta(body, name, "autoscaler"),
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
            "metadata": child_meta(body, name, "autoscaler"),
            "spec": {"scaleTargetRef": _scale_target(body), "minReplicas": max(1, scaling.get("minReplicas", 1)),
                     "maxReplicas": scaling["maxReplicas"],
                     "metrics": [{"type": "Pods", "pods": {"metric": {"name": metric},
                                                           "target": {"type": "AverageValue",
                                                                      "averageValue": str(target)}}}],
                     "behavior": {"scaleDown": {"stabilizationWindowSeconds":
                                                scaling.get("scaleDownDelaySeconds", 300)}}}}
