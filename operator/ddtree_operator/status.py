"""Pure status computation: what the owned objects report, turned into the DDTreeDeployment status.

Conditions follow metav1.Condition (a list-map keyed by `type`); `Ready` rolls the others up and its
reason is the single best debugging aid (it is a printer column). Sub-conditions that do not apply are
left out rather than set False.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddtree_operator import render

Manifest = dict[str, Any]

WARNING_REASONS = frozenset({"PullFailed", "InsufficientCapacity", "Degraded"})


@dataclass(frozen=True)
class Observed:
    """What the reconciler saw of the children this tick."""

    job: Manifest | None = None
    deployment: Manifest | None = None
    pods: tuple[Manifest, ...] = ()
    download: Manifest | None = None


@dataclass(frozen=True)
class Transition:
    """A condition whose status or reason changed: becomes one Kubernetes Event."""

    type: str
    status: str
    reason: str
    message: str

    @property
    def event_type(self) -> str:
        return "Warning" if self.reason in WARNING_REASONS else "Normal"


def _condition(obj: Manifest | None, type_: str) -> Manifest | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c.get("type") == type_ and c.get("status") == "True":
            return c
    return None


def _models(body: Manifest, job: Manifest | None) -> tuple[str, str, str] | None:
    """(status, reason, message) of ModelsReady; None in emptyDir mode, where each pod pulls."""
    if body["spec"].get("storage", {}).get("mode", "pvc") == "emptyDir":
        return None
    if job is None:
        return "False", "Pulling", "creating the pull Job"
    if _condition(job, "Complete"):
        return "True", "Pulled", f"target and draft are on the models volume (Job {job['metadata']['name']})"
    failed = _condition(job, "Failed")
    if failed:
        detail = failed.get("message") or failed.get("reason") or "see the Job's pod logs"
        return "False", "PullFailed", f"Job {job['metadata']['name']} failed: {detail}"
    return "False", "Pulling", f"Job {job['metadata']['name']} is pulling target and draft"


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


def compute(body: Manifest, seen: Observed) -> tuple[Manifest, dict[str, tuple[str, str, str]]]:
    """The status fields and the conditions as {type: (status, reason, message)}."""
    spec = body["spec"]
    desired = spec.get("replicas", 1)
    dep_status = (seen.deployment or {}).get("status") or {}
    ready = dep_status.get("readyReplicas") or 0
    models = _models(body, seen.job)
    if models and models[1] == "Pulling" and seen.download:
        models = (models[0], models[1], f"{models[2]}: {_progress_text(seen.download)}")
    conditions: dict[str, tuple[str, str, str]] = {}
    if models:
        conditions["ModelsReady"] = models

    unschedulable = _unschedulable(seen.pods)
    if models and models[1] == "PullFailed":
        reason, message, phase = "PullFailed", models[2], "Failed"
    elif seen.deployment is None:
        reason, message, phase = "Pulling", "waiting for the models before starting the server", "Downloading"
    elif desired == 0:
        reason, message, phase = "ScaledToZero", "spec.replicas is 0", "Pending"
    elif ready >= desired:
        reason, message, phase = "Ready", f"{ready}/{desired} replicas ready", "Ready"
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

    generation = body["metadata"].get("generation")
    dep_meta = (seen.deployment or {}).get("metadata") or {}
    rolling = seen.deployment is not None and (
        dep_status.get("observedGeneration", 0) < dep_meta.get("generation", 0)
        or (dep_status.get("updatedReplicas") or 0) < desired or ready < desired)
    if models and models[1] == "PullFailed":
        conditions["Progressing"] = ("False", "PullFailed", models[2])
    elif models and models[1] == "Pulling":
        conditions["Progressing"] = ("True", "Pulling", models[2])
    elif rolling:
        conditions["Progressing"] = ("True", "RollingOut", f"{ready}/{desired} replicas ready")
    else:
        conditions["Progressing"] = ("False", "Complete", "the latest spec is rolled out")
    conditions["Ready"] = ("True" if reason == "Ready" else "False", reason, message)

    name = body["metadata"]["name"]
    status: Manifest = {
        "observedGeneration": generation,
        "phase": phase,
        "replicas": dep_status.get("replicas") or 0,
        "readyReplicas": ready,
        "replicasReady": f"{ready}/{desired}",
        "selector": render.selector_string(name),
        "url": render.url(body),
        "pullJob": seen.job["metadata"]["name"] if seen.job else None,
        "download": seen.download,
    }
    return status, conditions


def merge_conditions(old: list[Manifest], new: dict[str, tuple[str, str, str]], generation: int | None,
                     now: str) -> tuple[list[Manifest], list[Transition]]:
    """The full conditions list (merge patches replace lists) keeping lastTransitionTime of unchanged
    statuses, and the transitions worth an Event."""
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
