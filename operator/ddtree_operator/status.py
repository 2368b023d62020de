"""Pure status computation: what the owned objects report, turned into the DDTreeDeployment status.

Conditions follow metav1.Condition (a list-map keyed by `type`); `Ready` rolls the others up and its
reason is the single best debugging aid (it is a printer column). Sub-conditions that do not apply are
left out rather than set False.
"""

from __future__ import annotations

import datetime
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ddtree_operator import resource, workload

Manifest = dict[str, Any]
Condition = tuple[str, str, str]  # (status, reason, message)

WARNING_REASONS = frozenset({"PullFailed", "InsufficientCapacity", "Degraded", "NameConflict", "ApplyFailed",
                             "ImagePullFailed", "CrashLooping", "ConfigError", "AutoscalerUnavailable",
                             "PrometheusAddressMissing", "NoMetricsSource", "MonitorUnavailable"})
INDEPENDENT_CONDITIONS = frozenset({"Autoscaling", "Monitoring"})  # not rolled up into Ready
# Container waiting reasons, by the Ready reason they become (first match wins, most actionable first).
WAITING_REASONS = {
    "ConfigError": frozenset({"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}),
    "ImagePullFailed": frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                                  "RegistryUnavailable", "SignatureValidationFailed"}),
    "CrashLooping": frozenset({"CrashLoopBackOff"}),
}


@dataclass(frozen=True)
class Observed:
    """What the reconciler saw of the children this pass, and what it could not do."""

    job: Manifest | None = None
    deployment: Manifest | None = None
    pods: tuple[Manifest, ...] = ()  # server pods
    pull_pods: tuple[Manifest, ...] = ()  # pods of the current pull Job
    download: Manifest | None = None
    conflict: str | None = None  # a child's name is taken by an object this DDTreeDeployment does not own
    apply_errors: tuple[str, ...] = ()  # children the API server rejected, with its message
    monitoring: Condition | None = None  # with spec.monitoring.enabled: whether the monitor exists
    autoscaling: Condition | None = None
    pull_attempt: int = 0
    pull_retry_at: datetime.datetime | None = None
    pull_error: str | None = None  # the failed pull pod's last error line
    pulled: Manifest | None = None  # {job, bytes} of the last finished pull


@dataclass(frozen=True)
class Transition:
    """A condition whose status or reason changed."""

    type: str
    status: str
    reason: str
    message: str

    @property
    def event_type(self) -> str:
        return "Warning" if self.reason in WARNING_REASONS else "Normal"


def parse_time(value: str | None) -> datetime.datetime:
    """A Kubernetes timestamp (RFC 3339, `Z`); the epoch when absent so that it is never in the future."""
    if not value:
        return datetime.datetime.fromtimestamp(0, datetime.UTC)
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))


def format_time(value: datetime.datetime) -> str:
    return value.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def job_condition(obj: Manifest | None, type_: str) -> Manifest | None:
    """The condition of that type when it is True."""
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return c
    return None


def pod_problem(pods: tuple[Manifest, ...], what: str) -> tuple[str, str] | None:
    """(reason, message) of the most actionable container problem among the pods: a missing Secret or bad
    command (ConfigError), an image that cannot be pulled (ImagePullFailed), a crash loop (CrashLooping),
    with the container's own message."""
    found: dict[str, str] = {}
    for pod in pods:
        status = pod.get("status") or {}
        for s in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
            waiting = (s.get("state") or {}).get("waiting") or {}
            for reason, waiting_reasons in WAITING_REASONS.items():
                if waiting.get("reason") in waiting_reasons and reason not in found:
                    detail = waiting.get("message") or waiting["reason"]
                    if reason == "CrashLooping":
                        detail = _crash_detail(s)
                    found[reason] = f"{what} {pod['metadata']['name']}: container {s.get('name')}: {detail}"
    for reason in WAITING_REASONS:
        if reason in found:
            return reason, found[reason]
    return None


def _crash_detail(container_status: Manifest) -> str:
    last = (container_status.get("lastState") or {}).get("terminated") or {}
    lines = [line for line in (last.get("message") or "").strip().splitlines() if line.strip()]
    said = f": {lines[-1].strip()}" if lines else ""
    return (f"restarted {container_status.get('restartCount', 0)} times, last exit code "
            f"{last.get('exitCode', '?')} ({last.get('reason', 'Error')}){said}")


def _unschedulable(pods: tuple[Manifest, ...]) -> str | None:
    for pod in pods:
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
                return c.get("message") or "no node has the requested GPUs"
    return None


def _pulling_in_pod(pods: tuple[Manifest, ...]) -> bool:
    for pod in pods:
        for s in (pod.get("status") or {}).get("initContainerStatuses") or []:
            if s.get("name") == "pull" and "running" in (s.get("state") or {}):
                return True
    return False


def _pod_ready(pod: Manifest) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def serving_model(body: Manifest, pods: tuple[Manifest, ...]) -> Manifest | None:
    """What the Ready server pods serve (their model annotations): during a model change, the model most
    of them still serve (the new one on a tie), with how many do."""
    served: Counter[tuple[str, str]] = Counter()
    for pod in pods:
        annotations = pod["metadata"].get("annotations") or {}
        if _pod_ready(pod) and resource.ANNOTATION_TARGET in annotations:
            served[(annotations[resource.ANNOTATION_TARGET], annotations.get(resource.ANNOTATION_DRAFT, ""))] += 1
    if not served:
        return None
    wanted = workload.model_annotations(body["spec"])
    (target, draft), replicas = max(served.items(), key=lambda kv: (kv[1], kv[0] == (
        wanted[resource.ANNOTATION_TARGET], wanted[resource.ANNOTATION_DRAFT])))
    return {"target": target, "draft": draft, "readyReplicas": replicas}


def _progress_text(download: Manifest) -> str:
    """`target 12.0/54.0 GB, draft done` for condition messages (kubectl describe)."""
    parts = []
    for role, p in sorted(download.items(), reverse=True):
        if p.get("done"):
            parts.append(f"{role} done")
        else:
            total = f"/{p['bytesTotal'] / 1e9:.1f}" if p.get("bytesTotal") else ""
            parts.append(f"{role} {p.get('bytesDone', 0) / 1e9:.1f}{total} GB")
    return ", ".join(parts)


def _pull_failure(body: Manifest, seen: Observed) -> str:
    """Why the pull Job failed, in the pull pod's words, and when (or how) it is retried."""
    job = seen.job or {}
    failed = job_condition(job, "Failed") or {}
    if failed.get("reason") == "DeadlineExceeded":
        detail = (f"it ran longer than storage.pullTimeoutSeconds "
                  f"({job.get('spec', {}).get('activeDeadlineSeconds', '?')} s)")
    else:
        detail = seen.pull_error or failed.get("message") or failed.get("reason") or "see the Job's pod logs"
    retry = (f"retrying at {format_time(seen.pull_retry_at)}; " if seen.pull_retry_at else "")
    return (f"Job {job.get('metadata', {}).get('name')} (attempt {seen.pull_attempt + 1}) failed: {detail}; "
            f"{retry}retry now with `kubectl annotate ddt {body['metadata']['name']} "
            f"{resource.ANNOTATION_RETRY_PULL}=$(date +%s) --overwrite`")


def _models(body: Manifest, seen: Observed) -> Condition | None:
    """ModelsReady; None in emptyDir mode, where each pod pulls."""
    if not resource.pulls_in_job(body["spec"]):
        return None
    job = seen.job
    if job is None:
        return "False", "Pulling", "creating the pull Job"
    name = job["metadata"]["name"]
    if job_condition(job, "Complete"):
        return "True", "Pulled", f"target and draft are on the models volume (Job {name})"
    if job_condition(job, "Failed"):
        return "False", "PullFailed", _pull_failure(body, seen)
    problem = pod_problem(seen.pull_pods, "pull pod")
    if problem:
        return "False", problem[0], problem[1]
    progress = f": {_progress_text(seen.download)}" if seen.download else ""
    return "False", "Pulling", f"Job {name} is pulling target and draft{progress}"


def rollout_remaining(deployment: Manifest | None, desired: int) -> str | None:
    """What the Deployment's rollout still waits for, read as `kubectl rollout status` reads it (the spec
    observed, every replica updated, no old replica left, all ready); None once it is complete."""
    if deployment is None:
        return None
    dep_status = deployment.get("status") or {}
    updated, ready = dep_status.get("updatedReplicas") or 0, dep_status.get("readyReplicas") or 0
    old = (dep_status.get("replicas") or 0) - updated
    if dep_status.get("observedGeneration", 0) < deployment["metadata"].get("generation", 0):
        return "the Deployment controller has not seen the latest spec yet"
    if updated < desired:
        return f"{updated}/{desired} replicas run the latest spec, {ready} ready"
    if old > 0:
        return f"{old} old replica(s) still serving until the updated ones are ready"
    if ready < desired:
        return f"{ready}/{desired} replicas ready"
    return None


def _autoscaling(seen: Observed) -> Condition | None:
    """The autoscaler's condition; False when the metric it scales on has no scrape behind it."""
    if seen.autoscaling and seen.autoscaling[0] == "True" and seen.monitoring and seen.monitoring[0] == "False":
        return ("False", "NoMetricsSource", f"{seen.autoscaling[2]}, but nothing scrapes the metric it reads: "
                                            f"{seen.monitoring[2]}")
    return seen.autoscaling


def compute(body: Manifest, seen: Observed) -> tuple[Manifest, dict[str, Condition]]:
    """The status fields and the conditions as {type: (status, reason, message)}."""
    spec = body["spec"]
    desired = spec.get("replicas", 1)
    dep_status = (seen.deployment or {}).get("status") or {}
    ready = dep_status.get("readyReplicas") or 0
    models = _models(body, seen)
    conditions: dict[str, Condition] = {}
    if models:
        conditions["ModelsReady"] = models
    pulling = models is not None and models[0] == "False"
    server_problem = pod_problem(seen.pods, "pod")

    def failing(reason: str, message: str) -> tuple[str, str, str]:
        return reason, message, "Degraded" if ready else "Failed"

    unschedulable = _unschedulable(seen.pods)
    if seen.conflict:
        reason, message, phase = failing("NameConflict", seen.conflict)
    elif seen.apply_errors:
        more = f" (and {len(seen.apply_errors) - 1} more)" if len(seen.apply_errors) > 1 else ""
        reason, message, phase = failing("ApplyFailed", seen.apply_errors[0] + more)
    elif models and models[1] in ("PullFailed", "ConfigError", "ImagePullFailed"):
        reason, message, phase = failing(models[1], models[2])
    elif seen.deployment is None:
        reason, message, phase = "Pulling", "waiting for the models before starting the server", "Downloading"
    elif desired == 0:
        reason, message, phase = "ScaledToZero", "spec.replicas is 0", "Pending"
    elif ready >= desired:
        reason, message, phase = "Ready", f"{ready}/{desired} replicas ready", "Ready"
    elif server_problem:
        reason, message, phase = failing(*server_problem)
    elif unschedulable:
        reason, message = "InsufficientCapacity", f"pods cannot be scheduled: {unschedulable}"
        phase = "Degraded" if ready else "Pending"
    elif _pulling_in_pod(seen.pods):
        reason, message, phase = "Pulling", "server pods are pulling the models", "Downloading"
    elif ready:
        reason, message, phase = "Degraded", f"{ready}/{desired} replicas ready", "Degraded"
    else:
        reason, message, phase = "Starting", "server pods are loading the models", "Starting"

    if ready:
        conditions["Available"] = ("True", "MinimumReplicasAvailable", f"{ready} replica(s) serving")
    else:
        conditions["Available"] = ("False", reason if reason != "Ready" else "Starting", message)

    rolling = rollout_remaining(seen.deployment, desired)
    if seen.conflict or seen.apply_errors:
        conditions["Progressing"] = ("False", reason, message)
    elif models and models[1] == "PullFailed":
        conditions["Progressing"] = ("False", "PullFailed", models[2])
    elif pulling:
        conditions["Progressing"] = ("True", models[1], models[2])
    elif rolling and server_problem:
        conditions["Progressing"] = ("True", server_problem[0], server_problem[1])
    elif rolling:
        conditions["Progressing"] = ("True", "RollingOut", rolling)
    else:
        conditions["Progressing"] = ("False", "Complete", "the latest spec is rolled out")
    if seen.monitoring:
        conditions["Monitoring"] = seen.monitoring
    if autoscaling := _autoscaling(seen):
        conditions["Autoscaling"] = autoscaling
    conditions["Ready"] = ("True" if reason == "Ready" else "False", reason, message)

    name = body["metadata"]["name"]
    status: Manifest = {
        "observedGeneration": body["metadata"].get("generation"),
        "phase": phase,
        "replicas": dep_status.get("replicas") or 0,
        "readyReplicas": ready,
        "replicasReady": f"{ready}/{desired}",
        "selector": resource.selector_string(name),
        "url": resource.url(body),
        "pullJob": seen.job["metadata"]["name"] if seen.job else None,
        "download": seen.download,
        "pulled": seen.pulled,
        "servingModel": serving_model(body, seen.pods),
    }
    return status, conditions


def merge_conditions(old: list[Manifest], new: dict[str, Condition], generation: int | None,
                     now: str) -> tuple[list[Manifest], list[Transition]]:
    """The full conditions list (merge patches replace lists) keeping lastTransitionTime of unchanged
    statuses, and the conditions whose status or reason changed."""
    previous = {c["type"]: c for c in old or []}
    out, transitions = [], []
    for type_, (status, reason, message) in new.items():
        before = previous.get(type_)
        changed = before is None or before.get("status") != status
        out.append({"type": type_, "status": status, "reason": reason, "message": message,
                    "lastTransitionTime": now if changed else before.get("lastTransitionTime", now),
                    "observedGeneration": generation})
        if changed or before.get("reason") != reason:
            transitions.append(Transition(type_, status, reason, message))
    return out, transitions


def events(transitions: list[Transition]) -> list[Transition]:
    """The transitions a pass reports as Events: one for what Ready rolls up (Ready's own when it changed,
    else the first sub-condition's), and those of Autoscaling and Monitoring, which Ready does not roll up,
    unless that reason is already told (a rejected monitor is one ApplyFailed, not two)."""
    rolled = [t for t in transitions if t.type not in INDEPENDENT_CONDITIONS]
    out = [next((t for t in rolled if t.type == "Ready"), rolled[0])] if rolled else []
    return out + [t for t in transitions if t.type in INDEPENDENT_CONDITIONS and t.reason not in
                  {o.reason for o in out}]
