"""The Helm chart: lint, render validated against the Kubernetes schemas (kubernetes-validate, strict),
RBAC that covers exactly what the operator touches, and a real `helm install` into the API server."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
import uuid
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from ddtree_operator import render
from k8s_testing import CRD_FILE, EXAMPLE, REPO, free_port, http_get, new_namespace, running, wait_for

CHART = REPO / "charts" / "ddtree"
HELM = shutil.which("helm") or (str(REPO / ".tools" / "helm") if (REPO / ".tools" / "helm").exists() else None)
pytestmark = pytest.mark.skipif(HELM is None, reason="no helm: run ../shared/tools/get-helm .tools/helm")
BUILTIN_GROUPS = ("v1", "apps/v1", "batch/v1", "policy/v1", "rbac.authorization.k8s.io/v1")


def helm(*args: str, kubeconfig: str | None = None) -> str:
    env = {**os.environ, **({"KUBECONFIG": kubeconfig} if kubeconfig else {})}
    done = subprocess.run([HELM, *args], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def template(*sets: str) -> list[dict[str, Any]]:
    out = helm("template", "ddt", str(CHART), "--namespace", "ddtree-system", "--include-crds",
               *[a for s in sets for a in ("--set", s)])
    return [d for d in yaml.safe_load_all(out) if d]


def test_lint():
    helm("lint", "--strict", str(CHART))
    helm("lint", "--strict", str(CHART), "--set", "rbac.cluster=false", "--set", "watchNamespaces={ml}")


@pytest.mark.parametrize("sets", [(), ("rbac.cluster=false", "watchNamespaces={ml,research}"),
                                  ("metrics.serviceMonitor.enabled=true", "grafanaDashboards.enabled=false")])
def test_template_is_valid_kubernetes(sets):
    docs = template(*sets)
    kinds = {d["kind"] for d in docs}
    assert {"CustomResourceDefinition", "Deployment", "ServiceAccount", "Service"} <= kinds
    for doc in docs:
        if doc["apiVersion"] in BUILTIN_GROUPS or doc["kind"] == "CustomResourceDefinition":
            kubernetes_validate.validate(doc, "1.33.0", strict=True)
    crd = next(d for d in docs if d["kind"] == "CustomResourceDefinition")
    assert crd == yaml.safe_load(CRD_FILE.read_text())  # the chart ships the very CRD in crds/


def test_operator_deployment_is_locked_down_and_scoped():
    dep = next(d for d in template() if d["kind"] == "Deployment")
    pod = dep["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["image"] == "ghcr.io/ddtree/ddtree-operator:0.1.0"  # appVersion, never latest
    assert "--all-namespaces" in container["args"] and "--standalone" in container["args"]
    assert "--server-image=ghcr.io/ddtree/ddtree-server:0.1.0" in container["args"]
    namespaced = next(d for d in template("rbac.cluster=false", "watchNamespaces={ml}") if d["kind"] == "Deployment")
    assert "--namespace=ml" in namespaced["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "ClusterRole" not in {d["kind"] for d in template("rbac.cluster=false", "watchNamespaces={ml}")}


def test_bad_values_are_rejected():
    for sets, message in [(["rbac.cluster=false"], "needs watchNamespaces"),
                          (["watchNamespaces={Not_A_Namespace}"], "watchNamespaces"),
                          (["imageTag=1"], "additional properties 'imageTag' not allowed")]:
        done = subprocess.run([HELM, "template", "x", str(CHART), *[a for s in sets for a in ("--set", s)]],
                              capture_output=True, text=True)
        assert done.returncode != 0 and message in done.stderr, done.stderr


def _allowed(rules: list[dict[str, Any]], group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


def test_rbac_covers_every_child_and_nothing_broader():
    """The static floor under tests/operator/test_rbac.py (which measures the exact verbs): every kind the operator
    renders can be read and applied, nothing is a wildcard, Secrets and pod creation are out of reach."""
    rules = next(d for d in template() if d["kind"] == "ClusterRole")["rules"]
    example = yaml.safe_load(EXAMPLE.read_text())
    example["metadata"].update(namespace="ml", uid="u")
    example["spec"].update(replicas=2, monitoring={"enabled": True},
                           autoscaling={"maxReplicas": 2, "target": {"waitingRequests": 1}})
    for autoscaler in ("KEDA", "HPA"):
        for child in render.render(example, autoscaler=autoscaler).all():
            group = child["apiVersion"].rpartition("/")[0]
            resource = child["kind"].lower() + "s"
            for verb in ("get", "create"):
                assert _allowed(rules, group, resource, verb), (group, resource, verb)
    assert _allowed(rules, "ddtree.io", "ddtreedeployments/status", "patch")
    assert _allowed(rules, "", "pods/log", "get") and not _allowed(rules, "", "pods", "create")
    assert not _allowed(rules, "", "secrets", "get")  # tokens reach pods via secretKeyRef, never the operator
    assert not _allowed(rules, "", "namespaces", "list")  # exact namespaces: kopf does not scan them
    assert all("*" not in r["verbs"] and "*" not in r["resources"] for r in rules)


@pytest.mark.cluster
def test_helm_install_and_uninstall(cluster, crd, kubeconfig):
    ns = f"helm-{uuid.uuid4().hex[:6]}"
    out = helm("install", "ddt", str(CHART), "--namespace", ns, "--create-namespace",
               "--set", "metrics.serviceMonitor.enabled=true", kubeconfig=kubeconfig)
    try:
        # The manifest NOTES.txt tells users to apply is accepted as written.
        notes_manifest = textwrap.dedent(out.split("<<'YAML'\n", 1)[1].split("  YAML\n", 1)[0])
        cluster.dynamic.resources.get(api_version="ddtree.io/v1alpha1", kind="DDTreeDeployment").create(
            body=yaml.safe_load(notes_manifest), namespace=ns, query_params=[("dryRun", "All")])
        dep = wait_for(lambda: cluster.get("apps/v1", "Deployment", ns, "ddt-ddtree"), what="operator Deployment")
        assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "ddt-ddtree"
        assert cluster.get("rbac.authorization.k8s.io/v1", "ClusterRoleBinding", "", "ddt-ddtree")
        assert cluster.get("monitoring.coreos.com/v1", "ServiceMonitor", ns, "ddt-ddtree")
        dashboards = cluster.list("v1", "ConfigMap", ns, "grafana_dashboard=1")
        assert len(dashboards) == len(list((REPO / "dashboards").glob("*.json")))
        assert "ddtree" in helm("list", "--namespace", ns, kubeconfig=kubeconfig)
    finally:
        helm("uninstall", "ddt", "--namespace", ns, kubeconfig=kubeconfig)
        cluster.delete("v1", "Namespace", "", ns)
    assert cluster.get("rbac.authorization.k8s.io/v1", "ClusterRole", "", "ddt-ddtree") is None


def test_chart_links_resolve():
    for link in (CHART / "crds" / CRD_FILE.name, CHART / "dashboards"):
        assert link.resolve().exists() and Path(os.path.realpath(link)).is_relative_to(REPO)


@pytest.mark.cluster
def test_console_script_runs_with_the_charts_arguments(cluster, crd, kubeconfig, tmp_path):
    """`ddtree-operator` started exactly as the chart starts it (ports aside) serves health and metrics
    and reconciles a DDTreeDeployment in the namespace it was given."""
    with new_namespace(cluster, "c") as ns:
        dep = next(d for d in template("rbac.cluster=false", f"watchNamespaces={{{ns}}}") if d["kind"] == "Deployment")
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        health, metrics = free_port(), free_port()
        ports = {"--liveness=http://0.0.0.0:8080/healthz": f"--liveness=http://127.0.0.1:{health}/healthz",
                 "--metrics-port=8081": f"--metrics-port={metrics}"}
        argv = ["ddtree-operator", *[ports.get(a, a) for a in args]]
        assert f"--namespace={ns}" in argv
        with running(argv, f"http://127.0.0.1:{health}/healthz", env={"KUBECONFIG": kubeconfig},
                     log=tmp_path / "operator.log"):
            body = {"apiVersion": "ddtree.io/v1alpha1", "kind": "DDTreeDeployment", "metadata": {"name": "m"},
                    "spec": {"target": {"model": {"uri": "hf://Qwen/Qwen3-8B"}},
                             "draft": {"model": {"uri": "hf://z-lab/Qwen3-8B-DFlash-b16"}}}}
            cluster.dynamic.resources.get(api_version="ddtree.io/v1alpha1", kind="DDTreeDeployment").create(
                body=body, namespace=ns)
            job = wait_for(lambda: cluster.list("batch/v1", "Job", ns, "ddtree.io/deployment=m"), what="pull Job")
            assert job[0]["spec"]["template"]["spec"]["containers"][0]["image"] == "ghcr.io/ddtree/ddtree-server:0.1.0"
            status, text = http_get(f"http://127.0.0.1:{metrics}/metrics")
            assert status == 200 and "ddtree_operator_reconciles_total" in text
            cluster.delete("ddtree.io/v1alpha1", "DDTreeDeployment", ns, "m")
            wait_for(lambda: cluster.get("ddtree.io/v1alpha1", "DDTreeDeployment", ns, "m") is None, timeout=60,
                     what="CR deleted")
