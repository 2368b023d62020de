"""Pure rendering: a DDTreeDeployment object in, the manifests of the objects it owns out.

Nothing here talks to the API server, so every storage mode and option is unit-testable and the
reconciler can apply the result idempotently (server-side apply) as often as it likes. The pieces live in
`workload` (claim, pull Job, Deployment) and `fleet` (Service, monitor, budget, autoscaler) over `resource`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddtree_operator.fleet import render_hpa, render_monitor, render_pdb, render_scaled_object, render_service
from ddtree_operator.resource import DEFAULT_IMAGE, Manifest
from ddtree_operator.workload import render_deployment, render_pull_job, render_pvc


@dataclass(frozen=True)
class Children:
    """Everything one DDTreeDeployment owns; None where the spec does not call for that object."""

    service: Manifest
    deployment: Manifest
    pvc: Manifest | None
    pull_job: Manifest | None
    monitor: Manifest | None
    pdb: Manifest | None
    autoscaler: Manifest | None = None

    def all(self) -> list[Manifest]:
        """The objects to apply, in dependency order (storage before its users)."""
        return [m for m in (self.pvc, self.pull_job, self.service, self.deployment, self.monitor, self.pdb,
                            self.autoscaler) if m]


def render(body: Manifest, default_image: str = DEFAULT_IMAGE, *, pull_attempt: int = 0,
           model_bytes: int | None = None, autoscaler: str | None = None, prometheus_address: str = "") -> Children:
    """All children of one DDTreeDeployment (the object must carry metadata.uid and namespace).

    What the cluster decides is passed in: the pull attempt, the pulled models' size (for the memory
    request) and the autoscaler available (`KEDA`, `HPA` or None) with KEDA's Prometheus address.
    """
    image = body["spec"].get("image") or default_image
    scaler = None
    if body["spec"].get("autoscaling") and autoscaler == "KEDA":
        scaler = render_scaled_object(body, prometheus_address)
    elif body["spec"].get("autoscaling") and autoscaler == "HPA":
        scaler = render_hpa(body)
    return Children(service=render_service(body), deployment=render_deployment(body, image, model_bytes),
                    pvc=render_pvc(body), pull_job=render_pull_job(body, image, pull_attempt),
                    monitor=render_monitor(body), pdb=render_pdb(body), autoscaler=scaler)
